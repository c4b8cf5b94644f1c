"""An ingress process's runtime: it holds the requests' tensors; the scheduler decides elsewhere.

:class:`IngressRuntime` stands where the HTTP and gRPC frontends expect a
:class:`~ppipe.runtime.scheduler.host.Runtime` (``infer``, ``infer_samples``, ``model_ready``,
``started``, ``clock``, ``profiles``, ``metrics``), but the data plane's scheduler runs in
another process (:mod:`ppipe.runtime.scheduler.ingresses`). Per request::

    client --HTTP--> ingress --Arrival (id, model, arrival)--> scheduler
                     ingress <--SendInputs (stage 0, rows)---- scheduler   (it dispatched)
                     ingress --stage 0 + its rows' inputs--> first worker --> ... --> last worker
    client <--HTTP-- ingress <--Answer (its rows of the outputs)-------------------- last worker

so the tensors go from the ingress to the first worker and from the last worker back, never
through the scheduler, whose cost per request is a few small messages, each coalesced with
the others of its loop tick in both directions (:class:`~ppipe.runtime.wire.messages.FromIngress`,
:class:`~ppipe.runtime.wire.messages.ToIngress`). A request's error comes as a
:class:`~ppipe.runtime.wire.messages.Refusal` (drops, failed batches, the scheduler's
timeouts). Exactly one answer per request: the first of an answer and a refusal wins, and a
request with neither by SLO + ``answer_grace_s`` is answered ``timeout`` here (a scheduler
that has gone answers nothing).

Metrics: the ingress sends its own Prometheus text to the scheduler every second and
answers ``/metrics`` with the whole server's that the scheduler sends back (every
process's samples, each labelled with its ``process``; until the first comes, its own).

Plan switches happen in the scheduler: it sends the plan it serves (its models, SLOs and
manifests) at the hello and after each switch, and the ingress takes it before anything
else of that message (its ``plan`` and ``profiles`` replaced, its ``on_switch`` hooks run:
the frontends' model lists). Requests it holds then are the scheduler's to move or refuse.

Times: the arrival is sent on the wall clock (the scheduler converts it to its timeline);
``clock`` is a :class:`~ppipe.runtime.clock.WallClock`, injected as the host's is.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
from dataclasses import dataclass
from typing import Any, Callable

import msgspec
import numpy as np

from ppipe.runtime.clock import WallClock
from ppipe.runtime.memory import trim_heap_periodically, tune_for_serving
from ppipe.runtime.scheduler.inflight import DroppedError
from ppipe.runtime.scheduler.metrics import RuntimeMetrics
from ppipe.runtime.wire.datapath import LOOPBACK, DataPathFull, Inbox, Outbox
from ppipe.runtime.wire.frames import WireError, pack, unpack
from ppipe.runtime.wire.messages import Answer, Arrival, FromIngress, IngressInbox, SendInputs, ServedPlan, ToIngress
from ppipe.spec.plan import Plan
from ppipe.spec.profile import ModelManifest, ModelProfile

log = logging.getLogger("ppipe.runtime")
METRICS_EVERY_S = 1.0  # how often the ingress sends the scheduler its metrics
HELLO_TIMEOUT_S = 30.0  # the scheduler answers a hello within this


@dataclass
class _Held:
    """A request this ingress holds until its answer: its future and its inputs (until sent)."""

    future: asyncio.Future
    inputs: dict[str, np.ndarray] | None
    timer: Any = None


class IngressRuntime:
    """The runtime an ingress process's frontends serve with (see the module's docstring).

    Args:
        index: this ingress's number among the server's ingresses.
        scheduler_address: the scheduler's ingress inbox (``Runtime.ingress_address``).
        plan, profiles: what the server serves (the frontends validate against the profiles).
        secret: the server's data-path secret (None: not authenticated).
        host: the address this ingress's inbox binds (workers and the scheduler reach it).
        answer_grace_s: a request unanswered at SLO + this is answered ``timeout``.
        clock_factory: ``f(loop)``: the clock (default :class:`~ppipe.runtime.clock.WallClock`).
    """

    def __init__(self, index: int, scheduler_address: str, plan: Plan, profiles: dict[str, ModelProfile], *,
                 secret: bytes | None = None, host: str = LOOPBACK, answer_grace_s: float = 30.0,
                 clock_factory: Callable[[asyncio.AbstractEventLoop], Any] = WallClock, metrics: RuntimeMetrics | None = None):
        self.index, self.scheduler_address, self.plan, self.profiles = index, scheduler_address, plan, profiles
        self.secret, self.host, self.answer_grace_s = secret, host, answer_grace_s
        self.metrics = metrics or RuntimeMetrics()
        self._clock_factory = clock_factory
        self.clock: Any = None
        self.on_switch: list[Callable[[], None]] = []
        self._inbox: Inbox | None = None
        self._outbox = Outbox(secret)
        self._held: dict[int, _Held] = {}
        self._ids = itertools.count()
        self._arrivals: list[Arrival] = []
        self._withdrawn: list[int] = []
        self._ready: set[str] | None = None  # the models the scheduler said are ready (None: not heard yet)
        self._heard: asyncio.Event | None = None  # set at the scheduler's first answer
        self._server_metrics: bytes | None = None  # the whole server's metrics, as the scheduler last sent them
        self._pushing: asyncio.Task | None = None
        self._trimming: asyncio.Task | None = None
        self.address: str | None = None

    # ---- lifecycle ------------------------------------------------------------------------
    async def start(self) -> None:
        """Bind the inbox, say hello to the scheduler and wait for its answer (the models
        ready), so that a frontend started on this ingress takes no request before it.

        Raises:
            TimeoutError: no answer within ``HELLO_TIMEOUT_S`` (the scheduler is not there).
        """
        loop = asyncio.get_running_loop()
        self.clock = self._clock_factory(loop)
        self._inbox = Inbox(self._on_message, self.host, self.secret)
        self.address = self._inbox.address
        self._heard = asyncio.Event()
        self._outbox.send(self.scheduler_address, pack(FromIngress(self.index, hello=self.address)))
        try:
            await asyncio.wait_for(self._heard.wait(), HELLO_TIMEOUT_S)
        except TimeoutError:
            raise TimeoutError(f"ingress {self.index}: no answer from the scheduler at {self.scheduler_address} "
                               f"within {HELLO_TIMEOUT_S:g} s") from None
        self._pushing = loop.create_task(self._push_metrics())
        tune_for_serving()  # the inputs it holds reuse the heap's pages; a burst's go back on a timer
        self._trimming = loop.create_task(trim_heap_periodically())

    async def stop(self) -> None:
        for task in (self._pushing, self._trimming):
            if task is not None:
                task.cancel()
        for rid in list(self._held):
            self._refuse(rid, "shutdown", "the server is shutting down")
        if self._inbox is not None:
            self._inbox.close()
        self._outbox.close()

    @property
    def started(self) -> bool:
        return self._ready is not None

    def model_ready(self, model: str) -> bool:
        return self._ready is not None and model in self._ready

    def render_metrics(self) -> bytes:
        """The whole server's metrics as the scheduler last sent them (until then, this ingress's own)."""
        return self._server_metrics if self._server_metrics is not None else self.metrics.render()

    async def _push_metrics(self) -> None:
        while True:
            await asyncio.sleep(METRICS_EVERY_S)
            try:
                self._outbox.send(self.scheduler_address, pack(FromIngress(self.index, metrics=self.metrics.render())))
            except DataPathFull as exc:
                log.warning("ingress %d: the scheduler takes no metrics: %s", self.index, exc)

    # ---- requests -----------------------------------------------------------------------
    async def infer(self, model: str, inputs: dict[str, np.ndarray], arrival_us: float | None = None) -> dict[str, np.ndarray]:
        """Serve one sample (arrays without the batch axis); returns its outputs.

        Raises:
            DroppedError: the scheduler refused it, its batch failed, or no answer came in time.
        """
        rid = self._hold(model, inputs, arrival_us)
        try:
            return await self._held[rid].future
        finally:
            self._let_go(rid)

    async def infer_samples(self, model: str, samples: list[dict[str, np.ndarray]], arrival_us: float | None = None) -> list[dict[str, np.ndarray]]:
        """Serve the samples of one client request; returns their outputs in order. At the
        first sample refused, the others are withdrawn and the request fails with its error."""
        rids = [self._hold(model, s, arrival_us) for s in samples]
        futures = [self._held[r].future for r in rids]
        try:
            return [await f for f in futures]
        except DroppedError:
            self._withdrawn.extend(r for r in rids if r in self._held)
            self._arm_flush()
            raise
        finally:
            for r in rids:
                self._let_go(r)

    def _hold(self, model: str, inputs: dict[str, np.ndarray], arrival_us: float | None) -> int:
        if self.clock is None:
            raise RuntimeError("IngressRuntime.start() has not run")
        mp = next((m for m in self.plan.models if m.name == model), None)
        if mp is None:
            raise DroppedError("unknown-model", f"the plan serves {', '.join(m.name for m in self.plan.models)}")
        rid = next(self._ids)
        loop = asyncio.get_running_loop()
        held = self._held[rid] = _Held(loop.create_future(), inputs)
        timeout_s = mp.slo_ms / 1e3 + self.answer_grace_s
        held.timer = loop.call_later(timeout_s, self._refuse, rid, "timeout", f"no answer within {timeout_s:.1f} s")
        now = self.clock.true_now_us() if arrival_us is None else arrival_us
        self._arrivals.append(Arrival(rid, model, self.clock.to_wall_us(now)))
        self._arm_flush()
        return rid

    def _let_go(self, rid: int) -> None:
        held = self._held.pop(rid, None)
        if held is not None:
            held.timer.cancel()

    def _arm_flush(self) -> None:
        if len(self._arrivals) + len(self._withdrawn) == 1:
            asyncio.get_running_loop().call_soon(self._flush)

    def _flush(self) -> None:
        """Send this tick's arrivals and withdrawals to the scheduler in one message."""
        if not (self._arrivals or self._withdrawn):
            return
        message = FromIngress(self.index, tuple(self._arrivals), tuple(self._withdrawn))
        self._arrivals, self._withdrawn = [], []
        try:
            self._outbox.send(self.scheduler_address, pack(message))
        except DataPathFull as exc:
            for a in message.arrivals:
                self._refuse(a.rid, "worker-failed", f"the scheduler cannot be reached: {exc}")

    # ---- from the scheduler and the workers -------------------------------------------------
    def _on_message(self, message: memoryview | bytes) -> None:
        try:
            m, tensors = unpack(message, IngressInbox)
        except WireError as exc:
            log.warning("ingress %d: dropped a malformed message: %s", self.index, exc)
            return
        if isinstance(m, Answer):
            for i, rid in enumerate(m.rids):
                held = self._held.get(rid)
                if held is not None and not held.future.done():
                    held.future.set_result({n: a[i] for n, a in tensors.items()})
            return
        self._told(m)

    def _told(self, m: ToIngress) -> None:
        if m.plan is not None:
            self._take_plan(m.plan)
        if m.ready is not None:
            self._ready = set(m.ready)
            self._heard.set()
        if m.metrics is not None:
            self._server_metrics = m.metrics
        for s in m.sends:
            self._send_inputs(s)
        for r in m.refusals:
            for rid in r.rids:
                self._refuse(rid, r.reason, r.detail)

    def _take_plan(self, served: ServedPlan) -> None:
        """Serve the plan the scheduler serves: its models and SLOs, and its models' manifests
        (a model's profile here is its manifest alone; the latencies are the scheduler's)."""
        try:
            plan = Plan.model_validate_json(served.plan_json)
            manifests = {name: ModelManifest.model_validate_json(text) for name, text in served.manifests_json.items()}
        except ValueError as exc:
            log.error("ingress %d: the scheduler sent a plan it cannot read; it serves the one it had: %s", self.index, exc)
            return
        old = self.profiles
        self.plan = plan
        self.profiles = {name: old[name] if name in old and old[name].manifest == man else ModelProfile(man, {})
                         for name, man in manifests.items()}
        for hook in self.on_switch:
            hook()

    def _send_inputs(self, s: SendInputs) -> None:
        """Send stage 0 of a batch these requests' rows, stacked in order (one request: a view)."""
        held = [self._held.get(rid) for rid in s.rids]
        if any(h is None or h.inputs is None for h in held):
            log.warning("ingress %d: batch %s asks for inputs it no longer holds", self.index, s.stage.batch_id)
            return
        if len(held) == 1:
            inputs = {n: np.expand_dims(a, 0) for n, a in held[0].inputs.items()}
        else:
            inputs = {n: np.stack([h.inputs[n] for h in held]) for n in held[0].inputs}
        for h in held:
            h.inputs = None
        message = msgspec.structs.replace(s.stage, sent_us=self.clock.wall_now_us())
        try:
            self._outbox.send(message.addresses[0], pack(message, inputs))
        except DataPathFull as exc:
            for rid in s.rids:
                self._refuse(rid, "worker-failed", str(exc))

    def _refuse(self, rid: int, reason: str, detail: str) -> None:
        held = self._held.get(rid)
        if held is not None and not held.future.done():
            held.future.set_exception(DroppedError(reason, detail))
            held.future.exception()  # retrieved: a withdrawn sample has nobody awaiting it
