"""Pruning of dominated configurations (ppipe.planner.configs)."""

from __future__ import annotations

import itertools

import numpy as np
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


def _physical(prune: bool):
    levels = {"A": [1, 2, 3], "B": [1, 2]}
    cl = cluster({"A": 2, "B": 2}, levels)
    lat = {"A": [2000.0, 3000.0, 1000.0], "B": [3000.0, 9000.0, 1500.0]}
    spec = ModelSpec(profile=profile("m1", lat, [200_000, 100_000], levels), slo_ms=60.0)
    return enumerate_configs(0, spec, cl, max_partitions=3, margin=0.2, levels=levels, group_by_multiset=True, prune=prune)


def _replaces(i, j) -> bool:
    """Physical packing: i's slots map one-to-one into j's with the same type and either the
    same level and X_i >= X_j, or j's level 1, i's level r and r X_i >= X_j."""
    (ti, li, xi), (tj, lj, xj) = i, j
    for perm in itertools.permutations(range(len(tj)), len(ti)):
        if all(
            ti[s] == tj[t] and (li[s] == lj[t] or lj[t] == 1) and (li[s] if lj[t] == 1 else 1) * xi[s] >= xj[t]
            for s, t in zip(range(len(ti)), perm)
        ):
            return True
    return False


def test_physical_pruning_drops_only_configurations_a_kept_one_dominates():
    every, kept = _physical(prune=False), _physical(prune=True)

    def slots(cs, c):
        n = int(cs.nparts[c])
        return (tuple(cs.gpu[c, :n]), tuple(cs.level[c, :n]), tuple(cs.X[c, :n]))

    kept_keys = {_key(kept, c): slots(kept, c) for c in range(len(kept))}
    # Two consecutive slots of one (type, level) are dropped by another rule (the mediant).
    def repeated(c):
        g, lv = every.gpu[c], every.level[c]
        return any(g[d] == g[d + 1] and lv[d] == lv[d + 1] for d in range(int(every.nparts[c]) - 1))

    dropped = [c for c in range(len(every)) if _key(every, c) not in kept_keys and not repeated(c)]
    survivors = list(kept_keys.values())
    # The rules across multisets fire here: a shorter or a higher-level configuration is the only witness.
    assert any(all(len(w[0]) < every.nparts[c] or w[1] != slots(every, c)[1] for w in survivors if _replaces(w, slots(every, c)))
               for c in dropped)
    for c in dropped:
        assert any(_replaces(w, slots(every, c)) for w in survivors), f"configuration {_key(every, c)} dropped without a witness"


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
    want = brute_force_paper(plain_configs(m, cl, slo_ms, 0.2, 2, LEVELS), counts, 2)
    assert plan.solver.objective == pytest.approx(want, rel=1e-6)


def _one_type(slo_ms: float, lat_us: list[float], authors: bool, margin: float = 0.5, per_server: int = 1):
    levels = {"A": [1, 2]}
    cl = cluster({"A": 2}, levels, per_server=per_server)
    spec = ModelSpec(profile=profile("m1", {"A": lat_us}, [1000] * (len(lat_us) - 1), levels, batches=(1,)), slo_ms=slo_ms)
    return enumerate_configs(
        0, spec, cl, max_partitions=1, margin=margin, levels=levels, group_by_multiset=False, prune=False,
        authors_arithmetic=authors,
    )


def test_authors_arithmetic_rounds_the_margin_to_whole_microseconds():
    # T = 10001 us, margin 0.5: the authors keep round(5000.5) = 5000 us (Python rounds
    # half to even), so 5001 us fit; T (1 - margin) = 5000.5 us does not.
    fits = _one_type(10.001, [2000.0, 3001.0], authors=True)
    plain = _one_type(10.001, [2000.0, 3001.0], authors=False)
    assert list(fits.level[:, 0]) == [1] and len(plain) == 0


def test_authors_arithmetic_caps_a_missing_nic_side_at_a_1_us_transfer():
    # Blocks of 1 us: one vGPU would run 500 k req/s at level 1; ilp_v4.py caps it at
    # 1e6 / (1 us * v * s_k) req/s (the first partition's input, the last one's output).
    authors = _one_type(1000.0, [1.0, 1.0], authors=True, per_server=2)
    plain = _one_type(1000.0, [1.0, 1.0], authors=False, per_server=2)
    for cs in (authors, plain):
        assert sorted(cs.level[:, 0]) == [1, 2]
    cap = {int(v): 1e6 / (1.0 * v * 2) for v in authors.level[:, 0]}
    assert all(x == pytest.approx(min(cap[int(v)], xp)) for x, v, xp in zip(authors.X[:, 0], authors.level[:, 0], plain.X[:, 0]))
    assert (authors.X[:, 0] < plain.X[:, 0]).any()


