"""The price bound (ppipe.planner.price_bound): never refutes a level a plan reaches, and
refutes levels just above the optimum where the cover bound cannot."""

from __future__ import annotations

import functools
import os

import numpy as np
import pytest

import ppipe
import ppipe.planner.core as core
from planner_synth import cluster, profile, unrefuted_root_weights
from ppipe.planner.api import usable_levels
from ppipe.planner.bounds import CoverBound
from ppipe.planner.configs import ModelSpec
from ppipe.planner.core import model_configs
from ppipe.planner.formulation import build
from ppipe.planner.objectives import MaxMinNormalized
from ppipe.planner.price_bound import PriceBound
from ppipe.planner.solvers import HighsSolver
from ppipe.planner.split_search import split_search

LEVELS = {"A": [1, 2], "B": [1, 2], "C": [1]}
LATS = (
    {"A": [2000.0, 3000.0, 1000.0], "B": [3000.0, 9000.0, 1500.0], "C": [4000.0, 7000.0, 2500.0]},
    {"A": [1500.0, 1000.0, 2500.0], "B": [2500.0, 2000.0, 8000.0], "C": [3500.0, 3000.0, 6000.0]},
    {"A": [900.0, 4000.0, 700.0], "B": [1200.0, 2500.0, 3000.0], "C": [2000.0, 5000.0, 1800.0]},
)
PAPER = dict(gpu_rule="paper", one_config_per_template=True)


def _case(counts):
    """(cluster, specs, configurations, optimum) of three models on ``counts``; the optimum,
    an exact MILP solve of a few seconds, is computed once per cluster."""
    return _solved_case(tuple(sorted(counts.items())))


@functools.lru_cache(maxsize=None)
def _solved_case(counts):
    counts = dict(counts)
    cl = cluster(counts, LEVELS, per_server=2)
    models = [profile(f"m{i}", lat, [200_000, 100_000], LEVELS) for i, lat in enumerate(LATS)]
    specs = [ModelSpec(profile=m, slo_ms=25.0, weight=w) for m, w in zip(models, (0.3, 0.33, 0.37))]
    configs = model_configs(specs, cl, [usable_levels(m, cl) for m in models], max_partitions=2, margin=0.2, group_by_multiset=False)
    milp, v = build(specs, configs, cl, **PAPER)
    MaxMinNormalized().apply(milp, v)
    res = HighsSolver().solve(milp, gap=1e-9, time_limit_s=60)
    assert res.status == "optimal"
    return cl, specs, configs, res.objective


def _bound(cl, specs, configs):
    N = np.array([cl.gpu_counts[g.name] for g in cl.gpu_types])
    tables = split_search(configs, [s.weight for s in specs], N).tables
    return PriceBound(specs, configs, cl, PAPER, tables=tables)


@pytest.mark.parametrize("counts", [{"A": 2, "B": 4, "C": 4}, {"A": 4, "B": 6, "C": 4}])
def test_never_refutes_the_optimum_and_refutes_just_above_it(counts):
    cl, specs, configs, z = _case(counts)
    N = np.array([cl.gpu_counts[g.name] for g in cl.gpu_types], dtype=float)
    assert not _bound(cl, specs, configs).refutes(z), "refuted the level the optimum reaches"
    cover = CoverBound(configs, [s.weight for s in specs], N, z_max=1.5 * z)
    assert not cover.refutes(z * 1.001)  # where the cover bound cannot ...
    bound = _bound(cl, specs, configs)
    assert bound.refutes(z * 1.001)  # ... this one can
    assert bound.solves > 0, "a proof needs the exact solves: the restriction's tables alone prove nothing"


def test_the_restrictions_dual_says_no_without_a_solve():
    # Far below the optimum every price leaves room: the seeded LP answers, no MILP is solved.
    cl, specs, configs, z = _case({"A": 2, "B": 4, "C": 4})
    bound = _bound(cl, specs, configs)
    assert not bound.refutes(0.5 * z)
    assert bound.solves == 0


def test_a_level_no_model_reaches_alone_is_refuted():
    # The restriction has no plan for any model at 100 z: the exact solve proves it.
    cl, specs, configs, z = _case({"A": 2, "B": 4, "C": 4})
    bound = _bound(cl, specs, configs)
    assert bound.refutes(100 * z)
    assert bound.solves >= 1


