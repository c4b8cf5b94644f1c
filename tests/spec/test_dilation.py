"""A dilated plan is the same plan problem k times slower (ppipe.spec.dilation)."""

from __future__ import annotations

import pytest

from ppipe.runtime.launch.deploy import load_deployment
from ppipe.sim.simulator import SimConfig
from ppipe.sim.sweep import run_point
from ppipe.spec.dilation import save_dilated

K = 3.0


@pytest.fixture(scope="module")
def default(tmp_path_factory):
    from ppipe.planner.api import plan as make_plan

    path = tmp_path_factory.mktemp("default") / "plan.yaml"
    make_plan().save(path)
    return load_deployment(path)


@pytest.fixture(scope="module")
def slow(default, tmp_path_factory):
    return load_deployment(save_dilated(default.plan, default.profiles, default.cluster, K, tmp_path_factory.mktemp("slow")))


def test_latencies_and_slos_scale_up_and_rates_down_on_the_same_pipelines(default, slow):
    assert slow.cluster.name == f"{default.cluster.name}-x3" == slow.plan.cluster
    assert slow.plan.placement == default.plan.placement
    for fast_m, slow_m in zip(default.plan.models, slow.plan.models):
        assert slow_m.slo_ms == pytest.approx(K * fast_m.slo_ms)
        assert slow_m.throughput_rps == pytest.approx(fast_m.throughput_rps / K)
        for a, b in zip(fast_m.pipelines, slow_m.pipelines):
            assert (a.batch, len(a.partitions)) == (b.batch, len(b.partitions))
            for pa, pb in zip(a.partitions, b.partitions):
                assert (pa.first_block, pa.last_block, pa.gpu, pa.count) == (pb.first_block, pb.last_block, pb.gpu, pb.count)
                assert pb.infer_us == pytest.approx(K * pa.infer_us)
                assert pb.transfer_us == pytest.approx(K * pa.transfer_us)
        fast_p, slow_p = default.profiles[fast_m.name], slow.profiles[fast_m.name]
        gpu = fast_p.gpus()[0]
        assert slow_p.model_latency_us(gpu) == pytest.approx(K * fast_p.model_latency_us(gpu), rel=1e-6)
        assert slow_p.transfer_us_per_sample(0, 10.0) == pytest.approx(fast_p.transfer_us_per_sample(0, 10.0))
    for a, b in zip(default.cluster.servers, slow.cluster.servers):
        assert b.nic_bandwidth_gbps == pytest.approx(a.nic_bandwidth_gbps / K)


def test_without_host_margins_the_simulator_serves_the_dilated_plan_as_the_plan(default, slow):
    """With no dispatch lead and no answer budget every time of the data plane scales by k:
    the same requests (k times sparser) meet their deadlines or miss them alike."""
    def simulate(dep, load):
        rates = {m.name: load * m.throughput_rps for m in dep.plan.models}
        res = run_point(dep.plan, dep.profiles, dep.cluster, 1.0, rates_rps=rates, config=SimConfig(duration_s=3.0 * (K if dep is slow else 1), seed=3))
        return {m: (r.attainment, r.p50_latency_ms) for m, r in res.models.items()}

    for load in (0.3, 1.2):
        fast, dilated = simulate(default, load), simulate(slow, load)
        for m, (att, p50) in fast.items():
            assert dilated[m][0] == pytest.approx(att, abs=0.02), (m, load)
            assert dilated[m][1] == pytest.approx(K * p50, rel=0.05), (m, load)


def test_a_dilation_must_be_positive(default, tmp_path):
    with pytest.raises(ValueError, match="> 0"):
        save_dilated(default.plan, default.profiles, default.cluster, 0.0, tmp_path)
