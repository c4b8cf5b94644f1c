"""Feedback correction (report) and failure handling (mark_failed)."""

from ppipe.dataplane import Dispatch, Drop, DropReason, Request, StageReport, WakeAt
from ppipe.dataplane.testing import FIG5_NODES

N1, N2, N3 = FIG5_NODES


def req(i, t, slo_us=5000.0):
    return Request(i, "m", t, t + slo_us)


def two_batches(s):
    """8 requests at t=0 -> batch 0 on n1->n2, batch 1 on n1->n3 (see the numbers below)."""
    ds = [d for i in range(8) for d in s.submit(req(i, 0.0)) if isinstance(d, Dispatch)]
    assert [d.batch for d in ds] == [4, 4]
    # batch 0: n1 [0,250) -> transfer [250,290) -> n2 [290,790)
    # batch 1: n1 [250,500) -> transfer [500,540) -> n3 [540,1040) (n2 busy until 790)
    assert [st.vgpu_id for st in ds[0].stages] == [N1, N2]
    assert [st.vgpu_id for st in ds[1].stages] == [N1, N3]
    return ds


def spans(table):
    return [(s, e) for s, e, _ in table.intervals()]


def report(d, k, start, end, ts=None, te=None):
    return StageReport(d.batch_id, d.stages[k].partition, d.stages[k].vgpu_id, start, end, ts, te)


def test_a_late_stage_pushes_later_reservations_on_its_vgpu_back(fig5):
    s, clock = fig5()
    b0, b1 = two_batches(s)
    clock.t_us = 300.0
    s.report(report(b0, 0, 0.0, 300.0))  # ran 50 us late
    assert spans(s.topology.vgpus[N1].table) == [(300.0, 550.0)]  # the reported past is pruned
    assert s.stats()["cascaded"] == 1


def test_an_early_stage_frees_its_slot_for_the_next_probe(fig5):
    s, clock = fig5()
    b0, b1 = two_batches(s)
    clock.t_us = 200.0
    s.report(report(b0, 0, 0.0, 200.0))  # 50 us early
    assert spans(s.topology.vgpus[N1].table) == [(250.0, 500.0)]
    r = s.probe(s.topology.pipelines["m"][0], 1)
    assert r.hops[0].start == 500.0  # the 50 us gap 200..250 is too short for 100 us


def test_transfer_reports_correct_both_nic_tables(fig5):
    s, clock = fig5()
    b0, b1 = two_batches(s)
    clock.t_us = 290.0  # a report while the (late) transfer is still on the wire
    s.report(report(b0, 1, 300.0, 800.0, ts=250.0, te=300.0))
    assert spans(s.topology.table("up:n-0")) == [(250.0, 300.0), (500.0, 540.0)]
    assert spans(s.topology.table("down:n-1")) == [(250.0, 300.0)]


def test_inflight_is_forgotten_after_the_last_report_or_when_its_end_passes(fig5):
    s, clock = fig5()
    b0, b1 = two_batches(s)
    s.report(report(b0, 0, 0.0, 250.0))
    assert s.stats()["inflight"] == 2
    s.report(report(b0, 1, 290.0, 790.0, 250.0, 290.0))
    assert s.stats()["inflight"] == 1
    clock.t_us = 1040.0
    s.wake()
    assert s.stats()["inflight"] == 1  # its planned end is now, not past
    clock.t_us = 1041.0
    s.wake()
    assert s.stats()["inflight"] == 0 and s.stats()["expired_inflight"] == 1


def test_a_late_report_re_decides_a_waiting_model(fig5):
    s, clock = fig5()
    b0, b1 = two_batches(s)
    (w,) = s.submit(req(8, 0.0))
    assert w == WakeAt(4010.0)  # b1 path waits until n1 is free at 500 and n2 at 790: finish 990
    clock.t_us = 3950.0
    before = s.stats()["probes"]
    out = s.report(report(b0, 0, 0.0, 3950.0))  # batch 0 hogged n1 for 3.7 ms more
    assert s.stats()["probes"] > before  # the waiting model was re-run on the corrected tables
    # batch 1's stage 0 was pushed to [3950, 4200); request 8 now needs n1 at 4200..4300,
    # transfer 4300..4310, n2 4310..4510: 490 us of slack from now
    assert out == [WakeAt(4440.0)]
    # A wake re-decides; the path no longer waits, so the next moment is the exact last one.
    clock.t_us = 4440.0
    assert s.wake() == [WakeAt(5000.0 - 310.0)]
    clock.t_us = 4690.0
    (d,) = s.wake()
    assert isinstance(d, Dispatch) and d.finish_us == 5000.0


def test_exact_last_moment_wakes_once_at_the_latest_feasible_start(fig5):
    s, clock = fig5(exact_last_moment=True)
    b0, b1 = two_batches(s)
    (w,) = s.submit(req(8, 0.0))
    # the path waits now (n1 busy until 500, n2 until 790), but started at 4690 it would not
    assert w == WakeAt(5000.0 - 310.0)
    clock.t_us = w.t_us
    (d,) = s.wake()
    assert isinstance(d, Dispatch) and d.finish_us == 5000.0


