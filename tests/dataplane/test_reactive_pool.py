"""The stage-by-stage reactive baseline (policy "reactive-pool")."""

import pytest

from ppipe.dataplane import Dispatch, Drop, DropReason, Request, StageReport, build_scheduler
from ppipe.dataplane.testing import FIG5_NODES, ManualClock, ToyModel, ToyPartition, ToyPipeline, replay, toy_cluster, toy_plan, toy_profile

N1, N2, N3 = FIG5_NODES


def req(i, t, slo_us=5000.0):
    return Request(i, "m", t, t + slo_us)


def done(s, clock, d, t_end=None):
    st = d.stages[0]
    end = st.end_us if t_end is None else t_end
    clock.t_us = max(clock.t_us, end)
    te = None if st.transfer_start_us is None else st.transfer_start_us + st.transfer_us
    return s.report(StageReport(d.batch_id, st.partition, st.vgpu_id, st.start_us, end, st.transfer_start_us, te))


def test_each_stage_is_its_own_dispatch_and_follows_the_report(fig5):
    s, clock = fig5(policy="reactive-pool", batch=1)
    (d0,) = s.submit(req(0, 0.0))
    assert isinstance(d0, Dispatch) and len(d0.stages) == 1
    assert (d0.stages[0].partition, d0.stages[0].vgpu_id, d0.stages[0].infer_us) == (0, N1, 100.0)
    (d1,) = done(s, clock, d0)
    assert [r.id for r in d1.requests] == [0] and d1.batch_id != d0.batch_id
    st = d1.stages[0]
    assert (st.partition, st.vgpu_id, st.transfer_start_us, st.transfer_us, st.start_us) == (1, N2, 100.0, 10.0, 110.0)
    assert done(s, clock, d1) == []
    assert s.stats()["inflight"] == 0 and s.stats()["queued"] == {"m": 0}


def test_a_pool_re_batches_requests_from_several_upstream_batches(fig5):
    s, clock = fig5(policy="reactive-pool", batch=2, batches=(1, 2))
    out = s.submit(req(0, 0.0)) + s.submit(req(1, 0.0))
    (a,) = [d for d in out if isinstance(d, Dispatch)]
    assert a.batch == 2
    # Two more arrive while n1 is busy; they go as a second batch of 2 when it is free.
    s.submit(req(2, 10.0))
    s.submit(req(3, 10.0))
    out = done(s, clock, a)  # pool 1 gets requests 0, 1; n1 takes 2, 3
    by_part = {d.stages[0].partition: d for d in out if isinstance(d, Dispatch)}
    assert [r.id for r in by_part[0].requests] == [2, 3]
    assert [r.id for r in by_part[1].requests] == [0, 1]


def test_pool_waits_for_a_fuller_batch_until_its_pool_deadline(fig5):
    s, clock = fig5(policy="reactive-pool", batch=2, batches=(1, 2))
    (d0,) = [d for d in s.submit(req(0, 0.0)) if isinstance(d, Dispatch)] or [None] or []
    # one request: pool 0 waits for a second one until its pool deadline allows batch 1 only
    assert d0 is None
    w = s.wake_at[("m", 0, 0)]
    frac = s.fractions[("m", 0)][0]
    assert w == pytest.approx(5000.0 * frac - 100.0)


def test_requests_late_at_the_second_pool_are_dropped_there(fig5):
    s, clock = fig5(policy="reactive-pool", batch=1, slo_ms=1.0)
    (d0,) = s.submit(req(0, 0.0, 1000.0))
    out = done(s, clock, d0, t_end=900.0)  # stage 0 ran 800 us late: 900 + 10 + 200 > 1000
    assert [(type(d).__name__, getattr(d, "reason", None)) for d in out] == [("Drop", DropReason.DEADLINE_UNREACHABLE)]


def test_failure_drops_running_and_downstream_requests(fig5):
    s, clock = fig5(policy="reactive-pool", batch=1)
    (d0,) = s.submit(req(0, 0.0))
    (d1,) = done(s, clock, d0)  # request 0 now runs on n2
    clock.t_us = 150.0
    (d2,) = s.submit(req(1, 150.0))  # request 1 on n1
    out = s.mark_failed(N2)
    assert [(d.request.id, d.reason) for d in out] == [(0, DropReason.WORKER_FAILED)]
    out = s.mark_failed(N1)  # pool 0 empty: the pipeline is gone
    assert [(d.request.id, d.reason) for d in out] == [(1, DropReason.WORKER_FAILED)]
    (x,) = s.submit(req(2, 200.0))
    assert isinstance(x, Drop) and x.reason is DropReason.NO_PIPELINE


def test_weighted_round_robin_over_pipelines():
    cluster = toy_cluster([("a", "A", 1, 3, 8.0)])
    prof = toy_profile("m", {"A": [100.0]}, out_bytes=[10], batches=(1,))
    plan = toy_plan(cluster, [ToyModel("m", 50.0, [ToyPipeline(1, [ToyPartition(0, 0, "A", 1, [(f"a-{i}", 0, 0)])]) for i in range(3)])])
    plan = plan.model_copy(
        update={"models": [plan.models[0].model_copy(update={"pipelines": [pp.model_copy(update={"throughput_rps": w}) for pp, w in zip(plan.models[0].pipelines, (2.0, 1.0, 1.0))]})]}
    )
    s = build_scheduler(plan, {"m": prof}, cluster, ManualClock(), policy="reactive-pool")
    got = {}
    for i in range(8):
        for d in s.submit(req(i, 0.0, 50_000.0)):
            if isinstance(d, Dispatch):
                got.update({r.id: d.pipeline for r in d.requests})
    assert sorted(got) == [0, 1, 2]  # one idle vGPU per pipeline; the rest queue
    got.update({it.req.id: pi for (m, pi, k), q in s.queues.items() for it in q})
    assert got == {0: 0, 1: 1, 2: 2, 3: 0, 4: 0, 5: 1, 6: 2, 7: 0}  # weights 2:1:1


def test_replay_resolves_every_request_deterministically(fig5):
    runs = []
    for _ in range(2):
        s, clock = fig5(policy="reactive-pool")
        reqs = [req(i, 37.0 * i) for i in range(200)]
        log, outcome = replay(s, clock, reqs, jitter=0.3, seed=5)
        runs.append(log)
        assert s.stats()["inflight"] == 0 and s.stats()["queued"] == {"m": 0}
    assert runs[0] == runs[1]
