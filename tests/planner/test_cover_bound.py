"""The cover bound (ppipe.planner.bounds) is a valid upper bound, and the prover path keeps optima exact."""

from __future__ import annotations

import itertools
import math

import numpy as np
import pytest

import ppipe
import ppipe.planner.core as core
from planner_synth import brute_force_paper, brute_force_physical, cluster, plain_configs, profile
from ppipe.planner.api import usable_levels
from ppipe.planner.bounds import CoverBound, cover_table, pipeline_patterns
from ppipe.planner.configs import ModelSpec
from ppipe.planner.core import model_configs

LEVELS = {"A": [1, 2], "B": [1]}
LAT_1 = {"A": [2000.0, 3000.0, 1000.0], "B": [3000.0, 9000.0, 1500.0]}
LAT_2 = {"A": [1500.0, 1000.0, 2500.0], "B": [2500.0, 2000.0, 8000.0]}


def test_cover_table_is_the_least_cost_cover():
    rng = np.random.default_rng(7)
    for _ in range(20):
        n = int(rng.integers(1, 5))
        bins = rng.integers(1, 7, size=n)
        cost = rng.uniform(0.5, 5.0, size=n)
        J = 14
        C, choice, kept = cover_table(bins, cost, J)
        for j in range(J + 1):
            # Brute force over multisets: at most ceil(j / b) copies of a pattern matter.
            best = math.inf
            for counts in itertools.product(*[range(-(-j // int(b)) + 1) for b in bins]):
                if sum(c * b for c, b in zip(counts, bins)) >= j:
                    best = min(best, sum(c * k for c, k in zip(counts, cost)))
            assert C[j] == pytest.approx(best, rel=1e-12), (bins, cost, j)
        # The recorded choices rebuild a cover of that cost.
        j, total, covered = J, 0.0, 0
        while j > 0:
            i = kept[choice[j]]
            total += cost[i]
            covered += bins[i]
            j -= bins[i]
        assert covered >= J and total == pytest.approx(C[J])


def test_patterns_are_the_fewest_vgpus_for_their_throughput():
    cl = cluster({"A": 2, "B": 2}, LEVELS)
    m = profile("m1", LAT_1, [200_000, 100_000], LEVELS)
    spec = ModelSpec(profile=m, slo_ms=40.0)
    (cs,) = model_configs([spec], cl, [usable_levels(m, cl)], max_partitions=2, margin=0.2, group_by_multiset=False)
    counts = np.array([2.0, 2.0])
    value, share = pipeline_patterns(cs, counts, 2)
    mu = np.array([1.0, 0.37])
    cost = share @ mu
    for c in range(len(cs)):
        n = int(cs.nparts[c])
        X, k, v = cs.X[c, :n], cs.gpu[c, :n], cs.level[c, :n]
        ranges = [range(1, int(counts[k[d]] * v[d]) + 1) for d in range(n)]
        for g in itertools.product(*ranges):
            x = min(X[d] * g[d] for d in range(n))
            own = sum(mu[k[d]] * g[d] / v[d] for d in range(n))
            # Some pattern gives at least this throughput for at most this price.
            assert ((value >= x * (1 - 1e-12)) & (cost <= own + 1e-12)).any(), (c, g)


def _bound(models, weights, cl, *, gpu_rule, one, D, num_bins=5000):
    specs = [ModelSpec(profile=m, slo_ms=slo, weight=w) for (m, slo), w in zip(models, weights)]
    configs = model_configs(
        specs, cl, [usable_levels(s.profile, cl) for s in specs], max_partitions=D, margin=0.2,
        group_by_multiset=(gpu_rule == "physical" and not one),
    )
    counts = np.array([cl.gpu_counts[g.name] for g in cl.gpu_types], dtype=float)
    return lambda z_max: CoverBound(configs, weights, counts, z_max=z_max, num_bins=num_bins)


def _two_models(num_bins=5000):
    """(the cover bound's maker, the brute-force optimum) of two models on 2 + 2 GPUs, physical packing."""
    counts = {"A": 2, "B": 2}
    cl = cluster(counts, LEVELS)
    m1 = profile("m1", LAT_1, [200_000, 100_000], LEVELS)
    m2 = profile("m2", LAT_2, [50_000, 300_000], LEVELS)
    w = [1.0, 2.0]
    want = brute_force_physical([plain_configs(m, cl, 25.0, 0.2, 2, LEVELS) for m in (m1, m2)], w, counts, LEVELS)
    return _bound([(m1, 25.0), (m2, 25.0)], w, cl, gpu_rule="physical", one=False, D=2, num_bins=num_bins), want


def test_the_coarse_tables_price_no_higher_than_the_fine_ones():
    # The price search starts on coarse tables, whose bins round each pattern's throughput
    # up further: their priced demand never exceeds the fine tables', so a proof found on
    # them is a proof. And the two-step search still proves just above the optimum.
    make, want = _two_models(num_bins=50_000)
    b = make(want * 2)
    assert b.Jc < b.J
    rng = np.random.default_rng(0)
    for _ in range(20):
        mu, T = rng.uniform(0.1, 1.0, 2), want * rng.uniform(0.5, 1.5)
        coarse, fine = b._priced(mu, T, coarse=True)[0], b._priced(mu, T)[0]
        assert coarse <= fine + 1e-9
    assert not b.refutes(want) and b.refutes(want * 1.5)


@pytest.mark.parametrize("slo_ms", [12.0, 20.0, 40.0])
def test_bound_never_refutes_the_physical_optimum(slo_ms):
    counts = {"A": 2, "B": 2}
    cl = cluster(counts, LEVELS)
    m = profile("m1", LAT_1, [200_000, 100_000], LEVELS)
    want = brute_force_physical([plain_configs(m, cl, slo_ms, 0.2, 3, LEVELS)], [1.0], counts, LEVELS)
    make = _bound([(m, slo_ms)], [1.0], cl, gpu_rule="physical", one=False, D=3)
    b = make(want * 2)
    assert not b.refutes(want)
    assert b.refutes(want * 1.5)  # far above the optimum the bound does refute


@pytest.mark.parametrize("slo_ms", [15.0, 30.0])
@pytest.mark.parametrize("counts", [{"A": 1, "B": 2}, {"A": 2, "B": 1}])
def test_bound_never_refutes_the_paper_optimum(slo_ms, counts):
    cl = cluster(counts, LEVELS)
    m = profile("m1", LAT_1, [200_000, 100_000], LEVELS)
    want = brute_force_paper(plain_configs(m, cl, slo_ms, 0.2, 2, LEVELS), counts, 2)
    make = _bound([(m, slo_ms)], [1.0], cl, gpu_rule="paper", one=True, D=2)
    assert not make(want * 2).refutes(want)


def test_bound_never_refutes_a_two_model_optimum():
    make, want = _two_models()
    assert not make(want * 2).refutes(want)


@pytest.fixture
def prover_at_once(monkeypatch):
    # Ask the cover bound from the first incumbent on, so that small models take that path too.
    monkeypatch.setattr(core, "PROVER_AFTER_POLLS", 0)


@pytest.mark.parametrize("formulation", ["ppipe", "ppipe-atc25"])
def test_prover_path_keeps_the_brute_force_optimum(prover_at_once, formulation):
    counts = {"A": 2, "B": 2}
    cl = cluster(counts, LEVELS)
    m1 = profile("m1", LAT_1, [200_000, 100_000], LEVELS)
    m2 = profile("m2", LAT_2, [50_000, 300_000], LEVELS)
    w = [1.0, 2.0]
    plan = ppipe.plan(cl, [m1, m2], slo_ms=25.0, weights=w, max_partitions=2, formulation=formulation,
                      batch_build=False, margin=0.2, gap=1e-4, time_limit_s=60)
    if formulation == "ppipe":
        want = brute_force_physical([plain_configs(m, cl, 25.0, 0.2, 2, LEVELS) for m in (m1, m2)], w, counts, LEVELS)
        assert plan.solver.objective == pytest.approx(want, rel=1e-4)
        assert plan.solver.objective <= want * (1 + 1e-6)
    assert plan.solver.status == "optimal" and plan.solver.gap <= 1e-4


def test_a_prover_that_refutes_stops_the_search_with_its_method(monkeypatch):
    # The built-in default instance (HC2-S, three models) takes HiGHS seconds to prove alone;
    # a prover that says yes must stop it at the first incumbent it is asked about.
    asked = []

    class Yes:
        method = "test prover"

        def __init__(self, *args, **kwargs):
            pass

        def __call__(self, T, bound):
            asked.append((T, bound))
            return True

    monkeypatch.setattr(core, "Prover", Yes)
    # Without the LP relaxation's start, which the prover would prove before HiGHS runs.
    monkeypatch.setattr(core, "_lp_support_attempt", lambda *args, **kw: (core.Start(), None))
    plan = ppipe.plan(place=False)
    assert asked, "the prover was never asked"
    T, bound = asked[-1]
    s = plan.solver
    assert s.status == "optimal" and s.method == "highs incumbent + test prover"
    # The reported gap is what the prover's answer proves: nothing reaches T.
    assert T <= s.objective * (1 + 1e-4) * (1 + 1e-12)
    assert s.gap == pytest.approx(max(0.0, T / s.objective - 1.0))
    assert bound >= s.objective * (1 - 1e-9)


class _RefutesFrom:
    """A stand-in cover bound that refutes every level from ``level`` up."""

    level = math.inf

    def __init__(self, *args, **kwargs):
        pass

    def refutes(self, T):
        return T >= self.level


def test_prover_keeps_the_looser_level_it_proves_and_answers_no(monkeypatch):
    cl = cluster({"A": 2, "B": 2}, LEVELS)
    inc = 1000.0
    monkeypatch.setattr(_RefutesFrom, "level", inc * (1 + 5e-4))
    monkeypatch.setattr(core, "CoverBound", _RefutesFrom)
    prover = core.Prover([], [], cl, gap=1e-4)
    assert not prover(inc * (1 + 1e-4), inc * 1.01)  # the requested gap is not proven ...
    assert prover.weak == (pytest.approx(inc * (1 + core.FALLBACK_GAP)), "cover bound")  # ... the looser one is
    # No fallback when the requested gap is already that loose, or HiGHS's bound is below it.
    loose = core.Prover([], [], cl, gap=core.FALLBACK_GAP)
    assert not loose(inc * (1 + 1e-4), inc * 1.01) and loose.weak is None
    tight = core.Prover([], [], cl, gap=1e-4)
    assert not tight(inc * (1 + 1e-4), inc * (1 + 5e-4)) and tight.weak is None


@pytest.mark.parametrize("refuted_from, kept", [(2e-2, 3e-2), (5e-2, 1e-1), (0.2, None)])
def test_prover_climbs_the_cover_bounds_ladder_to_the_first_level_it_refutes(monkeypatch, refuted_from, kept):
    cl = cluster({"A": 2, "B": 2}, LEVELS)
    inc = 1000.0
    monkeypatch.setattr(_RefutesFrom, "level", inc * (1 + refuted_from))
    monkeypatch.setattr(core, "CoverBound", _RefutesFrom)
    prover = core.Prover([], [], cl, gap=1e-4)
    assert not prover(inc * (1 + 1e-4), inc * 2)
    assert prover.weak == (None if kept is None else (pytest.approx(inc * (1 + kept)), "cover bound"))
    # A level at or above HiGHS's own bound needs no proof: the ladder stops below it.
    capped = core.Prover([], [], cl, gap=1e-4)
    assert not capped(inc * (1 + 1e-4), inc * (1 + 2e-2)) and capped.weak is None


def test_a_plan_stopped_by_its_time_limit_reports_the_gap_a_looser_proof_gives(monkeypatch):
    from dataclasses import replace

    from ppipe.planner.objectives import MaxMinNormalized
    from ppipe.planner.solvers import HighsSolver

    counts = {"A": 2, "B": 2}
    cl = cluster(counts, LEVELS)
    models = [profile("m1", LAT_1, [200_000, 100_000], LEVELS), profile("m2", LAT_2, [50_000, 300_000], LEVELS)]
    specs = [ModelSpec(profile=m, slo_ms=25.0, weight=w) for m, w in zip(models, (1.0, 2.0))]
    class OutOfTime:
        name, accepts_prover, accepts_start = "highs", True, False

        def solve(self, milp, *, time_limit_s=None, gap=1e-4, prover=None, prover_after_polls=0, **kw):
            res = HighsSolver().solve(milp, gap=1e-9)  # the real plan; only the time limit is pretended
            monkeypatch.setattr(_RefutesFrom, "level", res.objective * (1 + 5e-4))
            assert not prover(res.objective * (1 + gap), res.objective * 1.05)
            return replace(res, status="time_limit", gap=0.05)

    monkeypatch.setattr(core, "CoverBound", _RefutesFrom)
    out = core.milp_plan(specs, cl, [usable_levels(m, cl) for m in models], objective=MaxMinNormalized(), solver=OutOfTime(),
                         max_partitions=2, margin=0.2, gpu_rule="physical", one_config_per_template=False, time_limit_s=60, gap=1e-4)
    r = out.result
    assert r.status == "time_limit" and r.method == "highs incumbent + cover bound"
    assert r.gap == pytest.approx(core.FALLBACK_GAP)  # not the 5 % branch and bound reported



def test_a_better_plan_the_prover_offers_becomes_highs_incumbent():
    # The price bound may find, instead of a proof, a plan better than HiGHS's incumbent;
    # the prover leaves it in ``solution`` and HiGHS takes it at its next chance. Here the
    # optimum of a knapsack waits there from the start: the first level the prover is
    # asked about is then the optimum's, not HiGHS's own first incumbent (a worse one).
    from ppipe.planner.milp import Milp
    from ppipe.planner.solvers import HighsSolver

    rng = np.random.default_rng(3)
    w = rng.integers(20, 100, 50).astype(float)
    milp = Milp()
    cols = milp.add_cols(50, ub=1.0, integer=True)
    milp.add_row(dict(zip(cols.tolist(), w)), ub=float(w.sum() // 2))
    milp.set_objective(dict(zip(cols.tolist(), w + rng.integers(-8, 8, 50))), "max")
    best = HighsSolver().solve(milp, gap=1e-9)

    class Offering:
        def __init__(self, x):
            self.solution, self.asked = x, []

        def __call__(self, T, bound):
            self.asked.append(T)
            return False

    alone, helped = Offering(None), Offering(best.x.copy())
    for prover in (alone, helped):
        HighsSolver().solve(milp, gap=1e-9, prover=prover, prover_after_polls=0)
    assert alone.asked[0] < best.objective * (1 - 1e-3)  # what the test needs: a worse first incumbent
    assert helped.solution is None, "the offered plan was never taken"
    assert helped.asked[0] == pytest.approx(best.objective * (1 + 1e-9))


def test_the_prover_offers_the_plans_the_price_bound_finds_when_better(monkeypatch):
    from types import SimpleNamespace as NS

    class Reachable:
        def __init__(self):
            self.found = None

        def refutes(self, T, deadline=None, max_rounds=None):
            # Known plans reach T together: the models' throughputs are T w_m (weights 1, 2).
            self.found = [NS(throughput_rps=T), NS(throughput_rps=2 * T)]
            return False

    monkeypatch.setattr(core, "CoverBound", _RefutesFrom)
    offered = []
    specs = [NS(weight=1.0), NS(weight=2.0)]
    prover = core.Prover([], specs, cluster({"A": 2, "B": 2}, LEVELS), price_bound=Reachable(),
                              columns=lambda models: offered.append(models) or np.array([models[0].throughput_rps]))
    assert not prover(100.0, 110.0) and prover.solution.tolist() == [100.0]
    prover.solution = None  # taken by the solver
    assert not prover(99.0, 110.0) and prover.solution is None  # not better than the one offered
    assert len(offered) == 1
    assert not prover(101.0, 110.0) and prover.solution.tolist() == [101.0]


def test_an_error_in_the_prover_surfaces_as_itself():
    # Raised inside HiGHS's callback, it would end the solve as a bare "Solve error".
    from ppipe.planner.milp import Milp
    from ppipe.planner.solvers import HighsSolver

    milp = Milp()
    cols = milp.add_cols(30, ub=1.0, integer=True)
    w = np.arange(30, 60, dtype=float)
    milp.add_row(dict(zip(cols.tolist(), w)), ub=float(w.sum() // 2))
    milp.set_objective(dict(zip(cols.tolist(), w + np.sin(w))), "max")

    def broken(T, bound):
        raise ZeroDivisionError("a planner bug")

    with pytest.raises(ZeroDivisionError, match="a planner bug"):
        HighsSolver().solve(milp, gap=1e-9, prover=broken, prover_after_polls=0)


def test_the_cover_bound_serves_physical_packing_and_not_the_papers_rule(monkeypatch):
    # Under the paper's rule the cover bound cannot see each model's rounding to whole GPUs
    # and proved no benchmark case: a two-type plan there runs without a prover; under
    # physical packing it is asked.
    from ppipe.planner.solvers import HighsSolver

    provers = []
    real = HighsSolver.solve

    def spy(self, milp, **kw):
        provers.append(kw.get("prover"))
        return real(self, milp, **kw)

    monkeypatch.setattr(HighsSolver, "solve", spy)
    cl = cluster({"A": 2, "B": 2}, LEVELS)
    models = [profile("m1", LAT_1, [200_000, 100_000], LEVELS), profile("m2", LAT_2, [50_000, 300_000], LEVELS)]
    kw = dict(slo_ms=25.0, weights=[1.0, 2.0], max_partitions=2, batch_build=False, margin=0.2, time_limit_s=60)
    ppipe.plan(cl, models, formulation="ppipe-atc25", **kw)
    assert provers and provers[-1] is None
    ppipe.plan(cl, models, formulation="ppipe", **kw)
    assert isinstance(provers[-1], core.Prover)
