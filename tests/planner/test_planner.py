"""Planner behaviour: baselines' shapes, objectives, solvers, plan files, artifact cases."""

from __future__ import annotations

import math
import sys

import pytest

import ppipe
from planner_synth import cluster, profile
from ppipe.errors import InfeasibleError, NotAvailableError, UserError
from ppipe.planner.formulation import gpus_needed
from ppipe.planner.milp import Milp
from ppipe.spec.plan import load_plan

LEVELS = {"A": [1, 2], "B": [1, 2]}
LAT = {"A": [2000.0, 3000.0, 1000.0, 1500.0], "B": [3000.0, 9000.0, 1500.0, 2000.0]}
LAT2 = {"A": [1500.0, 1000.0, 2500.0, 500.0], "B": [2500.0, 2000.0, 8000.0, 900.0]}
CUTS = [200_000, 100_000, 50_000]
# Small GPU counts make max-min MILPs hard to prove; these tests check shapes, not optimality.
FAST = dict(max_partitions=2, gap=1e-3)


@pytest.fixture
def small():
    cl = cluster({"A": 4, "B": 8}, LEVELS, per_server=2)
    return cl, [profile("m1", LAT, CUTS, LEVELS), profile("m2", LAT2, CUTS, LEVELS)]


def _gpus(plan):
    return gpus_needed(plan.models, list(plan.gpus_used), plan.settings.gpu_rule)


def test_plan_respects_capacity_and_placement(small):
    cl, models = small
    plan = ppipe.plan(cl, models, slo_ms=30.0, **FAST)
    assert plan.solver.status == "optimal"
    need = _gpus(plan)
    assert all(need[k] <= cl.gpu_counts[k] for k in need)
    assert len(plan.placement) == sum(p.count for m in plan.models for pp in m.pipelines for p in pp.partitions)
    for m in plan.models:
        assert m.throughput_rps == pytest.approx(sum(p.throughput_rps for p in m.pipelines))
        for pp in m.pipelines:
            assert len(pp.partitions) <= 3
            assert pp.latency_us <= m.slo_ms * 1000 * (1 - plan.settings.margin) + 1e-6
            assert pp.throughput_rps == pytest.approx(min(p.throughput_rps for p in pp.partitions))


def test_np_shape(small):
    cl, models = small
    plan = ppipe.plan(cl, models, slo_ms=30.0, planner="np", **FAST)
    assert plan.settings.planner == "np" and plan.settings.max_partitions == 1
    for m in plan.models:
        for pp in m.pipelines:
            assert len(pp.partitions) == 1
            assert pp.partitions[0].vgpu == 1 and pp.partitions[0].first_block == 0


def test_ppipe_beats_np_and_dart_r_shape(small):
    cl, models = small
    npp = ppipe.plan(cl, models, slo_ms=30.0, planner="np", **FAST)
    pp = ppipe.plan(cl, models, slo_ms=30.0, **FAST)
    assert pp.solver.objective >= npp.solver.objective - 1e-6
    dr = ppipe.plan(cl, models, slo_ms=30.0, planner="dart-r", **FAST)
    assert dr.solver.status == "heuristic"
    total = {"A": 0, "B": 0}
    for m in dr.models:
        nm = npp.model(m.name)
        pairs = [p for p in m.pipelines if len(p.partitions) == 2]
        singles = [p for p in m.pipelines if len(p.partitions) == 1]
        assert len(singles) <= 2
        for p in pairs:  # a 1 high + 1 low replica of whole GPUs
            assert [x.count for x in p.partitions] == [1, 1]
            assert {x.gpu for x in p.partitions} == {"A", "B"}
            assert all(x.vgpu == 1 for x in p.partitions)
        # all pair replicas are the same configuration
        assert len({tuple((x.first_block, x.gpu) for x in p.partitions) for p in pairs}) <= 1
        for p in singles:
            assert p.partitions[0].vgpu == 1
        for p in m.pipelines:
            for x in p.partitions:
                total[x.gpu] += x.count
        # each model keeps at least NP's GPUs of each type (the leftover is shared on top)
        for k in ("A", "B"):
            used_np = sum(x.count for p in nm.pipelines for x in p.partitions if x.gpu == k)
            used_dr = sum(x.count for p in m.pipelines for x in p.partitions if x.gpu == k)
            assert used_dr >= used_np or not pairs and not singles
    assert total["A"] <= 4 and total["B"] <= 8


def test_dart_r_needs_two_types():
    cl = cluster({"A": 2}, {"A": [1]})
    m = profile("m1", {"A": LAT["A"]}, CUTS, {"A": [1]})
    with pytest.raises(UserError, match="two GPU types"):
        ppipe.plan(cl, [m], slo_ms=30.0, planner="dart-r", **FAST)


def test_objectives(small):
    cl, models = small
    mm = ppipe.plan(cl, models, slo_ms=30.0, **FAST)
    tot = ppipe.plan(cl, models, slo_ms=30.0, objective="total", **FAST)
    assert tot.settings.objective == "total"
    assert sum(m.throughput_rps for m in tot.models) >= tot.solver.objective - 1e-6
    # the max-min plan is a feasible plan for the total objective
    assert tot.solver.objective >= sum(m.throughput_rps for m in mm.models) * (1 - 2e-4)
    # cheapest GPUs that carry half the max-min rates
    rates = {m.name: 0.5 * mm.solver.objective * m.weight for m in mm.models}
    cheap = ppipe.plan(cl, models, slo_ms=30.0, required_rps=rates, **FAST)
    assert cheap.settings.objective == "min-cost"
    for m in cheap.models:
        assert m.throughput_rps >= rates[m.name] - 1e-6
    assert sum(_gpus(cheap).values()) <= sum(_gpus(mm).values())
    assert cheap.solver.objective == pytest.approx(sum(_gpus(cheap).values()))
    with pytest.raises(InfeasibleError, match="min-cost"):
        ppipe.plan(cl, models, slo_ms=30.0, required_rps=1e7, **FAST)


