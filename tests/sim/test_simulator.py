"""The simulator on a tiny hand-built plan with a fake scheduler (the real one: test_end_to_end)."""

from __future__ import annotations

import numpy as np
import pytest

from ppipe.sim.arrivals import make_arrivals
from ppipe.sim.records import Outcome
from ppipe.sim.simulator import SimConfig, Simulator, simulate

from sim_fakes import FakeScheduler


def fake(**kw):
    return lambda plan, profiles, cluster, clock: FakeScheduler(plan, profiles, cluster, clock, **kw)


def run(tiny, rate, dur=1.0, seed=0, **cfg):
    plan, profiles, cluster = tiny
    arr = make_arrivals("poisson", {"tiny": rate}, dur * 1e6, seed)
    return simulate(plan, profiles, cluster, arr, SimConfig(duration_s=dur, seed=seed, **cfg), fake())


def check_invariants(res):
    """Physical truth: no vGPU runs two stages at once; a stage starts after its input arrived."""
    by_vgpu: dict[str, list] = {}
    for b in res.batches:
        prev = None
        for st in b.stages:
            if st.start_us < 0:
                continue
            assert st.start_us >= st.planned_start_us - 1e-9
            if prev is not None:
                arrived = st.transfer_end_us if st.transfer_end_us is not None else prev.end_us
                assert st.transfer_start_us is None or st.transfer_start_us >= prev.end_us - 1e-9
                assert st.start_us >= arrived - 1e-9
            by_vgpu.setdefault(st.vgpu_id, []).append((st.start_us, st.end_us))
            prev = st
    for iv in by_vgpu.values():
        iv.sort()
        for (s0, e0), (s1, _e1) in zip(iv, iv[1:]):
            assert s1 >= e0 - 1e-9


def test_one_request_follows_the_plan_exactly(tiny):
    plan, profiles, cluster = tiny
    res = simulate(plan, profiles, cluster, {"tiny": np.array([0.0])}, SimConfig(duration_s=0.01), fake())
    (r,) = res.records
    (b,) = res.batches
    assert [(s.vgpu_id, s.start_us, s.end_us) for s in b.stages] == [("b-0/gpu0/s0", 0.0, 1000.0), ("a-0/gpu0/s0", 1001.0, 1401.0)]
    assert (b.stages[1].transfer_start_us, b.stages[1].transfer_end_us) == (1000.0, 1001.0)
    assert r.completion_us == 1401.0 and r.outcome is Outcome.OK
    assert res.overall.p50_latency_ms == pytest.approx(1.401)


def test_underloaded_gives_full_attainment(tiny):
    res = run(tiny, 200.0, dur=2.0)
    assert res.overall.requests > 300
    assert res.attainment == 1.0 and res.overall.dropped == 0 and res.overall.late == 0
    assert res.anomaly_count == 0
    # utilization: 200 req/s x 1 ms on 2 B GPUs = 10 %; 200 x 0.4 ms on 1 A GPU = 8 %
    assert res.utilization["B"] == pytest.approx(0.10, rel=0.15)
    assert res.utilization["A"] == pytest.approx(0.08, rel=0.15)
    assert res.models["tiny"].batch_histogram == {1: res.overall.requests}
    assert res.probes_per_dispatch == pytest.approx(1.0)
    check_invariants(res)


def test_overloaded_drops_with_reasons_and_loses_nothing(tiny):
    res = run(tiny, 6000.0, dur=1.0)
    o = res.overall
    assert o.requests == o.ok + o.late + o.dropped + o.unfinished
    assert o.unfinished == 0
    assert o.dropped > 0.4 * o.requests  # capacity is 2000 req/s
    assert o.drops_by_reason == {"deadline-unreachable": o.dropped}
    assert o.drops_by_where == {"queue": o.dropped}
    assert res.attainment < 0.6
    assert o.goodput_rps == pytest.approx(2000, rel=0.1)
    check_invariants(res)


