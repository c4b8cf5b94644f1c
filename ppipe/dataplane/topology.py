"""The plan compiled for the hot path: pools of vGPUs, latency arrays, NIC tables.

The scheduler never touches pydantic objects while deciding. :func:`compile_plan` reads
the :class:`~ppipe.spec.plan.Plan`, the model profiles and the cluster once and builds
plain ``__slots__`` objects:

* a :class:`VGpu` per placed vGPU (``VgpuPlacement.vgpu_id``), holding its own reservation
  table and references to its server's uplink and downlink tables and bandwidth;
* a :class:`Pool` per partition: its vGPUs sorted by id (the deterministic tie-break),
  two lazy heaps that spare probe a scan of every vGPU (the longest-idle vGPU; lower
  bounds on each vGPU's next start, :meth:`Pool.scan_set`),
  the inference latency per usable batch (``profile.partition_latency_us``), and the bits
  per sample that leave it (``profile.cut_bytes(last_block) * 8``; 0 for the last pool);
* a :class:`Pipeline` per pooled pipeline: its pools and its usable batch sizes, largest
  first, capped at the planned (unified) batch.

Usable batch sizes of a pipeline: those that every partition's profile has for its
(GPU type, vGPU level) — a batch a profile lacks cannot be timed, so it is not used.

Transfer time between two servers: ``bs * bits_per_sample / min(bw_sender, bw_receiver)``
with each server's effective bandwidth = its group's nominal NIC bandwidth times the
cluster's ``bandwidth_efficiency`` (``ClusterSpec.effective_bandwidth_gbps`` gives the same
value per GPU type; per server is finer where groups differ).
"""

from __future__ import annotations

import heapq
import math
from typing import Callable, Mapping

import numpy as np

from ppipe.dataplane.api import downlink, uplink, vgpu_resource
from ppipe.dataplane.tables import ReservationTable
from ppipe.errors import UserError
from ppipe.spec.cluster import ClusterSpec
from ppipe.spec.plan import Plan
from ppipe.spec.profile import ModelProfile


_NEG_INF = float("-inf")
_INF = float("inf")
_GAP_SLACK_US = 1e-3
"""Slack of the gap-heap bound (1 ns = 1000 x EPS_US): absorbs float tolerance in ``earliest``."""


def _vgpu_id(g: "VGpu") -> str:
    return g.id


_sift_down = heapq._siftup  # type: ignore[attr-defined]
"""Restore the heap below index i after its entry grew (heapq's name: items move up, the entry down)."""
_heapreplace = heapq.heapreplace
"""For the root: the same sift (the same heap afterwards), done by heapq's C code."""


class VGpu:
    """One placed vGPU. ``alive`` turns False on mark_failed."""

    __slots__ = ("id", "server", "gpu", "level", "table", "up", "down", "bw_gbps", "alive", "model", "pipeline", "partition", "pool")

    def __init__(self, vid: str, server: str, gpu: str, level: int, up: ReservationTable, down: ReservationTable, bw_gbps: float):
        self.id = vid
        self.server = server
        self.gpu = gpu
        self.level = level
        self.table = ReservationTable(vgpu_resource(vid))
        self.up = up
        self.down = down
        self.bw_gbps = bw_gbps
        self.alive = True
        self.model = ""
        self.pipeline = -1
        self.partition = -1
        self.pool: "Pool | None" = None

    def __repr__(self) -> str:
        return f"VGpu({self.id})"


