"""The runtime's driver: the data plane's scheduler under the wall clock, with Ray workers.

:class:`Runtime` owns the scheduler (built by :func:`ppipe.dataplane.build_scheduler`, or
any factory with its signature) and applies its decisions:

- :class:`~ppipe.dataplane.api.Dispatch`: stack the requests' inputs into a batch, call
  the first worker of the reserved path and walk the chain of stage results (each stage's
  report goes to ``scheduler.report`` as soon as it arrives); split the outputs and answer
  every request of the batch.
- :class:`~ppipe.dataplane.api.Drop`: answer the request with :class:`DroppedError`.
- :class:`~ppipe.dataplane.api.WakeAt`: ``clock.call_at(t, scheduler.wake)``.

A worker that dies (a call fails with ``RayActorError``, or the health loop's ping does)
is given to ``scheduler.mark_failed`` once; the requests of its in-flight batches are
answered with ``worker-failed``. Every request gets exactly one answer: its outputs, or an
error; a request the scheduler neither dispatched nor dropped within SLO + ``answer_grace_s``
is answered with a timeout error.

Everything runs on one asyncio loop (the HTTP server's), so the scheduler, which is not
thread-safe, is only ever called from that loop.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
from dataclasses import dataclass, field
from typing import Any, Callable

import numpy as np

from ppipe.errors import UserError
from ppipe.dataplane.api import Decision, Dispatch, Drop, DropReason, Request, StageReport, WakeAt
from ppipe.runtime.clock import WallClock, wall_us
from ppipe.runtime.metrics import RuntimeMetrics
from ppipe.spec.cluster import ClusterSpec
from ppipe.spec.plan import Plan
from ppipe.spec.profile import ModelProfile

log = logging.getLogger("ppipe.runtime")

SchedulerFactory = Callable[..., Any]


class DroppedError(Exception):
    """A request that will not be served; ``reason`` is a :class:`DropReason` value or 'timeout'/'worker-error'."""

    def __init__(self, reason: str, detail: str = ""):
        self.reason = reason
        self.detail = detail
        super().__init__(f"dropped: {reason}" + (f": {detail}" if detail else ""))


@dataclass
class _Pending:
    request: Request
    future: asyncio.Future
    slo_deadline_us: float  # arrival + SLO (the request's deadline is earlier by the answer budget)
    dispatched: bool = False


@dataclass
class BatchTrace:
    """What happened to one dispatched batch (kept for tests and debugging)."""

    batch_id: int
    model: str
    route: list[str]
    request_ids: list[int]
    dispatched_us: float = 0.0
    reports: list[dict[str, Any]] = field(default_factory=list)
    reserved_us: list[tuple[float, float]] = field(default_factory=list)  # per stage: reserved (start, end), scheduler time
    error: str | None = None


def check_whole_paths(scheduler: Any, policy: str) -> None:
    """The runtime runs a batch along its whole path; refuse policies that dispatch parts."""
    if getattr(scheduler, "partial_dispatches", False):
        raise UserError(
            f"data-plane policy '{policy}' dispatches partial paths (a batch continues from a middle stage), "
            "which the runtime does not run",
            fix="serve with --policy reservation (the paper's) or reactive",
        )


def freeze_startup_objects() -> None:
    """Move every object alive now out of the garbage collector's sight (``gc.freeze``).

    Why: a full (generation 2) collection walks every tracked object, and a serving
    process holds hundreds of thousands after start-up (Ray, pydantic schemas, profiles,
    the scheduler's tables). Measured in the frontend during a rehearsal at 135 req/s:
    two full collections in 10 s, one of 79 ms, which stalls every request in flight (a
    79 ms stop of the event loop misses SLOs of ~100 ms). Frozen start-up objects are never
    scanned again; what is allocated later is collected as usual.
    """
    import gc

    gc.collect()
    gc.freeze()


def default_scheduler_factory(plan, profiles, cluster, clock, policy: str = "reservation", **options):
    from ppipe.dataplane import build_scheduler  # the data plane's one scheduler

    return build_scheduler(plan, profiles, cluster, clock, policy=policy, **options)


class Runtime:
    """Serves a plan: scheduler + workers, behind :meth:`infer`.

    Args:
        plan, profiles, cluster: what to serve (profiles by model name).
        workers: {vGPU id: Ray actor handle} from :func:`ppipe.runtime.deploy.start_workers`.
        scheduler_factory: ``f(plan, profiles, cluster, clock, policy=..., **options)``;
            default :func:`ppipe.dataplane.build_scheduler`.
        policy, scheduler_options: passed to the factory.
        health_interval_s: how often every live worker is pinged.
        answer_grace_s: a request still unanswered at deadline + this gets a timeout error.
        keep_traces: remember the last N batches' routes and reports (:attr:`traces`).
        dispatch_lead_us: the scheduler plans each decision this far ahead of the wall clock,
            the time an actor call takes to reach its worker (:class:`~ppipe.runtime.clock.WallClock`).
        answer_budget_us: the deadline the scheduler gets is ``arrival + SLO - answer_budget``:
            a batch must end this long before the SLO, which is the time its answer still
            needs (the last report reaching the frontend, the HTTP reply). Without it, a
            batch the scheduler fits just inside the deadline is answered late. Lateness
            (metrics, the answer) is still judged against ``arrival + SLO``.
        edges: the transport of each (sender, receiver) vGPU pair, from
            :func:`ppipe.runtime.deploy.setup_transport` (``{edge: "nccl" | "object-store"}``
            or ``{edge: (transport, reason)}``); edges not named use the object store.
    """

    def __init__(
        self,
        plan: Plan,
        profiles: dict[str, ModelProfile],
        cluster: ClusterSpec,
        workers: dict[str, Any],
        *,
        scheduler_factory: SchedulerFactory | None = None,
        policy: str = "reservation",
        scheduler_options: dict[str, Any] | None = None,
        metrics: RuntimeMetrics | None = None,
        health_interval_s: float = 0.5,
        answer_grace_s: float = 30.0,
        keep_traces: int = 0,
        edges: dict[tuple[str, str], Any] | None = None,
        dispatch_lead_us: float = 0.0,
        answer_budget_us: float = 0.0,
    ):
        self.plan, self.profiles, self.cluster, self.workers = plan, profiles, cluster, dict(workers)
        self._factory = scheduler_factory or default_scheduler_factory
        self._policy, self._options = policy, dict(scheduler_options or {})
        self.metrics = metrics or RuntimeMetrics()
        self.health_interval_s, self.answer_grace_s = health_interval_s, answer_grace_s
        self.keep_traces = keep_traces
        self.dispatch_lead_us = dispatch_lead_us
        if answer_budget_us < 0:
            raise ValueError(f"answer_budget_us must be >= 0, got {answer_budget_us}")
        self.answer_budget_us = answer_budget_us
        self.traces: list[BatchTrace] = []
        self.failed: dict[str, float] = {}  # vGPU id -> scheduler time it was marked failed
        self.clock: WallClock | None = None
        self.scheduler: Any = None
        self._pending: dict[int, _Pending] = {}
        self._ids = itertools.count()
        self._wakes: set[float] = set()
        self._tasks: set[asyncio.Task] = set()
        self._health: asyncio.Task | None = None
        self._queued: dict[str, int] = {m.name: 0 for m in plan.models}
        # NCCL edges and the number of the next message on each (see ppipe.runtime.transport)
        self.nccl_edges = {e for e, t in (edges or {}).items() if (t if isinstance(t, str) else t[0]) == "nccl"}
        self._edge_seq: dict[tuple[str, str], int] = {e: 0 for e in self.nccl_edges}
        self._heard: dict[str, float] = {}  # vGPU id -> loop time of its last report

    # ---- lifecycle ------------------------------------------------------------------
    async def start(self) -> None:
        """Make the clock and the scheduler on the running loop; start the health loop."""
        self.clock = WallClock(asyncio.get_running_loop(), lead_us=self.dispatch_lead_us)
        self.scheduler = self._factory(self.plan, self.profiles, self.cluster, self.clock, policy=self._policy, **self._options)
        check_whole_paths(self.scheduler, self._policy)
        freeze_startup_objects()
        self._health = asyncio.get_running_loop().create_task(self._health_loop())

    async def stop(self) -> None:
        if self._health is not None:
            self._health.cancel()
        for p in list(self._pending.values()):
            self._answer_error(p.request.id, DroppedError("shutdown", "the server is shutting down"))
        for t in list(self._tasks):
            t.cancel()

    @property
    def started(self) -> bool:
        return self.scheduler is not None

    def model_ready(self, model: str) -> bool:
        """A model is ready while every partition of one of its pipelines has a live vGPU."""
        mp = self.plan.model(model)
        for i, pl in enumerate(mp.pipelines):
            if all(
                any(p.vgpu_id not in self.failed for p in self.plan.placements_of(model, i, j)) for j in range(len(pl.partitions))
            ):
                return True
        return False

    # ---- requests ---------------------------------------------------------------------
    async def infer(self, model: str, inputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        """Serve one sample (arrays without the batch axis); returns its outputs.

        Raises:
            DroppedError: the scheduler dropped it, a worker on its path failed, or no answer came.
        """
        if self.scheduler is None:
            raise RuntimeError("Runtime.start() has not run")
        mp = self.plan.model(model)
        now = self.clock.true_now_us()  # arrival and deadline on the true timeline, never the lead's
        slo_us = mp.slo_ms * 1e3
        # the scheduler must leave the answer its time (answer_budget_us, at most half the SLO)
        budget = min(self.answer_budget_us, 0.5 * slo_us)
        req = Request(id=next(self._ids), model=model, arrival_us=now, deadline_us=now + slo_us - budget, payload=inputs)
        fut = asyncio.get_running_loop().create_future()
        self._pending[req.id] = _Pending(req, fut, now + slo_us)
        self._queued[model] += 1
        self.metrics.bound(self.metrics.queue, model).inc()
        self._apply(self.scheduler.submit(req))
        timeout_s = mp.slo_ms / 1e3 + self.answer_grace_s
        # one timer per request (cheaper than wait_for(shield(...)), which wraps the future twice)
        timer = asyncio.get_running_loop().call_later(timeout_s, self._timed_out, req.id, timeout_s)
        try:
            return await fut
        finally:
            timer.cancel()
            self._pending.pop(req.id, None)

    def _timed_out(self, rid: int, timeout_s: float) -> None:
        self._answer_error(rid, DroppedError("timeout", f"no answer within {timeout_s:.1f} s"))

    # ---- decisions ------------------------------------------------------------------------
    def _apply(self, decisions: list[Decision]) -> None:
        for d in decisions:
            if isinstance(d, Dispatch):
                self._dispatch(d)
            elif isinstance(d, Drop):
                self.metrics.drops.labels(d.request.model, d.reason.value).inc()
                self._answer_error(d.request.id, DroppedError(d.reason.value, d.detail))
            elif isinstance(d, WakeAt):
                self._wake_at(d.t_us)
            else:  # pragma: no cover - the protocol has three decision types
                raise TypeError(f"unknown decision {d!r}")

    def _wake_at(self, t_us: float) -> None:
        if t_us in self._wakes:
            return
        self._wakes.add(t_us)

        def fire() -> None:
            # asyncio may run a timer up to one clock tick early, and the loop's monotonic
            # clock and the wall clock drift apart; the scheduler ignores a wake before its
            # time (and would not ask again), so an early timer is re-armed, never delivered.
            if self.clock.now_us() < t_us:
                self.clock.call_at(t_us, fire)
                return
            self._wakes.discard(t_us)
            self._apply(self.scheduler.wake())

        self.clock.call_at(t_us, fire)

    def _mark_dispatched(self, req: Request) -> None:
        p = self._pending.get(req.id)
        if p is not None and not p.dispatched:
            p.dispatched = True
            self._dequeue(req.model)

    def _dequeue(self, model: str) -> None:
        self._queued[model] -= 1
        self.metrics.bound(self.metrics.queue, model).dec()

    def _answer_error(self, rid: int, err: DroppedError) -> None:
        p = self._pending.get(rid)
        if p is None or p.future.done():
            return
        if not p.dispatched:
            p.dispatched = True
            self._dequeue(p.request.model)
        p.future.set_exception(err)

    def _answer(self, rid: int, outputs: dict[str, np.ndarray]) -> None:
        p = self._pending.get(rid)
        if p is None or p.future.done():
            return
        p.future.set_result(outputs)
        if self.clock.true_now_us() > p.slo_deadline_us:
            self.metrics.bound(self.metrics.late, p.request.model).inc()

    def _dispatch(self, d: Dispatch) -> None:
        for r in d.requests:
            self._mark_dispatched(r)
        self.metrics.bound(self.metrics.batch, d.model).observe(d.batch)
        # submit the stage calls now, not in the task: a task starts on a later turn of the
        # loop, which on a busy frontend is ms later, and the reservation is already running
        try:
            sub: Any = self._submit(d)
        except Exception as exc:  # answered by the task, like a failure while running
            sub = exc
        task = asyncio.get_running_loop().create_task(self._run_batch(d, sub))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def _submit(self, d: Dispatch) -> tuple[BatchTrace, list[Any], Any]:
        """Submit every stage of a batch; returns (trace, report refs, the last stage's output ref)."""
        route = [s.vgpu_id for s in d.stages]
        trace = BatchTrace(d.batch_id, d.model, route, [r.id for r in d.requests], self.clock.true_now_us(),
                           reserved_us=[(s.start_us, s.start_us + s.infer_us) for s in d.stages])
        if self.keep_traces:
            self.traces.append(trace)
            del self.traces[: -self.keep_traces]
        for j, vgpu in enumerate(route):
            if vgpu not in self.workers or vgpu in self.failed:
                raise _StageFailed(j, "worker was marked failed before the batch was sent", trace)
        names = list(d.requests[0].payload)
        inputs = {n: np.stack([r.payload[n] for r in d.requests]) for n in names}
        to_wall = self.clock.to_wall_us
        timing = [
            (None if s.transfer_start_us is None else to_wall(s.transfer_start_us), s.transfer_us, to_wall(s.start_us))
            for s in d.stages
        ]
        # NCCL edges of this path: both ends learn the edge's next message number now
        links: list[dict[str, Any]] = [{} for _ in route]
        for j in range(1, len(route)):
            e = (route[j - 1], route[j])
            if e in self.nccl_edges:
                seq = self._edge_seq[e]
                self._edge_seq[e] = seq + 1
                links[j - 1]["send"] = {"peer": route[j], "seq": seq}
                links[j]["recv"] = {"peer": route[j - 1], "seq": seq}
        # submit every stage now; over the object store stage k+1 takes stage k's output
        # ObjectRef, so Ray moves the feature map worker to worker and the frontend only
        # holds references; over NCCL it takes nothing and receives from its peer
        reports = []
        payload: Any = {"tensors": inputs, "sent_wall_us": wall_us()}
        for j, vgpu in enumerate(route):
            arg = {"tensors": None, "sent_wall_us": None} if "recv" in links[j] else payload
            meta = (d.batch_id, j, vgpu, d.batch, timing, links[j] or None)
            rep_ref, payload = self.workers[vgpu].run_stage.remote(arg, meta)
            reports.append(rep_ref)
        return trace, reports, payload

    async def _run_batch(self, d: Dispatch, sub: Any) -> None:
        import ray

        route = [s.vgpu_id for s in d.stages]
        trace = sub[0] if isinstance(sub, tuple) else getattr(sub, "trace", None) or BatchTrace(
            d.batch_id, d.model, route, [r.id for r in d.requests], self.clock.true_now_us()
        )
        k = 0
        try:
            if isinstance(sub, BaseException):
                raise sub
            _, reports, payload = sub
            for k, rep_ref in enumerate(reports):
                try:
                    report = await rep_ref
                except ray.exceptions.RayActorError as exc:
                    raise _StageFailed(k, str(exc).splitlines()[0]) from None
                outputs = report.pop("outputs", None)  # the last stage's (see VgpuWorker.run_stage)
                trace.reports.append(report)
                self._report(d, k, report)
            k = len(route) - 1
            if outputs is None:  # a worker that returns them apart
                try:
                    outputs = (await payload)["tensors"]
                except ray.exceptions.RayActorError as exc:
                    raise _StageFailed(k, str(exc).splitlines()[0]) from None
        except _StageFailed as exc:
            vgpu = route[exc.stage]
            trace.error = f"worker-failed: {vgpu}: {exc.detail}"
            self.mark_failed(vgpu)
            for r in d.requests:
                self.metrics.drops.labels(d.model, DropReason.WORKER_FAILED.value).inc()
                self._answer_error(r.id, DroppedError(DropReason.WORKER_FAILED.value, f"vGPU {vgpu} failed while running the batch"))
            return
        except Exception as exc:  # a backend error inside a live worker: answer, keep serving
            log.exception("batch %s failed", d.batch_id)
            trace.error = f"worker-error: {exc}"
            for r in d.requests:
                self._answer_error(r.id, DroppedError("worker-error", str(exc).splitlines()[0] if str(exc) else type(exc).__name__))
            return
        for i, r in enumerate(d.requests):
            self._answer(r.id, {n: a[i] for n, a in outputs.items()})

    def _report(self, d: Dispatch, k: int, rep: dict[str, Any]) -> None:
        self._heard[rep["vgpu_id"]] = asyncio.get_running_loop().time()
        c = self.clock
        self.metrics.bound(self.metrics.busy, rep["vgpu_id"]).inc(max(0.0, rep["end_us"] - rep["start_us"]) / 1e6)
        sr = StageReport(
            batch_id=d.batch_id,
            partition=d.stages[k].partition,
            vgpu_id=rep["vgpu_id"],
            start_us=c.from_wall_us(rep["start_us"]),
            end_us=c.from_wall_us(rep["end_us"]),
            transfer_start_us=None if rep["transfer_start_us"] is None else c.from_wall_us(rep["transfer_start_us"]),
            transfer_end_us=None if rep["transfer_end_us"] is None else c.from_wall_us(rep["transfer_end_us"]),
        )
        self._apply(self.scheduler.report(sr))

    # ---- failures ------------------------------------------------------------------------------
    def mark_failed(self, vgpu_id: str) -> None:
        """Tell the scheduler (once) that a vGPU is gone; it stops routing to it."""
        if vgpu_id in self.failed:
            return
        self.failed[vgpu_id] = self.clock.true_now_us()
        self.metrics.failed.labels(vgpu_id).set(1)
        log.warning("vGPU %s failed; the scheduler stops routing to it", vgpu_id)
        self._apply(self.scheduler.mark_failed(vgpu_id))
        # its NCCL peers abort their edges with it: a receive from it would never complete
        for a, b in self.nccl_edges:
            other = b if a == vgpu_id else a if b == vgpu_id else None
            if other is not None and other not in self.failed and other in self.workers:
                try:
                    self.workers[other].drop_peer.remote(vgpu_id)
                except Exception:  # pragma: no cover - best effort; the health loop finds a dead peer
                    log.exception("could not tell %s to drop its edge with %s", other, vgpu_id)

    async def _health_loop(self) -> None:
        import ray

        async def probe(vgpu: str, h: Any) -> None:
            try:
                await asyncio.wait_for(h.ping.remote(), timeout=max(1.0, 4 * self.health_interval_s))
            except ray.exceptions.RayActorError:
                self.mark_failed(vgpu)
            except asyncio.TimeoutError:
                pass  # slow is not dead (a loaded machine); a dead actor fails fast

        loop = asyncio.get_running_loop()
        while True:
            # a worker that reported within the interval is alive: ping only the quiet ones
            # (a busy worker that dies fails its in-flight calls, which marks it at once)
            fresh = loop.time() - self.health_interval_s
            live = [(v, h) for v, h in self.workers.items() if v not in self.failed and self._heard.get(v, -1e18) < fresh]
            await asyncio.gather(*(probe(v, h) for v, h in live))
            await asyncio.sleep(self.health_interval_s)


class _StageFailed(Exception):
    def __init__(self, stage: int, detail: str, trace: BatchTrace | None = None):
        self.stage, self.detail, self.trace = stage, detail, trace
