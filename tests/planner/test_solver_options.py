"""The HiGHS options the planner sets (presolve off, no RINS; RENS under physical packing only) change speed, not optima."""

from __future__ import annotations

import pytest

from planner_synth import brute_force_paper, cluster, plain_configs, profile
from ppipe.planner.api import usable_levels
from ppipe.planner.configs import ModelSpec
from ppipe.planner.core import milp_plan, model_configs
from ppipe.planner.objectives import get_objective
from ppipe.planner.solvers import HIGHS_MIP_OPTIONS, HighsSolver, get_solver

LEVELS = {"A": [1, 2], "B": [1]}
LAT_1 = {"A": [2000.0, 3000.0, 1000.0], "B": [3000.0, 9000.0, 1500.0]}
LAT_2 = {"A": [1500.0, 1000.0, 2500.0], "B": [2500.0, 2000.0, 8000.0]}
LAT_3 = {"A": [900.0, 4000.0, 700.0], "B": [1200.0, 2500.0, 3000.0]}


def _solve(solver, specs, cl, *, gpu_rule="paper", one=True, D=2):
    return milp_plan(
        specs,
        cl,
        [usable_levels(s.profile, cl) for s in specs],
        objective=get_objective("max-min"),
        solver=solver,
        max_partitions=D,
        margin=0.2,
        gpu_rule=gpu_rule,
        one_config_per_template=one,
        time_limit_s=60,
        gap=1e-9,
    )


def test_default_highs_solver_uses_the_tuned_options():
    assert get_solver("highs").options == HIGHS_MIP_OPTIONS
    assert HIGHS_MIP_OPTIONS["presolve"] == "off"


def test_highs_runs_rens_under_physical_packing_only_and_keeps_options_it_was_given():
    default = get_solver("highs")
    assert default.tuned_for("physical").options == {**HIGHS_MIP_OPTIONS, "mip_heuristic_run_rens": True}
    assert default.tuned_for("paper").options == HIGHS_MIP_OPTIONS
    # One model alone under the paper's rule (the ablation): HiGHS's own presolve and sub-MIPs.
    assert default.tuned_for("paper", single_model=True).options == {
        **HIGHS_MIP_OPTIONS, "presolve": "on", "mip_heuristic_run_rins": True, "mip_heuristic_run_rens": True
    }
    assert default.tuned_for("physical", single_model=True).options == default.tuned_for("physical").options
    mine = HighsSolver({"presolve": "on"})
    assert mine.tuned_for("physical").options == {"presolve": "on"}
    assert get_solver("cbc").tuned_for("physical").name == "cbc"
    # Gurobi keeps its own defaults; the HiGHS it falls back to is tuned like HiGHS itself.
    assert get_solver("gurobi").tuned_for("physical").fallback.options == default.tuned_for("physical").options


def test_the_planner_solves_with_the_options_of_its_gpu_rule(monkeypatch):
    seen = []
    solve = HighsSolver.solve

    def recording(self, milp, **kw):
        if milp.arrays()[2].any():  # a MILP (LP relaxations run with options of their own)
            seen.append(self.options.get("mip_heuristic_run_rens"))
        return solve(self, milp, **kw)

    monkeypatch.setattr(HighsSolver, "solve", recording)
    cl = cluster({"A": 2, "B": 2}, LEVELS)
    specs = [ModelSpec(profile=profile(f"m{i}", lat, [200_000, 100_000], LEVELS), slo_ms=30.0) for i, lat in enumerate((LAT_1, LAT_2))]
    # Physical packing: the MILP over the LP relaxation's configurations, then (unless a
    # bound proves that plan) over their templates' and the whole MILP, all with RENS.
    _solve(HighsSolver(), specs, cl, gpu_rule="physical", one=False)
    assert seen in ([True], [True, True], [True, True, True])
    # The paper's rule, several models: the MILP first (the price bound's subproblem solves,
    # asked from inside it, come after), without RENS.
    seen.clear()
    _solve(HighsSolver(), specs, cl, gpu_rule="paper")
    assert seen[0] is False
    # One model alone under the paper's rule: its MIP start (distinct types in consecutive
    # slots), then the MILP, with HiGHS's sub-MIPs (and presolve) on.
    seen.clear()
    _solve(HighsSolver(), specs[:1], cl, gpu_rule="paper")
    assert seen == [True, True]


@pytest.mark.parametrize("counts", [{"A": 1, "B": 2}, {"A": 2, "B": 1}, {"A": 2, "B": 2}])
@pytest.mark.parametrize("slo_ms", [15.0, 30.0])
def test_paper_formulation_with_tuned_options_matches_brute_force(counts, slo_ms):
    cl = cluster(counts, LEVELS)
    m = profile("m1", LAT_1, [200_000, 100_000], LEVELS)
    want = brute_force_paper(plain_configs(m, cl, slo_ms, 0.2, 2, LEVELS), counts, 2)
    out = _solve(HighsSolver(), [ModelSpec(profile=m, slo_ms=slo_ms)], cl)
    assert out.result.status == "optimal"
    assert out.result.objective == pytest.approx(want, rel=1e-6)


