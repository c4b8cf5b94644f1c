"""The split search (ppipe.planner.split_search) is exact for its restriction, never beats
the MILP, and its plan is a feasible MIP start that leaves the optimum unchanged."""

from __future__ import annotations

import itertools

import numpy as np
import pytest

import ppipe
from planner_synth import cluster, plain_configs, profile
from ppipe.planner.api import usable_levels
from ppipe.planner.configs import ModelSpec
from ppipe.planner.core import is_feasible, model_configs, split_start
from ppipe.planner.formulation import build
from ppipe.planner.objectives import MaxMinNormalized
from ppipe.planner.solvers import HighsSolver
from ppipe.planner.split_search import split_search, start_vector

LEVELS = {"A": [1, 2], "B": [1, 2]}
LAT_1 = {"A": [2000.0, 3000.0, 1000.0], "B": [3000.0, 9000.0, 1500.0]}
LAT_2 = {"A": [1500.0, 1000.0, 2500.0], "B": [2500.0, 2000.0, 8000.0]}
LAT_3 = {"A": [900.0, 4000.0, 700.0], "B": [1200.0, 2500.0, 3000.0]}


def _restricted_value(cfgs, counts: dict[str, int], authors_D: int | None = None) -> dict[tuple[int, ...], float]:
    """Brute force of the restriction for ONE model: every template gets at most one
    configuration and whole GPUs per slot, no GPU shared; value per GPU vector (A, B).
    Templates are the configurations' type tuples, or with ``authors_D`` the authors'
    tuples of D types, each open to the configurations whose types start it."""
    types = list(counts)
    per_t: dict[tuple, dict[tuple[int, ...], float]] = {}
    for tmpl, slots in cfgs:
        homes = [tmpl] if authors_D is None else [t for t in itertools.product(types, repeat=authors_D) if t[: len(tmpl)] == tmpl]
        for home in homes:
            _best_of(per_t.setdefault(home, {}), slots, counts, types)
    return _knapsack(per_t, counts, types)


def _best_of(best, slots, counts, types) -> None:
    """Record in ``best`` (GPUs per type -> req/s) one configuration on whole GPUs per slot."""
    for u in itertools.product(*[range(1, counts[k] + 1) for k, _v, _x in slots]):
        use = [0] * len(types)
        for (k, _v, _x), ud in zip(slots, u):
            use[types.index(k)] += ud
        if any(a > counts[k] for a, k in zip(use, types)):
            continue
        thr = min(x * v * ud for (_k, v, x), ud in zip(slots, u))
        key = tuple(use)
        best[key] = max(best.get(key, 0.0), thr)


def _knapsack(per_t, counts, types):
    """Value per GPU vector of at most one option per template (a group knapsack)."""
    grid = list(itertools.product(*[range(counts[k] + 1) for k in types]))
    # Templates one by one: best[use] = the best throughput with exactly `use` GPUs.
    best_use = {tuple([0] * len(types)): 0.0}
    for options in per_t.values():
        new = dict(best_use)
        for use0, thr0 in best_use.items():
            for use1, thr1 in options.items():
                use = tuple(a + b for a, b in zip(use0, use1))
                if all(a <= counts[k] for a, k in zip(use, types)) and thr0 + thr1 > new.get(use, -1.0):
                    new[use] = thr0 + thr1
        best_use = new
    return {r: max(t for u, t in best_use.items() if all(a <= b for a, b in zip(u, r))) for r in grid}


def _specs_configs(models, cl, slo_ms, D, *, gpu_rule="paper", one=True, weights=None):
    weights = weights or [1.0] * len(models)
    specs = [ModelSpec(profile=m, slo_ms=slo_ms, weight=w) for m, w in zip(models, weights)]
    configs = model_configs(
        specs, cl, [usable_levels(m, cl) for m in models], max_partitions=D, margin=0.2,
        group_by_multiset=(gpu_rule == "physical" and not one),
    )
    return specs, configs


@pytest.mark.parametrize("D", [2, 3])
@pytest.mark.parametrize("slo_ms", [15.0, 30.0])
def test_split_search_equals_brute_force_of_its_restriction(D, slo_ms):
    counts = {"A": 2, "B": 3}
    cl = cluster(counts, LEVELS)
    models = [profile("m1", LAT_1, [200_000, 100_000], LEVELS), profile("m2", LAT_2, [50_000, 300_000], LEVELS)]
    w = [1.0, 1.7]
    specs, configs = _specs_configs(models, cl, slo_ms, D, weights=w)
    got = split_search(configs, w, np.array([2, 3]))
    values = [_restricted_value(plain_configs(m, cl, slo_ms, 0.2, D, LEVELS), counts) for m in models]
    want = 0.0
    for r1 in values[0]:
        r2 = (counts["A"] - r1[0], counts["B"] - r1[1])
        want = max(want, min(values[0][r1] / w[0], values[1][r2] / w[1]))
    assert got is not None
    assert got.objective == pytest.approx(want, rel=1e-6)
    # The split is within the cluster and each model's pipelines fit its GPU vector.
    assert all(sum(g[k] for g in got.gpus) <= c for k, c in enumerate([2, 3]))
    for m, cs in enumerate(configs):
        use = np.zeros(2, int)
        for p in got.pipelines[m]:
            for d, u in enumerate(p.gpus):
                use[cs.gpu[p.config, d]] += u
        assert (use <= np.array(got.gpus[m])).all()


