"""One plan decided by K schedulers (ppipe.dataplane.split): the server groups, the sub-plans,
and SplitScheduler driven by the simulator."""

from __future__ import annotations

import pytest

from ppipe.dataplane.split import build_split_scheduler, group_capacity, split_report, split_servers, sub_plan
from ppipe.dataplane.testing import ToyModel, ToyPartition, ToyPipeline, toy_cluster, toy_plan, toy_profile
from ppipe.errors import UserError
from ppipe.sim.simulator import SimConfig
from ppipe.sim.sweep import run_point


def _world():
    """Two pipelines of one model over six A servers and two B servers: each pipeline's
    first pool on two A servers, its second on one B server."""
    cluster = toy_cluster([("a", "A", 1, 6, 8.0), ("b", "B", 2, 2, 8.0)])
    prof = toy_profile("m", {"A": [400.0, 300.0], "B": [200.0, 150.0]}, out_bytes=[20_000, 10])
    pipes = [
        ToyPipeline(batch=1, partitions=[ToyPartition(0, 0, "A", 1, [(f"a-{2 * i}", 0, 0), (f"a-{2 * i + 1}", 0, 0)]),
                                         ToyPartition(1, 1, "B", 1, [(f"b-{i}", 0, 0), (f"b-{i}", 1, 0)])])
        for i in range(2)
    ]
    plan = _with_throughputs(toy_plan(cluster, [ToyModel("m", slo_ms=20.0, pipelines=pipes)]), prof)
    return plan, {"m": prof}, cluster


def _with_throughputs(plan, prof):
    """The toy plan with each pool's throughput (count x batch / latency) and the model's (its pipelines' sum)."""
    models = []
    for m in plan.models:
        pipes = []
        for pp in m.pipelines:
            parts = [q.model_copy(update={"throughput_rps": q.count * pp.batch / prof.partition_latency_us(q.gpu, q.vgpu, pp.batch, q.first_block, q.last_block) * 1e6})
                     for q in pp.partitions]
            pipes.append(pp.model_copy(update={"partitions": parts, "throughput_rps": min(q.throughput_rps for q in parts)}))
        models.append(m.model_copy(update={"pipelines": pipes, "throughput_rps": sum(p.throughput_rps for p in pipes)}))
    return plan.model_copy(update={"models": models})


def _split_factory(k):
    return lambda plan, profiles, cluster, clock: build_split_scheduler(plan, profiles, cluster, clock, k)


def test_groups_keep_whole_pipelines_and_share_the_capacity():
    plan, _, _ = _world()
    groups = split_servers(plan, 2)
    assert sorted(map(sorted, groups)) == [["a-0", "a-1", "b-0"], ["a-2", "a-3", "b-1"]]
    subs = [sub_plan(plan, g) for g in groups]
    assert [len(s.model("m").pipelines) for s in subs] == [1, 1]
    assert sum(group_capacity(s)["m"] for s in subs) == pytest.approx(group_capacity(plan)["m"])
    assert all(sorted(p.replica for p in s.placement if p.partition == 0) == [0, 1] for s in subs)  # renumbered
    assert not groups[0] & groups[1]


def test_a_split_that_cannot_be_balanced_keeps_what_it_can_and_says_so():
    plan, _, _ = _world()
    # three groups of two whole pipelines: some pool must be cut; the best keeps 3/4
    groups = split_servers(plan, 3)
    report = split_report(plan, groups)
    assert report["kept"]["m"] == pytest.approx(0.75)
    assert not report["balanced"]
    assert split_report(plan, split_servers(plan, 2)) == {"kept": {"m": 1.0}, "shares": [0.5, 0.5], "balanced": True}


def test_more_groups_than_servers_is_a_user_error():
    plan, _, _ = _world()
    with pytest.raises(UserError, match="cannot split a plan on 6 servers into 9"):
        split_servers(plan, 9)  # 6 servers hold vGPUs (a-4, a-5 none)


def test_one_group_decides_exactly_as_the_plain_scheduler():
    plan, profiles, cluster = _world()
    cfg = SimConfig(duration_s=1.0, seed=3)
    plain = run_point(plan, profiles, cluster, 0.8, config=cfg)
    one = run_point(plan, profiles, cluster, 0.8, config=cfg, scheduler_factory=_split_factory(1))
    assert [(r.id, r.outcome, r.completion_us) for r in one.records] == [(r.id, r.outcome, r.completion_us) for r in plain.records]


def test_two_groups_serve_every_request_once_on_their_own_pipelines():
    plan, profiles, cluster = _world()
    res = run_point(plan, profiles, cluster, 0.6, config=SimConfig(duration_s=2.0, seed=1), scheduler_factory=_split_factory(2))
    assert res.models["m"].attainment >= 0.99
    assert len({r.id for r in res.records}) == len(res.records)
    used = {b.pipeline for b in res.batches}
    assert used == {0, 1}  # the plan's pipeline indices, both groups dispatching
    assert len({b.batch_id for b in res.batches}) == len(res.batches)


def test_a_failed_vgpu_is_marked_in_its_own_group_only():
    plan, profiles, cluster = _world()
    cfg = SimConfig(duration_s=2.0, seed=1, failures=((0.5, "a-0/gpu0/s0"),))
    res = run_point(plan, profiles, cluster, 0.4, config=cfg, scheduler_factory=_split_factory(2))
    assert res.models["m"].attainment >= 0.9  # the other vGPU of that pool and the other group carry on
