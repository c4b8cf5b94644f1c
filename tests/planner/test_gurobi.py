"""GurobiSolver, run for real when gurobipy is installed (the optional extra ``gurobi``).

The pip wheel's size-limited licence solves small models and refuses large ones; the
refusal must fall back to HiGHS with one warning. Skipped without gurobipy.
"""

from __future__ import annotations

import warnings

import numpy as np
import pytest

import ppipe
from planner_synth import cluster, profile
from ppipe.errors import InfeasibleError
from ppipe.planner.milp import Milp
from ppipe.planner.solvers import GurobiSolver

gp = pytest.importorskip("gurobipy", reason="gurobipy is not installed (optional extra 'gurobi': pip install 'ppipe[gurobi]')")

LEVELS = {"A": [1, 2], "B": [1]}
LAT_1 = {"A": [2000.0, 3000.0, 1000.0], "B": [3000.0, 9000.0, 1500.0]}
LAT_2 = {"A": [1500.0, 1000.0, 2500.0], "B": [2500.0, 2000.0, 8000.0]}
KW = dict(slo_ms=25.0, max_partitions=2, batch_build=False, margin=0.2, gap=1e-9, place=False)


@pytest.fixture
def small():
    cl = cluster({"A": 2, "B": 2}, LEVELS)
    return cl, [profile("m1", LAT_1, [200_000, 100_000], LEVELS), profile("m2", LAT_2, [50_000, 300_000], LEVELS)]


def _plan_on_gurobi(*args, **kw):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        plan = ppipe.plan(*args, solver="gurobi", **kw)
    if any("Gurobi refused" in str(w.message) for w in caught):
        pytest.skip("gurobipy has no usable licence here, not even the size-limited one")
    return plan


@pytest.mark.parametrize("formulation", ["ppipe", "ppipe-atc25"])
def test_gurobi_finds_the_highs_optimum(small, formulation):
    cl, models = small
    g = _plan_on_gurobi(cl, models, formulation=formulation, weights=[1.0, 2.0], **KW)
    h = ppipe.plan(cl, models, formulation=formulation, weights=[1.0, 2.0], **KW)
    assert g.solver.name == "gurobi" and g.solver.status == "optimal"
    assert g.solver.objective == pytest.approx(h.solver.objective, rel=1e-6)
    assert g.solver.nodes >= 0 and g.solver.lp_iterations >= 0


def test_gurobi_min_cost_and_infeasible(small):
    cl, models = small
    g = _plan_on_gurobi(cl, models, objective="min-cost", required_rps=100.0, **KW)
    h = ppipe.plan(cl, models, objective="min-cost", required_rps=100.0, **KW)
    assert g.solver.name == "gurobi" and g.solver.status == "optimal"
    assert g.solver.objective == pytest.approx(h.solver.objective, rel=1e-9)
    with pytest.raises(InfeasibleError, match="no plan meets objective 'min-cost'"):
        ppipe.plan(cl, models, objective="min-cost", required_rps=1e7, solver="gurobi", **KW)


def _wide_milp(n: int) -> Milp:
    # max sum x, sum x <= 7.5, x integer in [0, 1]: optimum 7, any solver, instantly.
    milp = Milp()
    cols = milp.add_cols(n, lb=0, ub=1, integer=True, name="x")
    milp.add_rows(1, np.zeros(n, int), cols, np.ones(n), ub=7.5, name="cap")
    milp.set_objective({int(c): 1.0 for c in cols}, "max")
    return milp


def test_a_model_the_licence_refuses_falls_back_to_highs_with_one_warning():
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        res = GurobiSolver().solve(_wide_milp(2500), time_limit_s=30, gap=1e-9)
    if res.solver == "gurobi":
        pytest.skip("this Gurobi licence is not size-limited: nothing to fall back from")
    refused = [w for w in caught if "Gurobi refused" in str(w.message)]
    assert len(refused) == 1 and "\n" not in str(refused[0].message)
    assert res.solver == "highs" and res.status == "optimal" and res.objective == pytest.approx(7.0)


def test_the_size_limited_licence_solves_a_small_model():
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        res = GurobiSolver().solve(_wide_milp(50), time_limit_s=30, gap=1e-9)
    if any("Gurobi refused" in str(w.message) for w in caught):
        pytest.skip("gurobipy has no usable licence here")
    assert res.solver == "gurobi" and res.status == "optimal" and res.objective == pytest.approx(7.0)
