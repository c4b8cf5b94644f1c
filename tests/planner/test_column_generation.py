"""Column generation (ppipe.planner.colgen): the LP bound of every configuration from a few
columns, an integer plan of the whole MILP from them, its gap honest, the same plan on
every run, and a re-plan that starts from the served plan."""

from __future__ import annotations

import numpy as np
import pytest

import ppipe.planner.colgen as colgen
from planner_synth import cluster, profile
from ppipe.errors import UserError
from ppipe.planner import api
from ppipe.planner.configs import ModelSpec, subset
from ppipe.planner.core import is_feasible, model_configs
from ppipe.planner.formulation import build, pipeline_columns, solution_vector
from ppipe.planner.objectives import MaxMinNormalized
from ppipe.planner.solvers import HighsSolver

LEVELS = {"A": [1, 2, 4], "B": [1, 2], "C": [1]}
LATS = (
    {"A": [2000.0, 3000.0, 1000.0, 1200.0], "B": [3000.0, 9000.0, 1500.0, 2000.0], "C": [4000.0, 7000.0, 2500.0, 3000.0]},
    {"A": [1500.0, 1000.0, 2500.0, 900.0], "B": [2500.0, 2000.0, 8000.0, 1500.0], "C": [3500.0, 3000.0, 6000.0, 2500.0]},
    {"A": [900.0, 4000.0, 700.0, 600.0], "B": [1200.0, 2500.0, 3000.0, 900.0], "C": [2000.0, 5000.0, 1800.0, 1500.0]},
)
COUNTS = {"A": 6, "B": 10, "C": 12}
KW = dict(weights=[0.3, 0.33, 0.37], slo_ms=30.0, max_partitions=3, margin=0.2, batch_build=False)
# Small enough for the whole MILP to be proven optimal in about a second.
SMALL_KW = dict(weights=[0.3, 0.33], slo_ms=30.0, max_partitions=2, margin=0.2, batch_build=False)


def _instance():
    cl = cluster(COUNTS, LEVELS, per_server=2)
    return cl, [profile(f"m{i}", lat, [200_000, 100_000, 50_000], LEVELS, batches=(1, 2, 4)) for i, lat in enumerate(LATS)]


def _small():
    cl = cluster({"A": 4, "B": 6, "C": 6}, LEVELS)
    return cl, [profile(f"m{i}", lat, [200_000, 100_000, 50_000], LEVELS, batches=(1, 2, 4)) for i, lat in enumerate(LATS[:2])]


def _configs(cl, models):
    specs = [ModelSpec(profile=p, slo_ms=KW["slo_ms"], weight=w) for p, w in zip(models, KW["weights"])]
    levels = [api.usable_levels(p, cl) for p in models]
    configs = model_configs(specs, cl, levels, max_partitions=3, margin=KW["margin"], group_by_multiset=True)
    return specs, configs


def _counts(cl):
    return np.array([cl.gpu_counts[g.name] for g in cl.gpu_types], dtype=float)


def test_the_master_lp_reaches_the_relaxation_of_the_whole_milp():
    cl, models = _instance()
    specs, configs = _configs(cl, models)
    gen = colgen.generate_columns(configs, KW["weights"], _counts(cl))
    milp, v = build(specs, configs, cl, gpu_rule="physical")
    MaxMinNormalized().apply(milp, v)
    relaxed = HighsSolver().relaxation(milp)
    assert gen.converged
    assert sum(len(c) for c in gen.columns) < sum(len(cs) for cs in configs)  # columns on demand
    assert gen.value == pytest.approx(relaxed.objective, rel=1e-6)
    assert relaxed.objective <= gen.bound <= relaxed.objective * (1 + 1e-6)


