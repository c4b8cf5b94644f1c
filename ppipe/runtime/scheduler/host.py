"""The scheduler's host: the data plane's scheduler under the wall clock, with vGPU workers.

:class:`Runtime` owns the scheduler (built by :func:`ppipe.dataplane.build_scheduler`, or
any factory with its signature) and applies its decisions:

- :class:`~ppipe.dataplane.api.Dispatch`: stack the requests' inputs into a batch and send
  it, with the reserved route, to the first worker over the data path
  (:mod:`ppipe.runtime.wire.datapath`); the workers pass it along the route themselves. Each
  worker's report goes to ``scheduler.report`` as it arrives; the last one carries the
  outputs, whose rows answer the batch's requests (:mod:`~ppipe.runtime.scheduler.batches`).
- :class:`~ppipe.dataplane.api.Drop`: answer the request with :class:`DroppedError`.
- :class:`~ppipe.dataplane.api.WakeAt`: ``clock.call_at(t, scheduler.wake)``.

Each worker is reached through a :class:`~ppipe.runtime.launch.handle.WorkerHandle`: its
launcher (in process, or Ray across machines) placed it; the host only opens its data path
and watches its life. Every request gets exactly one answer: its outputs, or an error; a
request the scheduler neither dispatched nor dropped within SLO + ``answer_grace_s`` is
answered with a timeout error, and a gone worker or a batch whose reports stop coming is
answered ``worker-failed`` (:mod:`~ppipe.runtime.scheduler.failures`). A live plan switch
is :mod:`~ppipe.runtime.scheduler.switching`.

Time comes from the clock the host makes on its loop (``clock_factory``, by default a
:class:`~ppipe.runtime.clock.WallClock`); the host reads no clock of its own. Everything runs
on one asyncio loop (the HTTP server's), so the scheduler, which is not thread-safe, is
only ever called from that loop.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
from typing import Any, Awaitable, Callable

import numpy as np

from ppipe.dataplane.api import Decision, Dispatch, Drop, DropReason, Request, WakeAt
from ppipe.dataplane.feedback import DEFAULT_REPORT_TOLERANCE_US
from ppipe.dataplane.handover import SwitchingScheduler
from ppipe.errors import UserError
from ppipe.runtime.clock import WallClock
from ppipe.runtime.memory import freeze_startup_objects, trim_heap_periodically, tune_for_serving
from ppipe.runtime.timerslack import tighten_timer_slack
from ppipe.runtime.launch.handle import WorkerHandle
from ppipe.runtime.scheduler.batches import BatchesMixin
from ppipe.runtime.scheduler.budgets import ServiceBudgets
from ppipe.runtime.scheduler.failures import FailuresMixin
from ppipe.runtime.scheduler.inflight import Answer, BatchTrace, DroppedError, InFlight, Pending
from ppipe.runtime.scheduler.ingresses import IngressesMixin, RemoteInput
from ppipe.runtime.scheduler.metrics import RuntimeMetrics
from ppipe.runtime.scheduler.switching import PreparedSwitch, RetiringWorker, SwitchingMixin, check_switchable
from ppipe.runtime.scheduler.warmup import WarmUpMixin
from ppipe.runtime.wire.datapath import Inbox, Outbox, node_host
from ppipe.runtime.workers.transport import LINKED
from ppipe.spec.cluster import ClusterSpec
from ppipe.spec.plan import Plan
from ppipe.spec.profile import ModelProfile

log = logging.getLogger("ppipe.runtime")

SchedulerFactory = Callable[..., Any]
ClockFactory = Callable[[asyncio.AbstractEventLoop], Any]
"""``f(loop)``: the clock the host and its scheduler run on (a :class:`~ppipe.runtime.clock.WallClock`'s methods)."""

__all__ = ["BatchTrace", "DroppedError", "PreparedSwitch", "Runtime", "check_switchable", "check_whole_paths",
           "default_scheduler_factory"]


def check_whole_paths(scheduler: Any, policy: str) -> None:
    """The runtime runs a batch along its whole path; refuse policies that dispatch parts."""
    if getattr(scheduler, "partial_dispatches", False):
        raise UserError(
            f"data-plane policy '{policy}' dispatches partial paths (a batch continues from a middle stage), "
            "which the runtime does not run",
            fix="serve with --policy reservation (the paper's) or reactive",
        )


def default_scheduler_factory(plan, profiles, cluster, clock, policy: str = "reservation", **options):
    from ppipe.dataplane import build_scheduler  # the data plane's one scheduler

    return build_scheduler(plan, profiles, cluster, clock, policy=policy, **options)


class Runtime(BatchesMixin, FailuresMixin, SwitchingMixin, IngressesMixin, WarmUpMixin):
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
            its handle once it has loaded its blocks (raises while its node is not back); the
            runtime tries every ``respawn_interval_s`` and hands the vGPU back to the
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
            reservation policy is fed only the reports outside the tolerance, the rule
            ``ppipe simulate`` runs too (:mod:`ppipe.dataplane.feedback`); a worker's death
            fails the batches whose reports it carried on (the host still holds their
            stages as running). None: every stage reports at once, and every report is fed.
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
        data_secret: the server's data-path secret (``ppipe serve`` makes one): handed to
            every worker as its data path opens; the report inbox reads only connections
            that prove it, and refusals count in ``ppipe_datapath_refused_total``. None:
            the data path is not authenticated.
        accept_ingresses: take requests from ingress processes that hold their tensors
            (:mod:`~ppipe.runtime.scheduler.ingresses`; they reach :attr:`ingress_address`)
            instead of :meth:`infer` in this process.
        warm_up: at the end of :meth:`start`, run every vGPU's first batches before the runtime
            is ``started`` (:mod:`~ppipe.runtime.scheduler.warmup`; :attr:`warmed` says what it did).
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
        report_tolerance_us: float | None = DEFAULT_REPORT_TOLERANCE_US,
        links: Any = None,
        clock_factory: ClockFactory = WallClock,
        data_secret: bytes | None = None,
        accept_ingresses: bool = False,
        warm_up: bool = False,
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
        self._refusals_seen: set[str] = set()  # reasons of refused connections and reports logged so far
        self.traces: list[BatchTrace] = []
        self.failed: dict[str, float] = {}  # vGPU id -> scheduler time it was marked failed
        self._clock_factory = clock_factory
        self.clock: WallClock | None = None
        self._loop: asyncio.AbstractEventLoop | None = None  # the loop start() ran on
        self.scheduler: Any = None
        self._pending: dict[int, Pending] = {}
        self._ids = itertools.count()
        self._wakes: set[float] = set()
        self._late_peak_us = 0.0  # recent peak lateness of the wake timers (_timer_was_late)
        self._lead_cap_us = 0.25e3 * min(m.slo_ms for m in plan.models)  # the wake lead's ceiling
        self._inflight: dict[int, InFlight] = {}  # batch id -> the batch, until its last report
        self._inbox: Inbox | None = None
        self.data_secret = data_secret
        self._outbox = Outbox(data_secret)
        self.addresses: dict[str, str] = {}  # vGPU id -> its worker's data-path address
        self._placement = {p.vgpu_id: p for p in plan.placement}
        self._lifelines: list[asyncio.Task] = []
        self._queued: dict[str, int] = {m.name: 0 for m in plan.models}
        self.metrics.track_queues(self._queued)
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
        self._retiring: list[RetiringWorker] = []
        self.switches: list[dict[str, Any]] = []
        self.on_switch: list[Callable[[], None]] = []  # called at each switch, after the new plan is in place
        self.arrival_log: list[tuple[str, float]] | None = None  # (model, arrival) of each request, for a re-plan loop
        self.metrics.track_capacity(self)  # ppipe_model_capacity_alive_ratio, from self.plan and self.failed
        self.accept_ingresses = accept_ingresses
        self._init_ingresses()
        self.warm_up_on_start = warm_up
        self._warming: set[str] | None = None  # while warming up: the vGPUs dispatched to so far (warmup)
        self.warmed = None  # what the warm-up did (a WarmUp), once it ran

    @property
    def nccl_edges(self) -> set[tuple[str, str]]:
        """The (sender, receiver) pairs whose feature maps go over NCCL in the current plan."""
        return set(self.nccl_links)

    # ---- lifecycle ------------------------------------------------------------------
    async def start(self) -> None:
        """Make the clock and the scheduler on the running loop, open the data path to every
        worker, and watch each worker's life (and the process's heap:
        :mod:`ppipe.runtime.memory`)."""
        loop = self._loop = asyncio.get_running_loop()  # (each get_running_loop() is a getpid() system call)
        self.clock = self._clock_factory(loop)
        self.scheduler, margins = self._build_scheduler(self.plan, self.profiles)
        self.budgets.adopt(margins)
        self._inbox = Inbox(self._on_report, self.data_host or node_host(), self.data_secret,
                            on_refused=lambda why: self.refuse("handshake", why))
        vgpus = list(self.workers)
        addrs = await asyncio.gather(*(self.workers[v].open_data_path(self._inbox.address, self.data_secret) for v in vgpus))
        self.addresses = dict(zip(vgpus, addrs))
        await asyncio.gather(*(self.workers[v].connect_peers(self._next_stage_addresses(v)) for v in vgpus))
        for a in addrs:
            self._outbox.connect(a)
        freeze_startup_objects()
        self._lifelines = [loop.create_task(self._watch(v, h)) for v, h in self.workers.items()]
        if self.accept_ingresses:
            self._lifelines.extend(self._open_ingress_inbox(self._inbox.address.split("://")[1].rpartition(":")[0]))
        self._lifelines.append(loop.create_task(self._sweep_overdue()))
        tune_for_serving()  # before the gRPC and image threads start: fewer arenas; inputs reuse the heap's pages
        tighten_timer_slack()  # the data plane's wake-ups on time (this loop's thread and those it starts)
        self._lifelines.append(loop.create_task(trim_heap_periodically()))  # a burst's buffers go back to the system
        if self.warm_up_on_start:
            self.warmed = await self.warm_up()

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
        """Whether it serves: :meth:`start` has run, its warm-up included."""
        return self.scheduler is not None and self._warming is None

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
        subs: list[Pending] = []
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

    def _submit(self, model: str, inputs: dict[str, np.ndarray], arrival_us: float | None,
                on_answer: Callable[[Pending, BaseException | None], None] | None = None) -> Pending:
        """Make a sample's request, give it to the scheduler and arm its timeout.

        With ``on_answer`` (an ingress's request, which nobody awaits here) the request's
        answer goes to ``on_answer(pending, error or None)`` as it is given (an
        :class:`~ppipe.runtime.scheduler.inflight.Answer`, no future), and its timeout is
        :meth:`~ppipe.runtime.scheduler.ingresses.IngressesMixin._time_out_remote`'s."""
        if self.scheduler is None:
            raise RuntimeError("Runtime.start() has not run")
        if self.accept_ingresses and not isinstance(inputs, RemoteInput) and self._warming is None:
            raise RuntimeError("this scheduler's requests come from its ingress processes, not from infer()")
        try:
            mp = self.plan.model(model)
        except KeyError:  # a model a plan switch has just removed
            raise DroppedError(DropReason.UNKNOWN_MODEL.value, f"the plan serves {', '.join(m.name for m in self.plan.models)}") from None
        # arrival and deadline on the true timeline, never the lead's
        now = self.clock.true_now_us() if arrival_us is None else arrival_us
        slo_us = mp.slo_ms * 1e3
        # (the scheduler plans for an earlier deadline itself: the answer budget, ppipe.runtime.scheduler.budgets)
        req = Request(id=next(self._ids), model=model, arrival_us=now, deadline_us=now + slo_us, payload=inputs)
        loop = self._loop
        p = Pending(req, None, now + slo_us)
        p.future = loop.create_future() if on_answer is None else Answer(lambda exc: on_answer(p, exc))
        self._pending[req.id] = p
        if self.arrival_log is not None:
            self.arrival_log.append((model, now))
        self._queued[model] += 1
        self._apply(self.scheduler.submit(req))
        if on_answer is None:
            timeout_s = mp.slo_ms / 1e3 + self.answer_grace_s
            # one timer per request (cheaper than wait_for(shield(...)), which wraps the future twice)
            p.timer = loop.call_later(timeout_s, self._timed_out, req.id, timeout_s)
        return p

    def _settle(self, p: Pending) -> None:
        if p.timer is not None:
            p.timer.cancel()
        self._pending.pop(p.request.id, None)

    def _withdraw(self, subs: list[Pending]) -> None:
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
        if opts is None or not hasattr(opts, "wake_lead_us") or self._warming is not None:
            return  # a scheduler without the option (test doubles), or a warm-up's timer
        self._late_peak_us = max(late_us, 0.995 * self._late_peak_us)
        lead = min(max(self._options.get("wake_lead_us", 0.0), 2.0 * self._late_peak_us), self._lead_cap_us)
        if abs(lead - opts.wake_lead_us) > 250.0:  # (not on every timer: a copy of the options)
            self._current_scheduler().options = opts.model_copy(update={"wake_lead_us": lead})

    def _answer_was_late(self, model: str, late_us: float) -> None:
        """Keep the answer and drop budgets above how late batches end here (:class:`ServiceBudgets`):
        when a model's budgets move, the current scheduler gets the new ones. (Not a warm-up's:
        a cold answer is late for reasons a served one is not.)"""
        if self._warming is not None:
            return
        budgets = self.budgets.answer_was_late(model, late_us)
        sched = self._current_scheduler()
        opts = getattr(sched, "options", None)
        if budgets is not None and opts is not None and hasattr(opts, "answer_budget_us"):
            sched.options = opts.model_copy(update=budgets)

    def _current_scheduler(self) -> Any:
        return self.scheduler.current if isinstance(self.scheduler, SwitchingScheduler) else self.scheduler

    def _mark_dispatched(self, req: Request) -> None:
        p = self._pending.get(req.id)
        if p is not None and not p.dispatched:
            p.dispatched = True
            self._dequeue(req.model)

    def _dequeue(self, model: str) -> None:
        self._queued[model] -= 1

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