@pytest.mark.parametrize("gpu_rule,one", [("paper", True), ("physical", False), ("physical", True)])
def test_tuned_and_default_highs_options_reach_the_same_optimum(gpu_rule, one):
    # Three models with different weights on 3 + 4 GPUs: a max-min instance with branching.
    cl = cluster({"A": 3, "B": 4}, LEVELS)
    specs = [
        ModelSpec(profile=profile(f"m{i}", lat, cut, LEVELS), slo_ms=slo, weight=w)
        for i, (lat, cut, slo, w) in enumerate(
            [(LAT_1, [200_000, 100_000], 25.0, 1.0), (LAT_2, [50_000, 300_000], 25.0, 2.0), (LAT_3, [80_000, 40_000], 20.0, 1.5)]
        )
    ]
    tuned = _solve(HighsSolver(), specs, cl, gpu_rule=gpu_rule, one=one)
    plain = _solve(HighsSolver(options={}), specs, cl, gpu_rule=gpu_rule, one=one)
    assert tuned.result.status == plain.result.status == "optimal"
    assert tuned.result.objective > 0
    assert tuned.result.objective == pytest.approx(plain.result.objective, rel=1e-7)


def test_highs_reports_its_work():
    cl = cluster({"A": 2, "B": 2}, LEVELS)
    out = _solve(HighsSolver(), [ModelSpec(profile=profile("m1", LAT_1, [200_000, 100_000], LEVELS), slo_ms=30.0)], cl)
    assert out.result.nodes >= 0
    assert out.result.lp_iterations > 0


def test_time_limit_is_a_budget_for_the_whole_plan_call(monkeypatch):
    # A plan solves several times (the NP plan for the batch-build estimate, then PPipe's
    # MILP): each solve gets at most what is left of the call's limit, never the whole limit
    # again, and the estimate's at most its share of it. (ppipe-atc25 estimates a single
    # model's batch build without the NP plan, as the authors did.)
    import time

    from ppipe.planner import api

    seen = []
    solve = HighsSolver.solve

    def recording(self, milp, **kw):
        seen.append((kw["time_limit_s"], time.perf_counter(), milp.num_cols))
        return solve(self, milp, **kw)

    monkeypatch.setattr(HighsSolver, "solve", recording)
    levels = {"A": [1, 2], "B": [1]}
    cl = cluster({"A": 2, "B": 4}, levels)
    prof = profile("m", {"A": [1000.0, 2000.0, 1500.0], "B": [3000.0, 5000.0, 4000.0]}, [100_000, 50_000], levels, slo_ms=40.0)
    t0 = time.perf_counter()
    api.plan(cl, [prof], formulation="ppipe", slo_ms=40.0, max_partitions=2, time_limit_s=5.0)
    assert len(seen) >= 2  # and under physical packing the LP relaxation and its restriction
    assert all(limit <= 5.0 - (at - t0) + 0.01 for limit, at, _cols in seen)
    assert seen[0][0] <= api.ESTIMATE_SHARE * 5.0 + 1e-6  # the NP plan of the estimate comes first
    solves = len(seen)
    api.plan(cl, [prof], formulation="ppipe", slo_ms=40.0, max_partitions=2, time_limit_s=None)
    assert [limit for limit, _at, _cols in seen[solves:]] == [None] * solves


def test_a_solve_stopped_at_its_objective_target_keeps_its_plan():
    # The price bound stops single-model solves at a plan priced at most a target: HiGHS
    # reports "objective target reached", which must come back as a stopped solve with its
    # plan and a valid (possibly large) gap, not as an error.
    import numpy as np

    from ppipe.planner.milp import Milp

    rng = np.random.default_rng(3)
    n, rows = 40, 6
    milp = Milp()
    x = milp.add_cols(n, lb=0, ub=5, integer=True, name="x")
    for _ in range(rows):
        w = rng.integers(3, 40, n).astype(float)
        milp.add_row({int(c): float(a) for c, a in zip(x, w)}, lb=float(w.sum()) * 0.9 + 0.5)
    milp.set_objective({int(c): float(a) for c, a in zip(x, rng.uniform(1.0, 2.0, n))}, "min")
    exact = HighsSolver().solve(milp, gap=1e-9, time_limit_s=60)
    assert exact.status == "optimal"
    res = HighsSolver({**HIGHS_MIP_OPTIONS, "objective_target": 1e6}).solve(milp, gap=1e-9, time_limit_s=60)
    assert res.status == "time_limit", "the target should stop the solve at its first plan"
    assert res.x is not None and exact.objective - 1e-9 <= res.objective <= 1e6
    assert res.objective - res.gap * max(1.0, abs(res.objective)) <= exact.objective + 1e-9  # its dual bound stays valid


def test_distinct_types_start_is_a_solution_and_a_restriction_out_of_time_gives_none_and_says_so():
    from ppipe.planner.core import distinct_types_start, is_feasible
    from ppipe.planner.formulation import build
    from ppipe.planner.solvers import SolverTimeLimitError

    cl = cluster({"A": 2, "B": 2}, LEVELS)
    specs = [ModelSpec(profile=profile(f"m{i}", lat, [200_000, 100_000], LEVELS), slo_ms=30.0) for i, lat in enumerate((LAT_1, LAT_2))]
    configs = model_configs(specs, cl, [usable_levels(s.profile, cl) for s in specs], max_partitions=2, margin=0.2, group_by_multiset=False)
    milp, v = build(specs, configs, cl, gpu_rule="paper", one_config_per_template=True)
    get_objective("max-min").apply(milp, v)
    kw = dict(gpu_rule="paper", deadline=None, gap=1e-9)
    start = distinct_types_start(specs, configs, cl, milp, v, HighsSolver(), **kw)
    x = start.x
    assert x is not None and is_feasible(milp, x) and x[v.extra["z"]] > 0 and not start.timed_out

    class OutOfTime(HighsSolver):
        def solve(self, milp, **kw):
            raise SolverTimeLimitError("out of time", fix="-")

    stopped = distinct_types_start(specs, configs, cl, milp, v, OutOfTime(), **kw)
    assert stopped.x is None and stopped.timed_out