def test_only_the_papers_gpu_rule_gets_it(monkeypatch):
    # Under physical packing models share the GPUs of a level, so a model's own GPU count
    # overstates its need and the bound would not be valid: the planner must not use it.
    made = []

    class Spy:
        found = None

        def __init__(self, *args, tables):
            assert tables, "the price bound is built without the split search's tables"
            made.append(args[3])

        def refutes(self, T, deadline=None, max_rounds=None):
            return False

    monkeypatch.setattr(core, "PriceBound", Spy)
    # Where the price bound serves, the prover is asked from the root on; elsewhere models
    # HiGHS proves at once keep their head start.
    after = []
    from ppipe.planner.solvers import HighsSolver

    real_solve = HighsSolver.solve

    def solve(self, milp, **kw):
        after.append(kw.get("prover_after_polls"))
        return real_solve(self, milp, **kw)

    monkeypatch.setattr(HighsSolver, "solve", solve)
    cl = cluster({"A": 2, "B": 4, "C": 4}, LEVELS, per_server=2)
    models = [profile(f"m{i}", lat, [200_000, 100_000], LEVELS) for i, lat in enumerate(LATS)]
    kw = dict(weights=[0.3, 0.33, 0.37], slo_ms=25.0, max_partitions=2, margin=0.2, batch_build=False, time_limit_s=30)
    ppipe.plan(cl, models, gpu_rule="physical", **kw)
    assert made == [] and after == [core.PROVER_AFTER_POLLS]
    ppipe.plan(cl, models, gpu_rule="paper", configs_per_template="one", **kw)
    assert made and made[-1]["gpu_rule"] == "paper" and after[-1] == 0


def test_branching_splits_where_the_weaker_box_scores_highest(monkeypatch):
    import ppipe.planner.price_bound as pbm

    lo, hi = np.zeros((2, 2)), np.full((2, 2), 9.0)
    known = [np.array([[2.0, 4.0], [5.0, 1.0]]), np.array([[3.0, 3.0]])]
    N, mu = np.array([9.0, 9.0]), np.array([0.5, 0.5])
    one = [np.array([0.5, 0.5]), np.array([1.0])]
    # Model 0 half and half: mean (3.5, 2.5), so the candidates cut type 0 at 3 and type 1
    # at 2. Each box is scored; the split whose weaker box scores higher wins.
    scores = {("hi", 0, 3.0): 1.2, ("lo", 0, 4.0): 0.9, ("hi", 1, 2.0): 1.0, ("lo", 1, 3.0): 1.05}
    asked = []

    def fake(known_, lo_, hi_, N_, mu_):
        key = next(("hi", k, hi_[0, k]) for k in range(2) if hi_[0, k] < 9) if (hi_ < 9).any() else \
            next(("lo", k, lo_[0, k]) for k in range(2) if lo_[0, k] > 0)
        asked.append(key)
        return scores[key]

    monkeypatch.setattr(pbm, "_box_value", fake)
    assert pbm._branching(known, one, lo, hi, known, N, mu) == (0, 1, 2.0)
    assert sorted(asked) == sorted(scores)
    scores[("lo", 0, 4.0)] = 1.3  # now type 0's weaker box (1.2) beats type 1's (1.0)
    assert pbm._branching(known, one, lo, hi, known, N, mu) == (0, 0, 3.0)
    # Whole means from differing plans: the only candidate splits between them, unscored.
    asked.clear()
    plans = [np.array([[2.0, 4.0], [2.0, 2.0]]), np.array([[3.0, 3.0]])]
    assert pbm._branching(plans, one, lo, hi, plans, N, mu) == (0, 1, 3.0) and not asked
    # Every model on one plan: nothing to split.
    assert pbm._branching(plans, [np.array([1.0, 0.0]), np.array([1.0])], lo, hi, plans, N, mu) is None


def test_a_box_without_a_known_plan_of_some_model_scores_highest():
    from ppipe.planner.price_bound import _box_value

    known = [np.array([[2.0, 4.0], [5.0, 1.0]]), np.array([[3.0, 3.0]])]
    N, mu, lo = np.array([9.0, 9.0]), np.array([0.5, 0.5]), np.zeros((2, 2))
    hi = np.full((2, 2), 9.0)
    assert np.isfinite(_box_value(known, lo, hi, N, mu))
    hi[1, 0] = 2.0  # model 1's only plan needs 3 of type 0
    assert _box_value(known, lo, hi, N, mu) == np.inf