class Pool:
    """The vGPUs of one partition of one pipeline.

    Besides the vGPUs in id order (the scan order of probe), a pool keeps a lazy min-heap
    of ``(busy_until, vgpu_id)``: :meth:`longest_idle` returns the vGPU whose reservations
    end first, the candidate probe tries before scanning the pool. Entries are repaired
    when they reach the top (a reservation made the vGPU busier), and :meth:`touch` adds a
    fresh entry when a table may have become *less* busy (feedback, release). The key of
    each vGPU's newest entry (pushed or repaired) is kept: it is at most the vGPU's
    ``busy_until`` (the table only grew since, or it was touched again), so that entry alone
    keeps the vGPU's place; a stale entry that reaches the top while the newest one already
    holds the current key is a duplicate and is dropped, not repaired into a second copy.

    A second lazy min-heap, the *gap heap*, holds a lower bound on when each vGPU can next
    start any batch: ``(h, vgpu_id, table_version)`` with ``h <= table.earliest(t, l)`` (to
    within a 1 ns slack) for every query time ``t >= gap_tau`` and every latency
    ``l >= gap_min_us`` (the pool's shortest inference). :meth:`scan_set` uses it to hand
    probe only the vGPUs that could finish by a given time, so a probe of a large busy
    pool looks at a few vGPUs instead of all of them. Why the bound stays valid:
    ``earliest`` grows with ``t`` and ``l``; a reservation (``add``) only makes it later
    (the entry becomes a looser bound, repaired when a scan reaches it); an update that
    may make it *earlier* (remove, correct, delay) calls the table's ``on_free``, which
    pushes a ``-inf`` entry for that vGPU (unless it has one: ``gap_unknown``). Several
    entries of one vGPU may coexist; the smallest is the one that counts.
    """

    __slots__ = (
        "index", "first_block", "last_block", "gpu", "level", "vgpus", "infer_us", "out_bits", "servers",
        "max_bw_gbps", "heap", "heap_newest", "by_id", "gap_heap", "gap_min_us", "gap_tau", "gap_unknown",
    )

    def __init__(self, index: int, first_block: int, last_block: int, gpu: str, level: int):
        self.index = index
        self.first_block = first_block
        self.last_block = last_block
        self.gpu = gpu
        self.level = level
        self.vgpus: list[VGpu] = []
        self.infer_us: dict[int, float] = {}
        self.out_bits = 0.0  # bits per sample sent to the next pool (0 for the last)
        self.servers: frozenset[str] = frozenset()
        self.max_bw_gbps = 0.0
        self.heap: list[tuple[float, str]] = []
        self.heap_newest: dict[str, float] = {}  # vGPU id -> key of its newest heap entry
        self.by_id: dict[str, VGpu] = {}
        self.gap_heap: list[tuple[float, str, int]] = []
        self.gap_min_us = 0.0  # shortest inference of the pool (0: no gap heap)
        self.gap_tau = _NEG_INF  # the latest query time a gap-heap entry was computed for
        self.gap_unknown: set[str] = set()  # the vGPUs with a -inf entry in the gap heap

    def refresh(self) -> None:
        """Recompute derived sets after vGPUs were added or removed (or tables changed)."""
        self.servers = frozenset(g.server for g in self.vgpus)
        self.max_bw_gbps = max((g.bw_gbps for g in self.vgpus), default=0.0)
        self.by_id = {g.id: g for g in self.vgpus}
        self.heap = [(g.table.busy_until(), g.id) for g in self.vgpus]
        heapq.heapify(self.heap)
        self.heap_newest = {vid: bu for bu, vid in self.heap}
        self.gap_min_us = min(self.infer_us.values(), default=0.0)
        # -inf: unknown; the first scan_set computes every entry
        self.gap_heap = [(_NEG_INF, g.id, -1) for g in self.vgpus]
        self.gap_unknown = set(self.by_id)
        for g in self.vgpus:
            g.table.on_free = self._freed_callback(g.id)

    def _freed_callback(self, vid: str) -> Callable[[], None]:
        """The ``on_free`` of a vGPU's table: its gap-heap bound is unknown again."""

        def freed() -> None:
            unknown = self.gap_unknown
            if vid in unknown:
                return  # its -inf entry, not yet brought up to date, is still the bound
            unknown.add(vid)
            heap = self.gap_heap
            heapq.heappush(heap, (_NEG_INF, vid, -1))
            if len(heap) > 4 * len(self.vgpus) + 16:
                # Many notifications between scans: keep the smallest entry of each vGPU.
                low: dict[str, tuple[float, str, int]] = {}
                for e in heap:
                    if e[1] in self.by_id and e < low.get(e[1], (_INF,)):
                        low[e[1]] = e
                self.gap_heap = list(low.values())
                heapq.heapify(self.gap_heap)

        return freed

    def scan_set(self, tau: float, l_i: float, limit: float) -> list[VGpu] | None:
        """The live vGPUs that might finish an inference of ``l_i`` us by ``limit``, in id order.

        Every vGPU left out cannot: for any query time ``t >= tau`` its earliest slot for
        ``l_i`` ends after ``limit``. ``tau`` must be a time no later than the query's
        start (probe passes ``min(t0, now)``). Returns None when the bound cannot be used
        (a query earlier than an entry's time, or a pool without positive latencies): the
        caller then scans every vGPU.

        How: the heap entries ``(h, vgpu_id, table_version)`` at or below ``limit - l_i``
        form a subtree at the heap's root; it is walked without popping. An entry is
        brought up to date (``earliest(tau, gap_min_us)``) unless its table has not changed
        since it was computed and ``h >= tau`` (then that is still the answer); a bound that
        grew is written back in place and sifted down, deepest entry first, so the indices
        still to visit do not move.
        """
        if tau < self.gap_tau or not self.gap_min_us > 0.0:
            return None
        self.gap_tau = tau
        heap = self.gap_heap
        # A vGPU can finish by `limit` only if it can start by limit - l_i. The slack covers
        # the float tolerance inside `earliest` (its result may dip by about EPS_US when the
        # query time crosses an interval's end), so the bound never excludes a candidate.
        lim = limit - l_i + _GAP_SLACK_US
        n = len(heap)
        by_id = self.by_id
        dmin = self.gap_min_us
        unknown = self.gap_unknown  # (a -inf entry that is overwritten leaves it)
        # 0. Repair the root while it is out of date (under load it is usually the vGPU
        # the last dispatch reserved). Then, if neither child qualifies, it alone does.
        while n and heap[0][0] <= lim:
            h, vid, ver = heap[0]
            if h == _NEG_INF:
                unknown.discard(vid)
            g = by_id.get(vid)
            if g is None:
                heapq.heappop(heap)
                n -= 1
                continue
            tab = g.table
            if ver == tab.version and h >= tau:
                if (n < 2 or heap[1][0] > lim) and (n < 3 or heap[2][0] > lim):
                    return [g]
                break
            h2 = tab.earliest(tau, dmin)
            if h2 < h:  # float tolerance only: keep the lower bound, note the version
                h2 = h
            _heapreplace(heap, (h2, vid, tab.version))  # = heap[0] = ...; _sift_down(heap, 0), in C
        if not n or heap[0][0] > lim:
            return []
        # 1. the entries <= lim (a subtree at the root)
        idx = []
        stack = [0]
        while stack:
            i = stack.pop()
            idx.append(i)
            c = 2 * i + 1
            if c < n and heap[c][0] <= lim:
                stack.append(c)
                c += 1
                if c < n and heap[c][0] <= lim:
                    stack.append(c)
            elif c + 1 < n and heap[c + 1][0] <= lim:
                stack.append(c + 1)
        # 2. bring them up to date, deepest first
        if len(idx) > 1:
            idx.sort(reverse=True)
        done: dict[str, float] = {}
        out: list[VGpu] = []
        lower: list[tuple[float, str, int]] = []
        for i in idx:
            h, vid, ver = heap[i]
            if h == _NEG_INF:
                unknown.discard(vid)  # every entry of the walk gets a finite bound, or sinks
            g = by_id.get(vid)
            if g is None:  # left the pool (its old table was released): sink the entry
                heap[i] = (_INF, vid, -1)
                _sift_down(heap, i)
                continue
            if vid in done:
                # A deeper entry of this vGPU was brought up to date in this walk: it is a
                # valid bound, so this copy (copies come from `on_free`) is redundant; sink
                # it, so that later walks do not visit it again.
                heap[i] = (_INF, vid, -1)
                _sift_down(heap, i)
                continue
            tab = g.table
            if ver == tab.version and h >= tau:
                h2 = h
            else:
                h2 = tab.earliest(tau, dmin)
                if h2 > h:
                    heap[i] = (h2, vid, tab.version)
                    _sift_down(heap, i)
                elif h2 < h:  # float tolerance only: add the lower entry, keep this one
                    lower.append((h2, vid, tab.version))
            done[vid] = h2
            if h2 <= lim:
                out.append(g)
        for e in lower:
            heapq.heappush(heap, e)
        if len(out) > 1:
            out.sort(key=_vgpu_id)
        return out

    def touch(self, g: VGpu) -> None:
        """Note that ``g``'s table changed in a way that may make it free earlier."""
        bu = g.table.busy_until()
        heapq.heappush(self.heap, (bu, g.id))
        self.heap_newest[g.id] = bu
        if len(self.heap) > 4 * len(self.vgpus) + 16:
            self.refresh()

    def longest_idle(self) -> VGpu | None:
        """The live vGPU whose last reservation ends first (ties: lower id), or None."""
        heap = self.heap
        while heap:
            bu, vid = heap[0]
            g = self.by_id.get(vid)
            if g is None:
                heapq.heappop(heap)
                continue
            ends = g.table.ends
            cur = ends[-1] if ends else _NEG_INF
            if bu != cur:
                if self.heap_newest.get(vid) == cur:
                    heapq.heappop(heap)  # its newest entry holds the current key already
                else:
                    heapq.heapreplace(heap, (cur, vid))
                    self.heap_newest[vid] = cur
                continue
            return g
        return None


