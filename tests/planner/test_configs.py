"""Pruning of dominated configurations (ppipe.planner.configs)."""

from __future__ import annotations

import pytest

import ppipe
from planner_synth import brute_force_paper, cluster, plain_configs, profile
from ppipe.planner.configs import ModelSpec, enumerate_configs

LEVELS = {"A": [1, 2, 3], "B": [1]}
LAT = {"A": [2000.0, 3000.0, 1000.0], "B": [3000.0, 9000.0, 1500.0]}


def _configs(across_levels: bool, slo_ms: float = 40.0):
    cl = cluster({"A": 1, "B": 2}, LEVELS)
    spec = ModelSpec(profile=profile("m1", LAT, [200_000, 100_000], LEVELS), slo_ms=slo_ms)
    return enumerate_configs(
        0, spec, cl, max_partitions=2, margin=0.2, levels=LEVELS, group_by_multiset=False, across_levels=across_levels
    )


def _key(cs, c):
    n = int(cs.nparts[c])
    return (int(cs.template[c]), tuple(cs.first[c, :n]), tuple(cs.level[c, :n]), int(cs.batch[c]))


def test_across_levels_drops_only_configurations_a_kept_one_dominates_by_shares():
    same, across = _configs(False), _configs(True)
    kept = {_key(across, c) for c in range(len(across))}
    dropped = [c for c in range(len(same)) if _key(same, c) not in kept]
    assert len(across) + len(dropped) == len(same) and dropped  # a subset, and the rule fires here
    for c in dropped:
        n = int(same.nparts[c])
        witnesses = [
            d for d in range(len(across))
            if across.template[d] == same.template[c]
            and all(across.level[d, s] % same.level[c, s] == 0 for s in range(n))
            and all(across.level[d, s] // same.level[c, s] * across.X[d, s] >= same.X[c, s] for s in range(n))
        ]
        assert witnesses, f"configuration {_key(same, c)} dropped without a dominating one kept"


def test_across_levels_is_refused_with_multisets():
    with pytest.raises(ValueError, match="across_levels"):
        from ppipe.planner.configs import pareto_keep

        pareto_keep(_configs(False), group_by_multiset=True, across_levels=True)


@pytest.mark.parametrize("slo_ms", [15.0, 30.0])
def test_paper_optimum_with_levels_1_to_3_matches_brute_force(slo_ms):
    # The brute force lists every configuration, dominated ones included.
    counts = {"A": 1, "B": 2}
    cl = cluster(counts, LEVELS)
    m = profile("m1", LAT, [200_000, 100_000], LEVELS)
    plan = ppipe.plan(cl, [m], slo_ms=slo_ms, max_partitions=2, formulation="ppipe-atc25", gap=1e-9,
                      batch_build=False, margin=0.2, time_limit_s=60)
    want = brute_force_paper(plain_configs(m, cl, slo_ms, 0.2, 2, LEVELS), counts)
    assert plan.solver.objective == pytest.approx(want, rel=1e-6)