def test_milp_column_bounds_can_be_changed_by_index():
    from ppipe.planner.milp import Milp

    milp = Milp()
    milp.add_cols(2, lb=0, ub=5, name="a")
    milp.add_cols(3, lb=1, ub=7, name="b")
    milp.set_col_bounds([1, 3], [2.0, 3.0], [4.0, 6.0])
    lb, ub, *_ = milp.arrays()
    assert lb.tolist() == [0, 2, 1, 3, 1] and ub.tolist() == [5, 4, 7, 6, 7]


@pytest.mark.parametrize("workers", [1, 2])
@pytest.mark.parametrize("above, refuted", [(1.001, True), (1.0, False)])
def test_branching_keeps_every_plan_in_one_of_the_boxes(monkeypatch, above, refuted, workers):
    # Small cases are refuted at the root, so the root is told that no price refutes (a
    # mix of two of model 0's plans): the search must branch, refute both boxes above the
    # optimum, and keep the box that holds the optimal plan's GPU vector at the optimum;
    # with one worker as with two bounding boxes at once.
    import ppipe.planner.price_bound as pbm

    monkeypatch.setattr(pbm, "WORKERS", workers)

    cl, specs, configs, z = _case({"A": 2, "B": 4, "C": 4})
    calls = _force_a_branch_at_the_root(monkeypatch)
    bound = _bound(cl, specs, configs)
    assert bound.refutes(z * above) is refuted
    assert calls, "the root was never asked"
    assert bound.nodes >= (3 if refuted else 2)  # the root and its boxes


def test_a_new_plan_that_completes_a_fitting_combination_ends_the_search():
    def up(*corners):
        g = np.zeros((4, 4), bool)
        for c in corners:
            g[c[0]:, c[1]:] = True
        return g

    from ppipe.planner.price_bound import _fitting_combination

    N = np.array([3.0, 3.0])
    reach = [up(), up((1, 1)), up((1, 0))]
    assert not _fitting_combination(reach, N, 0, np.array([2.0, 2.0]))  # (1, 1) left: model 1 fits, model 2 not
    assert reach[0][2, 2] and not reach[0][1, 3]  # the plan was recorded, upward
    budgets = _fitting_combination(reach, N, 0, np.array([1.0, 2.0]))  # (2, 1) left: (1, 1) + (1, 0)
    assert [list(r) for r in budgets] == [[1, 2], [1, 1], [1, 0]]


@pytest.mark.parametrize("work, first", [(None, 2), ([3000.0, 1000.0, 2000.0], 1)])
def test_a_round_solves_the_quickest_model_first(monkeypatch, work, first):
    # Before any solve, the model with the fewest configurations (listed last here) goes
    # first; after, the one whose last solve took the least work: a model that falls short
    # then ends the round before the slow ones run.
    cl, specs, configs, z = _case({"A": 2, "B": 4, "C": 4})
    specs, configs = specs[::-1], configs[::-1]
    assert [len(c) for c in configs] == sorted((len(c) for c in configs), reverse=True)
    bound = _bound(cl, specs, configs)
    if work is not None:
        bound.work = np.array(work)
    order = []
    real = PriceBound._solve_model

    def spy(self, know, sub, *args, **kw):
        order.append(sub[2])
        return real(self, know, sub, *args, **kw)

    monkeypatch.setattr(PriceBound, "_solve_model", spy)
    assert bound.refutes(z * 1.001)
    assert order[0] == first


@pytest.mark.parametrize("scale", [1e-3, 1.0, 1e6])
def test_models_not_solved_yet_are_estimated_from_the_solved_ones(scale):
    # A round that stopped early left some models solved and some not:
    # those count as their size times the solved ones' median work per configuration, so
    # the raw scale of HiGHS's work never decides (the size placeholders once put a 0.02 s
    # model last behind two unsolved ones).
    from ppipe.planner.price_bound import _quickest_first

    cl, specs, configs, z = _case({"A": 2, "B": 4, "C": 4})
    size = np.array([len(c) for c in configs], dtype=float)
    work = np.array([np.nan, scale * size[1], np.nan])  # one solved: all by size
    assert list(_quickest_first(work, configs)) == list(np.argsort(size, kind="stable"))
    work = np.array([0.5 * scale * size[0], np.nan, 4.0 * scale * size[2]])  # model 1: 2.25 per config
    assert list(_quickest_first(work, configs)) == [0, 1, 2]


