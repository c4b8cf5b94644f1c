"""Adaptive batching (the paper's Algorithm 1), shared by every policy.

:class:`BatchingScheduler` implements the :class:`~ppipe.dataplane.api.Scheduler`
protocol: per-model queues, Algorithm 1, dispatch bookkeeping, feedback correction and
failure handling. A policy subclasses it and supplies ``probe()`` (how a path and its
times are found for a pipeline and a batch size). The reservation policy
(:mod:`ppipe.dataplane.reservation`) probes the reservation tables of vGPUs and NICs (the
paper's Algorithm 2); the reactive baseline (:mod:`ppipe.dataplane.reactive`) looks only at
each pool's own vGPU queues.

Algorithm 1, as implemented, for one model with queue ``q`` sorted by deadline
(= arrival + SLO, so by arrival for one model)::

    while q:
        1. p* = the live pipeline whose probe at its planned batch waits least
           (waiting = finish - now - sum of the path's transfer and inference durations;
           ties: lower pipeline index).
        2. for bs in p*'s usable batch sizes <= its planned batch, largest first:
               r = probe(p*, bs); stop at the first r that finishes by q[0].deadline.
        3. if no bs >= 1 fits:          drop q[0] (DEADLINE_UNREACHABLE); back to 1.
           elif len(q) < bs:            wait, see below.
           else:                        reserve(r) and dispatch q[:bs] along r.

Readings of the paper's pseudo-code (its slips, as the issue notes):

* its last lines reserve ``r``, the step-1 probe result; the step-2 result (the path and
  batch chosen for the deadline) is what is meant and what is reserved here;
* "for bs = p.bs down to 0 ... if bs == 0" means "no batch size >= 1 fits";
* step 2 starts at the planned batch, which step 1 has just probed on the same tables, so
  with ``reuse_step1_probe`` (default) that result is reused rather than probed again.

Waiting "till the last moment": when fewer requests are queued than the chosen batch, the
batcher probes the largest usable batch it could send *now* (``<= len(q)``). If that path
still has slack before ``q[0].deadline``, it returns ``WakeAt(now + slack)``; the path's
finish time moves at most one for one with its start while the tables stay as they are,
so at that moment the queued requests can still go. When the slack is gone (a wake at the
last moment, or no slack to begin with) it dispatches what is queued. A new arrival, a
wake, or a feedback report that makes the tables busier re-runs the batcher, so a wait is
always re-decided on current tables.

Determinism: queues are ordered by (deadline, arrival, id); pipelines by plan index; a
pool's vGPUs by id; every comparison is strict, so the first in that order wins a tie.
No set or dict iteration order reaches a decision.

Feedback correction (``report``), decided here since the paper only says the tables
"take the truth":

* the reported stage's interval on its vGPU (and its transfer's on both NICs) is replaced
  by the reported one; reservations behind it on the same resource that now overlap are
  pushed back, cascading, each keeping its duration (a worker serves its queue in order,
  so a late batch delays the ones behind it); an earlier reservation that overlaps the
  reported start has not run yet and moves behind it (:meth:`ReservationTable.correct`);
* with ``propagate_delays`` (default), a late stage also moves its own batch's not yet
  reported downstream reservations to when their input can be there
  (:meth:`ReservationTable.delay`); the downstream reservations of *other* batches pushed
  back by a cascade are not moved along (their own reports correct them);
* past intervals are pruned as reports come in; a model that is waiting re-decides when a
  report shows the tables got busier (``reevaluate_on_report``).

Several models: each has its own queue and runs Algorithm 1 on its own; models share
NICs (servers host vGPUs of several models), so one model's reservations shape another's
probes. ``wake()`` runs the models whose wake time has come, in plan order.
"""

from __future__ import annotations

import heapq
from bisect import insort
from collections import deque
from dataclasses import dataclass, field
from typing import Callable, Iterator, Sequence

from ppipe.dataplane.api import (
    Clock,
    Decision,
    Dispatch,
    Drop,
    DropReason,
    Request,
    Reservation,
    Stage,
    StageReport,
    WakeAt,
    downlink,
    uplink,
    vgpu_resource,
)
from ppipe.dataplane.failure import failure_cut
from ppipe.dataplane.options import SchedulerOptions
from ppipe.dataplane.tables import EPS_US, ReservationTable
from ppipe.dataplane.topology import Pipeline, Topology, VGpu