def test_whole_gpu_estimate_is_the_authors_single_model_formula():
    # Per type: the largest batch whose whole-model latency + round(margin T) < T, on every
    # GPU of the type; x_hat = sum_k N_k b_k 1e6 / L_k(b_k).
    from ppipe.planner.baselines import whole_gpu_estimate

    levels = {"A": [1], "B": [1]}
    cl = cluster({"A": 2, "B": 3}, levels)
    m = profile("m1", {"A": [1000.0, 1000.0], "B": [4000.0, 4000.0]}, [1000], levels, batches=(1, 2, 3))
    # Latency of batch b: 2000 (0.6 + 0.4 b) us on A, 8000 (0.6 + 0.4 b) us on B. T = 10 ms,
    # margin 0.2 (2000 us): A's batches 1..3 (2000, 2800, 3600 us) stay below T, B's batch 1
    # reaches it (8000 + 2000 us), so B adds nothing.
    got = whole_gpu_estimate(ModelSpec(profile=m, slo_ms=10.0), cl, 0.2)
    assert got == pytest.approx(2 * 3 * 1e6 / 3600.0)


def test_every_feasible_configuration_comes_out_once_with_its_template_latency_and_x():
    # Three types, one with fewer levels than the others (its level axis is padded), three
    # partitions: the vectorized enumeration against plain loops (planner_synth.plain_configs).
    levels = {"A": [1, 2], "B": [1], "C": [1, 2, 3]}
    lat = {"A": [2000.0, 3000.0, 1000.0, 500.0], "B": [3000.0, 9000.0, 1500.0, 800.0], "C": [1200.0, 900.0, 2500.0, 700.0]}
    cl = cluster({"A": 2, "B": 2, "C": 2}, levels)
    prof = profile("m1", lat, [200_000, 100_000, 50_000], levels)
    cs = enumerate_configs(0, ModelSpec(profile=prof, slo_ms=60.0), cl, max_partitions=3, margin=0.2, levels=levels,
                           group_by_multiset=False, prune=False)
    types = [g.name for g in cl.gpu_types]
    got = []
    for c in range(len(cs)):
        n = int(cs.nparts[c])
        tmpl = tuple(types[k] for k in cs.templates[cs.template[c]])
        assert tmpl == tuple(types[k] for k in cs.gpu[c, :n])
        got.append((tmpl, tuple((types[cs.gpu[c, d]], int(cs.level[c, d]), round(float(cs.X[c, d]), 6)) for d in range(n))))
    want = [(t, tuple((k, v, round(x, 6)) for k, v, x in slots)) for t, slots in plain_configs(prof, cl, 60.0, 0.2, 3, levels)]
    assert sorted(got) == sorted(want) and len(got) == len(set(got)) > 100
    assert list(cs.template) == sorted(cs.template)  # in the order of templates_for


def test_the_grouped_dominance_keeps_exactly_the_rows_no_earlier_ranked_row_dominates():
    from ppipe.planner.configs import _undominated

    rng = np.random.default_rng(7)
    X = rng.integers(0, 4, size=(600, 3)).astype(float)  # many ties
    X[rng.random(600) < 0.3, 2] = 0.0
    lat = rng.integers(0, 3, size=600).astype(float)
    group = rng.integers(0, 40, size=600)
    keep = _undominated(X, lat, group)
    order = np.lexsort((lat, -X[:, 2], -X[:, 1], -X[:, 0]))
    rank = np.empty(600, int)
    rank[order] = np.arange(600)
    for j in range(600):
        dominated = any(group[i] == group[j] and rank[i] < rank[j] and (X[i] >= X[j]).all() for i in range(600))
        assert keep[j] == (not dominated)


def test_the_cover_test_across_multisets_is_the_same_in_one_step_or_many():
    from ppipe.planner.configs import _covered

    rng = np.random.default_rng(3)

    def rows(n, owners):
        gpu = rng.integers(0, 2, size=(n, 2))
        gpu[rng.random(n) < 0.3, 1] = -1
        level = np.where(gpu >= 0, rng.integers(1, 3, size=(n, 2)), 0)
        X = np.where(gpu >= 0, rng.integers(1, 5, size=(n, 2)).astype(float), 0.0)
        return gpu, level, X, rng.integers(0, owners, size=n)

    r, by = rows(300, 50), rows(200, 1)
    one = _covered(r, by)
    assert np.array_equal(one, _covered(r, by, max_pairs=7)) and one.size > 0

    def sig(gpu, level, X, i):  # (sorted (code, X) slots) of row i
        return sorted(((g + 1) * 5 + lv if g >= 0 else 10**9, -x) for g, lv, x in zip(gpu[i], level[i], X[i]))

    want = set()
    for i in range(300):
        a = sig(*r[:3], i)
        for j in range(200):
            b = sig(*by[:3], j)
            if [c for c, _ in a] == [c for c, _ in b] and all(-xb >= -xa for (_, xa), (_, xb) in zip(a, b)):
                want.add(int(r[3][i]))
    assert set(one.tolist()) == want
