"""The time limit is a budget shared by the plan's searches, and it never throws a plan away.

The estimate's NP plan, the starts and the final solve each get a share: a slow estimate
leaves the MILP a real part of the limit. A plan found on the way (a start) is returned
with status time_limit and its gap where the final solve finds none; only where there is no
plan at all does planning fail, with an error that names the limit and the fix.
"""

from __future__ import annotations

import time

import pytest

import ppipe.planner.core as core
from planner_synth import cluster, profile
from ppipe.planner import api
from ppipe.planner.solvers import HighsSolver, SolverTimeLimitError

LEVELS = {"A": [1, 2], "B": [1]}
LATS = (
    {"A": [2000.0, 3000.0, 1000.0], "B": [3000.0, 9000.0, 1500.0]},
    {"A": [1500.0, 1000.0, 2500.0], "B": [2500.0, 2000.0, 8000.0]},
)


def _instance():
    cl = cluster({"A": 3, "B": 4}, LEVELS)
    models = [profile(f"m{i}", lat, [200_000, 100_000], LEVELS) for i, lat in enumerate(LATS)]
    return cl, models, dict(weights=[1.0, 2.0], slo_ms=12.0, max_partitions=2, margin=0.2)


class _Recorder:
    """Wraps HighsSolver.solve: records (time limit, in the estimate?, MILP?, node limit) per solve."""

    def __init__(self, monkeypatch, estimate_sleeps: bool = False, fail=None):
        self.calls: list[tuple[float | None, bool, bool, object]] = []
        self.in_estimate = False
        real_solve, real_bb = HighsSolver.solve, api._with_batch_build

        def with_batch_build(run, specs, *args):
            self.in_estimate = True
            try:
                return real_bb(run, specs, *args)
            finally:
                self.in_estimate = False

        def solve(solver, milp, **kw):
            mip = any(a.any() for a in milp.col_int)
            self.calls.append((kw.get("time_limit_s"), self.in_estimate, mip, solver.options.get("mip_max_nodes")))
            if estimate_sleeps and self.in_estimate and kw.get("time_limit_s") is not None:
                time.sleep(kw["time_limit_s"])  # a search that uses all the time it is given
            if fail is not None and fail(self, milp, mip):
                raise SolverTimeLimitError(f"HiGHS found no plan within the time limit of {kw.get('time_limit_s')} s")
            return real_solve(solver, milp, **kw)

        monkeypatch.setattr(api, "_with_batch_build", with_batch_build)
        monkeypatch.setattr(HighsSolver, "solve", solve)


def test_a_slow_estimate_leaves_the_milp_a_real_share(monkeypatch):
    cl, models, kw = _instance()
    rec = _Recorder(monkeypatch, estimate_sleeps=True)
    plan = api.plan(cl, models, time_limit_s=2.0, **kw)
    assert any(est for _t, est, _m, _n in rec.calls), "the estimate ran no solve: the test proves nothing"
    main = [t for t, est, _m, _n in rec.calls if not est]
    assert main and max(main) >= 0.5  # not MIN_SOLVE_S: at least a quarter of the limit
    assert plan.solver.objective > 0


def test_the_estimate_stops_at_a_node_limit_the_plan_does_not(monkeypatch):
    # A node limit stops the estimate's NP plan at the same point on every machine; the
    # plan's own MILP has none.
    cl, models, kw = _instance()
    rec = _Recorder(monkeypatch)
    api.plan(cl, models, time_limit_s=None, **kw)
    estimate = {n for _t, est, mip, n in rec.calls if est and mip}
    main = {n for _t, est, mip, n in rec.calls if not est and mip}
    assert estimate == {api.ESTIMATE_MAX_NODES} and main == {None}


def test_an_estimate_the_clock_stopped_makes_the_plan_say_time_limit(monkeypatch):
    from dataclasses import replace

    cl, models, kw = _instance()
    assert api.plan(cl, models, time_limit_s=60.0, **kw).solver.status == "optimal"
    real_milp = api._Run.milp

    def clocked(self, specs, objective, **k):
        out = real_milp(self, specs, objective, **k)
        if k.get("no_partitioning"):
            out = replace(out, result=replace(out.result, status="time_limit"))
        return out

    monkeypatch.setattr(api._Run, "milp", clocked)
    assert api.plan(cl, models, time_limit_s=60.0, **kw).solver.status == "time_limit"


def test_a_start_found_on_the_way_is_returned_when_the_last_solve_finds_none(monkeypatch):
    # The LP relaxation's configurations give a plan (not proven here); the solve of the
    # whole MILP then finds none before the limit: the plan is that start, with its gap to
    # the relaxation's bound, not an error.
    cl, models, kw = _instance()
    real = core._lp_support_attempt
    monkeypatch.setattr(core, "_lp_support_attempt", lambda *a, **k: (real(*a, **k)[0], None))
    relaxed = {"cols": None}

    def whole_milp(rec, milp, mip):
        if not mip:
            relaxed["cols"] = milp.num_cols  # the LP relaxation of the whole MILP
        return mip and not rec.in_estimate and milp.num_cols == relaxed["cols"]

    _Recorder(monkeypatch, fail=whole_milp)
    plan = api.plan(cl, models, time_limit_s=30.0, batch_build=False, **kw)
    assert plan.solver.status == "time_limit"
    assert plan.solver.objective > 0 and plan.solver.gap < float("inf")


def test_no_plan_at_all_names_the_time_limit_and_the_fix(monkeypatch):
    cl, models, kw = _instance()
    _Recorder(monkeypatch, fail=lambda rec, milp, mip: mip)
    with pytest.raises(SolverTimeLimitError, match=r"time limit of 3\.0 s \(time_limit_s, --time-limit-s\)(.|\n)*raise --time-limit-s"):
        api.plan(cl, models, time_limit_s=3.0, **kw)


def test_column_generation_returns_its_rounded_plan_when_the_solver_finds_none(monkeypatch):
    cl, models, kw = _instance()
    _Recorder(monkeypatch, fail=lambda rec, milp, mip: mip and not rec.in_estimate)
    plan = api.plan(cl, models, time_limit_s=30.0, column_generation=True, **kw)
    assert plan.solver.status == "time_limit" and plan.solver.objective > 0
    assert plan.solver.method.startswith("column generation")