def _force_a_branch_at_the_root(monkeypatch):
    """Small cases are refuted at the root: make the root's Kelley LP answer that no price
    refutes, with a mix of two of model 0's plans, so that the search must branch."""
    import ppipe.planner.price_bound as pbm

    real = pbm.kelley_lp
    calls = []

    def root_says_no(N, cuts, weights=False):
        value, x, w = real(N, cuts, weights=True)
        if not calls:
            calls.append(1)
            value, w = 1.0, unrefuted_root_weights(cuts)
        return value, x, w

    monkeypatch.setattr(pbm, "kelley_lp", root_says_no)
    return calls


def _solve_log(monkeypatch, workers, delay=None):
    """(outcomes, the found plans, boxes of the second search, each model's work, whether
    any model was solved) of two searches, the second one forced to branch, with ``workers`` threads and ``delay(box) -> seconds``
    slept before each solve."""
    import time as _time

    import ppipe.planner.price_bound as pbm

    monkeypatch.setattr(pbm, "WORKERS", workers)
    cl, specs, configs, z = _case({"A": 2, "B": 4, "C": 4})
    real = PriceBound._solve_model
    log = []

    def spy(self, know, sub, mu, deadline, box, *args, **kw):
        if delay is not None:
            _time.sleep(delay(box))
        out = real(self, know, sub, mu, deadline, box, *args, **kw)
        log.append((sub[2], tuple(box[0]), tuple(box[1]), None if out[1] is None else tuple(out[1])))
        return out

    monkeypatch.setattr(PriceBound, "_solve_model", spy)
    bound = _bound(cl, specs, configs)
    outcome = [bound.refutes(z * 1.001)]
    _force_a_branch_at_the_root(monkeypatch)
    before = bound.nodes
    outcome.append(bound.refutes(z))
    found = [m.model_dump() for m in bound.found or []]
    # The solves' order across threads, and those of a box stopped because one before it
    # was not proven, follow the timing; what the search keeps does not.
    return outcome, found, bound.nodes - before, bound.work.tolist(), len(log) > 0


def test_the_search_does_not_depend_on_workers_or_their_timing(monkeypatch):
    # Each batch of boxes is bounded from the same knowledge and merged in box order: one
    # worker, two, and two whose solves are delayed unevenly (the later box first) make
    # the same solves, the same outcome and the same plan.
    from ppipe.planner import price_bound

    if (os.cpu_count() or 1) < 2:
        monkeypatch.setattr(price_bound.os, "cpu_count", lambda: 2)  # two threads even on one core
    serial = _solve_log(monkeypatch, 1)
    assert serial[0] == [True, False] and serial[4] and serial[1], "the second search should end at a plan"
    assert serial[2] >= 2, "the search did not branch"
    assert _solve_log(monkeypatch, 2) == serial
    # The later box's solves first: the box above the root's cut waits.
    assert _solve_log(monkeypatch, 2, delay=lambda box: 0.05 if box[0].sum() > 0 else 0.0) == serial


def test_the_search_does_not_depend_on_the_clock(monkeypatch):
    # The order of the solves follows HiGHS's work, not the wall clock: a clock that jumps
    # at random (but never past a deadline) changes nothing.
    import random
    import types

    from ppipe.planner import price_bound

    cl, specs, configs, z = _case({"A": 4, "B": 6, "C": 4})
    real = PriceBound._solve_model
    runs = []
    for seed in (1, 2, 3):
        rng = random.Random(seed)
        monkeypatch.setattr(price_bound, "time", types.SimpleNamespace(perf_counter=lambda: rng.uniform(0.0, 1e6)))
        bound, order = _bound(cl, specs, configs), []
        assert bound.refutes(z * 1.001)

        def spy(self, know, sub, *args, _order=order, **kw):
            _order.append(sub[2])
            return real(self, know, sub, *args, **kw)

        monkeypatch.setattr(PriceBound, "_solve_model", spy)
        assert bound.refutes(z * 1.0005)
        monkeypatch.setattr(PriceBound, "_solve_model", real)
        runs.append(order)
    assert len(runs[0]) >= 3 and runs[0] == runs[1] == runs[2]


