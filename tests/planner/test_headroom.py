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
    assert paper.settings.headroom_util is None and off.settings.headroom_util is None
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
