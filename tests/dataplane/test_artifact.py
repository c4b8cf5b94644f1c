"""The data plane on a real profile (PPipe artifact): latencies, transfers, a replayed trace."""

import random

import pytest

from ppipe.dataplane import Dispatch, Request, build_scheduler
from ppipe.dataplane.testing import ManualClock, ToyModel, ToyPartition, ToyPipeline, replay, toy_plan
from ppipe.spec.cluster import load_cluster
from ppipe.spec.profile import load_profile

pytestmark = pytest.mark.artifact
MODEL = "googlenet-v3-pytorch"


@pytest.fixture(scope="module")
def world(artifact_profiles):
    prof = load_profile(artifact_profiles[MODEL])
    cluster = load_cluster("HC2-S")  # l4-0 (4 x L4), t4-0..t4-5 (2 x T4 each), 10 Gbit/s effective
    # blocks 0-4 on 4 L4 vGPUs at level 2 (2 GPUs of l4-0), blocks 5-9 on 6 whole T4s
    l4 = [("l4-0", g, s) for g in (0, 1) for s in (0, 1)]
    t4 = [(f"t4-{i}", g, 0) for i in range(3) for g in (0, 1)]
    nominal = prof.partition_latency_us("L4", 2, 2, 0, 4) + prof.partition_latency_us("T4", 1, 2, 5, 9)
    slo_ms = 3 * nominal / 1000.0
    plan = toy_plan(cluster, [ToyModel(MODEL, slo_ms, [ToyPipeline(2, [ToyPartition(0, 4, "L4", 2, l4), ToyPartition(5, 9, "T4", 1, t4)])])])
    return plan, prof, cluster, slo_ms


def test_probe_uses_profile_latencies_and_cut_bytes(world):
    plan, prof, cluster, slo_ms = world
    s = build_scheduler(plan, {MODEL: prof}, cluster, ManualClock())
    pipe = s.topology.pipelines[MODEL][0]
    assert pipe.batches == (2, 1)
    r = s.probe(pipe, 2)
    h0, h1 = r.hops
    assert h0.infer_us == prof.partition_latency_us("L4", 2, 2, 0, 4)
    assert h1.infer_us == prof.partition_latency_us("T4", 1, 2, 5, 9)
    bw = cluster.effective_bandwidth_gbps("T4")
    assert h1.transfer_us == pytest.approx(2 * prof.transfer_us_per_sample(4, bw))
    assert h1.uses_nic and r.finish == pytest.approx(h0.infer_us + h1.transfer_us + h1.infer_us)


@pytest.mark.parametrize("policy", ["reservation", "reactive"])
def test_replayed_poisson_trace_resolves_every_request(world, policy):
    plan, prof, cluster, slo_ms = world
    clock = ManualClock()
    s = build_scheduler(plan, {MODEL: prof}, cluster, clock, policy=policy)
    rnd = random.Random(7)
    reqs, t = [], 0.0
    for i in range(600):
        t += rnd.expovariate(1 / 2500.0)  # 400 req/s
        reqs.append(Request(i, MODEL, t, t + slo_ms * 1000.0))
    log, outcome = replay(s, clock, reqs, jitter=0.2, seed=3)
    assert len(outcome) == 600
    dispatched = [o for o in outcome.values() if o[0] == "dispatched"]
    assert len(dispatched) > 300
    if policy == "reservation":
        assert all(f <= dl + 1e-6 for _k, f, dl in dispatched)
        for tab in s.topology.all_tables():
            tab.check()
    used = {st.vgpu_id for d in log if isinstance(d, Dispatch) for st in d.stages}
    assert len(used) > 4  # load spreads over the pools
    assert s.stats()["inflight"] == 0
