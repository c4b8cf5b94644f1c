"""On small instances the MILP's optimum equals an exhaustive search's (no shared code)."""

from __future__ import annotations

import pytest

import ppipe
from planner_synth import brute_force_paper, brute_force_physical, cluster, plain_configs, profile

LEVELS = {"A": [1, 2], "B": [1]}
LAT_1 = {"A": [2000.0, 3000.0, 1000.0], "B": [3000.0, 9000.0, 1500.0]}
LAT_2 = {"A": [1500.0, 1000.0, 2500.0], "B": [2500.0, 2000.0, 8000.0]}


def _opts(**kw):
    # Exact solve; beta off so that the brute force sees the same latency rule.
    base = dict(gap=1e-9, batch_build=False, margin=0.2, time_limit_s=60)
    base.update(kw)
    return base


@pytest.mark.parametrize("slo_ms", [12.0, 20.0, 40.0])
def test_single_model_physical_matches_brute_force(slo_ms):
    cl = cluster({"A": 2, "B": 2}, LEVELS)
    m = profile("m1", LAT_1, [200_000, 100_000], LEVELS)
    plan = ppipe.plan(cl, [m], slo_ms=slo_ms, max_partitions=3, **_opts())
    cfgs = plain_configs(m, cl, slo_ms, 0.2, 3, LEVELS)
    want = brute_force_physical([cfgs], [1.0], {"A": 2, "B": 2}, LEVELS)
    assert plan.solver.status == "optimal"
    assert plan.solver.objective == pytest.approx(want, rel=1e-6)
    assert plan.models[0].throughput_rps == pytest.approx(want, rel=1e-6)


def test_two_models_max_min_physical_matches_brute_force():
    cl = cluster({"A": 2, "B": 2}, LEVELS)
    m1 = profile("m1", LAT_1, [200_000, 100_000], LEVELS)
    m2 = profile("m2", LAT_2, [50_000, 300_000], LEVELS)
    w = [1.0, 2.0]
    plan = ppipe.plan(cl, [m1, m2], slo_ms=25.0, weights=w, max_partitions=2, **_opts())
    want = brute_force_physical(
        [plain_configs(m, cl, 25.0, 0.2, 2, LEVELS) for m in (m1, m2)], w, {"A": 2, "B": 2}, LEVELS
    )
    assert plan.solver.objective == pytest.approx(want, rel=1e-6)
    got = min(m.throughput_rps / m.weight for m in plan.models)
    assert got >= want * (1 - 1e-6)


@pytest.mark.parametrize("slo_ms", [15.0, 30.0])
def test_paper_formulation_matches_brute_force(slo_ms):
    counts = {"A": 1, "B": 2}
    cl = cluster(counts, LEVELS)
    m = profile("m1", LAT_1, [200_000, 100_000], LEVELS)
    paper = ppipe.plan(cl, [m], slo_ms=slo_ms, max_partitions=2, formulation="ppipe-atc25", **_opts())
    want = brute_force_paper(plain_configs(m, cl, slo_ms, 0.2, 2, LEVELS), counts, 2)
    assert paper.settings.gpu_rule == "paper" and paper.settings.configs_per_template == "one"
    assert paper.solver.objective == pytest.approx(want, rel=1e-6)
    # The general formulation can only do at least as well on the same instance.
    general = ppipe.plan(cl, [m], slo_ms=slo_ms, max_partitions=2, **_opts())
    assert general.solver.objective >= paper.solver.objective * (1 - 1e-6)


def test_nic_cap_binds_in_brute_force_and_milp():
    # A tiny NIC makes the feature-map transfer the bottleneck of every split pipeline.
    cl = cluster({"A": 2, "B": 2}, LEVELS, gbps=0.05)
    m = profile("m1", LAT_1, [200_000, 100_000], LEVELS)
    plan = ppipe.plan(cl, [m], slo_ms=400.0, max_partitions=2, **_opts())
    want = brute_force_physical([plain_configs(m, cl, 400.0, 0.2, 2, LEVELS)], [1.0], {"A": 2, "B": 2}, LEVELS)
    assert plan.solver.objective == pytest.approx(want, rel=1e-6)


def test_paper_formulation_pipelines_with_one_type_in_two_slots_match_brute_force():
    # Here the authors' optimum runs A at level 1 and then A at level 2 in one pipeline:
    # without templates (A, A) the best plan is 490.48 req/s, with them 500.
    counts = {"A": 2, "B": 1}
    cl = cluster(counts, LEVELS)
    m = profile("m1", {"A": [1000.0, 6000.0, 500.0], "B": [3000.0, 1000.0, 3000.0]}, [50_000, 50_000], LEVELS)
    cfgs = plain_configs(m, cl, 10.0, 0.2, 2, LEVELS)
    want = brute_force_paper(cfgs, counts, 2)
    without = brute_force_paper([c for c in cfgs if c[0][0] != c[0][-1] or len(c[0]) == 1], counts, 2)
    assert want > without * (1 + 1e-3)
    plan = ppipe.plan(cl, [m], slo_ms=10.0, max_partitions=2, formulation="ppipe-atc25", **_opts())
    assert plan.solver.objective == pytest.approx(want, rel=1e-6)
    assert any(len({p.gpu for p in pipe.partitions}) < len(pipe.partitions) for pipe in plan.models[0].pipelines)


def test_a_plan_of_the_lp_relaxations_configurations_proven_by_the_cover_bound_is_within_the_gap():
    # Physical packing: the optimum over the configurations the LP relaxation uses is the
    # plan here, and the cover bound proves it without branch and bound.
    counts = {"A": 3, "B": 4}
    cl = cluster(counts, LEVELS)
    models = [profile("m1", LAT_1, [200_000, 100_000], LEVELS), profile("m2", LAT_2, [50_000, 300_000], LEVELS)]
    w = [1.0, 2.0]
    plan = ppipe.plan(cl, models, slo_ms=12.0, weights=w, max_partitions=2, **_opts(gap=1e-4))
    want = brute_force_physical([plain_configs(m, cl, 12.0, 0.2, 2, LEVELS) for m in models], w, counts, LEVELS)
    assert plan.solver.status == "optimal" and plan.solver.method == "LP-support incumbent + cover bound"
    assert want / (1 + 1e-4) <= plan.solver.objective <= want * (1 + 1e-9)
    assert min(m.throughput_rps / m.weight for m in plan.models) >= plan.solver.objective * (1 - 1e-9)
