"""The discrete-event simulator: the data plane's scheduler under a virtual clock.

The scheduler (``ppipe.dataplane``, the same object ``ppipe serve`` runs) only *plans*: it
returns decisions. This module models what really happens when those decisions are
carried out, and feeds the truth back:

* **Arrivals** reach the frontend and are ``submit``-ted (deadline = arrival + SLO); with
  ``SimConfig.decode`` they are decoded first on a pool, admitted by the data plane's decode
  rule (:mod:`ppipe.sim.decoding`), and submitted once decoded.
* **A dispatched batch** runs stage by stage. A stage becomes *eligible* at
  ``max(planned start, its input arrived)``; its vGPU runs eligible stages one at a time in
  the order they became eligible (FIFO), so a stage starts at
  ``max(eligible, vGPU free)``. It never starts before its planned start: the vGPU's
  reservation table may hold an earlier batch in the gap before it, and a worker that ran
  ahead would take that batch's slot. Inference lasts the profiled latency (the
  partition's latency at the batch, taken from the ``Stage``), times an optional
  multiplicative lognormal jitter of mean 1 and a given CV.
* **Feature-map transfers** between stages on different servers need the sender's uplink
  and the receiver's downlink at the same time, for ``Stage.transfer_us`` (the data
  plane's model of the NIC); a link carries one transfer at a time, FIFO in the order the
  transfers became eligible (``max(planned transfer start, previous stage's end)``).
  Two stages on the same server copy locally: the transfer takes ``transfer_us`` but uses
  no NIC.
* **Reports**: after every stage the worker ``report``-s its actual start/end (and the
  transfer's) to the scheduler, as the runtime's workers do, so feedback correction is
  exercised whenever jitter makes reality differ from the plan.
* **WakeAt** decisions become timers (``Clock.call_at``); **Drop** decisions are recorded
  with reason and place; **failures** (optional, ``(time, vgpu_id)``) call
  ``mark_failed`` and kill the worker: stages it has not finished never finish.

**Exact execution** (``SimConfig.execution="auto"``, the default): with no jitter and no
failures, a policy that reserves every vGPU and NIC use of a batch without overlap
(``executes_as_planned``: the reservation policy) gets every stage and transfer run
exactly at its planned times -- by induction over time, no resource is ever busy when a
planned use begins -- so every report equals the plan. When the workers send only the
reports that differ (``feedback`` ``"changed"`` or ``"none"``), the simulator then writes a
batch's stage and transfer times and its requests' completion at dispatch, with the same
arithmetic as the events, instead of handling one event per transfer and stage start and
end; the early stop counts a late completion once its time has come. A run that stops
early, or ends at the horizon, undoes what falls after that time for the batches still
in flight. The records are the events' own, bit for bit
(tests/sim/test_exact_execution.py; busy times up to summation order); HC1-L G1 at load
1.0 then handles 8.5 k events (arrivals and timers) instead of 50 k. Nothing reads such a
batch's ``Dispatch`` again, so the simulator keeps only its records (a long run's memory
is the records', not every dispatch's requests, stages and reservations).

**Re-planning** (``SimConfig.replan``, ``ppipe simulate --replan auto``): the scheduler is
wrapped in a :class:`~ppipe.dataplane.handover.SwitchingScheduler` and every arrival is fed
to a :class:`~ppipe.control.replan.ReplanController` on the virtual clock -- the code the
runtime runs. A decision at ``t`` switches at ``t + load_delay_s`` (planning and loading
the new workers; the old plan serves meanwhile): the new plan's scheduler takes over
(``switch``), its decisions are applied, and the new plan's vGPUs get execution states. A
vGPU the handover keeps (same id, GPU, level, model and blocks) keeps its state; any
other old state is retired but stays with the batches dispatched on it (a batch holds the
states of the plan that dispatched it), so old batches finish on their old vGPUs even
where a new vGPU has the same id. The reservations the handover copies keep exact
execution exact. Utilization sums the retired states too. Without ``replan`` nothing of
this runs and the records are those of a plain run.

A request completes when the stage of its pipeline's last partition ends. A dispatch
may cover only some partitions (a per-pool policy dispatches stage by stage); the
request then waits at the server of its last stage for the next dispatch.

After the arrival window the simulator drains (keeps running) until nothing is pending,
up to a horizon; a request still pending then is *unfinished* -- counted as missing its
SLO, and a sign of a scheduler that forgot it. Every request ends completed (on time or
late), dropped or unfinished: none is lost.

Early stop (``SimConfig.stop_below``, what load sweeps use): a sweep only needs to know
whether each model's attainment reaches its target. Once *every* model has missed
(dropped, or completed late) more than ``1 - target`` of all the requests its arrival
stream holds for the window, none can reach the target whatever happens next, so the
run stops there (checked every 0.25 simulated s, and not before 10 % of the window: the
guided sweep reads a stopped run's served share as the model's capacity, and a run's first
instants can be a warm-up that misses far more than its steady state -- the reactive
policy on HC2-L atss at load 1.0 missed 45 % of its first 0.25 s and ~7 % later, and a
stop at 0.5 s sent the sweep to 0.65, a failing point below a passing 0.70). The result
then covers the requests that arrived before the stop (:attr:`Simulator.stopped_at_us`;
a request still queued or in flight counts as unfinished): its attainment is below the
target as the full run's would be, and it is flagged ``stopped_at_s``. A run in which
some model can still make its target always runs to the end, so no passing point is ever
cut short.
"""

from __future__ import annotations

