"""The headroom pass: idle GPUs become extra vGPUs for the busiest pools, nothing else changes."""

from __future__ import annotations

import pytest

import ppipe
from ppipe.errors import UserError
from ppipe.planner.formulation import gpus_needed
from ppipe.planner.headroom import add_headroom
from ppipe.planner.placement import gpus_used, place
from ppipe.spec.plan import ModelPlan, PartitionPlan, PipelinePlan

from planner_synth import cluster, profile


def _pool(first, last, gpu, level, count, per_vgpu_rps):
    return PartitionPlan(first_block=first, last_block=last, gpu=gpu, vgpu=level, count=count, infer_us=1000.0,
                         throughput_rps=per_vgpu_rps * count)


def _model(name, pipes):
    out = []
    for parts in pipes:
        thr = min(p.throughput_rps for p in parts)
        out.append(PipelinePlan(batch=1, throughput_rps=thr, latency_us=2000.0, partitions=parts))
    return ModelPlan(name=name, profile=name, slo_ms=50.0, weight=1.0, throughput_rps=sum(p.throughput_rps for p in out), pipelines=out)


def test_busiest_pool_on_an_idle_type_grows_until_the_target():
    # Pipeline 100 req/s: the H pool binds (2 x 50), the L pool runs at 100/104 = 96 %.
    cl = cluster({"H": 2, "L": 10}, {"H": [1], "L": [1]})
    m = _model("a", [[_pool(0, 4, "L", 1, 4, 26.0), _pool(5, 9, "H", 1, 2, 50.0)]])
    (out,) = add_headroom([m], cl, "physical", target_util=0.8)
    low, high = out.pipelines[0].partitions
    # 100 / (26 n) <= 0.8  <=>  n >= 4.81: one more vGPU; the exhausted H pool is untouched.
    assert (low.count, low.headroom) == (5, 1)
    assert low.throughput_rps == pytest.approx(130.0)
    assert (high.count, high.headroom) == (2, 0)
    assert out.pipelines[0].throughput_rps == pytest.approx(100.0)  # still bound by H
    assert out.throughput_rps == pytest.approx(100.0)


def test_target_zero_uses_every_idle_gpu_and_never_more_than_the_cluster():
    cl = cluster({"H": 2, "L": 10}, {"H": [1], "L": [1]})
    m = _model("a", [[_pool(0, 4, "L", 1, 4, 26.0), _pool(5, 9, "H", 1, 2, 50.0)]])
    (out,) = add_headroom([m], cl, "physical", target_util=0.0)
    assert out.pipelines[0].partitions[0].count == 10
    assert gpus_needed([out], ["H", "L"], "physical") == {"H": 2, "L": 10}


def test_the_busier_pool_gets_the_vgpu_first():
    cl = cluster({"H": 2, "L": 5}, {"H": [1], "L": [1]})
    a = _model("a", [[_pool(0, 4, "L", 1, 2, 52.0), _pool(5, 9, "H", 1, 1, 100.0)]])  # L at 100/104
    b = _model("b", [[_pool(0, 4, "L", 1, 2, 60.0), _pool(5, 9, "H", 1, 1, 100.0)]])  # L at 100/120
    out = add_headroom([a, b], cl, "physical", target_util=0.8)
    # One idle L GPU: model a's pool (96 %) takes it, b's (83 %) is left as it was.
    assert [m.pipelines[0].partitions[0].headroom for m in out] == [1, 0]


def test_paper_rule_fills_a_rounded_up_gpu_before_taking_a_new_one():
    # 3 vGPUs at level 2 occupy ceil(3/2) = 2 GPUs under the paper rule: one free share.
    cl = cluster({"H": 1, "L": 2}, {"H": [1], "L": [2]})
    m = _model("a", [[_pool(0, 4, "L", 2, 3, 34.0), _pool(5, 9, "H", 1, 1, 100.0)]])
    (out,) = add_headroom([m], cl, "paper", target_util=0.8)
    assert out.pipelines[0].partitions[0].count == 4
    assert gpus_needed([out], ["H", "L"], "paper") == {"H": 1, "L": 2}
    # and the placement puts the extra vGPU on the free share
    pl = place([out], cl, "paper")
    assert len(pl) == 5 and gpus_used(pl, cl) == {"H": 1, "L": 2}