def test_failed_vgpu_leaves_its_pool_at_once(fig5):
    s, clock = fig5()
    assert s.mark_failed(N2) == []
    (w,) = s.submit(req(0, 0.0))
    for i in range(1, 4):
        out = s.submit(req(i, 0.0))
    (d,) = out
    assert [st.vgpu_id for st in d.stages] == [N1, N3]
    assert s.mark_failed(N2) == []  # twice is a no-op
    assert s.mark_failed("no/such") == []


def test_inflight_batches_on_a_failed_vgpu_are_dropped_and_their_reservations_released(fig5):
    s, clock = fig5()
    b0, b1 = two_batches(s)
    clock.t_us = 260.0
    s.report(report(b0, 0, 0.0, 250.0))
    out = s.mark_failed(N2)
    assert [(d.request.id, d.reason) for d in out] == [(i, DropReason.WORKER_FAILED) for i in range(4)]
    assert spans(s.topology.table("up:n-0")) == [(500.0, 540.0)]  # batch 0's transfer released
    assert s.stats()["inflight"] == 1  # batch 1 (n1 -> n3) goes on


def test_a_dead_sender_loses_the_batch_whose_next_stage_has_not_reported(fig5):
    s, clock = fig5()
    b0, b1 = two_batches(s)
    s.report(report(b0, 0, 0.0, 250.0))
    s.report(report(b0, 1, 290.0, 790.0, 250.0, 290.0))  # batch 0 done
    s.report(report(b1, 0, 250.0, 500.0))  # batch 1 left n1, its transfer not confirmed
    out = s.mark_failed(N1)
    assert sorted(d.request.id for d in out) == [4, 5, 6, 7]
    assert all(d.reason is DropReason.WORKER_FAILED for d in out)


def test_a_model_without_live_pipeline_drops_with_no_pipeline(fig5):
    s, clock = fig5()
    s.submit(req(0, 0.0))
    out = s.mark_failed(N1)  # the only vGPU of pool 1
    assert [(d.request.id, d.reason) for d in out] == [(0, DropReason.NO_PIPELINE)]
    (d,) = s.submit(req(1, 0.0))
    assert isinstance(d, Drop) and d.reason is DropReason.NO_PIPELINE


def test_a_recovered_vgpu_serves_again_and_revives_its_pipeline(fig5):
    s, clock = fig5()
    s.mark_failed(N1)  # the only vGPU of pool 1: the model has no live pipeline
    (d,) = s.submit(req(0, 0.0))
    assert isinstance(d, Drop) and d.reason is DropReason.NO_PIPELINE
    assert s.mark_recovered(N1) == [] and s.failed == []
    assert s.mark_recovered(N1) == [] and s.mark_recovered("no/such") == []  # no-ops
    out = [d for i in range(1, 5) for d in s.submit(req(i, 0.0))]
    (d,) = [d for d in out if isinstance(d, Dispatch)]
    assert d.stages[0].vgpu_id == N1 and d.stages[0].start_us == 0.0  # an empty table: free at once
    s.mark_failed(N2)
    s.mark_recovered(N2)
    assert sorted(g.id for g in s.topology.pipelines["m"][0].pools[1].vgpus) == [N2, N3]


def test_a_late_stage_moves_its_batch_downstream_reservations(fig5):
    s, clock = fig5()
    b0, b1 = two_batches(s)
    clock.t_us = 300.0
    s.report(report(b0, 0, 0.0, 300.0))  # 50 us late: the transfer can start at 300, not 250
    assert spans(s.topology.table("up:n-0")) == [(300.0, 340.0), (500.0, 540.0)]
    assert spans(s.topology.table("down:n-1")) == [(300.0, 340.0)]
    assert spans(s.topology.vgpus[N2].table) == [(340.0, 840.0)]
    s2, clock2 = fig5(propagate_delays=False)
    c0, c1 = two_batches(s2)
    clock2.t_us = 300.0
    s2.report(report(c0, 0, 0.0, 300.0))
    assert spans(s2.topology.vgpus[N2].table) == [(290.0, 790.0)]


def test_failure_keeps_reservations_of_stages_before_the_dead_worker(fig5):
    s, clock = fig5()
    b0, b1 = two_batches(s)
    out = s.mark_failed(N2)  # batch 0 (n1 -> n2) is lost before it started
    assert sorted(d.request.id for d in out) == [0, 1, 2, 3]
    # its stage 0 on n1 may still run (a driver need not cancel it): still reserved
    assert spans(s.topology.vgpus[N1].table) == [(0.0, 250.0), (250.0, 500.0)]
    assert spans(s.topology.table("up:n-0")) == [(500.0, 540.0)]  # its transfer is freed
    assert not s.topology.vgpus[N2].alive
    assert s.partial_dispatches is False