import gc
import heapq
import math
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Mapping

import numpy as np

from ppipe.dataplane.api import Dispatch, Drop, DropReason, Request, StageReport, WakeAt
from ppipe.dataplane.feedback import EXACT_US, ran_as_reserved
from ppipe.errors import NotAvailableError, UserError
from ppipe.sim.clock import Event, EventLoop, Priority
from ppipe.sim.decoding import DECODE_WHERE, DecodeSetup, DecodeStage
from ppipe.sim.records import QUEUE, BatchRecord, RequestRecord, StageRun
from ppipe.spec.cluster import ClusterSpec
from ppipe.spec.plan import Plan
from ppipe.spec.profile import ModelProfile

SchedulerFactory = Callable[[Plan, dict, ClusterSpec, Any], Any]
"""``factory(plan, profiles, cluster, clock) -> Scheduler``."""

_MAX_WAKES_AT_ONE_INSTANT = 10_000
FEEDBACK_MODES = ("all", "changed", "none")
EXECUTION_MODES = ("auto", "events")
_STOP_CHECK_US = 250_000.0  # how often (simulated us) a run with stop_below checks whether it may stop
_STOP_MIN_SHARE = 0.1  # ... and not before this share of the arrival window (module docstring, "Early stop")
_EXACT_PRUNE_EVERY = 4096  # exact execution: forget ended batches once this many are listed


def default_feedback(policy: str) -> str:
    """The feedback ``ppipe simulate`` and the reproduction scripts use for ``policy``.

    ``"changed"`` for the reservation policy: a report equal to its reservation changes
    nothing (tests/sim/test_end_to_end.py), and without such reports a jitter-free run
    uses exact execution. ``"all"`` for the others (their reports drive late drops).
    """
    return "changed" if policy == "reservation" else "all"


@dataclass(frozen=True)
class SimConfig:
    """Settings of one simulation run.

    Attributes:
        duration_s: length of the arrival window (the paper: 30 s per point).
        seed: seed of the jitter stream (arrivals are seeded by the caller).
        jitter_cv: coefficient of variation of the multiplicative lognormal jitter on
            inference times (mean 1); 0 = every stage takes exactly its profiled latency.
        feedback: which stages the workers report to the scheduler: ``"all"``,
            ``"changed"`` (only stages whose actual start, end or transfer differ from the
            plan by more than ``report_tolerance_us``: the rule ``ppipe serve`` feeds the
            reservation policy by, :mod:`ppipe.dataplane.feedback`; skipping the others
            also makes long runs faster), or ``"none"``.
        report_tolerance_us: with ``"changed"``: how far from its reservation a stage may
            run and still send no report. The default, 1 ns, reads every report that
            differs at all; ``ppipe simulate`` uses ``ppipe serve``'s (1 ms).
        drain_s: how long after the window to keep running so that requests finish;
            ``None`` = 4 x the largest SLO + 1 s.
        failures: ``(time_s, vgpu_id)`` pairs: that vGPU dies at that time.
        policy: data-plane policy name, passed to ``build_scheduler``.
        scheduler_options: extra keyword options for ``build_scheduler``.
        stop_below: stop the run once every model's attainment is certain to end below
            this (module docstring, "Early stop"); ``None`` = always run to the end.
        stop_overall: with ``stop_below``, stop once the attainment over *all* requests is
            certain to end below it (their misses exceed ``1 - stop_below`` of all arrivals)
            instead of every model's: for searches on the overall attainment.
        execution: how dispatched batches are carried out (module docstring, "Exact
            execution"): ``"auto"`` writes a batch's stage times from its plan when nothing
            can make them differ, and simulates every transfer and stage as events
            otherwise; ``"events"`` always simulates them as events. Same records either way.
        replan: re-planning during the run (module docstring, "Re-planning"); None: off.
        decode: decoding before the scheduler, admitted by the data plane's rule
            (:mod:`ppipe.sim.decoding`); None: requests reach the scheduler as they arrive.
    """

    duration_s: float = 30.0
    seed: int = 0
    jitter_cv: float = 0.0
    feedback: str = "all"
    report_tolerance_us: float = EXACT_US
    drain_s: float | None = None
    failures: tuple[tuple[float, str], ...] = ()
    policy: str = "reservation"
    scheduler_options: Mapping[str, Any] = field(default_factory=dict)
    stop_below: float | None = None
    stop_overall: bool = False
    execution: str = "auto"
    replan: "ReplanSetup | None" = None
    decode: "DecodeSetup | None" = None


@dataclass(frozen=True)
class ReplanSetup:
    """Re-planning during a run (``ppipe simulate --replan auto``; module docstring, "Re-planning").

    Attributes:
        replan: ``replan(weights) -> Plan`` (e.g. :func:`ppipe.control.replan.planner_replan`).
        policy: the controller's tunables (a :class:`ppipe.control.replan.ReplanPolicy`;
            ``None``: its defaults with ``load_delay_s`` set to this setup's).
        load_delay_s: virtual time from a decision to the switch: the new plan's planning
            (at most the planner's time limit) and the loading of its workers, while the
            old plan keeps serving.
        estimator: the controller's ``estimator`` (``None``: from the arrivals it observes);
            a benchmark's oracle of the true rates, to bound what a controller can reach.
    """

    replan: Callable[[dict], Any]
    policy: Any = None
    load_delay_s: float = 10.0
    estimator: Callable[[float], Any] | None = None


