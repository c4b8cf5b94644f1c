"""The runtime's driver: the data plane's scheduler under the wall clock, with vGPU workers.

:class:`Runtime` owns the scheduler (built by :func:`ppipe.dataplane.build_scheduler`, or
any factory with its signature) and applies its decisions:

- :class:`~ppipe.dataplane.api.Dispatch`: stack the requests' inputs into a batch and send
  it, with the reserved route, to the first worker over the data path
  (:mod:`ppipe.runtime.wire.datapath`); the workers pass it along the route themselves. Each
  worker's report goes to ``scheduler.report`` as it arrives; the last one carries the
  outputs, whose rows answer the batch's requests.
- :class:`~ppipe.dataplane.api.Drop`: answer the request with :class:`DroppedError`.
- :class:`~ppipe.dataplane.api.WakeAt`: ``clock.call_at(t, scheduler.wake)``.

Each worker is reached through a :class:`~ppipe.runtime.launch.handle.WorkerHandle`: its
launcher (in process, or Ray across machines) placed it; the host opens its data path and
learns that it is gone when its ``lifeline`` call ends. A gone worker is given to ``scheduler.mark_failed`` once, and the requests of the batches
in flight whose remaining stages include it are answered with ``worker-failed``. Every
request gets exactly one answer: its outputs, or an error; a request the scheduler neither
dispatched nor dropped within SLO + ``answer_grace_s`` is answered with a timeout error,
and a dispatched batch whose reports stop coming (a connection between two workers broke
and took its message with it) is answered ``worker-failed`` once it is ``report_grace_s``
(at least the model's SLO) past its planned end.

Time comes from the clock the host makes on its loop (``clock_factory``, by default a
:class:`~ppipe.runtime.clock.WallClock`); the host reads no clock of its own. Everything runs
on one asyncio loop (the HTTP server's), so the scheduler, which is not thread-safe, is
only ever called from that loop.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
from bisect import insort
from dataclasses import dataclass, field
from typing import Any, Awaitable, Callable

import msgspec
import numpy as np

from ppipe.errors import UserError
from ppipe.dataplane.api import Decision, Dispatch, Drop, DropReason, Request, StageReport, WakeAt
from ppipe.dataplane.handover import SwitchingScheduler, kept_vgpus
from ppipe.runtime.scheduler.budgets import ServiceBudgets
from ppipe.runtime.clock import WallClock
from ppipe.runtime.wire.datapath import DataPathFull, Inbox, Outbox, node_host
from ppipe.runtime.wire.frames import WireError, pack, unpack
from ppipe.runtime.wire.messages import EdgeRef, Reservation, StageLinks, StageMsg, StageReport as StageReportMsg
from ppipe.runtime.scheduler.metrics import RuntimeMetrics
from ppipe.runtime.launch.handle import WorkerGone, WorkerHandle
from ppipe.runtime.scheduler.calls import call_unawaited
from ppipe.runtime.workers.transport import LINKED, relink
from ppipe.spec.cluster import ClusterSpec
from ppipe.spec.plan import Plan
from ppipe.spec.profile import ModelProfile

log = logging.getLogger("ppipe.runtime")

SchedulerFactory = Callable[..., Any]
ClockFactory = Callable[[asyncio.AbstractEventLoop], Any]
"""``f(loop)``: the clock the host and its scheduler run on (a :class:`~ppipe.runtime.clock.WallClock`'s methods)."""


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
    timer: Any = None  # its timeout (asyncio.TimerHandle)


@dataclass
class BatchTrace:
    """What happened to one dispatched batch (kept for tests and debugging)."""

    batch_id: int
    model: str
    route: list[str]
    request_ids: list[int]
    dispatched_us: float = 0.0
    reports: list[StageReportMsg] = field(default_factory=list)  # in stage order
    reserved_us: list[tuple[float, float]] = field(default_factory=list)  # per stage: reserved (start, end), scheduler time
    arrivals_us: list[float] = field(default_factory=list)  # its requests' arrivals (true timeline)
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
        workers: {vGPU id: :class:`~ppipe.runtime.launch.handle.WorkerHandle`}, from a launcher
            (:func:`ppipe.runtime.launch.deploy.start_workers` on Ray).
        scheduler_factory: ``f(plan, profiles, cluster, clock, policy=..., **options)``;
            default :func:`ppipe.dataplane.build_scheduler`.
        policy, scheduler_options: passed to the factory.
        data_host: the address the frontend's report socket binds (default: the loopback
            address when every Ray node is this host, else this node's address in Ray).
        respawn: ``await respawn(vgpu_id)`` creates a failed vGPU's worker anew and returns
            its handle once it has loaded its blocks (raises while its node is not back);
            the runtime tries every ``respawn_interval_s`` and hands the vGPU back to the
            scheduler when it is up. None: a failed vGPU stays failed. vGPUs with an NCCL
            edge are not re-created (their communicators would need re-opening).
        answer_grace_s: a request still unanswered at deadline + this gets a timeout error.
        report_grace_s: a dispatched batch still missing reports this long (or the model's
            SLO, if longer) after its planned end is answered ``worker-failed``.
        keep_traces: remember the last N batches' routes and reports (:attr:`traces`).
        dispatch_lead_us: the fixed part of the dispatch lead: the scheduler plans each
            decision this far (plus the input's transfer) ahead of now, the time a dispatch
            takes to reach its first worker (:mod:`ppipe.dataplane.margins`).
        report_tolerance_us: a stage whose start, end and NIC transfer each lie within this
            of its reservation sends no report of its own: its report rides on to the next
            report the batch sends (see :class:`~ppipe.runtime.workers.stage_server.StageServer`), so a
            batch that runs as reserved costs one report message, not one per stage. The
            scheduler then learns of such small deviations when the batch's next report
            comes, and a worker's death fails the batches whose reports it carried on
            (the scheduler still holds their stages as running). None: every stage reports
            at once.
        answer_budget_us: the fixed part of the answer budget: the scheduler plans every batch
            to end this long before ``arrival + SLO``, the time its answer still needs (the
            last report reaching the frontend, the HTTP reply). Lateness (metrics, the
            answer) is still judged against ``arrival + SLO``. The budget also grows by how
            late answers come here, never so far that a model cannot be served
            (:class:`~ppipe.runtime.scheduler.budgets.ServiceBudgets`). A plan whose slack cannot hold
            the lead and the budget is refused at :meth:`start` (UserError).
        edges: the transport of each (sender, receiver) vGPU pair, from
            :func:`ppipe.runtime.launch.deploy.setup_transport` (``{edge: "nccl" | "ring-cuda" | "tcp"}``
            or ``{edge: (transport, reason)}``); edges not named go over the data path's connections.
        links: a :class:`~ppipe.runtime.launch.deploy.LinkOpener`: a plan switch chooses the new
            plan's transports with it and opens the NCCL and ring edges it does not keep
            (:func:`ppipe.runtime.workers.transport.relink`). None: switches put every edge on the
            data path's connections, and a runtime with NCCL edges cannot switch.
        clock_factory: ``f(loop)`` makes the clock at :meth:`start` (default
            :class:`~ppipe.runtime.clock.WallClock`); tests inject their own.
    """

    def __init__(
        self,
        plan: Plan,
        profiles: dict[str, ModelProfile],
        cluster: ClusterSpec,
        workers: dict[str, WorkerHandle],
        *,
        scheduler_factory: SchedulerFactory | None = None,
        policy: str = "reservation",
        scheduler_options: dict[str, Any] | None = None,
        metrics: RuntimeMetrics | None = None,
        data_host: str | None = None,
        respawn: Callable[[str], Awaitable[WorkerHandle]] | None = None,
        respawn_interval_s: float = 2.0,
        answer_grace_s: float = 30.0,
        report_grace_s: float = 5.0,
        keep_traces: int = 0,
        edges: dict[tuple[str, str], Any] | None = None,
        dispatch_lead_us: float = 0.0,
        answer_budget_us: float = 0.0,
        report_tolerance_us: float | None = 1000.0,
        links: Any = None,
        clock_factory: ClockFactory = WallClock,
    ):
        self.plan, self.profiles, self.cluster, self.workers = plan, profiles, cluster, dict(workers)
        self._factory = scheduler_factory or default_scheduler_factory
        self._policy, self._options = policy, dict(scheduler_options or {})
        self.metrics = metrics or RuntimeMetrics()
        self.data_host, self.answer_grace_s, self.report_grace_s = data_host, answer_grace_s, report_grace_s
        self.respawn, self.respawn_interval_s = respawn, respawn_interval_s
        self._revivals: dict[str, asyncio.Task] = {}
        self.keep_traces = keep_traces
        if answer_budget_us < 0 or dispatch_lead_us < 0:
            raise ValueError(f"dispatch_lead_us and answer_budget_us must be >= 0, got {dispatch_lead_us} and {answer_budget_us}")
        self.budgets = ServiceBudgets(dispatch_lead_us, answer_budget_us, self.metrics.registry)
        if report_tolerance_us is not None and report_tolerance_us < 0:
            raise ValueError(f"report_tolerance_us must be >= 0 or None, got {report_tolerance_us}")
        self.report_tolerance_us = report_tolerance_us
        self.report_messages = 0  # report messages received (each with one or more stages' reports)
        self.traces: list[BatchTrace] = []
        self.failed: dict[str, float] = {}  # vGPU id -> scheduler time it was marked failed
        self._clock_factory = clock_factory
        self.clock: WallClock | None = None
        self.scheduler: Any = None
        self._pending: dict[int, _Pending] = {}
        self._ids = itertools.count()
        self._wakes: set[float] = set()
        self._late_peak_us = 0.0  # recent peak lateness of the wake timers (_timer_was_late)
        self._lead_cap_us = 0.25e3 * min(m.slo_ms for m in plan.models)  # the wake lead's ceiling
        self._inflight: dict[int, _InFlight] = {}  # batch id -> the batch, until its last report
        self._inbox: Inbox | None = None
        self._outbox = Outbox()
        self.addresses: dict[str, str] = {}  # vGPU id -> its worker's data-path address
        self._placement = {p.vgpu_id: p for p in plan.placement}
        self._lifelines: list[asyncio.Task] = []
        self._queued: dict[str, int] = {m.name: 0 for m in plan.models}
        # NCCL edges with their generation (0: opened at start-up; n: by the n-th switch
        # preparation), and the number of the next message on each (see ppipe.runtime.workers.transport)
        self.links = links
        self.nccl_links: dict[tuple[str, str], int] = {
            e: 0 for e, t in (edges or {}).items() if (t if isinstance(t, str) else t[0]) in LINKED}
        self._edge_seq: dict[tuple[str, str, int], int] = {}
        self._link_gen = 0  # the last generation a switch opened
        self._old_links: list[tuple[tuple[str, str], int]] = []  # earlier plans' edges, open until their drain ends
        # plan switches (switch_plan): the first batch id each current worker serves, and
        # the workers of earlier plans that still finish their batches
        self._since: dict[str, int] = {}
        self._retiring: list[_Retiring] = []
        self.switches: list[dict[str, Any]] = []
        self.on_switch: list[Callable[[], None]] = []  # called at each switch, after the new plan is in place
        self.arrival_log: list[tuple[str, float]] | None = None  # (model, arrival) of each request, for a re-plan loop
        self.metrics.track_capacity(self)  # ppipe_model_capacity_alive_ratio, from self.plan and self.failed

    @property
    def nccl_edges(self) -> set[tuple[str, str]]:
        """The (sender, receiver) pairs whose feature maps go over NCCL in the current plan."""
        return set(self.nccl_links)

    # ---- lifecycle ------------------------------------------------------------------
    async def start(self) -> None:
        """Make the clock and the scheduler on the running loop, open the data path to every
        worker, and watch each worker's life."""
        loop = asyncio.get_running_loop()
        self.clock = self._clock_factory(loop)
        self.scheduler, margins = self._build_scheduler(self.plan, self.profiles)
        self.budgets.adopt(margins)
        self._inbox = Inbox(self._on_report, self.data_host or node_host())
        vgpus = list(self.workers)
        addrs = await asyncio.gather(*(self.workers[v].open_data_path(self._inbox.address) for v in vgpus))
        self.addresses = dict(zip(vgpus, addrs))
        await asyncio.gather(*(self.workers[v].connect_peers(self._next_stage_addresses(v)) for v in vgpus))
        for a in addrs:
            self._outbox.connect(a)
        freeze_startup_objects()
        self._lifelines = [loop.create_task(self._watch(v, h)) for v, h in self.workers.items()]
        self._lifelines.append(loop.create_task(self._sweep_overdue()))

    def _build_scheduler(self, plan: Plan, profiles: dict[str, ModelProfile]) -> tuple[Any, dict]:
        """A scheduler for ``plan`` with the runtime's margins in its options, and the margins.

        Raises:
            UserError: a policy that dispatches partial paths, or a plan whose slack
                cannot hold the margins.
        """
        options = dict(self._options)
        margins = self.budgets.for_plan(plan, profiles, self.cluster) if self.budgets.active else {}
        if margins:
            options.update(self.budgets.options(margins))
        scheduler = self._factory(plan, profiles, self.cluster, self.clock, policy=self._policy, **options)
        check_whole_paths(scheduler, self._policy)
        return scheduler, margins

    def _next_stage_addresses(self, vgpu_id: str) -> list[str]:
        """The data-path addresses of the vGPUs a worker may forward to (its pipeline's next pool)."""
        p = self._placement[vgpu_id]
        return [self.addresses[q.vgpu_id] for q in self.plan.placements_of(p.model, p.pipeline, p.partition + 1) if q.vgpu_id in self.addresses]

    async def stop(self) -> None:
        """Answer what is pending with ``shutdown`` and close the data path (the workers are the caller's)."""
        for t in [*self._lifelines, *self._revivals.values()]:
            t.cancel()
        for p in list(self._pending.values()):
            self._answer_error(p.request.id, DroppedError("shutdown", "the server is shutting down"))
        self._inflight.clear()
        if self._inbox is not None:
            self._inbox.close()
        self._outbox.close()

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

    # ---- plan switches -------------------------------------------------------------------
    async def switch_plan(
        self,
        plan: Plan,
        profiles: dict[str, ModelProfile],
        start_workers: Callable[[list[str]], Awaitable[dict[str, Any]]],
        stop_worker: Callable[[Any], None],
    ) -> dict[str, Any]:
        """Move to ``plan`` while serving, with no pause (:mod:`ppipe.dataplane.handover`).

        1. The new plan's scheduler is built (a plan that does not fit its profiles or the
           cluster is refused here, and nothing changes).
        2. Its workers that are not kept (:func:`~ppipe.dataplane.handover.kept_vgpus`) are
           started and load their blocks while the old plan serves.
        3. The switch, in one step on the loop: the scheduler hands over (queued requests
           move, the old plan's reservations still ahead are carried over); new requests
           go to the new plan; batches already sent finish on the old plan's workers.
        4. The old plan's workers that the new plan does not keep are stopped once their
           batches have ended (after at most the old plan's largest SLO + 1 s, the batches
           still open are answered with ``plan-switch``).

        Steps 1-2 are :meth:`prepare_switch`, 3-4 :meth:`commit_switch` (a server of several
        shards runs them apart, :class:`ppipe.runtime.control.switch.ShardedSwitcher`).

        Args:
            start_workers: ``await start_workers(vgpu_ids)`` starts these vGPUs of ``plan``,
                loaded, and returns ``{vgpu_id: handle}``; it raises (having stopped what it
                started) when one cannot start.
            stop_worker: stops a worker (given its :class:`~ppipe.runtime.launch.handle.WorkerHandle`).

        Returns:
            what happened: ``kept``, ``started``, ``retiring`` (vGPU counts), ``moved``
            (queued requests handed over), ``first_batch_id``, ``load_s`` (starting the
            workers), ``switch_us`` (the switch step itself) and ``retired`` (per GPU and
            NIC the old plan gives up, when its last reservation there ends, in us).

        Raises:
            UserError: the plan cannot replace the running one; the old plan keeps serving.
        """
        return await self.commit_switch(await self.prepare_switch(plan, profiles, start_workers, stop_worker))

    async def prepare_switch(
        self,
        plan: Plan,
        profiles: dict[str, ModelProfile],
        start_workers: Callable[[list[str]], Awaitable[dict[str, Any]]],
        stop_worker: Callable[[Any], None],
    ) -> "PreparedSwitch":
        """Steps 1-2 of :meth:`switch_plan`: the new scheduler, its new workers started and
        connected; the old plan serves on. :meth:`commit_switch` or :meth:`abort_switch` follows."""
        if self.nccl_links and self.links is None:
            raise UserError("this runtime sends feature maps over NCCL and was given no link opener to open the new plan's edges",
                            fix="pass links=LinkOpener(...) (ppipe serve does), or restart with the new plan")
        t0 = self.clock.true_now_us()
        current = self.scheduler.current if isinstance(self.scheduler, SwitchingScheduler) else self.scheduler
        new, margins = self._build_scheduler(plan, profiles)
        check_switchable(current, new)
        kept = kept_vgpus(current.topology, new.topology)
        fresh = sorted(p.vgpu_id for p in plan.placement if p.vgpu_id not in kept)
        handles = await start_workers(fresh) if fresh else {}
        prepared = PreparedSwitch(plan, dict(profiles), new, kept, {}, handles, stop_worker, load_s=0.0, margins=margins)
        try:
            addrs = await asyncio.gather(*(handles[v].open_data_path(self._inbox.address) for v in fresh))
            prepared.fresh_addrs = dict(zip(fresh, addrs))
            await self._open_links(prepared)
        except BaseException:
            self.abort_switch(prepared)
            raise
        prepared.load_s = (self.clock.true_now_us() - t0) / 1e6
        return prepared

    async def _open_links(self, prepared: "PreparedSwitch") -> None:
        """The new plan's transports (``self.links``): keep the NCCL edges between kept
        workers, open the others as this preparation's generation; None: every edge on the
        data path."""
        if self.links is None:
            return
        workers = {**{v: self.workers[v] for v in prepared.kept}, **prepared.handles}
        choice = await asyncio.to_thread(self.links.choose, prepared.plan, self.cluster, prepared.profiles, workers)
        self._link_gen += 1
        prepared.gen = self._link_gen
        prepared.links = relink(choice, prepared.kept, self.nccl_links, prepared.gen)
        prepared.opened = sorted(e for e, g in prepared.links.items() if g == prepared.gen)
        kinds = {e: choice[e][0] for e in prepared.opened}
        await asyncio.to_thread(self.links.open, workers, prepared.opened, prepared.gen, kinds)

    def abort_switch(self, prepared: "PreparedSwitch") -> None:
        """Give up a prepared switch: close the edges it opened at kept workers and stop the
        workers it started (the old plan never stopped)."""
        self._close_edges([(e, prepared.gen) for e in prepared.opened], {v: self.workers[v] for v in prepared.kept})
        for h in prepared.handles.values():
            prepared.stop_worker(h)

    def _close_edges(self, edges: list[tuple[tuple[str, str], int]], at: dict[str, Any]) -> None:
        """Tell the workers in ``at`` to close their ends of ``edges`` (``((sender, receiver),
        generation)``); not awaited: a worker already gone has nothing to close."""
        ends: dict[str, list[tuple[str, int]]] = {}
        for (a, b), gen in edges:
            for me, peer in ((a, b), (b, a)):
                if me in at:
                    ends.setdefault(me, []).append((peer, gen))
        for v, es in ends.items():
            call_unawaited(at[v].close_edges(es), f"{v}.close_edges")

    async def commit_switch(self, prepared: "PreparedSwitch", embargo: dict[str, float | None] | None = None) -> dict[str, Any]:
        """Steps 3-4 of :meth:`switch_plan`.

        ``embargo``: GPUs and NICs another shard's old plan used, with when its reservations
        there end, or None where that shard has not switched yet (then :meth:`lift_embargo`
        follows); see :func:`ppipe.dataplane.handover.hand_over`.
        """
        record = self._switch_now(prepared, embargo or {})
        record["load_s"] = prepared.load_s
        live = [v for v in self.workers if v not in self.failed]
        await asyncio.gather(*(self.workers[v].connect_peers(self._next_stage_addresses(v)) for v in live),
                             return_exceptions=True)  # warming connections only: a dead worker's lifeline reports it
        task = asyncio.get_running_loop().create_task(self._drain(record["first_batch_id"], prepared.stop_worker,
                                                                  self._drain_timeout_s(), prepared.stale))
        self._lifelines.append(task)
        return record

    def lift_embargo(self, resource: str, until_us: float) -> None:
        """The shard that used ``resource`` before the switch has switched: it is busy until ``until_us``."""
        self._apply(self.scheduler.lift_embargo(resource, until_us))

    def _switch_now(self, prepared: "PreparedSwitch", embargo: dict[str, float | None]) -> dict[str, Any]:
        """The switch step: synchronous, so no request sees half of it."""
        t0 = self.clock.true_now_us()
        plan, kept, handles, fresh_addrs = prepared.plan, prepared.kept, prepared.handles, prepared.fresh_addrs
        if not isinstance(self.scheduler, SwitchingScheduler):
            self.scheduler = SwitchingScheduler(self.scheduler)
        h = self.scheduler.switch(prepared.scheduler, embargo=embargo)
        retiring = {v: w for v, w in self.workers.items() if v not in kept}
        for v, w in retiring.items():
            self._retiring.append(_Retiring(v, w, since=self._since.pop(v, 0), until=h.first_batch_id))
            if self.failed.pop(v, None) is not None:
                self.metrics.failed.labels(v).set(0)
            revival = self._revivals.pop(v, None)
            if revival is not None:
                revival.cancel()
        prepared.stale = self._relink(prepared)
        self.plan, self._placement = plan, {p.vgpu_id: p for p in plan.placement}
        self._lead_cap_us = 0.25e3 * min(m.slo_ms for m in plan.models)
        self.profiles = dict(prepared.profiles)
        self.budgets.adopt(prepared.margins)
        self.workers = {**{v: self.workers[v] for v in kept}, **handles}
        self.addresses = {**{v: self.addresses[v] for v in kept}, **fresh_addrs}
        loop = asyncio.get_running_loop()
        for v, addr in fresh_addrs.items():
            self._since[v] = h.first_batch_id
            self._outbox.connect(addr)
            self._lifelines.append(loop.create_task(self._watch(v, handles[v])))
        for m in plan.models:
            self._queued.setdefault(m.name, 0)
        for hook in self.on_switch:
            hook()
        self._apply(h.decisions)
        record = {"kept": len(kept), "started": len(handles), "retiring": len(retiring), "moved": h.moved,
                  "first_batch_id": h.first_batch_id, "switch_us": self.clock.true_now_us() - t0, "at_us": t0,
                  "first_dispatch_us": None, "retired": dict(h.retired), "nccl_opened": len(prepared.opened)}
        self.switches.append(record)
        log.warning("switched to a new plan (%d vGPUs kept, %d started, %d finishing their batches; %d queued requests moved)",
                    len(kept), len(handles), len(retiring), h.moved)
        return record

    def _relink(self, prepared: "PreparedSwitch") -> tuple[list[tuple[tuple[str, str], int]], dict[str, Any]]:
        """Make the prepared edges current; returns the edges the new plan does not use (to
        close once the old plan's batches end) and the kept workers that hold their ends."""
        if prepared.links is None:
            return [], {}
        stale = [(e, g) for e, g in self.nccl_links.items() if prepared.links.get(e) != g]
        self.nccl_links = dict(prepared.links)
        self._old_links += stale
        return stale, {v: self.workers[v] for v in prepared.kept}

    def _drain_timeout_s(self) -> float:
        return max((m.slo_ms for m in self.plan.models), default=0.0) / 1e3 + 1.0

    async def _drain(self, first_new: int, stop_worker: Callable[[Any], None], timeout_s: float,
                     stale_links: tuple[list[tuple[tuple[str, str], int]], dict[str, Any]] = ([], {})) -> None:
        """Stop the earlier plan's retiring workers once its batches (ids below ``first_new``) have
        ended, or after ``timeout_s``, answering the batches still open with ``plan-switch``;
        then close the NCCL edges it alone used (``stale_links``: the edges and the kept
        workers that hold their ends)."""
        deadline_us = self.clock.true_now_us() + timeout_s * 1e6
        while any(b < first_new for b in self._inflight) and self.clock.true_now_us() < deadline_us:
            await asyncio.sleep(0.02)
        for batch in [b for i, b in self._inflight.items() if i < first_new]:
            self._fail(batch, "plan-switch", f"the earlier plan's batch did not end within {timeout_s:.1f} s of the switch")
        for r in [r for r in self._retiring if r.until <= first_new]:
            r.stopping = True
            self._retiring.remove(r)
            try:
                stop_worker(r.handle)
            except Exception:  # pragma: no cover - a worker already gone
                log.debug("stopping %s of an earlier plan: already gone", r.vgpu_id)
        edges, holders = stale_links
        self._close_edges(edges, holders)
        self._old_links = [x for x in self._old_links if x not in edges]
        for (a, b), gen in edges:
            self._edge_seq.pop((a, b, gen), None)

    # ---- requests ---------------------------------------------------------------------
    async def infer(self, model: str, inputs: dict[str, np.ndarray], arrival_us: float | None = None) -> dict[str, np.ndarray]:
        """Serve one sample (arrays without the batch axis); returns its outputs.

        Args:
            arrival_us: when the request arrived, on the true timeline
                (``clock.true_now_us()``; default: now). A frontend that spent time
                reading and decoding the request passes the time it began, so that its
                deadline and lateness count from then.

        Raises:
            DroppedError: the scheduler dropped it, a worker on its path failed, or no answer came.
        """
        p = self._submit(model, inputs, arrival_us)
        try:
            return await p.future
        finally:
            self._settle(p)

    async def infer_samples(self, model: str, samples: list[dict[str, np.ndarray]], arrival_us: float | None = None) -> list[dict[str, np.ndarray]]:
        """Serve the samples of one client request (each is a request to the scheduler);
        returns their outputs in order.

        One answer for all: at the first sample that is dropped, the samples not submitted
        yet are not submitted and those still queued are withdrawn from the scheduler
        (``withdraw``, where it has one), so a refused request costs no more work than it
        must. Samples already dispatched run to the end (their batch may serve others).

        Raises:
            DroppedError: the first sample's error.
        """
        subs: list[_Pending] = []
        try:
            for inputs in samples:
                p = self._submit(model, inputs, arrival_us)
                subs.append(p)
                if p.future.done() and p.future.exception() is not None:
                    raise p.future.exception()
            return [await p.future for p in subs]
        except DroppedError:
            self._withdraw(subs)
            raise
        finally:
            for p in subs:
                self._settle(p)

    def _submit(self, model: str, inputs: dict[str, np.ndarray], arrival_us: float | None) -> _Pending:
        """Make a sample's request, give it to the scheduler and arm its timeout."""
        if self.scheduler is None:
            raise RuntimeError("Runtime.start() has not run")
        try:
            mp = self.plan.model(model)
        except KeyError:  # a model a plan switch has just removed
            raise DroppedError(DropReason.UNKNOWN_MODEL.value, f"the plan serves {', '.join(m.name for m in self.plan.models)}") from None
        # arrival and deadline on the true timeline, never the lead's
        now = self.clock.true_now_us() if arrival_us is None else arrival_us
        slo_us = mp.slo_ms * 1e3
        # (the scheduler plans for an earlier deadline itself: the answer budget, ppipe.runtime.scheduler.budgets)
        req = Request(id=next(self._ids), model=model, arrival_us=now, deadline_us=now + slo_us, payload=inputs)
        loop = asyncio.get_running_loop()
        p = _Pending(req, loop.create_future(), now + slo_us)
        self._pending[req.id] = p
        if self.arrival_log is not None:
            self.arrival_log.append((model, now))
        self._queued[model] += 1
        self.metrics.bound(self.metrics.queue, model).inc()
        self._apply(self.scheduler.submit(req))
        timeout_s = mp.slo_ms / 1e3 + self.answer_grace_s
        # one timer per request (cheaper than wait_for(shield(...)), which wraps the future twice)
        p.timer = loop.call_later(timeout_s, self._timed_out, req.id, timeout_s)
        return p

    def _settle(self, p: _Pending) -> None:
        p.timer.cancel()
        self._pending.pop(p.request.id, None)

    def _withdraw(self, subs: list[_Pending]) -> None:
        """Take the samples of a refused request that still wait in the scheduler's queue out
        of it; every unanswered sample is answered ``withdrawn`` (nobody awaits it)."""
        waiting = [p.request.id for p in subs if not p.dispatched]
        withdraw = getattr(self.scheduler, "withdraw", None)
        if waiting and withdraw is not None:
            self._apply(withdraw(waiting))
        for p in subs:
            if self._answer_error(p.request.id, DroppedError("withdrawn", "another sample of its request was dropped")):
                p.future.exception()  # retrieved: nobody awaits it

    def _timed_out(self, rid: int, timeout_s: float) -> None:
        self._answer_error(rid, DroppedError("timeout", f"no answer within {timeout_s:.1f} s"))

    # ---- decisions ------------------------------------------------------------------------
    def _apply(self, decisions: list[Decision]) -> None:
        for d in decisions:
            if isinstance(d, Dispatch):
                self._dispatch(d)
            elif isinstance(d, Drop):
                if self._answer_error(d.request.id, DroppedError(d.reason.value, d.detail)):  # counted once per request
                    self.metrics.drops.labels(d.request.model, d.reason.value).inc()
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
            self._timer_was_late(self.clock.now_us() - t_us)
            self._apply(self.scheduler.wake())

        self.clock.call_at(t_us, fire)

    def _timer_was_late(self, late_us: float) -> None:
        """Keep the scheduler's wake lead above how late this loop's timers fire.

        A batch waiting for more requests is woken ``wake_lead_us`` before its last
        feasible moment; a timer that fires later than that (a busy loop, a loaded host)
        turns the waiting head into a deadline drop. The lead is the larger of the one
        configured and twice the recent peak lateness ``L``, at most a quarter of the
        smallest SLO. ``L`` jumps to a new peak at once and decays by 0.5 % per timer
        (halving over ~140 timers), so one slow moment widens the lead for a while.
        """
        opts = getattr(self._current_scheduler(), "options", None)
        if opts is None or not hasattr(opts, "wake_lead_us"):
            return  # a scheduler without the option (test doubles)
        self._late_peak_us = max(late_us, 0.995 * self._late_peak_us)
        lead = min(max(self._options.get("wake_lead_us", 0.0), 2.0 * self._late_peak_us), self._lead_cap_us)
        if abs(lead - opts.wake_lead_us) > 250.0:  # (not on every timer: a copy of the options)
            self._current_scheduler().options = opts.model_copy(update={"wake_lead_us": lead})

    def _answer_was_late(self, model: str, late_us: float) -> None:
        """Keep the answer budget above how late batches end here (:class:`ServiceBudgets`):
        when a model's budget moves, the current scheduler gets the new budgets."""
        budgets = self.budgets.answer_was_late(model, late_us)
        sched = self._current_scheduler()
        opts = getattr(sched, "options", None)
        if budgets is not None and opts is not None and hasattr(opts, "answer_budget_us"):
            sched.options = opts.model_copy(update={"answer_budget_us": budgets})

    def _current_scheduler(self) -> Any:
        return self.scheduler.current if isinstance(self.scheduler, SwitchingScheduler) else self.scheduler

    def _mark_dispatched(self, req: Request) -> None:
        p = self._pending.get(req.id)
        if p is not None and not p.dispatched:
            p.dispatched = True
            self._dequeue(req.model)

    def _dequeue(self, model: str) -> None:
        self._queued[model] -= 1
        self.metrics.bound(self.metrics.queue, model).dec()

    def _answer_error(self, rid: int, err: DroppedError) -> bool:
        """Answer a request with ``err``; False when it had its answer already."""
        p = self._pending.get(rid)
        if p is None or p.future.done():
            return False
        if not p.dispatched:
            p.dispatched = True
            self._dequeue(p.request.model)
        p.future.set_exception(err)
        return True

    def _answer(self, rid: int, outputs: dict[str, np.ndarray]) -> None:
        p = self._pending.get(rid)
        if p is None or p.future.done():
            return
        p.future.set_result(outputs)
        if self.clock.true_now_us() > p.slo_deadline_us:
            self.metrics.bound(self.metrics.late, p.request.model).inc()

    def _dispatch(self, d: Dispatch) -> None:
        if self.switches and self.switches[-1]["first_dispatch_us"] is None and d.batch_id >= self.switches[-1]["first_batch_id"]:
            self.switches[-1]["first_dispatch_us"] = self.clock.true_now_us()
        for r in d.requests:
            self._mark_dispatched(r)
        self.metrics.bound(self.metrics.batch, d.model).observe(d.batch)
        route = [s.vgpu_id for s in d.stages]
        trace = BatchTrace(d.batch_id, d.model, route, [r.id for r in d.requests], self.clock.true_now_us(),
                           reserved_us=[(s.start_us, s.start_us + s.infer_us) for s in d.stages],
                           arrivals_us=[r.arrival_us for r in d.requests])
        if self.keep_traces:
            self.traces.append(trace)
            del self.traces[: -self.keep_traces]
        batch = _InFlight(d, trace, route)
        gone = next((v for v in route if v not in self.addresses or v in self.failed), None)
        if gone is not None:
            self._fail(batch, DropReason.WORKER_FAILED.value, f"vGPU {gone} was marked failed before the batch was sent")
            return
        self._inflight[d.batch_id] = batch
        try:
            self._send_stages(d, route)
        except DataPathFull as exc:
            self._fail(batch, DropReason.WORKER_FAILED.value, str(exc))

    def _send_stages(self, d: Dispatch, route: list[str]) -> None:
        """Send stage 0's message (the batch's inputs) and, for every stage that receives over
        NCCL, its message without tensors (both ends of an NCCL edge are posted at once)."""
        names = list(d.requests[0].payload)
        if len(d.requests) == 1:  # a view with the batch axis, not a copy of the input
            inputs = {n: np.expand_dims(d.requests[0].payload[n], 0) for n in names}
        else:
            inputs = {n: np.stack([r.payload[n] for r in d.requests]) for n in names}
        to_wall = self.clock.to_wall_us
        timing = tuple(
            Reservation(None if s.transfer_start_us is None else to_wall(s.transfer_start_us), s.transfer_us,
                        to_wall(s.start_us), to_wall(s.start_us + s.infer_us))
            for s in d.stages
        )
        links = self._links(route)
        addrs = tuple(self.addresses[v] for v in route)
        message = StageMsg(d.batch_id, 0, tuple(route), addrs, d.batch, timing, links, self.report_tolerance_us,
                           self.clock.wall_now_us())
        self._outbox.send(addrs[0], pack(message, inputs))
        for j in range(1, len(route)):
            if links is not None and links[j] is not None and links[j].recv is not None:
                self._outbox.send(addrs[j], pack(msgspec.structs.replace(message, stage=j, sent_us=None)))

    def _links(self, route: list[str]) -> tuple[StageLinks | None, ...] | None:
        """The NCCL and ring edges of a route, each numbered with its edge's next message and
        named by its generation (None: the route has none)."""
        if not self.nccl_links:
            return None
        sends: list[EdgeRef | None] = [None] * len(route)
        recvs: list[EdgeRef | None] = [None] * len(route)
        for j in range(1, len(route)):
            gen = self.nccl_links.get((route[j - 1], route[j]))
            if gen is not None:
                key = (route[j - 1], route[j], gen)
                seq = self._edge_seq.get(key, 0)
                self._edge_seq[key] = seq + 1
                sends[j - 1] = EdgeRef(route[j], seq, gen)
                recvs[j] = EdgeRef(route[j - 1], seq, gen)
        return tuple(None if s is None and r is None else StageLinks(s, r) for s, r in zip(sends, recvs))

    def _on_report(self, message: memoryview | bytes) -> None:
        """A worker's report (the data path's callback): feed the scheduler; the last stage's
        report answers every request of the batch with its row of the outputs.

        Reports of one batch come from different workers over different connections, so
        they may arrive in any order: stage k+1's before stage k's. A message may also hold
        the reports of earlier stages that ran as reserved (``carried``, see
        :class:`~ppipe.runtime.workers.stage_server.StageServer`); they are taken first, in stage order.
        The batch is answered by the last stage's report and forgotten once every stage has
        reported.
        """
        self.report_messages += 1
        try:
            rep, outputs = unpack(message, StageReportMsg)
        except WireError as exc:
            log.warning("dropped a malformed report: %s", exc)
            return
        for earlier in rep.carried:
            self._take_report(earlier, {})
        self._take_report(rep, outputs)

    def _take_report(self, rep: StageReportMsg, outputs: dict[str, np.ndarray]) -> None:
        batch = self._inflight.get(rep.batch_id)
        if batch is None:  # a batch already failed (a worker on its route died)
            return
        k = rep.stage
        if not 0 <= k < len(batch.route):
            log.warning("dropped a report of stage %s of batch %s, whose route has %d stages", k, rep.batch_id, len(batch.route))
            return
        if rep.error is not None:
            log.warning("batch %s failed on %s: %s", batch.d.batch_id, rep.vgpu_id, rep.error)
            self._fail(batch, "worker-error", rep.error.splitlines()[0] if rep.error else "error")
            return
        batch.unreported.discard(k)
        batch.next_stage = max(batch.next_stage, k + 1)
        if self.keep_traces:  # in stage order, whatever order the reports came in
            insort(batch.trace.reports, msgspec.structs.replace(rep, carried=()), key=lambda r: r.stage)
        self._report(batch.d, k, rep)
        if k == len(batch.route) - 1:
            self._answer_was_late(batch.d.model, self.clock.true_now_us() - batch.d.stages[-1].end_us)
            for i, r in enumerate(batch.d.requests):
                self._answer(r.id, {n: a[i] for n, a in outputs.items()})
        if not batch.unreported:
            del self._inflight[batch.d.batch_id]

    def _fail(self, batch: "_InFlight", reason: str, detail: str) -> None:
        """Answer every request of a batch with an error and forget the batch. A request the
        scheduler has dropped already (it drops a dead vGPU's batches itself) keeps that
        answer, and each request's drop is counted once."""
        self._inflight.pop(batch.d.batch_id, None)
        batch.trace.error = f"{reason}: {detail}"
        for r in batch.d.requests:
            if self._answer_error(r.id, DroppedError(reason, detail)) and reason == DropReason.WORKER_FAILED.value:
                self.metrics.drops.labels(batch.d.model, reason).inc()

    def _report(self, d: Dispatch, k: int, rep: StageReportMsg) -> None:
        c = self.clock
        self.metrics.bound(self.metrics.busy, rep.vgpu_id).inc(max(0.0, rep.end_us - rep.start_us) / 1e6)
        sr = StageReport(
            batch_id=d.batch_id,
            partition=d.stages[k].partition,
            vgpu_id=rep.vgpu_id,
            start_us=c.from_wall_us(rep.start_us),
            end_us=c.from_wall_us(rep.end_us),
            transfer_start_us=None if rep.transfer_start_us is None else c.from_wall_us(rep.transfer_start_us),
            transfer_end_us=None if rep.transfer_end_us is None else c.from_wall_us(rep.transfer_end_us),
        )
        self._apply(self.scheduler.report(sr))

    # ---- failures ------------------------------------------------------------------------------
    def mark_failed(self, vgpu_id: str) -> None:
        """Tell the scheduler (once) that a vGPU's current worker is gone; it stops routing to
        it. The batches in flight whose remaining stages include it are answered with
        ``worker-failed``."""
        if vgpu_id in self.failed:
            return
        self.failed[vgpu_id] = self.clock.true_now_us()
        self.metrics.failed.labels(vgpu_id).set(1)
        p = self._placement.get(vgpu_id)
        log.warning("vGPU %s (server %s) lost; the scheduler stops routing to it%s", vgpu_id, p.server if p else "?",
                    f"; re-creating it every {self.respawn_interval_s:g} s" if self.respawn is not None else "")
        since = self._since.get(vgpu_id, 0)
        if since:  # a worker started by a plan switch: earlier plans' vGPU of this id was another worker
            self._apply(self.scheduler.mark_failed(vgpu_id, since_batch_id=since))
        else:
            self._apply(self.scheduler.mark_failed(vgpu_id))
        self._fail_batches_through(vgpu_id, since, float("inf"))
        if self.respawn is not None and not any(vgpu_id in e for e in self.nccl_edges) and vgpu_id not in self._revivals:
            self._revivals[vgpu_id] = asyncio.get_running_loop().create_task(self._revive(vgpu_id))
        # its NCCL peers abort their edges with it: a receive from it would never complete
        self._drop_edges_with(vgpu_id, self.nccl_links.items())

    def _drop_edges_with(self, vgpu_id: str, links: Any) -> None:
        """Tell the live peers of ``vgpu_id`` on ``links`` (``((sender, receiver), generation)``
        pairs) to abort those edges."""
        for (a, b), gen in links:
            other = b if a == vgpu_id else a if b == vgpu_id else None
            if other is not None and other not in self.failed and other in self.workers:
                call_unawaited(self.workers[other].drop_peer(vgpu_id, [gen]), f"{other}.drop_peer({vgpu_id})")

    def _fail_batches_through(self, vgpu_id: str, since: int, until: float) -> None:
        """Answer ``worker-failed`` to the batches numbered in ``[since, until)`` that still
        need ``vgpu_id``; forget its stages of those that are past it."""
        for batch in list(self._inflight.values()):
            if not since <= batch.d.batch_id < until:
                continue
            if vgpu_id in batch.route[batch.next_stage :]:
                self._fail(batch, DropReason.WORKER_FAILED.value, f"vGPU {vgpu_id} failed while running the batch")
            else:  # its stage ran (a later stage has reported): its own report may never come
                batch.unreported -= {j for j, v in enumerate(batch.route) if v == vgpu_id}
                if not batch.unreported:
                    del self._inflight[batch.d.batch_id]

    async def _watch(self, vgpu_id: str, handle: WorkerHandle) -> None:
        """Await the worker's ``lifeline`` call, which returns or raises :class:`WorkerGone`
        only when the worker stops (its launcher tells as soon as its process or node is gone)."""
        try:
            await handle.lifeline()
            detail = "its lifeline returned"
        except WorkerGone as exc:
            detail = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        log.debug("vGPU %s is gone: %s", vgpu_id, detail)
        handle.kill()  # an unreachable (not dead) worker must not come back beside its re-creation
        if self.workers.get(vgpu_id) is handle:
            self.mark_failed(vgpu_id)
            return
        old = next((r for r in self._retiring if r.handle is handle), None)
        if old is not None and not old.stopping:  # an earlier plan's worker died while finishing its batches
            log.warning("vGPU %s of an earlier plan failed while finishing its batches", vgpu_id)
            self._apply(self.scheduler.mark_failed(vgpu_id, since_batch_id=old.since, until_batch_id=old.until))
            self._fail_batches_through(vgpu_id, old.since, old.until)
            self._drop_edges_with(vgpu_id, self._old_links)

    async def _sweep_overdue(self) -> None:
        """Answer the batches whose reports stopped coming (see ``report_grace_s``), four times
        per grace period."""
        slo_us = {m.name: m.slo_ms * 1e3 for m in self.plan.models}
        while True:
            await asyncio.sleep(self.report_grace_s / 4)
            now = self.clock.now_us()
            if self.switches:
                slo_us.update({m.name: m.slo_ms * 1e3 for m in self.plan.models})
            for batch in list(self._inflight.values()):
                d = batch.d
                if now > d.stages[-1].end_us + max(self.report_grace_s * 1e6, slo_us.get(d.model, 0.0)):
                    if len(batch.route) - 1 not in batch.unreported:  # answered; an earlier stage's report is lost
                        del self._inflight[d.batch_id]
                        continue
                    waiting = batch.route[min(batch.next_stage, len(batch.route) - 1)]
                    log.warning("batch %d: no report from vGPU %s; answered worker-failed", d.batch_id, waiting)
                    self._fail(batch, DropReason.WORKER_FAILED.value,
                               f"no report from vGPU {waiting} within {max(self.report_grace_s * 1e6, slo_us.get(d.model, 0.0)) / 1e6:.1f} s "
                               "of the batch's planned end (a lost data-path connection)")

    async def _revive(self, vgpu_id: str) -> None:
        """Re-create a failed vGPU's worker until it is up, then route to it again."""
        tries = 0
        while True:
            await asyncio.sleep(self.respawn_interval_s)
            tries += 1
            handle = None
            try:
                handle = await self.respawn(vgpu_id)
                addr = await handle.open_data_path(self._inbox.address)
                self.addresses[vgpu_id] = addr
                await handle.connect_peers(self._next_stage_addresses(vgpu_id))
            except asyncio.CancelledError:
                if handle is not None:
                    handle.kill()
                raise
            except Exception as exc:
                if handle is not None:  # created, but not usable: not left running beside the next try
                    handle.kill()
                log.info("vGPU %s is not back yet (try %d): %s", vgpu_id, tries, str(exc).splitlines()[0] if str(exc) else type(exc).__name__)
                continue
            break
        self.workers[vgpu_id] = handle
        self._outbox.connect(addr)
        del self.failed[vgpu_id]
        self._revivals.pop(vgpu_id, None)
        self.metrics.failed.labels(vgpu_id).set(0)
        self._lifelines.append(asyncio.get_running_loop().create_task(self._watch(vgpu_id, handle)))
        p = self._placement.get(vgpu_id)
        log.warning("vGPU %s (server %s) is back after %d tries; the scheduler routes to it again", vgpu_id, p.server if p else "?", tries)
        self._apply(self.scheduler.mark_recovered(vgpu_id))


def check_switchable(current: Any, new: Any) -> None:
    """A live switch hands a batching scheduler's queue and tables over; refuse other schedulers."""
    from ppipe.dataplane.batching import BatchingScheduler

    for s in (current, new):
        if not isinstance(s, BatchingScheduler):
            raise UserError(f"a live plan switch needs a batching data-plane policy; the server runs {type(s).__name__}",
                            fix="serve with --policy reservation (the paper's) or reactive")


@dataclass
class PreparedSwitch:
    """A plan switch whose new workers run, not yet committed (:meth:`Runtime.prepare_switch`)."""

    plan: Plan
    profiles: dict[str, ModelProfile]
    scheduler: Any  # the new plan's, fresh
    kept: frozenset[str]
    fresh_addrs: dict[str, str]  # new worker -> its data-path address
    handles: dict[str, WorkerHandle]  # new worker -> its handle
    stop_worker: Callable[[Any], None]
    load_s: float
    margins: dict = field(default_factory=dict)  # the new plan's service margins (ppipe.runtime.scheduler.budgets)
    links: dict[tuple[str, str], int] | None = None  # the new plan's NCCL edges -> generation (None: no link opener)
    gen: int = 0  # the generation this preparation opened
    opened: list[tuple[str, str]] = field(default_factory=list)  # the edges it opened
    stale: tuple[list[tuple[tuple[str, str], int]], dict[str, Any]] = ([], {})  # at commit: the edges to close after the drain


@dataclass
class _Retiring:
    """A worker of an earlier plan that finishes the batches numbered in ``[since, until)``."""

    vgpu_id: str
    handle: WorkerHandle
    since: int
    until: int
    stopping: bool = False


@dataclass
class _InFlight:
    """A dispatched batch until its last report or its failure."""

    d: Dispatch
    trace: BatchTrace
    route: list[str]
    next_stage: int = 0  # every stage before it has ended (its report, or a later stage's, arrived)
    unreported: set[int] = field(default_factory=set)

    def __post_init__(self) -> None:
        self.unreported = set(range(len(self.route)))
