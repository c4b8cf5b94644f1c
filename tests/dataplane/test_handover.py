"""A live plan switch in the data plane (ppipe.dataplane.handover): one answer per request,
nothing double-booked across the old and the new plan, reports routed to their scheduler."""

from __future__ import annotations

from collections import defaultdict

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ppipe.dataplane import Dispatch, Drop, DropReason, Request, build_scheduler
from ppipe.dataplane.handover import SwitchingScheduler, hand_over, kept_vgpus, physical_gpu
from ppipe.dataplane.testing import ManualClock, ToyModel, ToyPartition, ToyPipeline, replay, toy_cluster, toy_plan, toy_profile
from ppipe.errors import UserError

CLUSTER = toy_cluster([("n", "A", 1, 4, 8.0)])  # n-0 .. n-3, one GPU each
PROFILES = {
    name: toy_profile(name, {"A": [300.0, 600.0]}, out_bytes=[20_000, 10], batches=(1, 2, 4), levels=(1, 2))
    for name in ("m", "gone", "fresh")
}

# Old plan: m = [n-0] -> [n-1, n-2]; "gone" on n-3.
OLD = toy_plan(CLUSTER, [
    ToyModel("m", 6.0, [ToyPipeline(2, [ToyPartition(0, 0, "A", 1, [("n-0", 0, 0)]),
                                        ToyPartition(1, 1, "A", 1, [("n-1", 0, 0), ("n-2", 0, 0)])])]),
    ToyModel("gone", 6.0, [ToyPipeline(2, [ToyPartition(0, 1, "A", 1, [("n-3", 0, 0)])])]),
])
# New plan: n-0 kept as it is; n-1 re-cut into two level-2 shares; n-3 now serves m's
# second stage; n-2 serves a new model "fresh"; "gone" is not served any more.
NEW = toy_plan(CLUSTER, [
    ToyModel("m", 6.0, [ToyPipeline(2, [ToyPartition(0, 0, "A", 1, [("n-0", 0, 0)]),
                                        ToyPartition(1, 1, "A", 2, [("n-1", 0, 0), ("n-1", 0, 1)]),
                                        ]),
                        ToyPipeline(2, [ToyPartition(0, 1, "A", 1, [("n-3", 0, 0)])])]),
    ToyModel("fresh", 6.0, [ToyPipeline(2, [ToyPartition(0, 1, "A", 1, [("n-2", 0, 0)])])]),
])


def _sched(plan, clock, policy="reservation"):
    return build_scheduler(plan, {m.name: PROFILES[m.name] for m in plan.models}, CLUSTER, clock, policy=policy)


def _requests(arrivals):
    return [Request(i, model, t, t + 6_000.0) for i, (t, model) in enumerate(sorted(arrivals))]


def test_kept_vgpus_are_those_whose_worker_is_unchanged():
    clock = ManualClock()
    assert kept_vgpus(_sched(OLD, clock).topology, _sched(NEW, clock).topology) == {"n-0/gpu0/s0"}


def test_queued_requests_move_and_batch_ids_continue():
    clock = ManualClock()
    old = _sched(OLD, clock)
    decisions = []
    for r in _requests([(0.0, "m")] * 7 + [(0.0, "gone")] * 3):
        decisions += old.submit(r)
    dispatched = {r.id for d in decisions if isinstance(d, Dispatch) for r in d.requests}
    queued = sum(len(q) for q in old.queues.values())
    assert queued > 0  # the old plan could not dispatch everything at once
    new = _sched(NEW, clock)
    h = hand_over(old, new)
    assert h.moved == queued and h.first_batch_id == old._next_batch_id
    assert not any(old.queues.values())
    new_batches = [d for d in h.decisions if isinstance(d, Dispatch)]
    assert all(d.batch_id >= h.first_batch_id for d in new_batches)
    gone = [d for d in h.decisions if isinstance(d, Drop)]
    assert gone and all(d.reason is DropReason.UNKNOWN_MODEL and d.request.model == "gone" for d in gone)
    assert not dispatched & {r.id for d in new_batches for r in d.requests}