class Pipeline:
    """One pooled pipeline of a model."""

    __slots__ = ("model", "index", "planned_batch", "batches", "pools", "alive", "nominal_us", "planned_rps")

    def __init__(self, model: str, index: int, planned_batch: int):
        self.model = model
        self.index = index
        self.planned_batch = planned_batch
        # Usable batch sizes <= planned, descending: the batcher only shrinks a batch
        # (Algorithm 1); a larger one would break the latency the plan was sized for.
        self.batches: tuple[int, ...] = ()
        self.pools: list[Pool] = []
        self.alive = True
        self.nominal_us: dict[int, float] = {}  # sum of inference latencies at each batch
        self.planned_rps = 0.0  # the plan's throughput of this pipeline


class Topology:
    """Everything the scheduler needs, compiled from plan + profiles + cluster."""

    def __init__(self) -> None:
        self.vgpus: dict[str, VGpu] = {}
        self.pipelines: dict[str, list[Pipeline]] = {}  # model -> pipelines in plan order
        self.slo_us: dict[str, float] = {}
        self.nic: dict[str, ReservationTable] = {}  # resource id -> table (up/down of every server)
        self.input_us: dict[str, float] = {}  # model -> its input's transfer to a first pool (input_transfer_us)

    def table(self, resource: str) -> ReservationTable | None:
        """The table of a resource id (``vgpu:...``, ``up:...``, ``down:...``)."""
        if resource.startswith("vgpu:"):
            g = self.vgpus.get(resource[5:])
            return g.table if g else None
        return self.nic.get(resource)

    def all_tables(self) -> list[ReservationTable]:
        return [g.table for g in self.vgpus.values()] + list(self.nic.values())