def test_the_bound_holds_when_generation_stops_early(monkeypatch):
    # Farley's bound is valid at every round, so a generation the clock stops still bounds.
    cl, models = _instance()
    specs, configs = _configs(cl, models)
    full = colgen.generate_columns(configs, KW["weights"], _counts(cl))
    monkeypatch.setattr(colgen, "MAX_ROUNDS", 1)
    early = colgen.generate_columns(configs, KW["weights"], _counts(cl))
    assert not early.converged and early.rounds == 1
    assert early.bound >= full.value * (1 - 1e-9)


def test_the_rounded_start_fits_the_gpus():
    cl, models = _instance()
    specs, configs = _configs(cl, models)
    gen = colgen.generate_columns(configs, KW["weights"], _counts(cl))
    sub = [subset(c, cols) for c, cols in zip(configs, gen.columns)]
    milp, v = build(specs, sub, cl, gpu_rule="physical")
    MaxMinNormalized().apply(milp, v)
    x = pipeline_columns(v, milp.num_cols, colgen.rounded_start(sub, gen.flows, _counts(cl)))
    x[v.extra["z"]] = min(x[v.x_model[s.name]] / s.weight for s in specs)
    assert is_feasible(milp, x) and x[v.extra["z"]] > 0


def test_the_column_plan_is_a_plan_of_the_whole_milp_within_its_gap():
    cl, models = _small()
    full = api.plan(cl, models, column_generation=False, headroom=False, time_limit_s=None, **SMALL_KW)
    cg = api.plan(cl, models, column_generation=True, headroom=False, time_limit_s=None, **SMALL_KW)
    assert full.solver.status == "optimal" and cg.solver.status in ("optimal", "feasible")
    assert cg.solver.method.startswith("column generation")
    z_cg, z_opt = cg.solver.objective, full.solver.objective
    assert z_cg <= z_opt * (1 + 1e-6) and z_opt <= z_cg * (1 + cg.solver.gap) * (1 + 1e-6)
    assert cg.solver.columns < full.solver.columns
    specs = [ModelSpec(profile=p, slo_ms=SMALL_KW["slo_ms"], weight=w) for p, w in zip(models, SMALL_KW["weights"])]
    configs = model_configs(specs, cl, [api.usable_levels(p, cl) for p in models], max_partitions=2,
                            margin=SMALL_KW["margin"], group_by_multiset=True)
    milp, v = build(specs, configs, cl, gpu_rule="physical")
    MaxMinNormalized().apply(milp, v)
    assert is_feasible(milp, solution_vector(cg.models, v, milp.num_cols))


def test_the_same_inputs_give_the_same_column_plan():
    cl, models = _small()
    a, b = (api.plan(cl, models, column_generation=True, time_limit_s=None, **SMALL_KW) for _ in range(2))
    zero = {"seconds": 0.0}
    assert a.model_copy(update={"solver": a.solver.model_copy(update=zero)}) == \
        b.model_copy(update={"solver": b.solver.model_copy(update=zero)})


def test_by_default_column_generation_serves_large_milps_only(monkeypatch):
    import ppipe.planner.core as core

    cl, models = _small()
    assert not api.plan(cl, models, time_limit_s=None, **SMALL_KW).solver.method.startswith("column generation")
    monkeypatch.setattr(core, "CG_MIN_COLUMNS", 10)
    assert api.plan(cl, models, time_limit_s=None, **SMALL_KW).solver.method.startswith("column generation")


def test_column_generation_refuses_the_papers_rule():
    cl, models = _instance()
    with pytest.raises(UserError, match=r"column generation plans the max-min objective under physical packing(.|\n)*To fix"):
        api.plan(cl, models, column_generation=True, gpu_rule="paper", **KW)