@pytest.mark.parametrize("counts", [{"A": 2, "B": 4, "C": 4}, {"A": 4, "B": 6, "C": 4}])
def test_a_reachable_level_leaves_a_plan_that_reaches_it(counts):
    # Where known plans reach the level together (from the restriction's LP alone in the
    # first case, after exact solves in the second), the bound keeps them as a whole plan.
    from ppipe.planner.formulation import gpus_needed

    cl, specs, configs, z = _case(counts)
    bound = _bound(cl, specs, configs)
    T = 0.999 * z
    assert not bound.refutes(T)
    assert bound.found is not None
    assert min(m.throughput_rps / s.weight for m, s in zip(bound.found, specs)) >= T * (1 - 1e-6)
    used = gpus_needed(bound.found, list(counts), "paper")
    assert all(used[k] <= n for k, n in counts.items())


def test_a_known_plan_prunes_the_solve_but_not_the_bound():
    # Given the price of a plan known in the box, the solve prunes what cannot beat it
    # from the start; the bound it returns is the same, and the plan that reaches it is
    # still found (or a cheaper one).
    cl, specs, configs, z = _case({"A": 4, "B": 6, "C": 4})
    bound = _bound(cl, specs, configs)
    subs = bound._subproblems(z * 1.001)
    box = (np.zeros(3), bound.N)
    mu = 1000.0 / (3 * bound.N)
    for sub in subs:
        lb, u = bound._solve_model(bound.knowledge(1.0), sub, mu, None, box)
        lb_known, u_known = bound._solve_model(bound.knowledge(1.0), sub, mu, None, box, known=float(u @ mu))
        assert lb_known == pytest.approx(lb, rel=1e-6)
        assert u_known is not None and float(u_known @ mu) <= float(u @ mu) * (1 + 1e-9)


def _one_subproblem():
    """(bound, its first model's subproblem just above the optimum, the whole box, uniform prices)."""
    cl, specs, configs, z = _case({"A": 4, "B": 6, "C": 4})
    bound = _bound(cl, specs, configs)
    sub = bound._subproblems(z * 1.001)[0]
    return bound, sub, (np.zeros(3), bound.N), 1000.0 / (3 * bound.N)


def test_a_known_price_set_too_low_only_weakens_the_bound():
    # The cutoff assumes the known plan is in the box; were its price too low, the solve
    # would find nothing below the cutoff, and the bound falls back to that price: lower
    # than the true one, never above it, never "infeasible".
    bound, sub, box, mu = _one_subproblem()
    lb, _ = bound._solve_model(bound.knowledge(1.0), sub, mu, None, box)
    for share in (0.5, 0.99):
        weak, _ = bound._solve_model(bound.knowledge(1.0), sub, mu, None, box, known=share * lb)
        assert np.isfinite(weak) and weak <= lb * (1 + 1e-9)


def test_a_solve_asked_only_for_enough_bounds_by_it_and_never_above_the_truth():
    # The last solve of a round needs only P_m > its target: asked for ``enough`` below
    # P_m, the solve proves at least that much (never more than the truth); above P_m, it
    # still finds the optimal plan and its price.
    bound, sub, box, mu = _one_subproblem()
    lb, u = bound._solve_model(bound.knowledge(1.0), sub, mu, None, box)
    for share in (0.9, 0.999):
        got, plan = bound._solve_model(bound.knowledge(1.0), sub, mu, None, box, known=float(u @ mu), enough=share * lb)
        assert share * lb <= got <= lb * (1 + 1e-6)
    got, plan = bound._solve_model(bound.knowledge(1.0), sub, mu, None, box, known=float(u @ mu), enough=1.01 * lb)
    assert got == pytest.approx(lb, rel=1e-6) and plan is not None


def test_a_solve_stopped_by_its_time_limit_proves_only_its_dual_bound(monkeypatch):
    # HiGHS stopped by the clock may hold a plan above the cutoff without having searched
    # below it: the bound is then its dual bound, never the level the caller asked for.
    import ppipe.planner.price_bound as pbm
    from ppipe.planner.solvers import SolveResult

    bound, sub, box, mu = _one_subproblem()
    lb, u = bound._solve_model(bound.knowledge(1.0), sub, mu, None, box)
    x = np.zeros(sub[0].num_cols)
    stopped = SolveResult("highs", "time_limit", x, 2.0 * lb, 0.9, 0.01)  # dual bound 0.2 lb

    class Clocked:
        def __init__(self, options):
            pass

        def solve(self, milp, **kw):
            return stopped

    monkeypatch.setattr(pbm, "HighsSolver", Clocked)
    got, plan = bound._solve_model(bound.knowledge(1.0), sub, mu, None, box, known=float(u @ mu), enough=0.99 * lb)
    assert got <= 0.25 * lb and plan is None