def test_custom_objective_function(small):
    cl, models = small

    def most_m1_with_m2_floor(milp: Milp, v):
        milp.add_row({v.x_model["m2"]: 1.0}, lb=100.0, name="m2_floor")
        milp.set_objective({v.x_model["m1"]: 1.0}, "max")

    plan = ppipe.plan(cl, models, slo_ms=30.0, objective=most_m1_with_m2_floor, **FAST)
    assert plan.settings.objective == "most_m1_with_m2_floor"
    assert plan.model("m2").throughput_rps >= 100.0 - 1e-6
    assert plan.model("m1").throughput_rps == pytest.approx(plan.solver.objective, rel=1e-6)


def test_cbc_agrees_with_highs(small):
    cl, models = small
    h = ppipe.plan(cl, models, slo_ms=30.0, max_partitions=2, gap=1e-9)
    c = ppipe.plan(cl, models, slo_ms=30.0, max_partitions=2, solver="cbc", gap=1e-9)
    assert c.solver.name == "cbc" and c.solver.status == "optimal"
    assert c.solver.objective == pytest.approx(h.solver.objective, rel=1e-6)


def test_gurobi_missing_is_a_clear_error(small, monkeypatch):
    # None in sys.modules makes the import fail, whether or not gurobipy is installed.
    monkeypatch.setitem(sys.modules, "gurobipy", None)
    cl, models = small
    with pytest.raises(NotAvailableError, match="gurobipy"):
        ppipe.plan(cl, models, slo_ms=30.0, solver="gurobi", **FAST)


def test_general_formulation_at_least_paper(small):
    cl, models = small
    for slo in (15.0, 30.0):
        paper = ppipe.plan(cl, models, slo_ms=slo, formulation="ppipe-atc25", **FAST)
        gen = ppipe.plan(cl, models, slo_ms=slo, formulation="ppipe-atc25", gpu_rule="physical", configs_per_template="many", **FAST)
        assert paper.settings.gpu_rule == "paper"
        # both stop within 0.1 % of their optimum
        assert gen.solver.objective >= paper.solver.objective * (1 - 2e-3)


def test_paper_one_config_per_template(small):
    cl, models = small
    plan = ppipe.plan(cl, models, slo_ms=30.0, formulation="ppipe-atc25", **FAST)
    for m in plan.models:
        templates = [tuple(p.template) for p in m.pipelines]
        assert len(templates) == len(set(templates))


def test_plan_file_roundtrip(tmp_path, small):
    cl, models = small
    plan = ppipe.plan(cl, models, slo_ms=30.0, **FAST)
    path = plan.save(tmp_path / "plan.yaml")
    again = load_plan(path)
    assert again == plan
    with pytest.raises(Exception):
        plan.models[0].throughput_rps = 0.0  # immutable


@pytest.mark.artifact
def test_artifact_hc2_small(artifact_dir):
    from ppipe.spec.artifact import load_artifact_model

    names = ["repvgg-b3", "googlenet-v3-pytorch", "colorization-v2"]
    profs = [load_artifact_model(artifact_dir, n) for n in names]
    pp = ppipe.plan("HC2-S", profs, formulation="ppipe-atc25", max_partitions=2, weights=[0.3, 0.33, 0.37])
    npp = ppipe.plan("HC2-S", profs, formulation="ppipe-atc25", planner="np", weights=[0.3, 0.33, 0.37])
    assert pp.solver.status == "optimal"
    # SLO = 5 x the L4 batch-1 latency of model-latency-bs1.csv
    assert pp.model("repvgg-b3").slo_ms == pytest.approx(5 * profs[0].manifest.latency_bs1_us["L4"] / 1000)
    assert pp.solver.objective >= npp.solver.objective
    assert pp.model("repvgg-b3").profile.startswith("ppipe-artifact:")
    from ppipe.planner.api import load_profile_ref

    assert load_profile_ref(pp.model("repvgg-b3").profile).name == "repvgg-b3"
    assert math.isfinite(pp.solver.seconds)


@pytest.mark.parametrize(
    "kw, field, fix",
    [
        (dict(planner="bogus"), "planner", "--planner"),
        (dict(formulation="paper"), "formulation", "--formulation"),
        (dict(gpu_rule="shared"), "gpu_rule", "--gpu-rule"),
        (dict(configs_per_template="two"), "configs_per_template", "--configs-per-template"),
        (dict(margin=1.5), "margin", "--margin"),
        (dict(max_partitions=0), "max_partitions", "--max-partitions"),
        (dict(gap=-1.0), "gap", "--gap"),
        (dict(time_limit_s=0), "time_limit_s", "--time-limit-s"),
        (dict(headroom=1.5), "headroom", "--headroom-util"),
    ],
)
def test_a_bad_option_names_its_field_and_fix(kw, field, fix):
    # Checked before any profile is read: the message names the argument, the fix its flag.
    with pytest.raises(UserError) as exc:
        ppipe.plan("HC2-S", ["no-such-model"], **kw)
    assert exc.value.message.startswith(f"{field}: ") and fix in exc.value.fix
