"""The plan compiled for the hot path: pools of vGPUs, latency arrays, NIC tables.

The scheduler never touches pydantic objects while deciding. :func:`compile_plan` reads
the :class:`~ppipe.spec.plan.Plan`, the model profiles and the cluster once and builds
plain ``__slots__`` objects:

* a :class:`VGpu` per placed vGPU (``VgpuPlacement.vgpu_id``), holding its own reservation
  table and references to its server's uplink and downlink tables and bandwidth;
* a :class:`Pool` per partition: its vGPUs sorted by id (the deterministic tie-break),
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
from typing import Mapping

from ppipe.dataplane.api import downlink, uplink, vgpu_resource
from ppipe.dataplane.tables import ReservationTable
from ppipe.errors import UserError
from ppipe.spec.cluster import ClusterSpec
from ppipe.spec.plan import Plan
from ppipe.spec.profile import ModelProfile


_NEG_INF = float("-inf")


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
    fresh entry when a table may have become *less* busy (feedback, release).
    """

    __slots__ = (
        "index", "first_block", "last_block", "gpu", "level", "vgpus", "infer_us", "out_bits", "servers",
        "max_bw_gbps", "heap", "by_id",
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
        self.by_id: dict[str, VGpu] = {}

    def refresh(self) -> None:
        """Recompute derived sets after vGPUs were added or removed."""
        self.servers = frozenset(g.server for g in self.vgpus)
        self.max_bw_gbps = max((g.bw_gbps for g in self.vgpus), default=0.0)
        self.by_id = {g.id: g for g in self.vgpus}
        self.heap = [(g.table.busy_until(), g.id) for g in self.vgpus]
        heapq.heapify(self.heap)

    def touch(self, g: VGpu) -> None:
        """Note that ``g``'s table changed in a way that may make it free earlier."""
        heapq.heappush(self.heap, (g.table.busy_until(), g.id))
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
                heapq.heapreplace(heap, (cur, vid))
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
        self.batches: tuple[int, ...] = ()  # usable batch sizes <= planned, descending
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
    return topo