_INF = float("inf")


class Hop:
    """One stage of a probed path: the transfer into it (if any), then its inference."""

    __slots__ = ("vgpu", "transfer_start", "transfer_us", "uses_nic", "prev", "start", "infer_us")

    def __init__(self, vgpu: VGpu, transfer_start: float | None, transfer_us: float, uses_nic: bool, prev: VGpu | None, start: float, infer_us: float):
        self.vgpu = vgpu
        self.transfer_start = transfer_start
        self.transfer_us = transfer_us
        self.uses_nic = uses_nic
        self.prev = prev
        self.start = start
        self.infer_us = infer_us


class ProbeResult:
    """What probe() returns: a path through a pipeline at a batch size, with its times.

    Attributes:
        pipeline: the probed pipeline.
        batch: the batch size probed.
        start: the time the probe started from (now).
        finish: when the last stage's inference ends.
        wait: total time spent waiting for resources along the path (us).
        hops: one :class:`Hop` per partition.
    """

    __slots__ = ("pipeline", "batch", "start", "finish", "wait", "hops")

    def __init__(self, pipeline: Pipeline, batch: int, start: float, finish: float, wait: float, hops: list[Hop]):
        self.pipeline = pipeline
        self.batch = batch
        self.start = start
        self.finish = finish
        self.wait = wait
        self.hops = hops

    @property
    def path(self) -> list[str]:
        return [h.vgpu.id for h in self.hops]

    def reservations(self) -> list[Reservation]:
        """The resource intervals this path needs (what ``reserve`` marks busy)."""
        out: list[Reservation] = []
        for h in self.hops:
            if h.uses_nic and h.transfer_us > 0:
                out.append(Reservation(uplink(h.prev.server), h.transfer_start, h.transfer_us))
                out.append(Reservation(downlink(h.vgpu.server), h.transfer_start, h.transfer_us))
            if h.infer_us > 0:
                out.append(Reservation(vgpu_resource(h.vgpu.id), h.start, h.infer_us))
        return out


class ReservationList(Sequence[Reservation]):
    """``Dispatch.reservations`` of a batch: the :class:`Reservation` records of what
    ``reserve`` marked, built on first use.

    A dispatch's stages already say where and when it runs, and neither the simulator nor
    the runtime reads these records; building four of them per dispatch was ~6 % of a
    simulation's time. Behaves as the tuple it stands for (iteration, indexing, equality,
    hashing) and pickles as that tuple.
    """

    __slots__ = ("_hops", "_keys", "_items")

    def __init__(self, hops: Sequence[Hop], keys: Sequence[tuple[ReservationTable, tuple]]):
        self._hops = hops
        self._keys = keys
        self._items: tuple[Reservation, ...] | None = None

    def _tuple(self) -> tuple[Reservation, ...]:
        if self._items is None:
            out = []
            hops = self._hops
            for tab, (_bid, d, kind) in self._keys:
                h = hops[d]
                if kind == "i":
                    out.append(Reservation(tab.name, h.start, h.infer_us))
                else:
                    out.append(Reservation(tab.name, h.transfer_start, h.transfer_us))
            self._items = tuple(out)
            self._hops = self._keys = ()  # (the tables and hops need not stay alive)
        return self._items

    def __len__(self) -> int:
        return len(self._tuple())

    def __getitem__(self, i):  # type: ignore[override]
        return self._tuple()[i]

    def __iter__(self) -> Iterator[Reservation]:
        return iter(self._tuple())

    def __eq__(self, other: object) -> bool:
        if isinstance(other, ReservationList):
            other = other._tuple()
        return self._tuple() == other if isinstance(other, tuple) else NotImplemented

    def __hash__(self) -> int:
        return hash(self._tuple())

    def __repr__(self) -> str:
        return repr(self._tuple())

    def __reduce__(self):
        return (tuple, (self._tuple(),))