@pytest.mark.parametrize("slo_ms", [15.0, 30.0])
def test_split_search_with_the_authors_templates_equals_brute_force_of_its_restriction(slo_ms):
    # One configuration per template of D types: a single-partition one competes with the
    # two-partition ones for the templates that start with its type. m2 is too slow on B
    # for its SLO: it runs on A alone, single-partition or A -> A.
    counts = {"A": 2, "B": 3}
    cl = cluster(counts, LEVELS)
    slow_b = {"A": LAT_2["A"], "B": [40_000.0, 40_000.0, 40_000.0]}
    models = [profile("m1", LAT_1, [200_000, 100_000], LEVELS), profile("m2", slow_b, [50_000, 300_000], LEVELS)]
    w = [1.0, 1.7]
    _specs, configs = _specs_configs(models, cl, slo_ms, 2, weights=w)
    got = split_search(configs, w, np.array([2, 3]), paper_templates=True)
    values = [_restricted_value(plain_configs(m, cl, slo_ms, 0.2, 2, LEVELS), counts, authors_D=2) for m in models]
    want = max(
        min(values[0][r1] / w[0], values[1][(counts["A"] - r1[0], counts["B"] - r1[1])] / w[1]) for r1 in values[0]
    )
    assert got is not None and got.objective == pytest.approx(want, rel=1e-6)


def test_three_models_split_search_equals_brute_force_of_its_restriction():
    # Three models: the last two are searched as pairs of minimal points (_last_pair).
    counts = {"A": 2, "B": 3}
    cl = cluster(counts, LEVELS)
    models = [profile(n, lat, [200_000, 100_000], LEVELS) for n, lat in (("m1", LAT_1), ("m2", LAT_2), ("m3", LAT_3))]
    w = [0.3, 0.33, 0.37]
    _specs, configs = _specs_configs(models, cl, 25.0, 2, weights=w)
    got = split_search(configs, w, np.array([2, 3]))
    values = [_restricted_value(plain_configs(m, cl, 25.0, 0.2, 2, LEVELS), counts) for m in models]
    want = 0.0
    for r1 in values[0]:
        for r2 in values[1]:
            r3 = (counts["A"] - r1[0] - r2[0], counts["B"] - r1[1] - r2[1])
            if min(r3) >= 0:
                want = max(want, min(values[0][r1] / w[0], values[1][r2] / w[1], values[2][r3] / w[2]))
    assert got is not None and want > 0
    assert got.objective == pytest.approx(want, rel=1e-6)


@pytest.mark.parametrize("n", [25, 127, 128, 40000])
def test_last_pair_finds_a_fitting_pair_exactly_when_one_exists(n):
    # Random upward-closed sets on a 2-type grid, checked against all pairs; n picks the
    # integer type of the scan (int8, int16, int64).
    import ppipe.planner.split_search as ss

    rng = np.random.default_rng(n)
    counts = np.array([n, 3])
    for _ in range(20):
        sets = []
        for _k in range(3):
            s_ = np.zeros((n + 1, 4), bool)
            for _p in range(3):
                a, b = rng.integers(0, n + 1), rng.integers(0, 4)
                s_[a:, b:] = True
            sets.append(s_)
        A, B, C = sets
        got = ss._last_pair(A, B, C, counts)
        pts = [(b, c) for b in ss.minimal_points(B) for c in ss.minimal_points(C)
               if (counts - b - c >= 0).all() and A[tuple(counts - b - c)]]
        assert (got is not None) == bool(pts)
        if got is not None:
            left = counts - got[0] - got[1]
            assert B[tuple(got[0])] and C[tuple(got[1])] and (left >= 0).all() and A[tuple(left)]