def test_a_new_share_of_a_recut_gpu_waits_for_the_old_shares():
    clock = ManualClock()
    old = _sched(OLD, clock)
    for r in _requests([(0.0, "m")] * 4):
        old.submit(r)
    busy_n1 = old.topology.vgpus["n-1/gpu0/s0"].table.busy_until()
    new = _sched(NEW, clock)
    hand_over(old, new)
    for share in ("n-1/gpu0/s0", "n-1/gpu0/s1"):
        assert new.topology.vgpus[share].table.earliest(0.0, 1.0) == pytest.approx(busy_n1)
    kept = "n-0/gpu0/s0"
    assert new.topology.vgpus[kept].table.intervals()[-1][1] == old.topology.vgpus[kept].table.busy_until()


def test_a_policy_without_a_whole_path_queue_is_refused():
    clock = ManualClock()
    with pytest.raises(UserError, match="batching data-plane policy"):
        hand_over(_sched(OLD, clock, "reactive-pool"), _sched(NEW, clock))


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    arrivals=st.lists(st.tuples(st.floats(0.0, 20_000.0), st.sampled_from(["m", "m", "gone", "fresh"])), min_size=1, max_size=60),
    switch_at=st.floats(0.0, 20_000.0),
    burst=st.integers(0, 8),  # requests of "m" just before and just after the switch
    fail=st.one_of(st.none(), st.tuples(st.floats(0.0, 20_000.0), st.sampled_from(["n-0/gpu0/s0", "n-1/gpu0/s0", "n-2/gpu0/s0"]))),
    policy=st.sampled_from(["reservation", "reactive"]),
)
def test_switch_keeps_one_answer_per_request_and_books_nothing_twice(arrivals, switch_at, burst, fail, policy):
    clock = ManualClock()
    sched = SwitchingScheduler(_sched(OLD, clock, policy))
    reqs = _requests(arrivals + [(switch_at - 1.0, "m"), (switch_at + 1.0, "m")] * burst)
    log, outcome = replay(sched, clock, reqs, switches=[(switch_at, lambda: _sched(NEW, clock, policy))],
                          failures=[fail] if fail else [])
    # every request decided exactly once (replay raises on a second decision)
    assert set(outcome) == {r.id for r in reqs}
    for r in reqs:  # a request of a model the switch removed is never dispatched after it
        if r.model == "fresh" and outcome[r.id][0] == "dispatched":
            assert r.arrival_us >= switch_at
    first_new = sched.switches[0].first_batch_id
    # nothing double-booked: per vGPU id and per NIC, the planned intervals of both plans are
    # disjoint -- but for those a failure voided: a batch the failed worker held is dropped,
    # and its reservations from that worker's stage on (with the transfer into it) are
    # released, since they will never run; another worker may take that time
    busy = defaultdict(list)
    recut_old, recut_new = [], []
    for d in log:
        if not isinstance(d, Dispatch):
            continue
        era = int(d.batch_id >= first_new)
        void_from = float("inf")
        if fail and all(outcome[r.id] == ("dropped", DropReason.WORKER_FAILED) for r in d.requests):
            k = next((j for j, st in enumerate(d.stages) if st.vgpu_id == fail[1]), None)
            if k is not None:
                void_from = d.stages[k].start_us if d.stages[k].transfer_start_us is None else d.stages[k].transfer_start_us
        for res in d.reservations:
            if res.start_us >= void_from - 1e-6:
                continue
            busy[res.resource].append((res.start_us, res.end_us))
            if res.resource.startswith("vgpu:n-1/") or res.resource.startswith("vgpu:n-2/"):
                (recut_new if era else recut_old).append((res.resource, res.start_us, res.end_us))
    for res, spans in busy.items():
        spans.sort()
        for (s0, e0), (s1, e1) in zip(spans, spans[1:]):
            assert s1 >= e0 - 1e-6, f"{res}: {s0, e0} and {s1, e1} overlap"
    # a re-cut GPU's new shares start after its old shares' work has ended
    for res_new, s_new, _ in recut_new:
        for res_old, _, e_old in recut_old:
            if physical_gpu(res_new[5:]) == physical_gpu(res_old[5:]):
                assert s_new >= e_old - 1e-6


def test_withdraw_takes_queued_requests_back_and_ignores_the_rest():
    clock = ManualClock()
    sched = SwitchingScheduler(_sched(OLD, clock))
    reqs = _requests([(0.0, "m")] * 3)
    decided = [d for r in reqs for d in sched.submit(r) if isinstance(d, Dispatch)]
    queued = [r.id for r in sched.current.queues["m"]]
    assert queued and decided  # one batch of two went, one request waits for a partner
    assert sched.withdraw(queued + [999]) == []
    assert not sched.current.queues["m"]
    clock.advance_to(50_000.0)
    assert not [d for d in sched.wake() if isinstance(d, Dispatch)]  # its wake finds nothing to send