def test_a_replan_starts_from_the_served_plan():
    cl, models = _small()
    served = api.plan(cl, models, column_generation=True, time_limit_s=None, **SMALL_KW)
    specs = [ModelSpec(profile=p, slo_ms=SMALL_KW["slo_ms"], weight=w) for p, w in zip(models, SMALL_KW["weights"])]
    configs = model_configs(specs, cl, [api.usable_levels(p, cl) for p in models], max_partitions=2,
                            margin=SMALL_KW["margin"], group_by_multiset=True)
    warm = colgen.warm_columns(configs, specs, list(served.models))
    assert [len(w) for w in warm] == [len(m.pipelines) for m in served.models]
    again = api.plan(cl, models, column_generation=True, time_limit_s=None, warm_start=served, **SMALL_KW)
    assert again.solver.objective >= served.solver.objective * (1 - 1e-9)
    # A changed load (other weights): the served plan's columns still start the pricing.
    shifted = api.plan(cl, models, column_generation=True, time_limit_s=None, warm_start=served,
                       **{**SMALL_KW, "weights": [0.5, 0.25]})
    assert shifted.solver.objective > 0


def _shifted(weights, share):
    """The weights with ``share`` of their total moved from the second half of the models to the first."""
    w = np.asarray(weights, float) / np.sum(weights)
    half = len(w) // 2 or 1
    up, down = w[:half].sum(), w[half:].sum()
    return list(np.r_[w[:half] * (1 + share / up), w[half:] * (1 - share / down)])


def test_a_warm_replan_is_as_good_as_the_cold_ones_gap_allows():
    # Eight times the GPUs of _instance(): pools of a few tens of vGPUs, so that a plan can
    # be proven within 1 % of the LP bound (on 28 GPUs one vGPU is several per cent).
    cl = cluster({k: 8 * n for k, n in COUNTS.items()}, LEVELS, per_server=2)
    models = _instance()[1]
    kw = {**KW, "batch_build": True, "column_generation": True, "time_limit_s": None, "gap": 0.01}
    served = api.plan(cl, models, **kw)
    shifted = {**kw, "weights": _shifted(KW["weights"], 0.2)}
    cold = api.plan(cl, models, **shifted)
    warm, again = (api.plan(cl, models, warm_start=served, **shifted) for _ in range(2))
    for p in (cold, warm):
        assert p.solver.status in ("optimal", "feasible") and p.solver.gap < 0.02
    # One problem, one bound: each plan is within its proven gap of the other's objective,
    # and the warm plan loses at most the requested gap to the cold one.
    assert warm.solver.objective * (1 + warm.solver.gap) >= cold.solver.objective * (1 - 1e-9)
    assert cold.solver.objective * (1 + cold.solver.gap) >= warm.solver.objective * (1 - 1e-9)
    assert warm.solver.objective * (1 + 0.01) >= cold.solver.objective
    zero = {"seconds": 0.0}
    assert warm.model_copy(update={"solver": warm.solver.model_copy(update=zero)}) == \
        again.model_copy(update={"solver": again.solver.model_copy(update=zero)})


def test_column_generation_takes_x_hat_from_the_np_relaxation(monkeypatch):
    cl, models = _instance()
    calls = []
    real = api._Run.milp

    def recording(self, specs, objective, **k):
        calls.append((k.get("no_partitioning", False), [s.batch_build_rps for s in specs]))
        return real(self, specs, objective, **k)

    monkeypatch.setattr(api._Run, "milp", recording)
    plan = api.plan(cl, models, **{**KW, "batch_build": True, "column_generation": True, "time_limit_s": None, "gap": 0.1})
    assert plan.settings.batch_build and [np_ for np_, _ in calls] == [False]  # no NP MILP
    specs = [ModelSpec(profile=p, slo_ms=KW["slo_ms"], weight=w) for p, w in zip(models, KW["weights"])]
    np_configs = model_configs(specs, cl, [{k: [1] for k in LEVELS} for _ in models], max_partitions=1,
                               margin=KW["margin"], group_by_multiset=True)
    assert calls[0][1] == pytest.approx(colgen.relaxation_rates(np_configs, KW["weights"], _counts(cl)))
    calls.clear()
    small, small_models = _small()
    api.plan(small, small_models, **{**SMALL_KW, "batch_build": True, "time_limit_s": None})
    assert [np_ for np_, _ in calls] == [True, False]  # no column generation: the NP MILP, then the plan