@pytest.mark.parametrize("gpu_rule,one", [("paper", True), ("physical", True), ("physical", False)])
def test_split_search_never_beats_the_milp_and_its_start_is_feasible(gpu_rule, one):
    cl = cluster({"A": 4, "B": 4}, LEVELS, per_server=2)
    N = np.array([cl.gpu_counts[g.name] for g in cl.gpu_types])
    models = [profile(n, lat, [200_000, 100_000], LEVELS) for n, lat in (("m1", LAT_1), ("m2", LAT_2), ("m3", LAT_3))]
    w = [0.3, 0.33, 0.37]
    specs, configs = _specs_configs(models, cl, 25.0, 2, gpu_rule=gpu_rule, one=one, weights=w)
    milp, v = build(specs, configs, cl, gpu_rule=gpu_rule, one_config_per_template=one)
    MaxMinNormalized().apply(milp, v)
    sp = split_search(configs, w, N)
    assert sp is not None
    x = start_vector(sp, v, milp.num_cols, v.extra["z"])
    assert is_feasible(milp, x)
    assert x[v.extra["z"]] == pytest.approx(sp.objective)
    exact = HighsSolver().solve(milp, gap=1e-9, time_limit_s=60)
    assert exact.status == "optimal"
    assert sp.objective <= exact.objective * (1 + 1e-9)
    # With the start, the solver reaches the same optimum.
    started = HighsSolver().solve(milp, gap=1e-9, time_limit_s=60, start=x)
    assert started.status == "optimal" and started.objective == pytest.approx(exact.objective, rel=1e-9)


def test_is_feasible_rejects_a_broken_start():
    counts = {"A": 2, "B": 2}
    cl = cluster(counts, LEVELS)
    specs, configs = _specs_configs([profile("m1", LAT_1, [200_000, 100_000], LEVELS)], cl, 25.0, 2)
    milp, v = build(specs, configs, cl, gpu_rule="paper", one_config_per_template=True)
    MaxMinNormalized().apply(milp, v)
    x = split_start(configs, specs, cl, milp, v, None).x
    assert x is not None and is_feasible(milp, x)
    bad = x.copy()
    bad[v.extra["z"]] *= 1.5  # more than the model carries: breaks c3_maxmin
    assert not is_feasible(milp, bad)
    bad = x.copy()
    bad[v.gpus["A"]] += 0.5  # not an integer
    assert not is_feasible(milp, bad)


def test_split_search_gives_up_on_a_grid_too_large(monkeypatch):
    import ppipe.planner.split_search as ss

    counts = {"A": 2, "B": 2}
    cl = cluster(counts, LEVELS)
    specs, configs = _specs_configs([profile("m1", LAT_1, [200_000, 100_000], LEVELS)], cl, 25.0, 2)
    monkeypatch.setattr(ss, "MAX_GRID", 8)  # 3 x 3 GPU vectors > 8
    assert ss.split_search(configs, [1.0], np.array([2, 2])) is None


def test_split_search_out_of_time_in_the_bisection_returns_its_best_level_so_far(monkeypatch):
    """Anytime: a budget that ends during the bisection still yields a plan (the best
    reachable level so far, at most the full search's), not None."""
    import ppipe.planner.split_search as ss

    cl = cluster({"A": 4, "B": 4}, LEVELS, per_server=2)
    models = [profile(n, lat, [200_000, 100_000], LEVELS) for n, lat in (("m1", LAT_1), ("m2", LAT_2), ("m3", LAT_3))]
    w = [0.3, 0.33, 0.37]
    _specs, configs = _specs_configs(models, cl, 25.0, 2, weights=w)
    N = np.array([4, 4])
    full = ss.split_search(configs, w, N)
    assert full is not None

    class Ticks:  # each reading of the clock is one "second" later
        t = 0.0

        def perf_counter(self):
            self.t += 1.0
            return self.t

    # Readings: t0, one after the model tables, then one per halving: the budget allows 3 halvings.
    monkeypatch.setattr(ss, "time", Ticks())
    cut = ss.split_search(configs, w, N, time_budget_s=1 + 3.5)
    assert cut is not None
    assert 0 < cut.objective <= full.objective * (1 + 1e-9)
    assert all(sum(g[k] for g in cut.gpus) <= N[k] for k in range(2))


def test_plan_with_and_without_the_start_has_the_same_optimum(monkeypatch):
    import ppipe.planner.core as core

    counts = {"A": 3, "B": 3}
    cl = cluster(counts, LEVELS)
    models = [profile("m1", LAT_1, [200_000, 100_000], LEVELS), profile("m2", LAT_2, [50_000, 300_000], LEVELS)]
    kw = dict(slo_ms=25.0, weights=[1.0, 2.0], max_partitions=2, batch_build=False, margin=0.2, gap=1e-9,
              formulation="ppipe-atc25", place=False)
    assert core.SPLIT_SEARCH_MIN_TYPES["paper"] == 2  # this cluster has 2 types: the start serves ppipe-atc25
    starts = []
    real = core.split_start

    def counted(*a, **k):
        start = real(*a, **k)
        starts.append(start.x)
        return start

    monkeypatch.setattr(core, "split_start", counted)
    with_start = ppipe.plan(cl, models, **kw)
    assert starts and starts[-1] is not None, "the start was never made"
    monkeypatch.setattr(core, "split_start", lambda *a, **k: core.Start())
    without = ppipe.plan(cl, models, **kw)
    assert with_start.solver.status == without.solver.status == "optimal"
    assert with_start.solver.objective == pytest.approx(without.solver.objective, rel=1e-7)  # HiGHS row tolerance 1e-6


