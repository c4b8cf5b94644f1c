"""The same inputs give the same plan.yaml (apart from its timing field): whatever the
price bound's worker count, however its workers and the cover bound are delayed (a slower
or busier machine), as long as no time limit is hit."""

from __future__ import annotations

import time
from dataclasses import replace

import ppipe
import ppipe.planner.core as core
import ppipe.planner.price_bound as pbm
from planner_synth import cluster, profile, unrefuted_root_weights
from ppipe.planner.bounds import CoverBound
from ppipe.planner.price_bound import PriceBound

LEVELS = {"A": [1, 2], "B": [1, 2], "C": [1]}
LATS = (
    {"A": [2000.0, 3000.0, 1000.0], "B": [3000.0, 9000.0, 1500.0], "C": [4000.0, 7000.0, 2500.0]},
    {"A": [1500.0, 1000.0, 2500.0], "B": [2500.0, 2000.0, 8000.0], "C": [3500.0, 3000.0, 6000.0]},
    {"A": [900.0, 4000.0, 700.0], "B": [1200.0, 2500.0, 3000.0], "C": [2000.0, 5000.0, 1800.0]},
)


def _plan_text(monkeypatch, tmp_path, workers: int, delay_s: float = 0.0) -> tuple[str, dict]:
    """plan.yaml of a three-type, three-model plan that the price bound proves (the cover
    bound is told to refute nothing, and the price bound's first Kelley LP to branch), its
    timing field zeroed; and what the price bound did."""
    monkeypatch.setattr(pbm, "WORKERS", workers)
    monkeypatch.setattr(pbm.os, "cpu_count", lambda: 2)  # two threads even on one core
    monkeypatch.setattr(CoverBound, "refutes", lambda self, T: False)
    real_kelley, real_solve = pbm.kelley_lp, PriceBound._solve_model
    seen = {"kelley": 0, "solves": 0}

    def kelley(N, cuts, weights=False):
        value, x, w = real_kelley(N, cuts, weights=True)
        seen["kelley"] += 1
        if seen["kelley"] == 1:  # the root: a mix of two of model 0's plans, so the search branches
            value, w = 1.0, unrefuted_root_weights(cuts)
        return (value, x, w) if weights else (value, x)

    def solve(self, know, sub, mu, deadline, box, *args, **kw):
        seen["solves"] += 1
        if delay_s and box[0].sum() > 0:  # the boxes above a cut wait: the later box ends first
            time.sleep(delay_s)
        return real_solve(self, know, sub, mu, deadline, box, *args, **kw)

    monkeypatch.setattr(pbm, "kelley_lp", kelley)
    monkeypatch.setattr(PriceBound, "_solve_model", solve)
    cl = cluster({"A": 2, "B": 4, "C": 4}, LEVELS, per_server=2)
    models = [profile(f"m{i}", lat, [200_000, 100_000], LEVELS) for i, lat in enumerate(LATS)]
    plan = ppipe.plan(
        cl, models, weights=[0.3, 0.33, 0.37], slo_ms=25.0, max_partitions=2, margin=0.2, batch_build=False,
        gpu_rule="paper", configs_per_template="one", time_limit_s=None,
    )
    plan = plan.model_copy(update={"solver": plan.solver.model_copy(update={"seconds": 0.0})})
    path = plan.save(tmp_path / f"plan-{workers}-{delay_s}.yaml")
    return path.read_text(), seen


def test_the_plan_does_not_depend_on_workers_or_their_timing(monkeypatch, tmp_path):
    serial, seen = _plan_text(monkeypatch, tmp_path, 1)
    assert seen["kelley"] > 1 and seen["solves"] > 0, "the price bound did not search: the test proves nothing"
    assert "time_limit" not in serial
    assert _plan_text(monkeypatch, tmp_path, 2)[0] == serial
    assert _plan_text(monkeypatch, tmp_path, 2, delay_s=0.05)[0] == serial


def test_a_slower_prover_changes_nothing(monkeypatch, tmp_path):
    # The prover is first asked after a number of HiGHS's interrupt checks, not seconds:
    # a cover bound that takes 0.3 s longer (a slower machine) leaves the plan as it was.
    monkeypatch.setattr(core, "PROVER_AFTER_POLLS", core.PROVER_AFTER_POLLS)
    fast, _ = _plan_text(monkeypatch, tmp_path, 1)
    real = CoverBound.__init__

    def slow(self, *args, **kw):
        time.sleep(0.3)
        real(self, *args, **kw)

    monkeypatch.setattr(CoverBound, "__init__", slow)
    assert _plan_text(monkeypatch, tmp_path, 1)[0] == fast


def test_a_start_the_clock_stopped_says_time_limit(monkeypatch):
    # Wall-clock time may stop a search, never choose a plan silently: a split search cut
    # short by its share of the time limit makes the plan report time_limit.
    cl = cluster({"A": 2, "B": 4, "C": 4}, LEVELS, per_server=2)
    models = [profile(f"m{i}", lat, [200_000, 100_000], LEVELS) for i, lat in enumerate(LATS)]
    kw = dict(weights=[0.3, 0.33, 0.37], slo_ms=25.0, max_partitions=2, margin=0.2, batch_build=False,
              gpu_rule="paper", configs_per_template="one", time_limit_s=60.0)
    unhurried = ppipe.plan(cl, models, **kw)
    assert unhurried.solver.status == "optimal"
    real = core.split_search

    def slow_split_search(*args, **kw):
        time.sleep(kw["time_budget_s"] + 0.05)
        return real(*args, **kw)

    monkeypatch.setattr(core, "split_search", slow_split_search)
    monkeypatch.setattr(core, "START_SHARE", 0.002)  # 0.12 s of the 60
    stopped = ppipe.plan(cl, models, **kw)
    assert stopped.solver.status == "time_limit"
    assert stopped.solver.gap <= 1e-4  # the same search proved the same gap


def test_an_lp_relaxation_the_clock_stopped_says_time_limit(monkeypatch):
    # Under physical packing the LP relaxation's configurations give the first plan; where
    # the time limit stops that relaxation, the plan made without it says time_limit.
    from ppipe.planner.solvers import HighsSolver

    levels = {"A": [1, 2], "B": [1]}
    cl = cluster({"A": 3, "B": 4}, levels)
    models = [profile(f"m{i}", {k: lat[k] for k in levels}, [200_000, 100_000], levels) for i, lat in enumerate(LATS[:2])]
    kw = dict(weights=[1.0, 2.0], slo_ms=12.0, max_partitions=2, margin=0.2, batch_build=False, time_limit_s=60.0)
    assert ppipe.plan(cl, models, **kw).solver.status == "optimal"
    real = HighsSolver.relaxation

    def stopped(self, milp, **k):
        return replace(real(self, milp, **k), status="time_limit")

    monkeypatch.setattr(HighsSolver, "relaxation", stopped)
    assert ppipe.plan(cl, models, **kw).solver.status == "time_limit"
