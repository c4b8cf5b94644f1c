"""The reactive baseline, determinism, and invariants over a random trace."""

import random

import pytest

from ppipe.dataplane import POLICIES, Dispatch, DropReason, Request, StageReport, build_scheduler
from ppipe.dataplane.testing import FIG5_NODES, ManualClock, replay, ToyModel, ToyPartition, ToyPipeline, toy_cluster, toy_plan, toy_profile

N1, N2, N3 = FIG5_NODES


def req(i, t, slo_us=5000.0, model="m"):
    return Request(i, model, t, t + slo_us)


def test_both_paper_policies_are_registered():
    assert {"reservation", "reactive"} <= set(POLICIES)


def test_reactive_reserves_no_nic_and_ignores_nic_contention(fig5):
    res, _ = fig5(batch=1)
    rea, _ = fig5(batch=1, policy="reactive")
    for s in (res, rea):
        s.topology.table("up:n-0").add(100.0, 500.0, "someone else's transfer")
    (d_res,) = res.submit(req(0, 0.0))
    (d_rea,) = rea.submit(req(0, 0.0))
    assert d_res.stages[1].transfer_start_us == 600.0  # waits for the uplink
    assert d_rea.stages[1].transfer_start_us == 100.0  # does not know about it
    assert not [r for r in d_rea.reservations if not r.resource.startswith("vgpu:")]
    assert len(rea.topology.table("up:n-0")) == 1  # nothing added to the NIC tables


def test_dispatch_reservations_are_what_reserve_marked(fig5):
    # Built on first use (ReservationList), they must equal the intervals the tables hold,
    # and behave (and pickle) as the tuple they stand for.
    import pickle

    from ppipe.dataplane import Reservation

    res, _ = fig5(batch=1)
    (d,) = res.submit(req(0, 0.0))
    marked = tuple(
        Reservation(tab.name, s, e - s)
        for tab in [res.topology.table(r.resource) for r in d.reservations]
        for s, e, key in tab.intervals() if key[0] == d.batch_id
    )
    assert len(d.reservations) == 4 == len(marked)  # two inferences, the transfer on both NICs
    assert sorted(d.reservations, key=repr) == sorted(marked, key=repr)
    as_tuple = tuple(d.reservations)
    assert d.reservations == as_tuple and as_tuple == d.reservations and hash(d.reservations) == hash(as_tuple)
    assert d.reservations[0] == as_tuple[0] and repr(d.reservations) == repr(as_tuple)
    assert pickle.loads(pickle.dumps(d.reservations)) == as_tuple
    assert type(pickle.loads(pickle.dumps(d.reservations))) is tuple


def test_reactive_appends_to_vgpu_queues_without_filling_gaps(fig5):
    rea, _ = fig5(batch=1, policy="reactive")
    for s in (rea,):
        s.topology.vgpus[N2].table.add(0.0, 50.0, "a")
        s.topology.vgpus[N2].table.add(900.0, 100.0, "b")  # free 50..900 but queue ends at 1000
        s.topology.vgpus[N3].table.add(0.0, 700.0, "c")
    (d,) = rea.submit(req(0, 0.0))
    assert d.stages[1].vgpu_id == N3 and d.stages[1].start_us == 700.0


def test_reactive_drops_requests_that_a_late_stage_made_unreachable(fig5):
    rea, clock = fig5(policy="reactive", slo_ms=1.0)
    ds = [d for i in range(4) for d in rea.submit(req(i, 0.0, 1000.0))]
    (d,) = [x for x in ds if isinstance(x, Dispatch)]
    assert d.finish_us == 790.0
    clock.t_us = 600.0
    out = rea.report(StageReport(d.batch_id, 0, N1, 0.0, 600.0))  # 350 us late: ends ~1140 > 1000
    assert [(x.request.id, x.reason) for x in out] == [(i, DropReason.DEADLINE_UNREACHABLE) for i in range(4)]
    assert rea.stats()["inflight"] == 0
    res, clock = fig5(slo_ms=1.0)
    ds = [d for i in range(4) for d in res.submit(req(i, 0.0, 1000.0))]
    (d,) = [x for x in ds if isinstance(x, Dispatch)]
    clock.t_us = 600.0
    assert res.report(StageReport(d.batch_id, 0, N1, 0.0, 600.0)) == []  # the paper's policy keeps going