def test_same_seed_same_result(tiny):
    a = run(tiny, 1500.0, seed=3, jitter_cv=0.2)
    b = run(tiny, 1500.0, seed=3, jitter_cv=0.2)
    c = run(tiny, 1500.0, seed=4, jitter_cv=0.2)
    key = lambda res: [(r.outcome, r.completion_us) for r in res.records]  # noqa: E731
    assert key(a) == key(b)
    assert key(a) != key(c)


def test_jitter_reports_truth_and_late_requests_count_as_misses(tiny):
    plan, profiles, cluster = tiny
    # SLO 1.45 ms vs 1.401 ms planned: jitter makes some requests finish late
    from sim_fakes import tiny_plan

    plan = tiny_plan(slo_ms=1.45)
    seen = []

    def factory(p, pr, c, clock):
        s = FakeScheduler(p, pr, c, clock)
        seen.append(s)
        return s

    arr = make_arrivals("poisson", {"tiny": 300.0}, 2e6, 1)
    res = simulate(plan, profiles, cluster, arr, SimConfig(duration_s=2.0, jitter_cv=0.3), factory)
    o = res.overall
    assert o.late > 0 and o.attainment == pytest.approx(o.ok / o.requests)
    assert o.late_rate == pytest.approx(o.late / o.requests)
    assert o.ok + o.late + o.dropped == o.requests
    check_invariants(res)
    # every stage was reported with its actual times, which differ from the plan
    reps = seen[0].reports
    assert len(reps) == sum(len(b.stages) for b in res.batches)
    actual = {(b.batch_id, s.partition): (s.start_us, s.end_us) for b in res.batches for s in b.stages}
    assert all(actual[(r.batch_id, r.partition)] == (r.start_us, r.end_us) for r in reps)
    assert any(abs((s.end_us - s.start_us) - s.planned_infer_us) > 1 for b in res.batches for s in b.stages)


def test_no_feedback_means_no_reports(tiny):
    plan, profiles, cluster = tiny
    seen = []

    def factory(p, pr, c, clock):
        seen.append(FakeScheduler(p, pr, c, clock))
        return seen[-1]

    simulate(plan, profiles, cluster, {"tiny": np.array([0.0, 10.0])}, SimConfig(duration_s=0.01, feedback="none"), factory)
    assert seen[0].reports == []


def test_wake_at_is_honoured(tiny):
    plan, profiles, cluster = tiny
    res = simulate(plan, profiles, cluster, {"tiny": np.array([0.0, 5000.0])}, SimConfig(duration_s=0.01), fake(wait_us=250.0))
    assert [r.dispatch_us for r in res.records] == [250.0, 5250.0]
    assert [r.completion_us - r.arrival_us for r in res.records] == [1651.0, 1651.0]


def test_failure_drops_in_flight_work_and_traffic_moves_on(tiny):
    res = run(tiny, 1000.0, dur=1.0, failures=((0.5, "b-0/gpu0/s0"),))
    o = res.overall
    assert o.unfinished == 0 and o.requests == o.ok + o.late + o.dropped
    # the batch on b-0 at t=0.5 s (if any) is lost; the fake scheduler does not drop it, the simulator does
    assert set(o.drops_by_reason) <= {"worker-failed", "deadline-unreachable"}
    after = [b for b in res.batches if b.dispatch_us > 0.5e6]
    assert after and all(b.stages[0].vgpu_id == "b-1/gpu0/s0" for b in after)
    check_invariants(res)


def test_unknown_failure_vgpu_is_a_user_error(tiny):
    from ppipe.errors import UserError

    with pytest.raises(UserError, match="unknown vGPU"):
        run(tiny, 10.0, failures=((0.1, "nope"),))


def test_unplaced_partition_is_a_user_error(tiny):
    from ppipe.errors import UserError

    plan, profiles, cluster = tiny
    bad = plan.model_copy(update={"placement": plan.placement[:1]})
    with pytest.raises(UserError, match="planned"):
        Simulator(bad, profiles, cluster, SimConfig(duration_s=1), fake())
