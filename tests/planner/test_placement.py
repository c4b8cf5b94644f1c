"""Placement of vGPUs onto physical GPUs of named servers."""

from __future__ import annotations

from collections import Counter

import pytest

from ppipe.errors import InfeasibleError
from ppipe.planner.placement import gpus_used, physical_gpus, place
from ppipe.spec import ModelPlan, PartitionPlan, PipelinePlan, load_cluster


def _part(first, last, gpu, vgpu, count):
    return PartitionPlan(first_block=first, last_block=last, gpu=gpu, vgpu=vgpu, count=count, infer_us=1000, throughput_rps=1)


def _model(name, pipelines):
    pipes = [PipelinePlan(batch=1, throughput_rps=1, latency_us=1, partitions=parts) for parts in pipelines]
    return ModelPlan(name=name, profile=name, slo_ms=100, weight=1, throughput_rps=1, pipelines=pipes)


def test_interleaves_servers():
    c = load_cluster("HC2-S")  # 1 L4 server with 4 GPUs; 6 T4 servers with 2
    t4 = physical_gpus(c, "T4")
    assert t4[:6] == [(f"t4-{i}", 0) for i in range(6)] and t4[6] == ("t4-0", 1)
    assert len(t4) == 12 and len(set(t4)) == 12


def test_physical_rule_packs_levels():
    c = load_cluster("HC2-S")
    m = _model("a", [[_part(0, 4, "T4", 2, 3), _part(5, 9, "L4", 4, 5)]])
    rows = place([m], c, "physical")
    assert len(rows) == 8
    t4 = [r for r in rows if r.partition == 0]
    # 3 vGPUs at level 2 -> 2 GPUs, slots 0,1 then 0
    assert Counter((r.server, r.gpu_index) for r in t4) == Counter({("t4-0", 0): 2, ("t4-1", 0): 1})
    l4 = [r for r in rows if r.partition == 1]
    assert {r.vgpu for r in l4} == {4} and len({(r.server, r.gpu_index) for r in l4}) == 2
    assert len({r.vgpu_id for r in rows}) == 8  # every vGPU has its own id
    assert gpus_used(rows, c) == {"L4": 2, "T4": 2}


def test_physical_rule_shares_gpus_across_models_of_a_level():
    c = load_cluster("HC2-S")
    a = _model("a", [[_part(0, 9, "L4", 2, 1)]])
    b = _model("b", [[_part(0, 9, "L4", 2, 1)]])
    rows = place([a, b], c)
    assert rows[0].server == rows[1].server and rows[0].gpu_index == rows[1].gpu_index
    assert {rows[0].slot, rows[1].slot} == {0, 1}


def test_too_many_vgpus_is_infeasible():
    c = load_cluster("HC2-S")
    m = _model("a", [[_part(0, 9, "L4", 1, 5)]])
    with pytest.raises(InfeasibleError, match=r"more than the 4 L4 GPUs"):
        place([m], c)


def test_unknown_gpu_type():
    with pytest.raises(InfeasibleError, match=r"does not have"):
        place([_model("a", [[_part(0, 9, "A100", 1, 1)]])], load_cluster("HC2-S"))


def test_paper_rule_mixes_levels_within_a_partition_group():
    c = load_cluster("HC2-S")
    # one pipeline at level 2 and one at level 4 in the same (model, partition 0, L4) group: 1/2 + 2/4 = 1 GPU
    m = _model("a", [[_part(0, 9, "L4", 2, 1)], [_part(0, 9, "L4", 4, 2)]])
    rows = place([m], c, "paper")
    assert len({(r.server, r.gpu_index) for r in rows}) == 1
    assert sorted(r.slot for r in rows) == [0, 1, 2]


def test_paper_rule_packs_where_first_fit_decreasing_fails():
    c = load_cluster("HC2-S")
    # 1/2 + 3 x 1/3 + 2 x 1/4 = 2 GPUs ({1/2, 1/4, 1/4} and {1/3 x 3}); FFD needs 3
    m = _model("a", [[_part(0, 9, "L4", 2, 1)], [_part(0, 9, "L4", 3, 3)], [_part(0, 9, "L4", 4, 2)]])
    rows = place([m], c, "paper")
    assert len({(r.server, r.gpu_index) for r in rows}) == 2