def test_a_gpu_another_scheduler_gives_up_waits_under_embargo_until_its_last_old_reservation():
    """Two shards of one server: shard A's old plan (m) uses n-2; the new plan gives n-2 to
    shard B (fresh). B's switch embargoes n-2; A's switch says when its old reservations
    there end; lifting B's embargo to that instant is the one-scheduler rule."""
    from ppipe.dataplane.handover import EMBARGO_US
    from ppipe.runtime.control.shard_plan import sub_plan

    clock = ManualClock()
    new_a = toy_plan(CLUSTER, [ToyModel("m", 6.0, [ToyPipeline(2, [ToyPartition(0, 0, "A", 1, [("n-0", 0, 0)]),
                                                                   ToyPartition(1, 1, "A", 1, [("n-1", 0, 0)])])])])
    old_a, old_b = _sched(sub_plan(OLD, ["m"]), clock), _sched(sub_plan(OLD, ["gone"]), clock)
    for r in _requests([(0.0, "m")] * 6):
        old_a.submit(r)
    a_until = old_a.topology.vgpus["n-2/gpu0/s0"].table.busy_until()
    assert a_until > 0.0  # A has booked n-2 ahead
    shard_a, shard_b = SwitchingScheduler(old_a), SwitchingScheduler(old_b)
    clock.advance_to(100.0)
    hb = shard_b.switch(_sched(sub_plan(NEW, ["fresh"]), clock), embargo=["n-2/gpu0"])
    fresh = shard_b.topology.vgpus["n-2/gpu0/s0"].table
    assert fresh.earliest(100.0, 1.0) >= EMBARGO_US  # nobody's until the giver has spoken
    assert hb.retired == {}  # B gives n-3 up, with nothing booked there
    # under the embargo, B holds what it is given: a probe would see n-2 busy without end
    held = shard_b.submit(Request(98, "fresh", 150.0, 150.0 + 6_000.0)) + shard_b.submit(Request(99, "fresh", 150.0, 150.0 + 6_000.0))
    assert held == []
    ha = shard_a.switch(_sched(new_a, clock))
    assert ha.retired["n-2/gpu0"] == a_until and "n-2/gpu0" not in ha.kept
    out = shard_b.lift_embargo("n-2/gpu0", ha.retired["n-2/gpu0"])
    assert all(key[0] != "embargo" for _, _, key in fresh.intervals())
    d = [x for x in out if isinstance(x, Dispatch)]
    assert not any(isinstance(x, Drop) for x in out)
    assert d and {r.id for r in d[0].requests} == {98, 99}
    assert d[0].stages[0].start_us == pytest.approx(a_until)  # once lifted, B books n-2 from A's last batch there on


def test_queued_requests_taken_over_under_an_embargo_wait_for_its_lift_instead_of_being_dropped():
    """The taker of a cycle of GPU moves switches first, under an embargo; the requests
    queued when it switches would be dropped by a probe during it, so they are held."""
    clock = ManualClock()
    old, new = _sched(OLD, clock), _sched(NEW, clock)
    for r in _requests([(0.0, "m")] * 7):
        old.submit(r)
    queued = sum(len(q) for q in old.queues.values())
    sched = SwitchingScheduler(old)
    h = sched.switch(new, embargo={"n-1/gpu0": None, "n-3/gpu0": None})  # m's second stage, both pools
    assert queued and len(h.held) == queued and not [d for d in h.decisions if isinstance(d, (Dispatch, Drop))]
    assert sched.lift_embargo("n-1/gpu0", 0.0) == []  # one embargo left: still held
    sched.withdraw([h.held[0].id])  # a withdrawn request is not submitted later
    out = sched.lift_embargo("n-3/gpu0", 0.0)
    decided = {r.id for d in out if isinstance(d, Dispatch) for r in d.requests} | {d.request.id for d in out if isinstance(d, Drop)}
    waiting = {r.id for q in new.queues.values() for r in q}
    assert decided | waiting == {r.id for r in h.held[1:]} and not any(isinstance(d, Drop) for d in out)
