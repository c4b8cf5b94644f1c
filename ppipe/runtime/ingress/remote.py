"""An ingress process's runtime: it holds the requests' tensors; the scheduler decides elsewhere.

:class:`IngressRuntime` stands where the HTTP and gRPC frontends expect a
:class:`~ppipe.runtime.scheduler.host.Runtime` (``infer``, ``infer_samples``, ``model_ready``,
``started``, ``clock``, ``profiles``, ``metrics``), but the data plane's scheduler runs in
another process (:mod:`ppipe.runtime.scheduler.ingresses`). Per request::

    client --HTTP--> ingress --Arrival (id, model, arrival, where its inputs lie)--> scheduler
                                    scheduler --stage 0 + the rows' refs--> first worker   (it dispatched)
                                    first worker --> ... --> last worker
    client <--HTTP-- ingress <--Answer (its rows of the outputs)-------------------- last worker

The arrival offers the inputs (:func:`row_inputs`): where they lie in this process's shared
memory, or a small input's bytes. Where the first worker can read them that way (shared
memory: it is on this machine), the scheduler sends it the batch itself. Otherwise (a worker
on another machine, an input neither shared nor small) it tells the ingress to send them::

                     ingress <--SendInputs (stage 0, rows)---- scheduler   (it dispatched)
                     ingress --stage 0 + its rows' inputs--> first worker

so the tensors go from the ingress (or its shared memory) to the first worker and from the
last worker back, never through the scheduler (but for inputs of a few kB), whose cost per
request is a few small messages, each coalesced with the others of its loop tick in both
directions (:class:`~ppipe.runtime.wire.messages.FromIngress`,
:class:`~ppipe.runtime.wire.messages.ToIngress`). A request's error comes as a
:class:`~ppipe.runtime.wire.messages.Refusal` (drops, failed batches, the scheduler's
timeouts). Exactly one answer per request: the first of an answer and a refusal wins, and a
request with neither by SLO + ``answer_grace_s`` is answered ``timeout`` here (a scheduler
that has gone answers nothing).

Metrics: the ingress sends its own Prometheus text to the scheduler every second and
answers ``/metrics`` with the whole server's that the scheduler sends back (every
process's samples, each labelled with its ``process``; until the first comes, its own).

Several schedulers (``ppipe serve --ingress N --shards K``): each arrival goes to the
scheduler of its model (where several schedule it, the next turn of a deal weighted by their
capacity: :class:`~ppipe.runtime.ingress.shard_router.Routes`, as a shard's router deals);
the ingress says hello to every scheduler and keeps each one's plan and ready models, and
serves their union. Scheduler 0 tells it the schedulers' inboxes and the owner table; a
scheduler that goes down has its requests here answered ``shard-down`` at once (its process
held their place in its queue), and the models only it schedules are refused ``shard-down``
until it is back; a new inbox for it gets a hello.

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
import math
from dataclasses import dataclass
from typing import Any, Callable

import msgspec
import numpy as np

from ppipe.runtime.clock import WallClock
from ppipe.runtime.ingress.shard_router import Routes
from ppipe.runtime.memory import trim_heap_periodically, tune_for_serving
from ppipe.runtime.timerslack import tighten_timer_slack
from ppipe.runtime.scheduler.inflight import DroppedError
from ppipe.runtime.scheduler.metrics import RuntimeMetrics
from ppipe.runtime.wire.datapath import LOOPBACK, DataPathFull, Inbox, Outbox
from ppipe.runtime.wire.frames import Rows, WireError, pack, unpack
from ppipe.runtime.wire.messages import Answer, Arrival, FromIngress, IngressInbox, RowInput, SendInputs, ServedPlan, ToIngress
from ppipe.runtime.wire.shared_inputs import InputArena, process_arena, shared_arena_for
from ppipe.spec.plan import Plan
from ppipe.spec.profile import ModelManifest, ModelProfile

log = logging.getLogger("ppipe.runtime")
METRICS_EVERY_S = 1.0  # how often the ingress sends the scheduler its metrics
HELLO_TIMEOUT_S = 30.0  # the scheduler answers a hello within this
TIMEOUT_CHECK_S = 1.0  # how often the held requests are looked at for their timeout
INLINE_INPUT_BYTES = 4096  # a request's inputs up to this size ride with its arrival


def row_inputs(inputs: dict[str, np.ndarray], arena: InputArena | None) -> tuple[RowInput, ...]:
    """A request's inputs as its arrival offers them to the scheduler, which then sends the
    first worker the batch itself (no send order back, no message from here): each by
    where it lies in ``arena`` (this process's shared memory; the scheduler uses the ref
    only for a worker on this machine), or, when all of them together are small
    (``INLINE_INPUT_BYTES``), their bytes. Empty where an input can go neither way: the
    scheduler then asks this ingress to send them (:class:`SendInputs`)."""
    inline = sum(a.nbytes for a in inputs.values()) <= INLINE_INPUT_BYTES
    out = []
    for name, a in inputs.items():
        if inline:
            out.append(RowInput(name, a.dtype.str, a.shape, data=a.tobytes()))
            continue
        ref = None if arena is None else arena.locate(a)
        if ref is None:
            return ()
        out.append(RowInput(name, a.dtype.str, a.shape, ref=tuple(ref)))
    return tuple(out)


def in_shared_memory(inputs: dict[str, np.ndarray], arena: InputArena | None) -> dict[str, np.ndarray]:
    """A request's inputs as :func:`row_inputs` can offer them by ref: those too large to ride
    with the arrival that lie outside ``arena`` (a gRPC message's bytes, a decoded JSON body,
    prepared images) copied into it, so that the scheduler sends them to the first worker
    itself (one copy here, instead of a send order back and a send of their bytes from here).
    Unchanged where they ride inline, or where one of them cannot be shared: then they are
    sent from here when asked (:class:`SendInputs`)."""
    if arena is None or sum(a.nbytes for a in inputs.values()) <= INLINE_INPUT_BYTES:
        return inputs
    shared = {name: arena.share(a) for name, a in inputs.items()}
    return inputs if any(a is None for a in shared.values()) else shared


@dataclass
class _Held:
    """A request this ingress holds until its answer: its future and its inputs (until sent;
    inputs sent as shared memory stay ``pinned`` until the answer, so that their slot is not
    reused while the first worker reads it)."""

    future: asyncio.Future
    inputs: dict[str, np.ndarray] | None
    due_s: float = math.inf  # the loop's time at which it is answered timeout (SLO + answer grace)
    timeout_s: float = 0.0
    scheduler: int = 0  # the scheduler it was sent to
    pinned: dict[str, np.ndarray] | None = None


@dataclass
class _Scheduler:
    """What this ingress knows of one scheduler: its inbox (``""`` while it is down), and
    (once it answered the hello) the models ready there and the plan it serves (its part of
    the server's; kept while it is down or restarting, so that its models are refused
    ``shard-down``, not unknown)."""

    address: str
    ready: set[str] | None = None
    plan: Plan | None = None
    manifests: dict[str, ModelManifest] | None = None


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
        self._arrivals: dict[int, list[Arrival]] = {}  # this tick's, by scheduler
        self._withdrawn: dict[int, list[int]] = {}
        self._flush_armed = False
        self._schedulers: list[_Scheduler | None] = [_Scheduler(scheduler_address)]  # by shard (None: down)
        self._routes: Routes | None = None  # which scheduler each model's requests go to (None: scheduler 0)
        self._heard: asyncio.Event | None = None  # set once every scheduler up has answered the hello
        self._server_metrics: bytes | None = None  # the whole server's metrics, as the scheduler last sent them
        self._pushing: asyncio.Task | None = None
        self._trimming: asyncio.Task | None = None
        self._sweeping: asyncio.Task | None = None
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
        self._hello(self.scheduler_address)
        try:
            await asyncio.wait_for(self._heard.wait(), HELLO_TIMEOUT_S)
        except TimeoutError:
            raise TimeoutError(f"ingress {self.index}: no answer from the scheduler at {self.scheduler_address} "
                               f"within {HELLO_TIMEOUT_S:g} s") from None
        self._pushing = loop.create_task(self._push_metrics())
        self._sweeping = loop.create_task(self._time_out_held())
        tune_for_serving()  # the inputs it holds reuse the heap's pages; a burst's go back on a timer
        tighten_timer_slack()
        self._trimming = loop.create_task(trim_heap_periodically())

    async def stop(self) -> None:
        for task in (self._pushing, self._trimming, self._sweeping):
            if task is not None:
                task.cancel()
        for rid in list(self._held):
            self._refuse(rid, "shutdown", "the server is shutting down")
        if self._inbox is not None:
            self._inbox.close()
        self._outbox.close()

    def _hello(self, address: str) -> None:
        self._outbox.send(address, pack(FromIngress(self.index, hello=self.address)))

    @property
    def started(self) -> bool:
        return self._heard is not None and self._heard.is_set()

    def model_ready(self, model: str) -> bool:
        return any(s is not None and s.ready is not None and model in s.ready for s in self._schedulers)

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
            for r in rids:
                if r in self._held:
                    self._withdrawn.setdefault(self._held[r].scheduler, []).append(r)
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
        j = self._scheduler_of(model)
        rid = next(self._ids)
        loop = asyncio.get_running_loop()
        arena = process_arena()
        inputs = in_shared_memory(inputs, arena)
        timeout_s = mp.slo_ms / 1e3 + self.answer_grace_s
        self._held[rid] = _Held(loop.create_future(), inputs, loop.time() + timeout_s, timeout_s, scheduler=j)
        now = self.clock.true_now_us() if arrival_us is None else arrival_us
        self._arrivals.setdefault(j, []).append(Arrival(rid, model, self.clock.to_wall_us(now), row_inputs(inputs, arena)))
        self._arm_flush()
        return rid

    def _scheduler_of(self, model: str) -> int:
        """The scheduler the next request of ``model`` goes to.

        Raises:
            DroppedError: ``shard-down``: that scheduler is down (restarting or stopping).
        """
        j = 0 if self._routes is None else self._routes.get(model, 0)
        if j >= len(self._schedulers) or self._schedulers[j] is None or not self._schedulers[j].address:
            raise DroppedError("shard-down", f"scheduler {j} of this server, which schedules {model}, is down "
                                             "(restarting or stopping): retry shortly")
        return j

    def _let_go(self, rid: int) -> None:
        self._held.pop(rid, None)

    async def _time_out_held(self) -> None:
        """Answer ``timeout`` the requests still held at SLO + ``answer_grace_s``, looking every
        ``TIMEOUT_CHECK_S`` or half the grace, whichever is shorter. A timeout is a safety net
        (the scheduler answers or times out every request it was sent), so one sweep of the
        held requests replaces a timer per request."""
        loop = asyncio.get_running_loop()
        every_s = min(TIMEOUT_CHECK_S, self.answer_grace_s / 2)
        while True:
            await asyncio.sleep(every_s)
            now = loop.time()
            for rid in [r for r, h in self._held.items() if h.due_s <= now]:
                self._refuse(rid, "timeout", f"no answer within {self._held[rid].timeout_s:.1f} s")

    def _arm_flush(self) -> None:
        if not self._flush_armed:
            self._flush_armed = True
            asyncio.get_running_loop().call_soon(self._flush)

    def _flush(self) -> None:
        """Send this tick's arrivals and withdrawals to each scheduler in one message."""
        self._flush_armed = False
        arrivals, withdrawn = self._arrivals, self._withdrawn
        self._arrivals, self._withdrawn = {}, {}
        for j in {*arrivals, *withdrawn}:
            message = FromIngress(self.index, tuple(arrivals.get(j, ())), tuple(withdrawn.get(j, ())))
            s = self._schedulers[j] if j < len(self._schedulers) else None
            try:
                if s is None or not s.address:
                    raise DataPathFull(f"scheduler {j} is down")
                self._outbox.send(s.address, pack(message))
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
        if m.schedulers is not None and m.origin == 0:
            self._take_directory(m.schedulers, m.owner or {})
        s = self._schedulers[m.origin] if m.origin < len(self._schedulers) else None
        if s is not None and s.address:
            if m.plan is not None:
                self._take_plan(s, m.plan)
            if m.ready is not None:
                s.ready = set(m.ready)
                if all(x is None or not x.address or x.ready is not None for x in self._schedulers):
                    self._heard.set()
        if m.metrics is not None and m.origin == 0:
            self._server_metrics = m.metrics
        for s in m.sends:
            self._send_inputs(s)
        for r in m.refusals:
            for rid in r.rids:
                self._refuse(rid, r.reason, r.detail)

    def _take_directory(self, addresses: tuple[str, ...], owner: dict) -> None:
        """Scheduler 0's word on the schedulers (inboxes by shard, "" down) and who schedules
        each model. A scheduler gone or at a new inbox has its requests here refused at
        once (nothing there will answer them); a new inbox gets a hello."""
        self._schedulers += [None] * (len(addresses) - len(self._schedulers))
        for j, address in enumerate(addresses):
            known = self._schedulers[j]
            if j == 0 or (known is not None and known.address == address):
                continue
            if known is not None:
                for rid in [r for r, h in self._held.items() if h.scheduler == j]:
                    self._refuse(rid, "shard-down", f"scheduler {j} of this server went away while it held the request: retry")
            # its part of the plan stays served (refused shard-down) until it answers anew
            self._schedulers[j] = _Scheduler(address, ready=None if address else set(), plan=known.plan if known else None,
                                             manifests=known.manifests if known else None)
            if address:
                self._hello(address)
        self._routes = Routes(owner, -1)
        self._merge_plans()

    def _take_plan(self, s: _Scheduler, served: ServedPlan) -> None:
        """Take the plan scheduler ``s`` serves: its models and SLOs, and its models'
        manifests; the ingress serves the union of its schedulers' (:meth:`_merge_plans`)."""
        try:
            s.plan = Plan.model_validate_json(served.plan_json)
            s.manifests = {name: ModelManifest.model_validate_json(text) for name, text in served.manifests_json.items()}
        except ValueError as exc:
            log.error("ingress %d: a scheduler sent a plan it cannot read; it serves the one it had: %s", self.index, exc)
            return
        self._merge_plans()

    def _merge_plans(self) -> None:
        """Serve the union of the schedulers' plans (a model that several schedule: its
        pipelines and planned rate over all of them; its profile here is its manifest alone:
        the latencies are the schedulers'), then run the ``on_switch`` hooks (the frontends'
        model lists)."""
        known = [s for s in self._schedulers if s is not None and s.plan is not None]
        if not known:
            return
        models, manifests, placement = {}, {}, []
        for s in known:
            for m in s.plan.models:
                have = models.get(m.name)  # a model several schedulers share: its pipelines and rate are all of theirs
                models[m.name] = m if have is None else have.model_copy(update={
                    "pipelines": [*have.pipelines, *m.pipelines], "throughput_rps": have.throughput_rps + m.throughput_rps})
            for name, man in s.manifests.items():
                manifests.setdefault(name, man)
            placement += s.plan.placement
        first = known[0].plan
        self.plan = first if len(known) == 1 else first.model_copy(update={"models": list(models.values()), "placement": placement})
        old = self.profiles
        self.profiles = {name: old[name] if name in old and old[name].manifest == man else ModelProfile(man, {})
                         for name, man in manifests.items()}
        for hook in self.on_switch:
            hook()

    def _send_inputs(self, s: SendInputs) -> None:
        """Send stage 0 of a batch these requests' rows in order: stacked on the wire, or named
        where they lie in shared memory when the worker is on this machine."""
        held = [self._held.get(rid) for rid in s.rids]
        if any(h is None or h.inputs is None for h in held):
            log.warning("ingress %d: batch %s asks for inputs it no longer holds", self.index, s.stage.batch_id)
            return
        inputs = {n: Rows([h.inputs[n] for h in held]) for n in held[0].inputs}
        message = msgspec.structs.replace(s.stage, sent_us=self.clock.wall_now_us())
        arena = shared_arena_for(message.addresses[0])
        for h in held:
            h.inputs, h.pinned = None, h.inputs if arena is not None else None
        try:
            self._outbox.send(message.addresses[0], pack(message, inputs, arena))
        except DataPathFull as exc:
            for rid in s.rids:
                self._refuse(rid, "worker-failed", str(exc))

    def _refuse(self, rid: int, reason: str, detail: str) -> None:
        held = self._held.get(rid)
        if held is not None and not held.future.done():
            held.future.set_exception(DroppedError(reason, detail))
            held.future.exception()  # retrieved: a withdrawn sample has nobody awaiting it