def test_nothing_to_do_returns_the_plans_unchanged():
    cl = cluster({"H": 2, "L": 4}, {"H": [1], "L": [1]})
    m = _model("a", [[_pool(0, 4, "L", 1, 4, 26.0), _pool(5, 9, "H", 1, 2, 50.0)]])
    assert add_headroom([m], cl, "physical", target_util=0.8) == [m]


def _synthetic():
    levels = {"H": [1], "L": [1]}
    cl = cluster({"H": 2, "L": 12}, levels)
    prof = profile("m", {"H": [1000.0] * 4, "L": [8000.0, 30000.0, 30000.0, 30000.0]}, [1000, 1000, 1000], levels, slo_ms=60.0)
    return cl, prof


def test_plan_api_defaults_and_records_the_target():
    cl, prof = _synthetic()
    default = ppipe.plan(cl, [prof], max_partitions=2)
    paper = ppipe.plan(cl, [prof], max_partitions=2, formulation="ppipe-atc25", slo_ms=60.0)
    off = ppipe.plan(cl, [prof], max_partitions=2, headroom=False)
    assert default.settings.headroom_util == 0.8
    # on in the paper's formulation too: the pass picks another optimal plan of the same MILP
    assert paper.settings.headroom_util == 0.8 and off.settings.headroom_util is None
    assert ppipe.plan(cl, [prof], max_partitions=2, planner="np").settings.headroom_util is None
    # same objective, never more GPUs than the cluster, and the idle L GPUs were used
    assert default.solver.objective == pytest.approx(off.solver.objective)
    assert all(default.gpus_used[k] <= n for k, n in cl.gpu_counts.items())
    assert sum(p.headroom for mp in default.models for pp in mp.pipelines for p in pp.partitions) > 0
    assert sum(default.gpus_used.values()) > sum(off.gpus_used.values())
    assert len(default.placement) == sum(p.count for mp in default.models for pp in mp.pipelines for p in pp.partitions)
    assert ppipe.plan(cl, [prof], max_partitions=2, formulation="ppipe-atc25", slo_ms=60.0, headroom=True).settings.headroom_util == 0.8


def test_bad_headroom_target_is_a_user_error():
    cl, prof = _synthetic()
    with pytest.raises(UserError, match="headroom utilization target"):
        ppipe.plan(cl, [prof], max_partitions=2, headroom=1.5)


def test_cli_flags_set_the_headroom_target(tmp_path):
    from click.testing import CliRunner

    from ppipe.cli import main
    from ppipe.spec.plan import load_plan

    cl, prof = _synthetic()
    model_dir = prof.save(tmp_path / "models" / "m")
    cl_file = tmp_path / "cl.yaml"
    from ppipe.spec.base import dump_yaml

    dump_yaml(cl.model_dump(mode="json"), cl_file)
    got = {}
    for flags in ((), ("--no-headroom",), ("--headroom-util", "0.5")):
        out = tmp_path / f"p{len(got)}.yaml"
        r = CliRunner().invoke(main, ["plan", str(cl_file), str(model_dir), "--max-partitions", "2", "-o", str(out), "--quiet", *flags])
        assert r.exit_code == 0, r.output
        got[flags] = load_plan(out).settings.headroom_util
    assert got == {(): 0.8, ("--no-headroom",): None, ("--headroom-util", "0.5"): 0.5}
    r = CliRunner().invoke(main, ["plan", str(cl_file), str(model_dir), "-o", str(tmp_path / "x.yaml"), "--headroom-util", "2"])
    assert r.exit_code == 2 and "headroom utilization target" in r.output


# --- the headroom plan is a solution of the MILP the planner solved ----------------------
# Why this matters: the max-min MILP has many optimal solutions that differ in the counts
# of pools that do not bind. The headroom pass picks one of them (idle GPUs to the busiest
# pools); these tests check, row by row, that what it returns is still a solution of the
# MILP with the paper's pool bounds g <= N_k v (ppipe's tighter U_{c,d} cut exactly the
# slack the pass adds) with the same objective value, as headroom.py claims.