@pytest.mark.parametrize("halves", [0, 1])
@pytest.mark.parametrize("thirds", [0, 1, 2])
@pytest.mark.parametrize("quarters", [0, 1, 2, 3])
def test_leftover_shares_always_reach_the_bound(halves, thirds, quarters):
    from fractions import Fraction

    from ppipe.planner.placement import _pack_shares

    items = [("m", 0, 0, i, "L4", 2) for i in range(halves)]
    items += [("m", 1, 0, i, "L4", 3) for i in range(thirds + 3)]  # plus one full group of thirds
    items += [("m", 2, 0, i, "L4", 4) for i in range(quarters)]
    bins = _pack_shares(items)
    assert all(sum(Fraction(1, v[5]) for v in b) <= 1 for b in bins)
    assert len(bins) == -(-sum(Fraction(1, v[5]) for v in items) // 1)


# ---- keep_live: a re-plan's placement that keeps the running plan's vGPUs where they are ----------------
def _where(placement, models):
    """Each vGPU as (server, gpu, slot, model, blocks, gpu type, level): what a running worker is."""
    parts = {(m.name, i, j): p for m in models for i, pl in enumerate(m.pipelines) for j, p in enumerate(pl.partitions)}
    return {(r.server, r.gpu_index, r.slot, r.model, parts[(r.model, r.pipeline, r.partition)].first_block,
             parts[(r.model, r.pipeline, r.partition)].last_block, parts[(r.model, r.pipeline, r.partition)].gpu, r.vgpu)
            for r in placement}


def _valid(placement, models, cluster):
    type_of = {name: g.gpu_type for name, g in cluster.server_names()}
    assert len({(r.server, r.gpu_index, r.slot) for r in placement}) == len(placement)
    per_gpu = Counter((r.server, r.gpu_index) for r in placement)
    for r in placement:
        part = next(m for m in models if m.name == r.model).pipelines[r.pipeline].partitions[r.partition]
        assert type_of[r.server] == part.gpu and r.vgpu == part.vgpu and per_gpu[(r.server, r.gpu_index)] <= r.vgpu
        assert 0 <= r.slot < per_gpu[(r.server, r.gpu_index)]


def test_keep_live_keeps_every_vgpu_that_can_stay():
    from ppipe.planner.placement import keep_live

    cluster = load_cluster("HC1-S")  # 4 L4 servers, 12 P4 servers, one GPU each
    live_models = [_model("a", [[_part(0, 3, "P4", 2, 4), _part(4, 9, "L4", 1, 2)]]), _model("b", [[_part(0, 9, "P4", 1, 3)]])]
    # the mix moved: "a" keeps its pools, "b" loses one vGPU, a new "c" takes P4s; placed from scratch,
    # the interleaving puts most of them elsewhere
    new_models = [_model("c", [[_part(0, 9, "P4", 1, 2)]]), live_models[0], _model("b", [[_part(0, 9, "P4", 1, 2)]])]
    live = place(live_models, cluster)
    fresh = place(new_models, cluster)
    kept = keep_live(fresh, new_models, live, live_models, cluster)
    _valid(kept, new_models, cluster)
    stays = _where(kept, new_models) & _where(live, live_models)
    assert len(stays) == 4 + 2 + 2  # all of "a", and both of "b"'s remaining vGPUs
    assert len(_where(fresh, new_models) & _where(live, live_models)) < len(stays)
    assert [(r.model, r.pipeline, r.partition, r.replica) for r in kept] == [(r.model, r.pipeline, r.partition, r.replica) for r in fresh]
    assert keep_live(live, live_models, live, live_models, cluster) == live  # nothing to move: unchanged
    assert keep_live(kept, new_models, live, live_models, cluster) == kept  # renamed once, renamed for good