def test_two_types_get_the_start_under_the_papers_rule_only():
    import ppipe.planner.core as core

    cl = cluster({"A": 3, "B": 3}, LEVELS)
    specs = [None, None]  # only their number counts
    assert core.wants_split_start(MaxMinNormalized(), HighsSolver(), specs, cl, "paper")
    assert not core.wants_split_start(MaxMinNormalized(), HighsSolver(), specs, cl, "physical")


def test_three_types_two_models_start_is_used_and_never_beats_the_milp():
    import ppipe.planner.core as core

    levels = {"A": [1, 2], "B": [1, 2], "C": [1]}
    lat1 = {"A": [2000.0, 3000.0, 1000.0], "B": [3000.0, 9000.0, 1500.0], "C": [2500.0, 5000.0, 2000.0]}
    lat2 = {"A": [1500.0, 1000.0, 2500.0], "B": [2500.0, 2000.0, 8000.0], "C": [1800.0, 1500.0, 4000.0]}
    cl = cluster({"A": 2, "B": 2, "C": 3}, levels)
    models = [profile("m1", lat1, [200_000, 100_000], levels), profile("m2", lat2, [50_000, 300_000], levels)]
    w = [1.0, 1.5]
    specs, configs = _specs_configs(models, cl, 25.0, 2, weights=w)
    assert core.wants_split_start(MaxMinNormalized(), HighsSolver(), specs, cl, "paper")
    assert not core.wants_split_start(MaxMinNormalized(), HighsSolver(), specs[:1], cl, "paper")
    milp, v = build(specs, configs, cl, gpu_rule="paper", one_config_per_template=True)
    MaxMinNormalized().apply(milp, v)
    x = split_start(configs, specs, cl, milp, v, None).x
    assert x is not None and is_feasible(milp, x)
    exact = HighsSolver().solve(milp, gap=1e-9, time_limit_s=60)
    assert exact.status == "optimal" and x[v.extra["z"]] <= exact.objective * (1 + 1e-9)
    plan = ppipe.plan(cl, models, slo_ms=25.0, weights=w, max_partitions=2, batch_build=False, margin=0.2, gap=1e-9,
                      formulation="ppipe-atc25", place=False)
    assert plan.solver.status == "optimal" and plan.solver.objective == pytest.approx(exact.objective, rel=1e-7)


@pytest.mark.parametrize("narrow", [None, 1.0])
@pytest.mark.parametrize("seed", range(16))
def test_best_level_equals_brute_force_over_every_split(seed, narrow, monkeypatch):
    # The bisection (with its jump to a split's own level and its try of the next level
    # above it) against every split of a small grid, on random monotone tables. Half of
    # them hold values within 0.2 % of each other, where the bracket gets narrow while
    # values still lie inside it: there the next level is tried, and its failure ends the
    # search. With ``narrow`` = 1 the next level is tried from the first reachable level
    # on, so that every step of that climb is checked too.
    import ppipe.planner.split_search as ss
    from ppipe.planner.split_search import _best_level

    if narrow is not None:
        monkeypatch.setattr(ss, "NARROW", narrow)

    rng = np.random.default_rng(seed)
    counts = np.array([3, 4, 2])
    M = 2 + seed % 2
    clustered = seed % 4 >= 2
    w = np.full(M, rng.uniform(0.5, 1.0)) if clustered else rng.uniform(0.2, 1.0, M)
    tables = []
    for _ in range(M):
        t = rng.uniform(0, 1 if clustered else 10, size=tuple(counts + 1))
        for ax in range(3):
            t = np.maximum.accumulate(t, axis=ax)
        if clustered:
            t = np.where(t > 0.3, 10 * (1 + 0.002 * t), 0.0)
        t[0, 0, 0] = 0.0
        tables.append(t.astype(np.float32))
    grid = [np.array(r) for r in itertools.product(*[range(c + 1) for c in counts])]
    want = 0.0
    for rs in itertools.product(grid, repeat=M - 1):
        last = counts - sum(rs)
        if (last < 0).any():
            continue
        split = list(rs) + [last]
        want = max(want, min(float(t[tuple(r)]) / wm for t, wm, r in zip(tables, w, split)))
    lo, split = _best_level(tables, w, counts)
    assert lo == pytest.approx(want, rel=1e-6)
    assert split is not None and (sum(np.asarray(r) for r in split) <= counts).all()
    assert min(float(t[tuple(np.asarray(r))]) / wm for t, wm, r in zip(tables, w, split)) == pytest.approx(want, rel=1e-6)