class InFlight:
    """A dispatched batch the scheduler remembers until it completes or expires."""

    __slots__ = ("dispatch", "hops", "reported", "stage_end", "planned_finish", "expected_end", "keys", "live")

    def __init__(self, dispatch: Dispatch, hops: list[Hop], keys: list[tuple[ReservationTable, tuple]], stage_end: list[float] | None = None):
        self.dispatch = dispatch
        self.hops = hops
        self.reported = [False] * len(hops)
        # planned end of each stage's inference (the caller may pass them, computed already)
        self.stage_end = [h.start + h.infer_us for h in hops] if stage_end is None else stage_end
        self.planned_finish = self.stage_end[-1]
        self.expected_end = self.planned_finish
        self.keys = keys
        self.live = list(dispatch.requests)  # requests not dropped mid-flight


@dataclass
class Counters:
    """What the simulator and the benchmark read. ``probes`` counts probe() calls."""

    probes: int = 0
    dispatches: int = 0
    dispatched_requests: int = 0
    waits: int = 0
    drops: dict[str, int] = field(default_factory=dict)
    corrections: int = 0
    cascaded: int = 0
    expired_inflight: int = 0

    @property
    def probes_per_dispatch(self) -> float:
        return self.probes / self.dispatches if self.dispatches else float("nan")

    def as_dict(self) -> dict:
        return {
            "probes": self.probes,
            "dispatches": self.dispatches,
            "dispatched_requests": self.dispatched_requests,
            "probes_per_dispatch": self.probes_per_dispatch,
            "waits": self.waits,
            "drops": dict(sorted(self.drops.items())),
            "corrections": self.corrections,
            "cascaded": self.cascaded,
            "expired_inflight": self.expired_inflight,
        }


_LB_MAX_VGPUS = 4
"""First pools up to this size get a lower bound on their waiting before step 1 probes them."""


def _first_pool_wait(p: Pipeline, bs: int, now: float) -> float:
    """A lower bound on ``probe(p, bs, now).wait``: the waiting before the first inference.

    A probe's ``wait`` sums every wait along its path (before each transfer and each
    inference), so it is at least the wait of its first inference, which is at least the
    shortest wait of any vGPU of the first pool. Computed for small pools only (the
    pipelines of a baseline such as DART-r: one vGPU per pool, a dozen pipelines per
    model); 0 otherwise.
    """
    pool = p.pools[0]
    vgpus = pool.vgpus
    if len(vgpus) > _LB_MAX_VGPUS:
        return 0.0
    l_i = pool.infer_us[bs]
    lb = _INF
    for g in vgpus:
        tab = g.table
        ends = tab.ends
        if not ends or ends[-1] <= now + EPS_US:
            return 0.0
        s = tab.earliest(now, l_i)
        if s < lb:
            lb = s
    return lb - now if lb < _INF else 0.0


def _queue_key(r: Request) -> tuple[float, float, int]:
    return (r.deadline_us, r.arrival_us, r.id)


