"""Load sweeps: the search finds each model's largest grid load with attainment >= target."""

from __future__ import annotations

import importlib
from types import SimpleNamespace

import pytest
from sim_fakes import FakeScheduler

from ppipe.sim.simulator import SimConfig
from ppipe.sim.sweep import base_rates, run_point, sweep

sweep_mod = importlib.import_module("ppipe.sim.sweep")  # the package re-exports a function of the same name


def _fake_point(thresholds: dict[str, float], calls: list):
    """run_point stand-in: a model meets 100 % up to its threshold, then ~capacity/load."""

    def fake(plan, profiles, cluster, load, **kw):
        calls.append(load)
        models = {}
        for m, cap in thresholds.items():
            att = 1.0 if load <= cap + 1e-9 else min(0.985, (cap + 0.02) / load)
            models[m] = SimpleNamespace(attainment=att)
        return SimpleNamespace(models=models, stopped_at_s=None)

    return fake


@pytest.mark.parametrize("search", ["scan", "bisect", "guided"])
def test_search_finds_the_threshold_per_model(monkeypatch, tiny, search):
    plan, profiles, cluster = tiny
    thresholds = {"tiny": 0.65}
    calls: list = []
    monkeypatch.setattr(sweep_mod, "run_point", _fake_point(thresholds, calls))
    res = sweep(plan, profiles, cluster, search=search)
    assert res.max_load == {"tiny": 0.65}
    assert len(calls) == len(set(calls))  # no load simulated twice
    if search == "scan":
        assert calls == [round(1.0 - 0.05 * i, 4) for i in range(8)]  # 1.0 down to 0.65
    if search == "guided":
        assert len(calls) <= 4


def test_several_models_and_none_passing(monkeypatch, tiny):
    plan, profiles, cluster = tiny
    thresholds = {"a": 1.0, "b": 0.3, "c": 0.0}
    for search in ("scan", "bisect", "guided"):
        calls: list = []
        monkeypatch.setattr(sweep_mod, "run_point", _fake_point(thresholds, calls))
        plan2 = plan.model_copy(update={"models": [plan.models[0].model_copy(update={"name": n}) for n in thresholds]})
        res = sweep(plan2, profiles, cluster, search=search)
        assert res.max_load == {"a": 1.0, "b": 0.3, "c": None}, search
        assert res.mean_max_load == pytest.approx(1.3 / 3)


def test_bisect_steps_refine_below_the_grid(monkeypatch, tiny):
    plan, profiles, cluster = tiny
    calls: list = []
    monkeypatch.setattr(sweep_mod, "run_point", _fake_point({"tiny": 0.67}, calls))
    res = sweep(plan, profiles, cluster, search="guided", bisect_steps=2)
    assert res.max_load["tiny"] == pytest.approx(0.6625)  # 0.65 + 0.0125: within 0.0125 of 0.67


def test_real_runs_on_the_tiny_plan(tiny):
    plan, profiles, cluster = tiny
    fake = lambda p, pr, c, clock: FakeScheduler(p, pr, c, clock)  # noqa: E731
    cfg = SimConfig(duration_s=1.0)
    low = run_point(plan, profiles, cluster, 0.2, config=cfg, scheduler_factory=fake)
    assert low.attainment == 1.0
    assert low.overall.offered_rps == pytest.approx(0.2 * base_rates(plan)["tiny"], rel=0.1)
    # explicit rates (another plan's) replace the plan's own
    other = run_point(plan, profiles, cluster, 0.5, rates_rps={"tiny": 100.0}, config=cfg, scheduler_factory=fake)
    assert other.overall.offered_rps == pytest.approx(50, rel=0.3)
    res = sweep(plan, profiles, cluster, config=cfg, scheduler_factory=fake, search="scan")
    assert res.max_load["tiny"] is not None and 0.3 <= res.max_load["tiny"] < 1.0
    assert all(r.models["tiny"].attainment < 0.99 for f, r in res.points.items() if f > res.max_load["tiny"])


def test_missing_rate_is_a_user_error(tiny):
    from ppipe.errors import UserError

    plan, profiles, cluster = tiny
    with pytest.raises(UserError, match="no rate"):
        run_point(plan, profiles, cluster, 1.0, rates_rps={"other": 1.0})