def world(policy, **options):
    """Two models, 3 pipelines on 2-GPU servers sharing NICs."""
    cluster = toy_cluster([("h", "H", 2, 2, 10.0), ("l", "L", 2, 3, 10.0)])
    pa = toy_profile("a", {"H": [300.0, 400.0], "L": [900.0, 1200.0]}, out_bytes=[40_000, 10], batches=(1, 2, 4))
    pb = toy_profile("b", {"H": [200.0, 200.0], "L": [500.0, 700.0]}, out_bytes=[20_000, 10], batches=(1, 2))
    plan = toy_plan(
        cluster,
        [
            ToyModel("a", 10.0, [
                ToyPipeline(4, [ToyPartition(0, 0, "L", 1, [("l-0", 0, 0), ("l-1", 0, 0), ("l-2", 0, 0)]), ToyPartition(1, 1, "H", 1, [("h-0", 0, 0)])]),
                ToyPipeline(2, [ToyPartition(0, 1, "H", 1, [("h-1", 0, 0)])]),
            ]),
            ToyModel("b", 6.0, [
                ToyPipeline(2, [ToyPartition(0, 0, "L", 1, [("l-0", 1, 0), ("l-1", 1, 0)]), ToyPartition(1, 1, "H", 1, [("h-0", 1, 0), ("h-1", 1, 0)])]),
            ]),
        ],
    )
    clock = ManualClock()
    s = build_scheduler(plan, {"a": pa, "b": pb}, cluster, clock, policy=policy, **options)
    return s, clock


def drive(s, clock, n=400, seed=1, rate_per_ms=3.0, jitter=0.0, fail=None):
    """Poisson arrivals of both models, replayed with ppipe.dataplane.testing.replay."""
    rnd = random.Random(seed)
    slo = {"a": 10_000.0, "b": 6_000.0}
    reqs, t = [], 0.0
    for i in range(n):
        t += rnd.expovariate(rate_per_ms / 1000.0)
        m = "a" if rnd.random() < 0.6 else "b"
        reqs.append(Request(i, m, t, t + slo[m]))
    return replay(s, clock, reqs, jitter=jitter, seed=seed, failures=[fail] if fail else ())


@pytest.mark.parametrize("policy", ["reservation", "reactive"])
def test_same_inputs_give_the_same_decisions(policy):
    runs = []
    for _ in range(2):
        s, clock = world(policy)
        log, _ = drive(s, clock, n=300, jitter=0.3)
        runs.append((log, s.stats()))
    assert runs[0] == runs[1]


def test_every_request_ends_once_and_dispatches_meet_their_deadlines_in_plan():
    s, clock = world("reservation")
    log, outcome = drive(s, clock, n=500, rate_per_ms=4.0)
    assert len(outcome) == 500
    assert s.stats()["queued"] == {"a": 0, "b": 0}
    for rid, o in outcome.items():
        if o[0] == "dispatched":
            assert o[1] <= o[2] + 1e-6, (rid, o)
    for tab in s.topology.all_tables():
        tab.check()
    served = sum(1 for o in outcome.values() if o[0] == "dispatched")
    assert served > 250  # not a trivial all-drop run
    st = s.stats()
    assert st["dispatches"] > 0 and st["probes"] >= st["dispatches"]


def test_feedback_with_jitter_keeps_tables_consistent():
    s, clock = world("reservation")
    drive(s, clock, n=400, jitter=0.5, rate_per_ms=4.0)
    for tab in s.topology.all_tables():
        tab.check()
    assert s.stats()["corrections"] > 0 and s.stats()["inflight"] == 0


def test_failure_mid_trace_routes_around_and_never_uses_the_dead_vgpu():
    s, clock = world("reservation")
    log, outcome = drive(s, clock, n=400, rate_per_ms=3.0, fail=(30_000.0, "h-0/gpu0/s0"))
    after = [d for d in log if isinstance(d, Dispatch) and d.stages[0].start_us > 30_000.0]
    assert after and all(st.vgpu_id != "h-0/gpu0/s0" for d in after for st in d.stages)
    assert len(outcome) == 400


def test_reusing_the_step1_probe_changes_the_probe_count_not_the_decisions():
    logs = []
    for reuse in (True, False):
        s, clock = world("reservation", reuse_step1_probe=reuse)
        log, _ = drive(s, clock, n=300, jitter=0.2)
        logs.append((log, s.stats()["probes"]))
    assert logs[0][0] == logs[1][0]
    assert logs[0][1] < logs[1][1]


def test_out_of_order_submissions_keep_the_queue_sorted_by_deadline(fig5):
    s, clock = fig5()
    s.submit(req(0, 100.0))
    s.submit(req(1, 0.0))  # arrived earlier (e.g. clock skew between frontends)
    assert [r.id for r in s.queues["m"]] == [1, 0]


def test_the_longest_idle_vgpu_wins_among_equals(fig5):
    s, clock = fig5(batch=1)
    # n2 and n3 are both free at t=0, but n2 was busy until 50 and n3 never: n3 has been idle longer
    s.topology.vgpus[N2].table.add(0.0, 50.0, "old work")
    s.topology.vgpus[N2].pool.refresh()
    clock.t_us = 60.0
    (d,) = s.submit(req(0, 60.0))
    assert d.stages[1].vgpu_id == N3


def test_reactive_late_drop_can_be_switched_off(fig5):
    rea, clock = fig5(policy="reactive", slo_ms=1.0, late_drop=False)
    ds = [d for i in range(4) for d in rea.submit(req(i, 0.0, 1000.0))]
    (d,) = [x for x in ds if isinstance(x, Dispatch)]
    clock.t_us = 600.0
    assert rea.report(StageReport(d.batch_id, 0, N1, 0.0, 600.0)) == []
