"""Tiny hand-built cluster/profile/plan and a fake scheduler, so the simulator is tested
without the real data plane (its own tests cover it; ``test_end_to_end`` runs both)."""

from __future__ import annotations

from ppipe.dataplane.api import Dispatch, Drop, DropReason, Reservation, Stage, StageReport, WakeAt
from ppipe.spec.cluster import ClusterSpec
from ppipe.spec.plan import ModelPlan, PartitionPlan, PipelinePlan, Plan, PlanSettings, SolverReport, VgpuPlacement
from ppipe.spec.profile import BlockSpec, ModelManifest, ModelProfile, SourceSpec

# Model "tiny": block 0 then block 1. Cut after block 0: 1250 bytes/sample = 1 us at 10 Gbit/s.
# Latencies (us): on B (slow) block 0 = 1000 at batch 1; on A (fast) block 1 = 400.
LAT = {("A", 1, b, 0): 300.0 * b for b in (1, 2)}
LAT.update({("A", 1, b, 1): 400.0 * b for b in (1, 2)})
LAT.update({("B", 1, b, 0): 1000.0 * b for b in (1, 2)})
LAT.update({("B", 1, b, 1): 1500.0 * b for b in (1, 2)})
SLO_MS = 5.0


def tiny_cluster() -> ClusterSpec:
    return ClusterSpec(
        name="tiny",
        gpu_types=[dict(name="A", vgpu_levels=[1]), dict(name="B", vgpu_levels=[1])],
        servers=[
            dict(name="a", gpu_type="A", gpus_per_server=1, count=1, nic_bandwidth_gbps=10),
            dict(name="b", gpu_type="B", gpus_per_server=1, count=2, nic_bandwidth_gbps=10),
        ],
    )


def tiny_profile(name: str = "tiny") -> ModelProfile:
    manifest = ModelManifest(
        name=name,
        source=SourceSpec(kind="synthetic"),
        blocks=[BlockSpec(index=0, out_bytes_per_sample=1250), BlockSpec(index=1, out_bytes_per_sample=0)],
        latency_bs1_us={"A": 700.0, "B": 2500.0},
    )
    return ModelProfile(manifest=manifest, table=dict(LAT))


def tiny_plan(profile_path: str = "tiny", slo_ms: float = SLO_MS) -> Plan:
    """Block 0 on two B vGPUs (b-0, b-1), block 1 on one A vGPU (a-0): ~1000 req/s planned."""
    parts = [
        PartitionPlan(first_block=0, last_block=0, gpu="B", vgpu=1, count=2, infer_us=1000, transfer_us=1, throughput_rps=2000),
        PartitionPlan(first_block=1, last_block=1, gpu="A", vgpu=1, count=1, infer_us=400, throughput_rps=2500),
    ]
    pipe = PipelinePlan(batch=1, throughput_rps=2000, latency_us=1401, template=["B", "A"], partitions=parts)
    placement = [
        VgpuPlacement(model="tiny", pipeline=0, partition=0, replica=i, server=f"b-{i}", gpu_index=0, vgpu=1, slot=0)
        for i in range(2)
    ] + [VgpuPlacement(model="tiny", pipeline=0, partition=1, replica=0, server="a-0", gpu_index=0, vgpu=1, slot=0)]
    return Plan(
        cluster="tiny",
        settings=PlanSettings(planner="ppipe", formulation="ppipe", gpu_rule="physical", objective="max-min", margin=0.4, max_partitions=2),
        solver=SolverReport(name="none", status="heuristic", seconds=0.0, objective=2000.0),
        models=[ModelPlan(name="tiny", profile=profile_path, slo_ms=slo_ms, weight=1.0, throughput_rps=2000, pipelines=[pipe])],
        gpus_used={"A": 1, "B": 2},
        placement=placement,
    )


class FakeScheduler:
    """FIFO, batch 1, dispatch at once on the earliest-free vGPU of each pool; drop when late.

    It keeps its own estimate of when each vGPU and link is free (the plan), and takes
    reports as the truth (free = max(estimate, reported end)). Enough to drive the simulator.
    """

    def __init__(self, plan, profiles, cluster, clock, wait_us: float = 0.0):
        self.clock = clock
        self.plan = plan
        self.free: dict[str, float] = {}
        self.link: dict[str, float] = {}
        self.pools = []
        m = plan.models[0]
        for k, part in enumerate(m.pipelines[0].partitions):
            self.pools.append([(p.vgpu_id, p.server) for p in plan.placements_of(m.name, 0, k)])
        self.parts = m.pipelines[0].partitions
        self.next_id = 0
        self.probe_calls = 0
        self.reports: list[StageReport] = []
        self.wait_us = wait_us
        self.queue = []

    def submit(self, request):
        if self.wait_us:
            self.queue.append(request)
            return [WakeAt(self.clock.now_us() + self.wait_us)]
        return self._dispatch(request)

    def wake(self):
        out = []
        now = self.clock.now_us()
        while self.queue and self.queue[0].arrival_us + self.wait_us <= now:
            out += self._dispatch(self.queue.pop(0))
        return out

    def _dispatch(self, request):
        self.probe_calls += 1
        now = self.clock.now_us()
        t = now
        stages, res = [], []
        prev_server = None
        for k, (part, pool) in enumerate(zip(self.parts, self.pools)):
            vgpu, server = min(pool, key=lambda vs: (self.free.get(vs[0], 0.0), vs[0]))
            tr_start, tr = None, 0.0
            if k > 0:
                tr = self.parts[k - 1].transfer_us
                tr_start = max(t, self.link.get("up:" + prev_server, 0.0), self.link.get("down:" + server, 0.0))
                t = tr_start + tr
            start = max(t, self.free.get(vgpu, 0.0))
            stages.append(Stage(k, vgpu, server, part.first_block, part.last_block, tr_start, tr, start, part.infer_us))
            t = start + part.infer_us
            prev_server = server
        if t > request.deadline_us:
            return [Drop(request, DropReason.DEADLINE_UNREACHABLE, "fake: late")]
        for s, prev in zip(stages, [None] + stages[:-1]):
            self.free[s.vgpu_id] = s.end_us
            res.append(Reservation("vgpu:" + s.vgpu_id, s.start_us, s.infer_us))
            if prev is not None:
                self.link["up:" + prev.server] = self.link["down:" + s.server] = s.transfer_start_us + s.transfer_us
        self.next_id += 1
        return [Dispatch(self.next_id, request.model, 0, (request,), tuple(stages), tuple(res))]

    def report(self, rep):
        self.reports.append(rep)
        self.free[rep.vgpu_id] = max(self.free.get(rep.vgpu_id, 0.0), rep.end_us)
        return []

    def mark_failed(self, vgpu_id):
        for pool in self.pools:
            pool[:] = [vs for vs in pool if vs[0] != vgpu_id]
        return []