@pytest.mark.artifact
def test_plans_made_from_in_memory_artifact_profiles_reload(artifact_dir, tmp_path):
    """plan.yaml records such profiles as 'ppipe-artifact:<dir>#<model>'; simulate and serve
    must reload them through the same resolver as the planner."""
    import ppipe
    from ppipe.runtime.launch.deploy import load_deployment
    from ppipe.spec.artifact import load_artifact_model

    prof = load_artifact_model(artifact_dir, "repvgg-b3")
    path = ppipe.plan("HC2-S", [prof], planner="np").save(tmp_path / "plan.yaml")
    plan, profiles, cluster = sweep_mod.load_inputs(path)
    assert plan.models[0].profile.startswith("ppipe-artifact:")
    assert profiles["repvgg-b3"].table == prof.table and cluster.name == "HC2-S"
    assert load_deployment(str(path), None).profiles["repvgg-b3"].table == prof.table


def test_early_stop_cuts_a_run_only_when_it_must_fail(tiny):
    plan, profiles, cluster = tiny
    full = run_point(plan, profiles, cluster, 2.0, config=SimConfig(duration_s=2.0))
    cut = run_point(plan, profiles, cluster, 2.0, config=SimConfig(duration_s=2.0, stop_below=0.99))
    assert full.stopped_at_s is None and full.attainment < 0.99
    assert cut.stopped_at_s is not None and cut.stopped_at_s < 1.0 and cut.attainment < 0.99
    assert cut.overall.requests < full.overall.requests
    # up to the stop it is the same run: every request decided there ended the same way
    by_id = {r.id: r for r in full.records}
    decided = [r for r in cut.records if r.outcome.value != "unfinished"]
    assert decided and all((r.outcome, r.completion_us) == (by_id[r.id].outcome, by_id[r.id].completion_us) for r in decided)
    # a point that passes runs to the end
    ok = run_point(plan, profiles, cluster, 0.5, config=SimConfig(duration_s=2.0, stop_below=0.99))
    assert ok.stopped_at_s is None and ok.attainment >= 0.99


def test_early_stop_waits_for_a_tenth_of_the_window(tiny):
    # the guided sweep reads a stopped run's served share as the capacity: a stop in the
    # first instants would read a warm-up, not the steady state
    plan, profiles, cluster = tiny
    cut = run_point(plan, profiles, cluster, 2.0, config=SimConfig(duration_s=20.0, stop_below=0.99))
    assert cut.stopped_at_s is not None and 1.75 < cut.stopped_at_s <= 2.0 and cut.attainment < 0.99


def test_sweep_gives_the_same_answer_with_and_without_early_stop(tiny):
    plan, profiles, cluster = tiny
    cfg = SimConfig(duration_s=1.0)
    for search in ("scan", "guided"):
        slow = sweep(plan, profiles, cluster, config=cfg, search=search, early_stop=False)
        fast = sweep(plan, profiles, cluster, config=cfg, search=search)
        assert fast.max_load == slow.max_load
        assert any(r.stopped_at_s is not None for r in fast.points.values())
        assert all(r.stopped_at_s is None for r in slow.points.values())
        for load, r in fast.points.items():
            if load in slow.points:
                assert (r.attainment >= 0.99) == (slow.points[load].attainment >= 0.99)


@pytest.mark.artifact
def test_early_stop_waits_while_any_model_can_still_pass(artifact_dir):
    import ppipe
    from ppipe.spec.artifact import load_artifact_model
    from ppipe.spec.cluster import load_cluster

    profs = [load_artifact_model(artifact_dir, n) for n in ("repvgg-b3", "googlenet-v3-pytorch")]
    cluster = load_cluster("HC2-S")
    plan = ppipe.plan(cluster, profs, formulation="ppipe-atc25")
    base = base_rates(plan)
    rates = {"repvgg-b3": 5 * base["repvgg-b3"], "googlenet-v3-pytorch": 0.3 * base["googlenet-v3-pytorch"]}
    res = run_point(plan, {p.name: p for p in profs}, cluster, 1.0, rates_rps=rates,
                    config=SimConfig(duration_s=2.0, stop_below=0.99, feedback="changed"))
    assert res.stopped_at_s is None
    assert res.models["repvgg-b3"].attainment < 0.99 <= res.models["googlenet-v3-pytorch"].attainment