@dataclass(slots=True)
class VgpuState:
    """A simulated vGPU (one worker)."""

    vgpu_id: str
    gpu: str
    level: int
    server: str
    free_us: float = 0.0
    busy_in_window_us: float = 0.0
    failed_at_us: float = math.inf


class _BatchRun:
    """A dispatched batch in execution (internal)."""

    __slots__ = ("record", "dispatch", "last_partition", "lost", "vgpus")

    def __init__(self, record: BatchRecord, dispatch: Dispatch, last_partition: int, vgpus: dict):
        self.record = record
        self.dispatch = dispatch
        self.last_partition = last_partition
        self.lost = False
        self.vgpus = vgpus  # the vGPU states of the plan that dispatched it (they outlive a switch)


# ---- events (one class per kind; each handler returns its follow-ups) -------------------


class DecodedEvent(Event):
    """Request number ``index`` is decoded (``SimConfig.decode``): it reaches the scheduler."""

    __slots__ = ("sim", "index")
    priority = Priority.ARRIVAL

    def __init__(self, time_us: float, sim: "Simulator", index: int):
        self.time_us = time_us
        self.sim = sim
        self.index = index

    def handle(self):
        return self.sim.on_decoded(self.index)


class ArrivalEvent(Event):
    """Request number ``index`` (in arrival order) reaches the frontend; chains the next one."""

    __slots__ = ("sim", "index")
    priority = Priority.ARRIVAL

    def __init__(self, time_us: float, sim: "Simulator", index: int):
        self.time_us = time_us  # (not super().__init__: events are the hot path's allocations)
        self.sim = sim
        self.index = index

    def handle(self):
        return self.sim.on_arrival(self.index)


class _StageEvent(Event):
    """Base of the events about stage k of a running batch (worker-side hardware events)."""

    __slots__ = ("sim", "run", "k")
    priority = Priority.WORKER

    def __init__(self, time_us: float, sim: "Simulator", run: _BatchRun, k: int):
        self.time_us = time_us
        self.sim, self.run, self.k = sim, run, k


class StageReadyEvent(_StageEvent):
    """A stage is eligible to run on its vGPU (input there, planned start reached)."""

    __slots__ = ()

    def handle(self):
        return self.sim.on_stage_ready(self.run, self.k)


class StageEndEvent(_StageEvent):
    """A stage's inference ended on its vGPU."""

    __slots__ = ()

    def handle(self):
        return self.sim.on_stage_end(self.run, self.k)


class TransferReadyEvent(_StageEvent):
    """A stage's input transfer is eligible (previous stage done, planned start reached)."""

    __slots__ = ()

    def handle(self):
        return self.sim.on_transfer_ready(self.run, self.k)


class WakeEvent(Event):
    """The scheduler's ``WakeAt``."""

    __slots__ = ("sim",)
    priority = Priority.TIMER

    def __init__(self, time_us: float, sim: "Simulator"):
        self.time_us = time_us
        self.sim = sim

    def handle(self):
        return self.sim.on_wake(self.time_us)


class FailureEvent(Event):
    """A vGPU dies."""

    __slots__ = ("sim", "vgpu_id")
    priority = Priority.FAILURE

    def __init__(self, time_us: float, sim: "Simulator", vgpu_id: str):
        super().__init__(time_us)
        self.sim, self.vgpu_id = sim, vgpu_id

    def handle(self):
        return self.sim.on_failure(self.vgpu_id)


class SwitchEvent(Event):
    """The re-plan controller's new plan takes over (its workers are loaded)."""

    __slots__ = ("sim", "decision")
    priority = Priority.TIMER

    def __init__(self, time_us: float, sim: "Simulator", decision: Any):
        self.time_us = time_us
        self.sim, self.decision = sim, decision

    def handle(self):
        return self.sim.on_switch(self.decision)


# ---- the simulator -------------------------------------------------------------------------


def default_scheduler_factory(policy: str = "reservation", **options: Any) -> SchedulerFactory:
    """``build_scheduler`` of :mod:`ppipe.dataplane` with a policy and options."""

    def factory(plan: Plan, profiles: dict, cluster: ClusterSpec, clock: Any):
        try:
            from ppipe.dataplane import build_scheduler
        except ImportError as exc:  # the data plane is a separate sub-package
            raise NotAvailableError(
                f"the data plane is not available ({exc})", fix="install a ppipe build that includes ppipe.dataplane"
            ) from None
        return build_scheduler(plan, profiles, cluster, clock, policy=policy, **options)

    return factory


def vgpus_of_plan(plan: Plan, cluster: ClusterSpec) -> dict[str, VgpuState]:
    """The plan's vGPUs with their GPU type, level and server; checks placement against the cluster.

    Raises:
        UserError: a partition without its vGPUs placed, or a server/GPU type the cluster lacks.
    """
    servers = {name: group for name, group in cluster.server_names()}
    out: dict[str, VgpuState] = {}
    for m in plan.models:
        for pi, pipe in enumerate(m.pipelines):
            for k, part in enumerate(pipe.partitions):
                placed = plan.placements_of(m.name, pi, k)
                if len(placed) != part.count:
                    raise UserError(
                        f"model '{m.name}' pipeline {pi} partition {k}: {part.count} vGPUs planned, {len(placed)} placed",
                        fix="re-run `ppipe plan`: every vGPU of every pool needs an entry in 'placement'",
                    )
                for p in placed:
                    group = servers.get(p.server)
                    if group is None:
                        raise UserError(
                            f"placement: server '{p.server}' is not in cluster '{cluster.name}'",
                            fix="simulate with the cluster the plan was made for (--cluster), or re-plan",
                        )
                    if group.gpu_type != part.gpu:
                        raise UserError(
                            f"placement: server '{p.server}' has {group.gpu_type} GPUs, but model '{m.name}' "
                            f"pipeline {pi} partition {k} runs on {part.gpu}",
                            fix="simulate with the cluster the plan was made for (--cluster), or re-plan",
                        )
                    out.setdefault(p.vgpu_id, VgpuState(p.vgpu_id, part.gpu, p.vgpu, p.server))
    return out


