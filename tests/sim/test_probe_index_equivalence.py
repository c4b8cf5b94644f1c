"""The data plane's shortcuts take the same decisions as the plain algorithm.

``Pool.scan_set`` only narrows which vGPUs a probe visits. With it switched off (every
probe scans every vGPU, as before the index), the same seeded run must produce the same
records, request for request and stage for stage: NIC contention, jitter with feedback
correction, and failures included. Likewise for step 1's skipping of pipelines that
cannot beat the best so far (``batching._first_pool_wait``).
"""

from __future__ import annotations

import pytest

from ppipe.dataplane.testing import ToyModel, ToyPartition, ToyPipeline, toy_cluster, toy_plan, toy_profile
from ppipe.dataplane import reservation
from ppipe.dataplane.topology import Pool
from ppipe.sim import SimConfig, run_point


def _fingerprint(res):
    recs = [(r.id, r.dispatch_us, tuple(r.batch_ids), r.completion_us, r.drop_reason, r.drop_where) for r in res.records]
    bats = [
        (b.batch_id, b.pipeline, b.request_ids, tuple((s.vgpu_id, s.planned_start_us, s.start_us, s.end_us, s.transfer_start_us) for s in b.stages))
        for b in res.batches
    ]
    return recs, bats


def _both(monkeypatch, run):
    out = []
    for indexed in (True, False):
        with monkeypatch.context() as m:
            m.setattr(reservation, "_INDEX_MIN_VGPUS", 1)  # every pool uses the index, small ones too
            if not indexed:
                m.setattr(Pool, "scan_set", lambda self, tau, l_i, limit: None)
            out.append(run())
    return out


@pytest.mark.parametrize("jitter_cv,feedback", [(0.0, "changed"), (0.25, "all")])
def test_toy_world_same_records_with_and_without_the_index(monkeypatch, jitter_cv, feedback):
    cluster = toy_cluster([("a", "A", 2, 4, 8.0), ("b", "B", 4, 3, 8.0)])
    prof = toy_profile("m", {"A": [100.0, 300.0], "B": [120.0, 290.0]}, out_bytes=[20_000, 10], batches=(1, 2, 4))
    pool0 = [(f"a-{i // 2}", i % 2, 0) for i in range(8)]
    pool1 = [(f"b-{i // 4}", i % 4, 0) for i in range(12)]
    plan = toy_plan(cluster, [ToyModel("m", 4.0, [ToyPipeline(2, [ToyPartition(0, 0, "A", 1, pool0), ToyPartition(1, 1, "B", 1, pool1)])])])
    cfg = SimConfig(duration_s=0.05, seed=5, jitter_cv=jitter_cv, feedback=feedback, failures=((0.02, "b-1/gpu2/s0"),))
    a, b = _both(monkeypatch, lambda: run_point(plan, {"m": prof}, cluster, 1.0, rates_rps={"m": 45_000.0}, config=cfg))
    assert _fingerprint(a) == _fingerprint(b)
    assert len(a.records) > 1500 and a.dispatches > 500
    assert 0.0 < a.attainment < 1.0  # loaded enough that pools queue and some requests miss


@pytest.mark.artifact
def test_real_plan_same_records_with_and_without_the_index(monkeypatch, artifact_dir):
    """efficientnet-b8 on HC1-L (a 75-vGPU pool) at load 1.0, the speed benchmark's case."""
    import ppipe
    from ppipe.spec.artifact import load_artifact_model
    from ppipe.spec.cluster import load_cluster

    prof = load_artifact_model(artifact_dir, "efficientnet-b8_3rdparty_8xb32-aa-advprop_in1k")
    cluster = load_cluster("HC1-L")
    plan = ppipe.plan(cluster, [prof], formulation="ppipe-atc25", slo_ms=5 * prof.manifest.latency_bs1_us["L4"] / 1e3,
                      margin=0.4, max_partitions=2)
    assert max(p.count for m in plan.models for pp in m.pipelines for p in pp.partitions) >= 30
    cfg = SimConfig(duration_s=0.3, seed=2, jitter_cv=0.1, feedback="changed")
    a, b = _both(monkeypatch, lambda: run_point(plan, {prof.name: prof}, cluster, 1.0, config=cfg))
    assert _fingerprint(a) == _fingerprint(b)
    assert a.dispatches > 300


@pytest.mark.parametrize("jitter_cv,feedback", [(0.0, "changed"), (0.25, "all")])
def test_step1_skips_probes_without_changing_a_decision(monkeypatch, jitter_cv, feedback):
    """Algorithm 1's step 1 does not probe a pipeline whose first pool alone waits at least
    as long as the best so far (batching._first_pool_wait). Six one-vGPU-per-pool pipelines
    (DART-r's shape), the first pools the bottleneck, loaded: same records as probing every pipeline, fewer probes."""
    from ppipe.dataplane import batching

    cluster = toy_cluster([("a", "A", 2, 3, 8.0), ("b", "B", 4, 2, 8.0)])
    prof = toy_profile("m", {"A": [150.0, 300.0], "B": [30.0, 60.0]}, out_bytes=[100, 10], batches=(1, 2, 4))
    pipes = [
        ToyPipeline(1, [ToyPartition(0, 0, "A", 1, [(f"a-{i // 2}", i % 2, 0)]), ToyPartition(1, 1, "B", 1, [(f"b-{i // 4}", i % 4, 0)])])
        for i in range(6)
    ]
    plan = toy_plan(cluster, [ToyModel("m", 4.0, pipes)])
    cfg = SimConfig(duration_s=0.05, seed=5, jitter_cv=jitter_cv, feedback=feedback, failures=((0.03, "b-1/gpu1/s0"),))
    run = lambda: run_point(plan, {"m": prof}, cluster, 1.0, rates_rps={"m": 38_000.0}, config=cfg)  # noqa: E731
    skipping = run()
    with monkeypatch.context() as m:
        m.setattr(batching, "_first_pool_wait", lambda p, bs, now: 0.0)  # never skip
        probing_all = run()
    assert _fingerprint(skipping) == _fingerprint(probing_all)
    assert skipping.dispatches > 1000 and skipping.attainment > 0.8  # ~95 % of the first pools' capacity, a failure, jitter
    assert skipping.probes_per_dispatch < 0.6 * probing_all.probes_per_dispatch
