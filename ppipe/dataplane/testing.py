"""Small hand-built worlds for tests of the data plane and its drivers.

Builds a :class:`ClusterSpec`, :class:`ModelProfile` and :class:`Plan` in code (no files),
plus a :class:`ManualClock` whose time the test sets. Used by ``tests/dataplane`` and
usable by the simulator's and runtime's tests.

Example::

    cluster = toy_cluster([("a", "A", 1, 3, 8.0)])           # servers a-0, a-1, a-2
    prof = toy_profile("m", {"A": [100.0, 200.0]}, out_bytes=[1000, 10])
    plan = toy_plan(cluster, [ToyModel("m", slo_ms=5.0, pipelines=[
        ToyPipeline(batch=2, partitions=[
            ToyPartition(0, 0, "A", 1, [("a-0", 0, 0)]),
            ToyPartition(1, 1, "A", 1, [("a-1", 0, 0), ("a-2", 0, 0)]),
        ])])])
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

from ppipe.spec.cluster import ClusterSpec, GpuType, ServerGroup
from ppipe.spec.plan import ModelPlan, PartitionPlan, PipelinePlan, Plan, PlanSettings, SolverReport, VgpuPlacement
from ppipe.spec.profile import BlockSpec, ModelManifest, ModelProfile, SourceSpec


class ManualClock:
    """A clock the caller moves. ``call_at`` only records timers (sorted by time, then order)."""

    def __init__(self, t_us: float = 0.0) -> None:
        self.t_us = float(t_us)
        self._timers: list[tuple[float, int, Callable[[], None]]] = []
        self._seq = 0

    def now_us(self) -> float:
        return self.t_us

    def call_at(self, t_us: float, fn: Callable[[], None]) -> Any:
        heapq.heappush(self._timers, (t_us, self._seq, fn))
        self._seq += 1
        return self._seq - 1

    def advance_to(self, t_us: float) -> None:
        """Move time forward (never back), firing due timers in (time, order) order."""
        while self._timers and self._timers[0][0] <= t_us:
            t, _s, fn = heapq.heappop(self._timers)
            self.t_us = max(self.t_us, t)
            fn()
        self.t_us = max(self.t_us, float(t_us))


def toy_cluster(
    groups: Sequence[tuple[str, str, int, int, float]], efficiency: float = 1.0, name: str = "toy"
) -> ClusterSpec:
    """Cluster from ``(group, gpu_type, gpus_per_server, count, nic_gbps)`` rows."""
    types = sorted({g[1] for g in groups})
    return ClusterSpec(
        name=name,
        bandwidth_efficiency=efficiency,
        gpu_types=[GpuType(name=t, vgpu_levels=[1, 2, 3, 4]) for t in types],
        servers=[
            ServerGroup(name=n, gpu_type=t, gpus_per_server=k, count=c, nic_bandwidth_gbps=bw) for n, t, k, c, bw in groups
        ],
    )


def toy_profile(
    name: str,
    block_us: dict[str, Sequence[float]],
    out_bytes: Sequence[int],
    batches: Sequence[int] = (1, 2, 4, 8),
    levels: Sequence[int] = (1,),
    batch_cost: float = 0.5,
    level_cost: float = 1.0,
    latency: Callable[[str, int, int, int], float] | None = None,
) -> ModelProfile:
    """A profile: per GPU type the batch-1 latency of each block (us) at level 1.

    Latency at batch b and level v: ``base * (1 + batch_cost * (b - 1)) * (1 + level_cost * (v - 1))``
    unless ``latency(gpu, v, b, block)`` is given.
    """
    n = len(out_bytes)
    manifest = ModelManifest(
        name=name,
        source=SourceSpec(kind="synthetic"),
        blocks=[BlockSpec(index=i, out_bytes_per_sample=int(out_bytes[i])) for i in range(n)],
        latency_bs1_us={g: float(sum(v)) for g, v in block_us.items()},
    )
    table: dict[tuple[str, int, int, int], float] = {}
    for gpu, lat in block_us.items():
        if len(lat) != n:
            raise ValueError(f"{gpu}: {len(lat)} block latencies for {n} blocks")
        for v in levels:
            for b in batches:
                for i in range(n):
                    table[(gpu, v, b, i)] = (
                        latency(gpu, v, b, i)
                        if latency
                        else lat[i] * (1 + batch_cost * (b - 1)) * (1 + level_cost * (v - 1))
                    )
    return ModelProfile(manifest=manifest, table=table)


@dataclass
class ToyPartition:
    first_block: int
    last_block: int
    gpu: str
    vgpu: int
    vgpus: list[tuple[str, int, int]]  # (server, gpu_index, slot) per replica


@dataclass
class ToyPipeline:
    batch: int
    partitions: list[ToyPartition]


@dataclass
class ToyModel:
    name: str
    slo_ms: float
    pipelines: list[ToyPipeline] = field(default_factory=list)
    weight: float = 1.0


def toy_plan(cluster: ClusterSpec, models: Sequence[ToyModel]) -> Plan:
    """A Plan with the given pipelines and placement (latency fields are informational)."""
    mplans = []
    placement = []
    for m in models:
        pplans = []
        for pi, p in enumerate(m.pipelines):
            parts = [
                PartitionPlan(
                    first_block=q.first_block,
                    last_block=q.last_block,
                    gpu=q.gpu,
                    vgpu=q.vgpu,
                    count=len(q.vgpus),
                    infer_us=0.0,
                    throughput_rps=0.0,
                )
                for q in p.partitions
            ]
            pplans.append(PipelinePlan(batch=p.batch, throughput_rps=0.0, latency_us=0.0, partitions=parts))
            for di, q in enumerate(p.partitions):
                for ri, (server, gidx, slot) in enumerate(q.vgpus):
                    placement.append(
                        VgpuPlacement(
                            model=m.name, pipeline=pi, partition=di, replica=ri, server=server, gpu_index=gidx, vgpu=q.vgpu, slot=slot
                        )
                    )
        mplans.append(
            ModelPlan(name=m.name, profile=m.name, slo_ms=m.slo_ms, weight=m.weight, throughput_rps=0.0, pipelines=pplans)
        )
    return Plan(
        cluster=cluster.name,
        settings=PlanSettings(planner="toy", formulation="ppipe", gpu_rule="physical", objective="none", margin=0.0, max_partitions=3),
        solver=SolverReport(name="none", status="heuristic", seconds=0.0, objective=0.0),
        models=mplans,
        placement=placement,
    )


# The paper's Fig. 5: pool 1 = {node 1}, pool 2 = {node 2, node 3}, every GPU on its own
# server. Block 0 takes 100 us, block 1 200 us at batch 1 (x1.5 at batch 2, x2.5 at 4);
# the cut after block 0 is 10 kB per sample: 10 us per sample at 8 Gbit/s.
FIG5_NODES = ("n-0/gpu0/s0", "n-1/gpu0/s0", "n-2/gpu0/s0")


def fig5_world(slo_ms: float = 5.0, batch: int = 4, policy: str = "reservation", batches: Sequence[int] = (1, 2, 4), **options: Any):
    """The Fig. 5 pipeline as (scheduler, ManualClock); ``options`` go to build_scheduler."""
    from ppipe.dataplane import build_scheduler

    cluster = toy_cluster([("n", "A", 1, 3, 8.0)])
    prof = toy_profile("m", {"A": [100.0, 200.0]}, out_bytes=[10_000, 10], batches=batches)
    plan = toy_plan(
        cluster,
        [
            ToyModel(
                "m",
                slo_ms,
                [
                    ToyPipeline(
                        batch,
                        [ToyPartition(0, 0, "A", 1, [("n-0", 0, 0)]), ToyPartition(1, 1, "A", 1, [("n-1", 0, 0), ("n-2", 0, 0)])],
                    )
                ],
            )
        ],
    )
    clock = ManualClock()
    return build_scheduler(plan, {"m": prof}, cluster, clock, policy=policy, **options), clock


def replay(
    scheduler: Any,
    clock: ManualClock,
    requests: Sequence[Any],
    *,
    jitter: float = 0.0,
    seed: int = 0,
    failures: Sequence[tuple[float, str]] = (),
    switches: Sequence[tuple[float, Callable[[], Any]]] = (),
) -> tuple[list[Any], dict[int, tuple]]:
    """Drive a scheduler through ``requests`` with a minimal event loop (not the simulator).

    Events, in time order (ties: failures, arrivals, reports, timers): arrivals are
    submitted; every dispatched stage is reported at its planned start plus the delays of
    the stages before it, lasting its planned time times ``1 + jitter * u`` (u uniform in
    [0, 1), seeded); transfers are reported as planned; WakeAt become timers. No NIC or
    vGPU contention is modelled: the scheduler's own plan is taken as the truth.
    ``switches``: at each time, ``scheduler.switch(make())`` (a
    :class:`~ppipe.dataplane.handover.SwitchingScheduler` moving to a new plan's scheduler).

    Returns:
        (every decision in order, {request id: ("dispatched", planned finish, deadline) or
        ("dropped", reason)}); a later in-flight drop overrides "dispatched", and so does a
        later one-stage dispatch of the same request (its planned finish is then that of
        the last stage dispatched so far).
    """
    import random

    from ppipe.dataplane.api import Dispatch, Drop, StageReport, WakeAt

    rnd = random.Random(seed)
    ev: list = []
    seq = 0
    for r in requests:
        heapq.heappush(ev, (r.arrival_us, 1, seq, "arrive", r))
        seq += 1
    for t, vid in failures:
        heapq.heappush(ev, (t, 0, seq, "fail", vid))
        seq += 1
    for t, make in switches:
        heapq.heappush(ev, (t, 0, seq, "switch", make))
        seq += 1
    log: list[Any] = []
    outcome: dict[int, tuple] = {}

    def apply(decisions: list[Any]) -> None:
        nonlocal seq
        for d in decisions:
            log.append(d)
            if isinstance(d, Dispatch):
                shift = 0.0
                for st in d.stages:
                    dur = st.infer_us * (1.0 + jitter * rnd.random())
                    start = st.start_us + shift
                    shift += dur - st.infer_us
                    te = None if st.transfer_start_us is None else st.transfer_start_us + st.transfer_us
                    rep = StageReport(d.batch_id, st.partition, st.vgpu_id, start, start + dur, st.transfer_start_us, te)
                    heapq.heappush(ev, (start + dur, 2, seq, "report", rep))
                    seq += 1
                for r in d.requests:
                    # A dispatch that starts past partition 0 continues its requests (per-pool policies).
                    if r.id in outcome and not (d.stages[0].partition > 0 and outcome[r.id][0] == "dispatched"):
                        raise AssertionError(f"request {r.id} decided twice: {outcome[r.id]} then dispatched")
                    outcome[r.id] = ("dispatched", d.finish_us, r.deadline_us)
            elif isinstance(d, Drop):
                outcome[d.request.id] = ("dropped", d.reason)
            elif isinstance(d, WakeAt):
                if d.t_us < clock.now_us() - 1e-6:
                    raise AssertionError(f"WakeAt {d.t_us} is in the past (now {clock.now_us()})")
                heapq.heappush(ev, (d.t_us, 3, seq, "wake", None))
                seq += 1

    while ev:
        t, _p, _s, kind, x = heapq.heappop(ev)
        clock.t_us = max(clock.t_us, t)
        if kind == "arrive":
            apply(scheduler.submit(x))
        elif kind == "wake":
            apply(scheduler.wake())
        elif kind == "report":
            apply(scheduler.report(x))
        elif kind == "switch":
            apply(scheduler.switch(x()).decisions)
        else:
            apply(scheduler.mark_failed(x))
    return log, outcome