class Simulator:
    """One simulation run of a plan.

    Args:
        plan: the plan (its placement names the vGPUs and servers).
        profiles: model name -> profile (handed to the scheduler: latencies, cut bytes).
        cluster: the cluster the plan was made for.
        config: run settings.
        scheduler_factory: ``factory(plan, profiles, cluster, clock) -> Scheduler``;
            default: ``ppipe.dataplane.build_scheduler`` with ``config.policy``.
    """

    def __init__(
        self,
        plan: Plan,
        profiles: Mapping[str, ModelProfile],
        cluster: ClusterSpec,
        config: SimConfig = SimConfig(),
        scheduler_factory: SchedulerFactory | None = None,
    ):
        if config.duration_s <= 0:
            raise UserError(f"duration must be > 0 s, got {config.duration_s}", fix="give e.g. --duration-s 30")
        if config.feedback not in FEEDBACK_MODES:
            raise UserError(f"feedback must be one of {FEEDBACK_MODES}, got {config.feedback!r}", fix="e.g. --feedback all")
        if config.jitter_cv < 0:
            raise UserError(f"jitter CV must be >= 0, got {config.jitter_cv}", fix="give e.g. --jitter-cv 0.1")
        if config.execution not in EXECUTION_MODES:
            raise UserError(f"execution must be one of {EXECUTION_MODES}, got {config.execution!r}", fix="use 'auto' (the default) or 'events'")
        if config.stop_below is not None and not (0 < config.stop_below <= 1):
            raise UserError(f"stop_below must be in (0, 1], got {config.stop_below}", fix="give the sweep's target, e.g. 0.99")
        self.plan = plan
        self.profiles = dict(profiles)
        self.cluster = cluster
        self.config = config
        self.loop = EventLoop()
        self.clock = self.loop.clock
        self.vgpus = vgpus_of_plan(plan, cluster)
        self.window_us = config.duration_s * 1e6
        self._feedback = config.feedback
        self._report_tolerance_us = config.report_tolerance_us
        self._up_free: dict[str, float] = {}
        self._down_free: dict[str, float] = {}
        self._slo_us = {m.name: m.slo_ms * 1e3 for m in plan.models}
        self._last_partition = {
            (m.name, pi): len(p.partitions) - 1 for m in plan.models for pi, p in enumerate(m.pipelines)
        }
        factory = scheduler_factory or default_scheduler_factory(config.policy, **dict(config.scheduler_options))
        self._factory = factory
        self.scheduler = factory(plan, self.profiles, cluster, self.clock)
        self.retired_vgpus: dict[str, VgpuState] = {}  # states of vGPUs a switch replaced, keyed "<id>@<switch>"
        self.switch_log: list[dict] = []
        self.controller = self._controller(config.replan) if config.replan is not None else None
        self.decoding = DecodeStage(config.decode, plan, self.profiles, cluster, config.scheduler_options) if config.decode else None
        # Exact execution (module docstring): nothing can make a stage differ from its plan.
        self.exact = (
            config.execution == "auto"
            and config.jitter_cv == 0
            and not config.failures
            and config.feedback != "all"
            and getattr(self.scheduler, "executes_as_planned", False) is True
        )
        # exact execution's bookkeeping: (end, run) of the batches that may still be in
        # flight, and (time, model) of the late completions the early stop has not counted yet
        self._exact_batches: list[tuple[float, _BatchRun]] = []
        self._exact_prune_at = _EXACT_PRUNE_EVERY
        self._late: list[tuple[float, str]] = []
        # jitter: lognormal with mean 1 and CV c has sigma^2 = ln(1 + c^2), mu = -sigma^2 / 2
        self._jitter_rng = np.random.default_rng(np.random.SeedSequence([int(config.seed), 0x717E]))
        s2 = math.log1p(config.jitter_cv**2)
        self._jit_mu, self._jit_sigma = -s2 / 2, math.sqrt(s2)
        self._jit_buf: np.ndarray = np.empty(0)
        self._jit_pos = 0
        # state filled by run()
        self.records: list[RequestRecord] = []
        self.batches: list[BatchRecord] = []
        self._runs_by_id: dict[int, _BatchRun] = {}
        self._arr_t: list[float] = []  # Python floats: indexing a numpy array costs ~10x more per arrival
        self._arr_model: list[str] = []
        self._pending_wakes: set[float] = set()
        self._wakes_now = (-1.0, 0)
        self.scheduler_s = 0.0
        self.scheduler_calls = 0
        self.anomalies: list[str] = []
        self.anomaly_count = 0
        # early stop: requests each model may still miss before it cannot reach stop_below
        self._miss_budget: dict[str, float] | None = None
        self.missed: dict[str, int] = {m: 0 for m in self._slo_us}
        self.stopped_at_us: float | None = None

    # ---- entry point ----------------------------------------------------------------------

    def run(self, arrivals_us: Mapping[str, np.ndarray]) -> "Simulator":
        """Simulate the given arrivals (us, per model) and drain. Returns ``self`` (records filled)."""
        unknown = sorted(set(arrivals_us) - set(self._slo_us))
        if unknown:
            raise UserError(f"arrivals for model(s) {unknown} that the plan does not serve", fix=f"use models of the plan: {sorted(self._slo_us)}")
        names = sorted(arrivals_us)
        times = [np.asarray(arrivals_us[n], dtype=float) for n in names]
        all_t = np.concatenate(times) if times else np.empty(0)
        which = np.concatenate([np.full(t.size, i) for i, t in enumerate(times)]) if times else np.empty(0, int)
        order = np.argsort(all_t, kind="stable")
        self._arr_t = all_t[order].tolist()
        self._arr_model = [names[i] for i in which[order]]
        n = len(self._arr_t)
        self.records = [None] * n  # type: ignore[list-item]  # filled as requests arrive
        for t_s, vgpu_id in sorted(self.config.failures):
            if vgpu_id not in self.vgpus:
                raise UserError(f"failure of unknown vGPU '{vgpu_id}'", fix=f"use a vGPU id of the plan, e.g. {next(iter(self.vgpus), '?')}")
            self.loop.schedule(FailureEvent(t_s * 1e6, self, vgpu_id))
        if n:
            self.loop.schedule(ArrivalEvent(self._arr_t[0], self, 0))
        drain_s = self.config.drain_s
        if drain_s is None:
            drain_s = 4 * max(self._slo_us.values()) / 1e6 + 1.0
        # The run allocates millions of short-lived, acyclic objects (events, requests,
        # decisions) that reference counting frees; the cyclic collector would only rescan
        # them (15-30 % of the CPU time, measured). It is paused for the run and restored.
        horizon = self.window_us + drain_s * 1e6
        if self.config.stop_below is not None:
            share = 1.0 - self.config.stop_below
            self._miss_budget = {m: share * t.size for m, t in zip(names, times) if t.size}
            if self.config.stop_overall and self._miss_budget:
                self._miss_budget = {"*": share * sum(t.size for t in times)}
        gc_was_enabled = gc.isenabled()
        gc.disable()
        try:
            if not self._miss_budget:
                self.loop.run(until_us=horizon)
                if self._exact_batches:
                    self._exact_cutoff(horizon)
            else:
                t = 0.0
                earliest_stop = _STOP_MIN_SHARE * self.window_us
                while t < horizon and len(self.loop):
                    t = min(t + _STOP_CHECK_US, horizon)
                    self.loop.run(until_us=t)
                    late, missed = self._late, self.missed
                    while late and late[0][0] <= t:  # exact execution: late completions due by now
                        missed[heapq.heappop(late)[1]] += 1
                    if t >= earliest_stop and self._all_below_target():
                        self.stopped_at_us = self._exact_cutoff(t) if self._exact_batches else self.clock.now_us()
                        self.records = [r for r in self.records if r is not None]
                        break
                else:
                    if self._exact_batches:
                        self._exact_cutoff(horizon)
        finally:
            if gc_was_enabled:
                gc.enable()
        return self

    def _exact_cutoff(self, t: float) -> float:
        """Exact execution ends at ``t`` (stop or horizon): undo what happens after ``t``.

        Batches still in flight had all their stage times written at dispatch; the events
        would only have done what falls at or before ``t``. Returns the time of the last
        event up to ``t`` that the events would have handled (the clock's reading then).
        """
        last = self.clock.now_us()  # (>= the end of every pruned batch: pruned by an earlier reading)
        w = self.window_us
        records = self.records
        for end_b, run in self._exact_batches:
            if end_b <= t:
                if end_b > last:
                    last = end_b
                continue
            for rid in run.record.request_ids:  # completed after t: not yet
                r = records[rid]
                if r.completion_us == end_b and r.drop_reason is None:
                    r.completion_us = -1.0
            for st in run.record.stages:
                ts = st.transfer_start_us
                if ts is not None:
                    if ts > t:
                        st.transfer_start_us = st.transfer_end_us = None
                    elif ts > last:
                        last = ts
                start, end = st.start_us, st.end_us
                if start > t:
                    hi = w if w < end else end
                    if hi > start:
                        run.vgpus[st.vgpu_id].busy_in_window_us -= hi - start
                    st.start_us = st.end_us = -1.0
                else:
                    if start > last:
                        last = start
                    if last < end <= t:
                        last = end
        self._exact_batches.clear()
        return last

    def _exact_prune(self, now: float) -> None:
        """Forget the listed batches that ended by ``now`` (nothing can undo them)."""
        keep = [item for item in self._exact_batches if item[0] > now]
        self._exact_batches = keep
        self._exact_prune_at = max(_EXACT_PRUNE_EVERY, 2 * len(keep))

    def _all_below_target(self) -> bool:
        """Every model with arrivals has missed more than its budget (it ends below target)."""
        missed = self.missed
        budget = self._miss_budget
        if "*" in budget:
            return sum(missed.values()) > budget["*"]
        return all(missed[m] > b for m, b in budget.items())

    # ---- decisions -> events ---------------------------------------------------------------

    def _call(self, fn, arg=None) -> list:
        t0 = time.perf_counter()
        out = fn() if arg is None else fn(arg)
        self.scheduler_s += time.perf_counter() - t0
        self.scheduler_calls += 1
        return out

    def _anomaly(self, what: str) -> None:
        self.anomaly_count += 1
        if len(self.anomalies) < 20:
            self.anomalies.append(f"t={self.clock.now_us():.1f}us: {what}")

    def apply(self, decisions: Iterable[Any]) -> list[Event]:
        """Turn the scheduler's decisions into state changes and follow-up events."""
        out: list[Event] = []
        if not decisions:
            return out
        now = self.clock._now_us
        for d in decisions:
            if type(d) is Dispatch or isinstance(d, Dispatch):
                ev = self._start_dispatch(d, now)
                if ev is not None:
                    out.append(ev)
            elif isinstance(d, Drop):
                self._drop(d.request.id, d.reason, d.detail)
            elif isinstance(d, WakeAt):
                t = max(float(d.t_us), now)
                if t not in self._pending_wakes:
                    self._pending_wakes.add(t)
                    out.append(WakeEvent(t, self))
            else:
                raise TypeError(f"unknown decision {d!r} from the scheduler")
        return out

    def _drop(self, rid: int, reason: DropReason | str, detail: str) -> None:
        rec = self.records[rid] if 0 <= rid < len(self.records) else None
        if rec is None:
            self._anomaly(f"drop of unknown request {rid}")
            return
        if rec.drop_reason is not None or rec.completion_us >= 0:
            self._anomaly(f"drop of request {rid}, which already ended ({rec.outcome.value})")
            return
        rec.drop_reason = reason.value if isinstance(reason, DropReason) else str(reason)
        self.missed[rec.model] += 1
        rec.drop_detail = detail
        rec.drop_where = self._where(rec)

    def _last_done(self, rec: RequestRecord) -> StageRun | None:
        """The last stage of the request that finished (None if none has)."""
        for bid in reversed(rec.batch_ids):
            run = self._runs_by_id.get(bid)
            if run is None:
                continue
            for st in reversed(run.record.stages):
                if 0 <= st.end_us <= self.clock.now_us():
                    return st
        return None

    def _where(self, rec: RequestRecord) -> str:
        if not rec.batch_ids:
            return QUEUE
        done = self._last_done(rec)
        if done is None:
            first = self._runs_by_id[rec.batch_ids[0]].record.stages[0]
            return f"in-flight:stage{first.partition}"
        return f"after-stage{done.partition}"

    def _start_dispatch(self, d: Dispatch, now: float) -> Event | None:
        dstages = d.stages
        if not dstages:
            self._anomaly(f"dispatch {d.batch_id} has no stages")
            return None
        bid = d.batch_id
        last = self._last_partition.get((d.model, d.pipeline))
        if last is None:
            self._anomaly(f"dispatch {bid} on unknown pipeline {d.model}/{d.pipeline}")
            return None
        rids = tuple([r.id for r in d.requests])
        vgpus = self.vgpus
        exact = self.exact and dstages[0].partition == 0
        if exact:
            for s in dstages:
                if s.vgpu_id not in vgpus:
                    exact = False  # a scheduler bug, which the events record as an anomaly
                    break
        if exact:
            # Exact execution: the batch's transfer and stage times from its plan, with the
            # same arithmetic as the events (on_stage_ready, on_stage_end, on_transfer_ready)
            # without the waits for a busy vGPU or link, which cannot occur here (module
            # docstring, "Exact execution").
            w = self.window_us
            t = now  # when the input is ready: the dispatch, then the previous stage's end
            stages = []
            k = 0
            for ds in dstages:
                ts = te = None
                if k and ds.transfer_us > 0:
                    ts = ds.transfer_start_us
                    if ts is None or ts < t:
                        ts = t
                    te = t = ts + ds.transfer_us
                ps = ds.start_us
                li = ds.infer_us
                start = ps if ps > t else t
                end = start + li
                vg = vgpus[ds.vgpu_id]
                vg.free_us = end
                hi = w if w < end else end
                if hi > start:
                    vg.busy_in_window_us += hi - start
                stages.append(StageRun(ds.partition, ds.vgpu_id, ds.server, ps, li, start, end, ts, te))
                t = end
                k += 1
        else:
            stages = [StageRun(s.partition, s.vgpu_id, s.server, s.start_us, s.infer_us) for s in dstages]
        rec = BatchRecord(bid, d.model, d.pipeline, rids, now, stages)
        # (exact: no event reads the dispatch, so its requests, stages and reservations can go)
        run = _BatchRun(rec, None if exact else d, last, vgpus)
        self.batches.append(rec)
        self._runs_by_id[bid] = run
        records = self.records
        for rid in rids:
            r = records[rid]
            if r.drop_reason is not None or r.completion_us >= 0:
                self._anomaly(f"dispatch {bid} carries request {rid}, which already ended")
                continue
            if r.dispatch_us < 0:
                r.dispatch_us = now
            r.batch_ids.append(bid)
        if exact:
            if stages[-1].partition == last:  # (as on_stage_end)
                for rid in rids:
                    r = records[rid]
                    if r.drop_reason is None and r.completion_us < 0:
                        r.completion_us = t
                        if t > r.deadline_us:
                            heapq.heappush(self._late, (t, r.model))  # counted when its time comes
            lst = self._exact_batches
            lst.append((t, run))
            if len(lst) >= self._exact_prune_at:
                self._exact_prune(now)
            return None
        first = dstages[0]
        if first.partition > 0 and first.transfer_us > 0:
            ts = first.transfer_start_us if first.transfer_start_us is not None else now
            return TransferReadyEvent(max(now, ts), self, run, 0)
        ps = first.start_us
        return StageReadyEvent(ps if ps > now else now, self, run, 0)

    # ---- event handlers ----------------------------------------------------------------------

    def on_arrival(self, i: int) -> list[Event]:
        arr = self._arr_t
        t = arr[i]
        model = self._arr_model[i]
        rec = RequestRecord(i, model, t, t + self._slo_us[model])
        self.records[i] = rec
        out = self._submit(rec) if self.decoding is None else self._decode(rec)
        if i + 1 < len(arr):
            out.append(ArrivalEvent(arr[i + 1], self, i + 1))
        ctl = self.controller
        if ctl is not None:
            ctl.observe(model, t)
            if t >= ctl.next_check_us:
                d = ctl.poll()
                if d is not None:
                    out.append(SwitchEvent(t + self.config.replan.load_delay_s * 1e6, self, d))
        return out

    def _submit(self, rec: RequestRecord) -> list[Event]:
        t0 = time.perf_counter()  # (self._call inlined: one call per request)
        decisions = self.scheduler.submit(Request(rec.id, rec.model, rec.arrival_us, rec.deadline_us))
        self.scheduler_s += time.perf_counter() - t0
        self.scheduler_calls += 1
        return self.apply(decisions)

    def _decode(self, rec: RequestRecord) -> list[Event]:
        """Decode admission (:mod:`ppipe.sim.decoding`): queue the request's decode, or drop it."""
        end, why = self.decoding.admit(rec.model, rec.arrival_us, self.clock.now_us())
        if end is None:
            self._drop(rec.id, DropReason.DEADLINE_UNREACHABLE, why)
            rec.drop_where = DECODE_WHERE
            return []
        return [DecodedEvent(end, self, rec.id)]

    def on_decoded(self, i: int) -> list[Event]:
        rec = self.records[i]
        late = self.decoding.late_by_us(rec.model, rec.arrival_us, self.clock.now_us())
        if late is not None:
            self._drop(i, DropReason.DEADLINE_UNREACHABLE, f"decoding ended {late / 1e3:.1f} ms too late for the SLO")
            rec.drop_where = DECODE_WHERE
            return []
        return self._submit(rec)

    def on_wake(self, t: float) -> list[Event]:
        self._pending_wakes.discard(t)
        last_t, count = self._wakes_now
        count = count + 1 if last_t == t else 1
        self._wakes_now = (t, count)
        if count > _MAX_WAKES_AT_ONE_INSTANT:
            raise RuntimeError(f"the scheduler asked to be woken at t={t} us more than {_MAX_WAKES_AT_ONE_INSTANT} times")
        return self.apply(self._call(self.scheduler.wake))

    def on_failure(self, vgpu_id: str) -> list[Event]:
        now = self.clock.now_us()
        for key, vg in [(vgpu_id, self.vgpus.get(vgpu_id)), *self.retired_vgpus.items()]:
            if vg is not None and vg.vgpu_id == vgpu_id and vg.failed_at_us > now:
                vg.failed_at_us = now  # (a retired state of that id may still run old batches)
        return self.apply(self._call(self.scheduler.mark_failed, vgpu_id))

    # ---- re-planning (module docstring, "Re-planning") ------------------------------------------

    def _controller(self, setup: "ReplanSetup"):
        """Wrap the scheduler for switches and build the re-plan controller on the virtual clock."""
        from dataclasses import replace

        from ppipe.control.replan import ReplanController, ReplanPolicy
        from ppipe.dataplane.handover import SwitchingScheduler

        if setup.load_delay_s < 0:
            raise UserError(f"re-plan load delay must be >= 0 s, got {setup.load_delay_s}", fix="give e.g. --replan-load-delay-s 10")
        if getattr(self.scheduler, "partial_dispatches", False):  # (hand_over would refuse it at the first switch)
            raise UserError(
                f"re-planning needs a policy that dispatches whole paths; '{self.config.policy}' does not",
                fix="simulate with --policy reservation (the paper's) or reactive",
            )
        policy = setup.policy or replace(ReplanPolicy(), load_delay_s=setup.load_delay_s)
        self.scheduler = SwitchingScheduler(self.scheduler)
        return ReplanController(self.plan, setup.replan, self.clock, policy, setup.estimator)

    def on_switch(self, decision) -> list[Event]:
        """Hand over to ``decision.plan``: new scheduler, new vGPU states (kept ones carried over)."""
        new_plan = decision.plan
        states = vgpus_of_plan(new_plan, self.cluster)
        sched = self._factory(new_plan, self.profiles, self.cluster, self.clock)
        t0 = time.perf_counter()
        h = self.scheduler.switch(sched)
        self.scheduler_s += time.perf_counter() - t0
        n = len(self.switch_log)
        for v, vg in self.vgpus.items():
            if v in h.kept:
                states[v] = vg  # the same worker: its queue of stages goes on
            else:
                self.retired_vgpus[f"{v}@{n}"] = vg  # old batches finish on it (run.vgpus)
        self.vgpus = states
        for m in new_plan.models:
            self._slo_us.setdefault(m.name, m.slo_ms * 1e3)
            for pi, p in enumerate(m.pipelines):
                self._last_partition[(m.name, pi)] = len(p.partitions) - 1
        self.switch_log.append({
            "decided_s": decision.at_us / 1e6, "switched_s": self.clock.now_us() / 1e6,
            "planner_s": decision.planner_s, "kept": len(h.kept), "vgpus": len(states), "moved_requests": h.moved,
            "z_old": decision.z_old, "z_new": decision.z_new, "trigger": decision.trigger,
            "weights": dict(decision.weights),
        })
        return self.apply(h.decisions)

    def _jitter(self) -> float:
        if self._jit_sigma == 0.0:
            return 1.0
        if self._jit_pos >= self._jit_buf.size:
            self._jit_buf = self._jitter_rng.lognormal(self._jit_mu, self._jit_sigma, 4096)
            self._jit_pos = 0
        x = float(self._jit_buf[self._jit_pos])
        self._jit_pos += 1
        return x

    def _lose(self, run: _BatchRun, k: int) -> None:
        """The batch's worker died: its requests that nobody dropped yet are dropped here."""
        run.lost = True
        st = run.record.stages[k]
        for rid in run.record.request_ids:
            r = self.records[rid]
            if r.drop_reason is None and r.completion_us < 0:
                self._drop(rid, DropReason.WORKER_FAILED, f"vGPU {st.vgpu_id} died while the batch was on it")

    def on_stage_ready(self, run: _BatchRun, k: int) -> list[Event]:
        st = run.record.stages[k]
        vg = run.vgpus.get(st.vgpu_id)
        if vg is None:
            self._anomaly(f"batch {run.record.batch_id} stage {k} on unknown vGPU {st.vgpu_id}")
            self._lose(run, k)
            return []
        now = self.clock._now_us
        if vg.failed_at_us <= now:
            self._lose(run, k)
            return []
        start = now if now > vg.free_us else vg.free_us
        end = start + (st.planned_infer_us * self._jitter() if self._jit_sigma else st.planned_infer_us)
        vg.free_us = end
        # busy time inside the arrival window, for temporal utilization
        w = self.window_us
        hi = w if w < end else end
        if hi > start:
            vg.busy_in_window_us += hi - start
        st.start_us, st.end_us = start, end
        return [StageEndEvent(end, self, run, k)]

    def on_stage_end(self, run: _BatchRun, k: int) -> list[Event]:
        rec = run.record
        st = rec.stages[k]
        now = self.clock._now_us
        vg = run.vgpus[st.vgpu_id]
        if vg.failed_at_us < now:  # died mid-inference: this stage never finishes
            self._lose(run, k)
            return []
        out: list[Event] = []
        if k + 1 < len(rec.stages):
            nxt = rec.stages[k + 1]
            ds = run.dispatch.stages[k + 1]
            if ds.transfer_us > 0:
                ts = ds.transfer_start_us
                out.append(TransferReadyEvent(ts if ts is not None and ts > now else now, self, run, k + 1))
            else:
                ps = nxt.planned_start_us
                out.append(StageReadyEvent(ps if ps > now else now, self, run, k + 1))
        elif st.partition == run.last_partition:
            records = self.records
            for rid in rec.request_ids:
                r = records[rid]
                if r.drop_reason is None and r.completion_us < 0:
                    r.completion_us = now
                    if now > r.deadline_us:
                        self.missed[r.model] += 1
        # the worker reports after it has passed the result on: a completed request is
        # answered, whatever the scheduler decides next
        fb = self._feedback
        if fb == "changed":  # the report tolerance (ppipe.dataplane.feedback)
            report = not ran_as_reserved(st, run.dispatch.stages[k], self._report_tolerance_us)
        else:
            report = fb == "all"
        if report:
            rep = StageReport(rec.batch_id, st.partition, st.vgpu_id, st.start_us, st.end_us, st.transfer_start_us, st.transfer_end_us)
            out.extend(self.apply(self._call(self.scheduler.report, rep)))
        return out

    def on_transfer_ready(self, run: _BatchRun, k: int) -> list[Event]:
        st = run.record.stages[k]
        ds = run.dispatch.stages[k]
        now = self.clock._now_us
        if k > 0:
            src = run.record.stages[k - 1].server
        else:  # a dispatch that continues requests from an earlier stage: they wait where it ran
            # (a batch re-formed from requests of several earlier batches is modelled as
            # coming from the server where the latest of them finished)
            prev = [self._last_done(self.records[rid]) for rid in run.record.request_ids]
            prev = [p for p in prev if p is not None]
            src = max(prev, key=lambda p: p.end_us).server if prev else st.server
        dst = st.server
        if src == dst:
            start = now  # same server: local copy, no NIC
        else:
            start = now  # max(now, uplink free, downlink free), spelled out (hot path)
            u = self._up_free.get(src, 0.0)
            if u > start:
                start = u
            u = self._down_free.get(dst, 0.0)
            if u > start:
                start = u
            self._up_free[src] = self._down_free[dst] = start + ds.transfer_us
        end = start + ds.transfer_us
        st.transfer_start_us, st.transfer_end_us = start, end
        ps = st.planned_start_us
        return [StageReadyEvent(ps if ps > end else end, self, run, k)]


def simulate(
    plan: Plan,
    profiles: Mapping[str, ModelProfile],
    cluster: ClusterSpec,
    arrivals_us: Mapping[str, np.ndarray],
    config: SimConfig = SimConfig(),
    scheduler_factory: SchedulerFactory | None = None,
):
    """Run one simulation and summarize it.

    Returns:
        a :class:`ppipe.sim.metrics.SimResult`.
    """
    from ppipe.sim.metrics import summarize

    t0, c0 = time.perf_counter(), time.process_time()
    sim = Simulator(plan, profiles, cluster, config, scheduler_factory).run(arrivals_us)
    wall_s, cpu_s = time.perf_counter() - t0, time.process_time() - c0
    return summarize(sim, wall_s=wall_s, cpu_s=cpu_s)