def compile_plan(plan: Plan, profiles: Mapping[str, ModelProfile], cluster: ClusterSpec) -> Topology:
    """Compile a plan for the data plane.

    Raises:
        UserError: a model without a profile, a plan without placement for a pool, a
            server the cluster does not have, or a pipeline with no usable batch size.
    """
    topo = Topology()
    server_bw: dict[str, float] = {
        name: group.nic_bandwidth_gbps * cluster.bandwidth_efficiency for name, group in cluster.server_names()
    }
    by_pool: dict[tuple[str, int, int], list] = {}
    for pl in plan.placement:
        by_pool.setdefault((pl.model, pl.pipeline, pl.partition), []).append(pl)

    for m in plan.models:
        if m.name not in profiles:
            raise UserError(
                f"plan model '{m.name}' has no profile among {sorted(profiles)}",
                fix=f"pass the profile of '{m.name}' (the folder named in the plan's 'profile' field: {m.profile})",
            )
        prof = profiles[m.name]
        topo.slo_us[m.name] = m.slo_ms * 1000.0
        pipes: list[Pipeline] = []
        for pi, pp in enumerate(m.pipelines):
            pipe = Pipeline(m.name, pi, pp.batch)
            usable: set[int] | None = None
            for di, part in enumerate(pp.partitions):
                have = set(prof.batches(part.gpu, part.vgpu))
                usable = have if usable is None else usable & have
            cands = sorted((b for b in (usable or ()) if b <= pp.batch), reverse=True)
            if not cands:
                raise UserError(
                    f"model '{m.name}' pipeline {pi}: no batch size <= {pp.batch} is profiled for every partition "
                    f"({[(p.gpu, p.vgpu) for p in pp.partitions]})",
                    fix="re-plan with this profile, or profile the missing (gpu, vgpu, batch) entries",
                )
            pipe.batches = tuple(cands)
            for di, part in enumerate(pp.partitions):
                if part.last_block >= prof.num_blocks:
                    raise UserError(
                        f"model '{m.name}' pipeline {pi} partition {di}: last_block {part.last_block} but the profile "
                        f"has {prof.num_blocks} blocks",
                        fix="the plan was made for another profile of this model: re-plan",
                    )
                pool = Pool(di, part.first_block, part.last_block, part.gpu, part.vgpu)
                for b in cands:
                    pool.infer_us[b] = prof.partition_latency_us(part.gpu, part.vgpu, b, part.first_block, part.last_block)
                if di < len(pp.partitions) - 1:
                    pool.out_bits = prof.cut_bytes(part.last_block) * 8.0
                places = sorted(by_pool.get((m.name, pi, di), []), key=lambda p: p.replica)
                if not places:
                    raise UserError(
                        f"model '{m.name}' pipeline {pi} partition {di}: the plan places no vGPU for this pool",
                        fix="re-run `ppipe plan` (it writes a placement) or add 'placement' rows for it",
                    )
                for pl in places:
                    if pl.server not in server_bw:
                        raise UserError(
                            f"placement of '{m.name}' pipeline {pi} partition {di}: server '{pl.server}' is not in "
                            f"cluster '{cluster.name}'",
                            fix="plan and serve with the same cluster file",
                        )
                    vid = pl.vgpu_id
                    if vid in topo.vgpus:
                        raise UserError(
                            f"placement: vGPU '{vid}' is placed twice (second time for '{m.name}' pipeline {pi} "
                            f"partition {di})",
                            fix="each (server, gpu_index, slot) may host one vGPU: re-run the placement",
                        )
                    up = topo.nic.setdefault(uplink(pl.server), ReservationTable(uplink(pl.server)))
                    down = topo.nic.setdefault(downlink(pl.server), ReservationTable(downlink(pl.server)))
                    g = VGpu(vid, pl.server, part.gpu, part.vgpu, up, down, server_bw[pl.server])
                    g.model, g.pipeline, g.partition = m.name, pi, di
                    topo.vgpus[vid] = g
                    g.pool = pool
                    pool.vgpus.append(g)
                # Deterministic tie-break: candidates are scanned in vGPU id order.
                pool.vgpus.sort(key=lambda g: g.id)
                pool.refresh()
                pipe.pools.append(pool)
            pipe.nominal_us = {b: sum(p.infer_us[b] for p in pipe.pools) for b in cands}
            pipe.planned_rps = pp.throughput_rps
            pipes.append(pipe)
        topo.pipelines[m.name] = pipes
        topo.input_us[m.name] = input_transfer_us(prof, pipes)
    return topo


def input_transfer_us(profile: ModelProfile, pipes: list[Pipeline]) -> float:
    """The time a batch's inputs take from the frontend to a first pool: the largest
    planned batch of samples of ``bits_in`` bits (the manifest's input shape and dtype; 0
    for a profile that names none) over the slowest NIC of the pipelines' first pools,
    ``b * bits_in / bw``."""
    t = profile.manifest.input
    bits = 0.0 if t is None else 8.0 * math.prod(t.shape) * np.dtype(t.dtype).itemsize
    return max((p.batches[0] * bits * 1e-3 / min(g.bw_gbps for g in p.pools[0].vgpus) for p in pipes), default=0.0)