class BatchingScheduler:
    """Algorithm 1 over a compiled :class:`Topology`; subclasses provide ``probe``.

    Args:
        topology: the compiled plan (:func:`ppipe.dataplane.topology.compile_plan`).
        clock: the time source; only ``now_us()`` is read here (drivers honour WakeAt).
        options: tunables (:class:`SchedulerOptions`).
    """

    policy_name = "base"
    partial_dispatches = False  # every Dispatch covers a whole path
    tracks_nics = True  # whether NIC tables are reserved and corrected (the reactive baseline: no)
    executes_as_planned = False  # see the driver contract in ppipe.dataplane.api

    def __init__(self, topology: Topology, clock: Clock, options: SchedulerOptions | None = None):
        self.topology = topology
        self.clock = clock
        self.options = options or SchedulerOptions()
        self.models: list[str] = list(topology.pipelines)
        self.queues: dict[str, deque[Request]] = {m: deque() for m in self.models}
        self.wake_at: dict[str, float | None] = {m: None for m in self.models}
        self.inflight: dict[int, InFlight] = {}
        self._expiry: list[tuple[float, int]] = []
        self._next_batch_id = 0
        self.counters = Counters()
        self.failed: list[str] = []
        self._live: dict[str, list[Pipeline]] = {m: [p for p in ps if p.alive] for m, ps in topology.pipelines.items()}

    # ---- the policy's part ---------------------------------------------------------
    def probe(self, pipeline: Pipeline, bs: int, t0: float | None = None) -> ProbeResult:  # pragma: no cover
        raise NotImplementedError

    def _after_report(self, rec: InFlight, report: StageReport, now: float) -> list[Decision]:
        return []

    # ---- Scheduler protocol --------------------------------------------------------
    def submit(self, request: Request) -> list[Decision]:
        """A request arrived: queue it (or refuse it) and run its model's batcher."""
        now = self.clock.now_us()
        self._housekeeping(now)
        q = self.queues.get(request.model)
        if q is None:
            return [self._drop(request, DropReason.UNKNOWN_MODEL, f"models served: {', '.join(self.models)}")]
        if not self._live[request.model]:
            return [self._drop(request, DropReason.NO_PIPELINE, "every pipeline of the model has a failed pool")]
        bound = self.options.queue_bound(request.model)
        if bound is not None and len(q) >= bound:
            return [self._drop(request, DropReason.QUEUE_FULL, f"queue bound {bound}")]
        last = q[-1] if q else None
        if last is None or (request.deadline_us, request.arrival_us, request.id) >= (last.deadline_us, last.arrival_us, last.id):
            q.append(request)  # (the usual case; the test is _queue_key's, inlined)
        else:  # out-of-order arrival (clock skew in the runtime): keep the queue sorted
            items = list(q)
            insort(items, request, key=_queue_key)
            q.clear()
            q.extend(items)
        return self._run_model(request.model, now)

    def wake(self) -> list[Decision]:
        """A timer fired: run the batcher of every model whose wake time has come."""
        now = self.clock.now_us()
        self._housekeeping(now)
        out: list[Decision] = []
        for m in self.models:
            t = self.wake_at[m]  # (on the model's planning timeline: now + its dispatch lead)
            if t is not None and t <= now + self.lead_us(m) + EPS_US:
                out.extend(self._run_model(m, now))
        return out

    def report(self, report: StageReport) -> list[Decision]:
        """Feedback correction: a worker reports the real times of one stage."""
        now = self.clock.now_us()
        self.counters.corrections += 1
        rec = self.inflight.get(report.batch_id)
        later = False
        g = self.topology.vgpus.get(report.vgpu_id)
        part = report.partition
        hint = rec.hops[part] if rec is not None and 0 <= part < len(rec.hops) else None
        if g is not None:
            key = (report.batch_id, part, "i")
            hint_start = hint.start if hint else None
            # (the usual report: it ran as reserved, and the table already says so)
            if not g.table.confirm(key, report.start_us, report.end_us, now, hint_start):
                self.counters.cascaded += g.table.correct(key, report.start_us, report.end_us, now=now, hint_start=hint_start)
                if g.alive and g.pool is not None:
                    g.pool.touch(g)  # it may be free earlier than the pool's idle-heap thinks
        if rec is not None and 0 <= part < len(rec.hops):
            hop = rec.hops[part]
            later = report.end_us > rec.stage_end[part] + EPS_US
            if self.tracks_nics and hop.uses_nic and report.transfer_start_us is not None and report.transfer_end_us is not None:
                ts, te = report.transfer_start_us, report.transfer_end_us
                for tab, kind in ((hop.prev.up, "u"), (hop.vgpu.down, "d")):
                    key = (report.batch_id, part, kind)
                    if not tab.confirm(key, ts, te, now, hop.transfer_start):
                        self.counters.cascaded += tab.correct(key, ts, te, now=now, hint_start=hop.transfer_start)
                later = later or report.transfer_end_us > hop.transfer_start + hop.transfer_us + EPS_US
            rec.reported[part] = True
            if later and self.options.propagate_delays:
                self._propagate(rec, report.batch_id, part, report.end_us)
            delay = report.end_us - rec.stage_end[part]
            if rec.planned_finish + delay > rec.expected_end:
                rec.expected_end = rec.planned_finish + delay
                heapq.heappush(self._expiry, (rec.expected_end, report.batch_id))
        out: list[Decision] = []
        if rec is not None:
            if all(rec.reported):
                self._forget(report.batch_id)
            else:
                out.extend(self._after_report(rec, report, now))
        self._housekeeping(now)
        if later and self.options.reevaluate_on_report:
            for m in self.models:
                if self.wake_at[m] is not None:
                    out.extend(self._run_model(m, now))
        return out

    def _propagate(self, rec: InFlight, bid: int, part: int, ready: float) -> None:
        """A stage ended late: its batch's later stages cannot start as planned either.

        Moves the batch's unreported downstream reservations (transfer on both NICs, then
        inference) to no earlier than the time their input can be there, so that the
        tables show where that work will really sit (and who is pushed back by it).
        """
        t = ready
        for j in range(part + 1, len(rec.hops)):
            if rec.reported[j]:
                break
            h = rec.hops[j]
            if h.uses_nic and h.transfer_us > 0:
                if self.tracks_nics:
                    a = h.prev.up.delay((bid, j, "u"), t, h.transfer_start)
                    b = h.vgpu.down.delay((bid, j, "d"), t, h.transfer_start)
                    if a is not None and b is not None and a[0] != b[0]:
                        # the two links must carry it at once: align both on the later start
                        s2 = max(a[0], b[0])
                        a = h.prev.up.delay((bid, j, "u"), s2)
                        b = h.vgpu.down.delay((bid, j, "d"), s2)
                    t = max(t, a[0] if a else t, b[0] if b else t) + h.transfer_us
                else:
                    t = max(t, h.transfer_start) + h.transfer_us
            else:
                t = t + h.transfer_us
            moved = h.vgpu.table.delay((bid, j, "i"), t, h.start)
            t = moved[1] if moved is not None else max(t, h.start) + h.infer_us

    def mark_failed(self, vgpu_id: str) -> list[Decision]:
        """A worker died: stop routing to it and drop the in-flight requests it held.

        The vGPU leaves its pool at once; a pool left empty disables its pipeline; a model
        with no live pipeline drops its queue (and later arrivals) with ``NO_PIPELINE``.
        An in-flight batch is lost (its requests dropped with ``WORKER_FAILED``) where the
        failure cut (:func:`~ppipe.dataplane.failure.failure_cut`) of its reported stages
        says so: the failed vGPU holds a stage that has not been reported done, or holds
        the stage just before the first unreported one (its feature map may not have left
        the dead worker yet). Its reservations from the cut on are released; those of
        earlier stages, on live workers that may still run them, are kept until their end.
        """
        now = self.clock.now_us()
        g = self.topology.vgpus.get(vgpu_id)
        if g is None or not g.alive:
            return []
        g.alive = False
        self.failed.append(vgpu_id)
        pipe = self.topology.pipelines[g.model][g.pipeline]
        pool = pipe.pools[g.partition]
        pool.vgpus.remove(g)
        pool.refresh()
        if not pool.vgpus:
            pipe.alive = False
            self._live[g.model] = [p for p in self.topology.pipelines[g.model] if p.alive]
        g.table = ReservationTable(g.table.name)  # nothing will run there any more
        out: list[Decision] = []
        for bid in list(self.inflight):
            rec = self.inflight[bid]
            cut = failure_cut([h.vgpu.id for h in rec.hops], rec.reported, vgpu_id)
            if cut is not None:
                for r in rec.live:
                    out.append(self._drop(r, DropReason.WORKER_FAILED, f"vGPU {vgpu_id} failed"))
                # Stages before the cut are on live workers that may run them anyway (a
                # driver need not cancel them): keep their reservations, free the rest.
                self._release(rec, from_partition=cut)
                self._forget(bid)
        out.extend(self._run_model(g.model, now))
        return out

    def mark_recovered(self, vgpu_id: str) -> list[Decision]:
        """A failed vGPU's worker runs again (restarted, its blocks loaded): route to it.

        It rejoins its pool with an empty reservation table (nothing of the dead worker's
        runs there); a pipeline whose pools all have a live vGPU again is live again, and
        the model's queue is served at once.
        """
        g = self.topology.vgpus.get(vgpu_id)
        if g is None or g.alive:
            return []
        g.alive = True
        self.failed.remove(vgpu_id)
        pipe = self.topology.pipelines[g.model][g.pipeline]
        pool = pipe.pools[g.partition]
        g.table = ReservationTable(g.table.name)
        pool.vgpus.append(g)
        pool.vgpus.sort(key=lambda v: v.id)
        pool.refresh()
        if all(p.vgpus for p in pipe.pools):
            pipe.alive = True
            self._live[g.model] = [p for p in self.topology.pipelines[g.model] if p.alive]
        return self._run_model(g.model, self.clock.now_us())

    def withdraw(self, request_ids) -> list[Decision]:
        """Take queued (not yet dispatched) requests out of their queues: the driver answers
        them itself (their client request was refused as a whole). Ids not queued are ignored."""
        ids = set(request_ids)
        for q in self.queues.values():
            if any(r.id in ids for r in q):
                kept = [r for r in q if r.id not in ids]
                q.clear()
                q.extend(kept)
        return []

    def lead_us(self, model: str) -> float:
        """The model's dispatch lead: the fixed one, plus the input's transfer where the
        options count it (:func:`ppipe.dataplane.topology.input_transfer_us`)."""
        lead = self.options.dispatch_lead_us
        if self.options.input_transfer_lead:
            lead += self.topology.input_us.get(model, 0.0)
        return lead

    # ---- introspection -------------------------------------------------------------
    def stats(self) -> dict:
        """Counters as a plain dict (probes, dispatches, probes per dispatch, drops...)."""
        d = self.counters.as_dict()
        d["policy"] = self.policy_name
        d["queued"] = {m: len(q) for m, q in self.queues.items()}
        d["inflight"] = len(self.inflight)
        return d

    def live_pipelines(self, model: str) -> list[Pipeline]:
        return list(self._live[model])

    # ---- Algorithm 1 ---------------------------------------------------------------
    def _run_model(self, model: str, now: float) -> list[Decision]:
        """Algorithm 1 for one model, planned from ``now + dispatch lead`` for the deadline
        ``deadline - answer budget`` (:class:`SchedulerOptions`); its WakeAt times are on the
        clock's timeline."""
        out: list[Decision] = []
        lead = self.lead_us(model)
        budget = self.options.budget_us(model)
        now += lead
        q = self.queues[model]
        self.wake_at[model] = None
        reuse = self.options.reuse_step1_probe
        k_min = self.options.min_batch_on_overload
        while q:
            pipes = self._live[model]
            if not pipes:
                while q:
                    out.append(self._drop(q.popleft(), DropReason.NO_PIPELINE, "every pipeline of the model has a failed pool"))
                break
            # Step 1: the pipeline with the least waiting at its planned batch. (A pipeline
            # whose first pool alone makes it wait at least as long as the best so far
            # cannot replace it, so it is not probed: same choice, fewer probes.)
            best: ProbeResult | None = None
            step1: list[ProbeResult | Pipeline] = []
            for p in pipes:
                bs = p.batches[0]
                if best is not None and _first_pool_wait(p, bs, now) > best.wait - 0.5 * EPS_US:
                    step1.append(p)  # not probed (see the fallback below)
                    continue
                r = self.probe(p, bs, now)
                step1.append(r)
                if best is None or r.wait < best.wait - EPS_US:
                    best = r
            p = best.pipeline
            head = q[0]
            due = head.deadline_us - budget  # the last end that leaves the answer its time
            # Step 2: the largest batch whose path finishes by the oldest deadline.
            chosen = self._largest_fitting(best, due, now, reuse)
            if chosen is None and self.options.try_other_pipelines and len(step1) > 1:
                # Not in the paper: before dropping, try the other pipelines, least waiting first.
                others = [r if isinstance(r, ProbeResult) else self.probe(r, r.batches[0], now) for r in step1 if r is not best]
                for r1 in sorted(others, key=lambda r: (r.wait, r.pipeline.index)):
                    chosen = self._largest_fitting(r1, due, now, reuse)
                    if chosen is not None:
                        p = r1.pipeline
                        break
            if k_min and self._shed_for_min_batch(p, chosen, k_min, now, lead, budget, out):
                continue
            # Step 3: drop, wait or dispatch.
            if chosen is None:
                self._at_risk_or_drop(best, step1, now, budget, out)
                continue
            if len(q) < chosen.batch:
                now_r: ProbeResult | None = None
                for bs in p.batches:
                    if bs > len(q):
                        continue
                    r = self.probe(p, bs, now)
                    if r.finish <= due + EPS_US:
                        now_r = r
                        break
                if now_r is None:
                    # Only larger batches fit (a non-monotone profile): nothing can be sent
                    # now and the head cannot wait for a batch that fits -> drop it.
                    out.append(self._drop(q.popleft(), DropReason.DEADLINE_UNREACHABLE, f"pipeline {p.index}: no batch <= {len(q) + 1} fits"))
                    continue
                slack = due - now_r.finish - self.options.wake_lead_us
                if slack > EPS_US:
                    t = now + slack
                    if self.options.exact_last_moment and now_r.wait > EPS_US:
                        # The path waits now; starting later absorbs some of that waiting.
                        # The latest start with no waiting at all, if the tables allow it:
                        t_late = due - (now_r.finish - now - now_r.wait)
                        if self.probe(p, now_r.batch, t_late).finish <= due + EPS_US:
                            t = t_late
                    self.wake_at[model] = t
                    self.counters.waits += 1
                    out.append(WakeAt(t - lead))
                    break
                chosen = now_r
            elif self.options.defer_small_batches and chosen.batch < p.batches[0] and chosen.hops[0].start > now + EPS_US:
                # The small batch would only sit in a reservation until its first vGPU is
                # free: decide then, with whatever has arrived meanwhile.
                t = chosen.hops[0].start
                self.wake_at[model] = t
                self.counters.waits += 1
                out.append(WakeAt(t - lead))
                break
            self._dispatch(chosen, [q.popleft()] if chosen.batch == 1 else [q.popleft() for _ in range(chosen.batch)], out)
        return out

    def _at_risk_or_drop(self, best: ProbeResult, step1: list, now: float, budget: float, out: list[Decision]) -> None:
        """Step 3 for a head that no batch serves within the answer budget: dispatch it in
        the batch :meth:`_at_risk` finds within the drop budget, or drop it."""
        model = best.pipeline.model
        q, drop_budget = self.queues[model], self.options.drop_budget(model)
        risky = None if drop_budget >= budget else self._at_risk(best, step1, q[0].deadline_us - drop_budget, now, len(q))
        if risky is None:
            p = best.pipeline
            out.append(self._drop(q.popleft(), DropReason.DEADLINE_UNREACHABLE, f"pipeline {p.index}: even batch {p.batches[-1]} finishes too late"))
            return
        self._dispatch(risky, [q.popleft() for _ in range(risky.batch)], out)

    def _at_risk(self, best: ProbeResult, step1: list, due_us: float, now: float, queued: int) -> ProbeResult | None:
        """A head that no batch serves within the answer budget, served within the smaller
        drop budget (:attr:`SchedulerOptions.drop_budget_us`, ``due_us`` its last end): the
        largest batch of at most ``queued`` requests finishing by ``due_us``, on the first
        pipeline that has one, least waiting first (None: the head is hopeless)."""
        others = [r if isinstance(r, ProbeResult) else self.probe(r, r.batches[0], now)
                  for r in step1 if r is not best] if self.options.try_other_pipelines else []
        for r in [best, *sorted(others, key=lambda r: (r.wait, r.pipeline.index))]:
            for bs in r.pipeline.batches:
                if bs <= queued:
                    x = r if bs == r.batch else self.probe(r.pipeline, bs, now)
                    if x.finish <= due_us + EPS_US:
                        return x
        return None

    def _largest_fitting(self, first: ProbeResult, deadline_us: float, now: float, reuse: bool) -> ProbeResult | None:
        """Step 2 on ``first.pipeline``: the first usable batch, largest first, finishing by the deadline."""
        p = first.pipeline
        for bs in p.batches:
            r = first if (reuse and bs == first.batch) else self.probe(p, bs, now)
            if r.finish <= deadline_us + EPS_US:
                return r
        return None

    def _shed_for_min_batch(self, p: Pipeline, chosen: ProbeResult | None, k_min: int, now: float, lead: float,
                            budget: float, out: list[Decision]) -> bool:
        """Optional overload fix (``min_batch_on_overload``); True if it shed requests.

        When the head's deadline only allows a batch smaller than ``bk`` (the largest usable
        batch <= min(k, planned)) but a request arriving now could still ride a ``bk``
        batch, the pipeline is backlogged: instead of spending it on a small batch, drop
        the queued requests that a ``bk`` batch cannot serve in time, oldest first, and
        start over (the next head then fits a batch >= bk, or waits for one).
        """
        cap = min(k_min, p.batches[0])
        bk = next((b for b in p.batches if b <= cap), None)
        if bk is None or (chosen is not None and chosen.batch >= bk):
            return False
        q = self.queues[p.model]
        r = self.probe(p, bk, now)
        if r.finish > now - lead + self.topology.slo_us[p.model] - budget + EPS_US:
            return False  # even a fresh request misses a bk batch: keep the paper's rule
        shed = False
        while q and q[0].deadline_us - budget + EPS_US < r.finish:
            out.append(self._drop(q.popleft(), DropReason.DEADLINE_UNREACHABLE, f"shed to keep batches >= {bk} (min_batch_on_overload)"))
            shed = True
        return shed

    # ---- reserve + dispatch --------------------------------------------------------
    def reserve(self, result: ProbeResult, batch_id: int) -> list[tuple[ReservationTable, tuple]]:
        """Mark the path's intervals busy (the paper's ``reserve``); returns (table, key) pairs."""
        keys: list[tuple[ReservationTable, tuple]] = []
        limit = self.options.prune_threshold
        now = result.start
        for d, h in enumerate(result.hops):
            if h.uses_nic and h.transfer_us > 0:
                for tab, key in ((h.prev.up, (batch_id, d, "u")), (h.vgpu.down, (batch_id, d, "d"))):
                    if len(tab.starts) > limit:
                        tab.prune(now)
                    tab.add(h.transfer_start, h.transfer_us, key)
                    keys.append((tab, key))
            if h.infer_us > 0:
                tab = h.vgpu.table
                if len(tab.starts) > limit:
                    tab.prune(now)
                key = (batch_id, d, "i")
                tab.add(h.start, h.infer_us, key)
                keys.append((tab, key))
        return keys

    def _dispatch(self, r: ProbeResult, requests: list[Request], out: list[Decision]) -> None:
        bid = self._next_batch_id
        self._next_batch_id += 1
        keys = self.reserve(r, bid)
        pipe = r.pipeline
        pools = pipe.pools
        hops = r.hops
        stages = []
        ends = []
        for d, h in enumerate(hops):
            g = h.vgpu
            pool = pools[d]
            st = h.start
            li = h.infer_us
            stages.append(Stage(d, g.id, g.server, pool.first_block, pool.last_block, h.transfer_start, h.transfer_us, st, li))
            ends.append(st + li)
        disp = Dispatch(bid, pipe.model, pipe.index, tuple(requests), tuple(stages), ReservationList(hops, keys))
        rec = InFlight(disp, hops, keys, ends)
        self.inflight[bid] = rec
        heapq.heappush(self._expiry, (rec.expected_end, bid))
        c = self.counters
        c.dispatches += 1
        c.dispatched_requests += len(requests)
        out.append(disp)

    # ---- bookkeeping ---------------------------------------------------------------
    def _drop(self, request: Request, reason: DropReason, detail: str = "") -> Drop:
        self.counters.drops[reason.value] = self.counters.drops.get(reason.value, 0) + 1
        return Drop(request, reason, detail)

    def _release(self, rec: InFlight, from_partition: int = 0) -> None:
        """Free the batch's reservations of partitions >= ``from_partition``."""
        for tab, key in rec.keys:
            if key[1] >= from_partition:
                tab.remove(key)

    def _forget(self, bid: int) -> None:
        self.inflight.pop(bid, None)

    def _housekeeping(self, now: float) -> None:
        """Forget in-flight batches whose expected end (plus grace) has passed."""
        grace = self.options.inflight_grace_us
        exp = self._expiry
        while exp and exp[0][0] + grace < now:
            t, bid = heapq.heappop(exp)
            rec = self.inflight.get(bid)
            if rec is not None and rec.expected_end + grace < now:
                del self.inflight[bid]
                self.counters.expired_inflight += 1


PolicyFactory = Callable[[Topology, Clock, SchedulerOptions], BatchingScheduler]