LEVELS = {"A": [1, 2], "B": [1, 2]}
LATS = (
    {"A": [2000.0, 3000.0, 1000.0], "B": [3000.0, 9000.0, 1500.0]},
    {"A": [1500.0, 1000.0, 2500.0], "B": [2500.0, 2000.0, 8000.0]},
    {"A": [900.0, 4000.0, 700.0], "B": [1200.0, 2500.0, 3000.0]},
)


def _solved(gpu_rule, one, counts, slo_ms=25.0):
    from ppipe.planner.api import usable_levels
    from ppipe.planner.configs import ModelSpec
    from ppipe.planner.core import model_configs
    from ppipe.planner.formulation import build, extract
    from ppipe.planner.objectives import MaxMinNormalized
    from ppipe.planner.solvers import HighsSolver

    cl = cluster(counts, LEVELS, per_server=2)
    models = [profile(f"m{i}", lat, [200_000, 100_000], LEVELS) for i, lat in enumerate(LATS)]
    specs = [ModelSpec(profile=m, slo_ms=slo_ms, weight=w) for m, w in zip(models, (0.3, 0.33, 0.37))]
    configs = model_configs(specs, cl, [usable_levels(m, cl) for m in models], max_partitions=2, margin=0.2,
                            group_by_multiset=(gpu_rule == "physical" and not one))
    milps = {}
    for tight in (True, False):
        milp, v = build(specs, configs, cl, gpu_rule=gpu_rule, one_config_per_template=one, tight_bounds=tight)
        MaxMinNormalized().apply(milp, v)
        milps[tight] = (milp, v)
    milp, v = milps[True]
    res = HighsSolver().solve(milp, gap=1e-9, time_limit_s=60)
    assert res.status == "optimal"
    return cl, extract(res.x, v, specs), res.objective, milps


# Cases whose optimal plan leaves GPUs (or vGPU slots) idle. (Physical packing at 25 ms
# fills every GPU of {"A": 2, "B": 16}, there is nothing for the pass to use.)
@pytest.mark.parametrize(
    "gpu_rule,one,counts,slo_ms", [("paper", True, {"A": 6, "B": 12}, 25.0), ("physical", False, {"A": 2, "B": 16}, 15.0)]
)
@pytest.mark.parametrize("target", [0.8, 0.0])
def test_headroom_plan_is_an_optimal_solution_of_the_same_milp(gpu_rule, one, counts, slo_ms, target):
    from ppipe.planner.core import is_feasible
    from ppipe.planner.formulation import solution_vector

    cl, plans, z, milps = _solved(gpu_rule, one, counts, slo_ms)
    # the extracted plan itself round-trips into the tight MILP
    milp, v = milps[True]
    x = solution_vector(plans, v, milp.num_cols)
    assert is_feasible(milp, x) and x[v.extra["z"]] == pytest.approx(z, rel=1e-9)

    grown = add_headroom(plans, cl, gpu_rule, target_util=target)
    added = sum(p.headroom for m in grown for pp in m.pipelines for p in pp.partitions)
    assert added > 0  # the case leaves idle GPUs that the pass uses
    paper_milp, pv = milps[False]
    xg = solution_vector(grown, pv, paper_milp.num_cols)
    assert is_feasible(paper_milp, xg)
    assert xg[pv.extra["z"]] == pytest.approx(z, rel=1e-9)  # the same (optimal) objective value


def test_solution_vector_catches_a_plan_that_breaks_the_milp():
    from ppipe.planner.core import is_feasible
    from ppipe.planner.formulation import solution_vector

    cl, plans, _z, milps = _solved("paper", True, {"A": 6, "B": 12})
    paper_milp, pv = milps[False]
    m = plans[0]
    p0 = m.pipelines[0]
    part = p0.partitions[0]
    over = part.model_copy(update=dict(count=part.count + 100, throughput_rps=part.throughput_rps / part.count * (part.count + 100)))
    broken = m.model_copy(update=dict(pipelines=[p0.model_copy(update=dict(partitions=[over, *p0.partitions[1:]]))] + m.pipelines[1:]))
    assert not is_feasible(paper_milp, solution_vector([broken, *plans[1:]], pv, paper_milp.num_cols))
    other = p0.model_copy(update=dict(batch=p0.batch + 7))
    with pytest.raises(ValueError, match="not a column"):
        solution_vector([m.model_copy(update=dict(pipelines=[other])), *plans[1:]], pv, paper_milp.num_cols)