def _two_workers(monkeypatch):
    import ppipe.planner.price_bound as pbm

    monkeypatch.setattr(pbm, "WORKERS", 2)
    monkeypatch.setattr(pbm.os, "cpu_count", lambda: 2)  # two threads whatever this host has
    cl, specs, configs, z = _case({"A": 2, "B": 4, "C": 4})
    bound = _bound(cl, specs, configs)
    assert bound.workers == 2
    return bound, z


def test_a_box_not_proven_stops_the_boxes_after_it(monkeypatch):
    # Two workers: the root splits; the batch's first box is not proven, so the search ends
    # False and the second box, still being bounded, is told to stop (a solve it runs
    # would be interrupted) instead of running on to its deadline.
    import threading

    bound, z = _two_workers(monkeypatch)
    calls, told, lock = [], threading.Event(), threading.Lock()

    def bound_box(self, know, lo, hi, subs, deadline, stopped):
        with lock:
            calls.append(1)
            n = len(calls)
        if n == 1:
            return (0, 0, 0.0)  # the root: two boxes
        if lo[0, 0] == 1.0:  # the batch's first box (the stack's top, above the cut): not proven
            threading.Event().wait(0.05)
            return False
        for _ in range(1000):  # the other box: bounded until told
            if stopped():
                told.set()
                return False
            threading.Event().wait(0.01)
        return None

    monkeypatch.setattr(PriceBound, "_bound_box", bound_box)
    assert not bound.refutes(z * 1.001)
    assert told.is_set(), "the box after the one not proven was not told that the search ended"


def test_an_error_in_a_worker_is_raised_to_the_caller(monkeypatch):
    bound, z = _two_workers(monkeypatch)

    def bound_box(self, *args):
        raise RuntimeError("boom")

    monkeypatch.setattr(PriceBound, "_bound_box", bound_box)
    with pytest.raises(RuntimeError, match="boom"):
        bound.refutes(z * 1.001)


def test_a_solve_told_to_stop_ends_as_a_time_limit():
    # HighsSolver(stop=...): a branch-and-bound search interrupted at once, not run out.
    from ppipe.planner.milp import Milp
    from ppipe.planner.solvers import SolverTimeLimitError

    rng = np.random.default_rng(1)
    a = rng.integers(0, 100, size=(2, 16)).astype(float)
    milp = Milp()
    x = milp.add_cols(16, lb=0, ub=1, integer=True, name="x")
    for r in range(2):  # market split: hundreds of nodes to find the one plan
        milp.add_row({int(c): float(v) for c, v in zip(x, a[r])}, lb=float(a[r].sum() // 2), ub=float(a[r].sum() // 2))
    milp.set_objective({int(c): 1.0 for c in x}, "max")
    free = HighsSolver().solve(milp, time_limit_s=30)
    assert free.status == "optimal" and free.nodes > 100
    try:
        told = HighsSolver().solve(milp, time_limit_s=30, stop=lambda: True)
    except SolverTimeLimitError:  # stopped before any plan: as a time limit without one
        return
    assert told.status == "time_limit" and told.nodes < free.nodes


def test_a_solve_stopped_at_its_target_only_raises_the_models_work(monkeypatch):
    # The round order reads each model's work: a solve that stopped early at a cheap plan
    # did only part of a proof, so it may raise the measure but never lower it; a solve
    # that ran to its end sets it.
    import ppipe.planner.price_bound as pbm
    from ppipe.planner.solvers import SolveResult

    bound, sub, box, mu = _one_subproblem()
    x = np.zeros(sub[0].num_cols)
    results = []

    class Scripted:
        def __init__(self, options):
            pass

        def solve(self, milp, **kw):
            return results.pop(0)

    monkeypatch.setattr(pbm, "HighsSolver", Scripted)
    m, know = sub[2], bound.knowledge(1.0)
    for status, its, want in [("optimal", 5000, 5000), ("time_limit", 300, 5000), ("time_limit", 9000, 9000), ("optimal", 200, 200)]:
        results.append(SolveResult("highs", status, x, 1.0, 0.0, 0.01, nodes=1, lp_iterations=its))
        bound._solve_model(know, sub, mu, None, box)
        assert know.work[m] == want, (status, its)
