"""The simulator driving the real data plane (``ppipe.dataplane.build_scheduler``)."""

from __future__ import annotations

import pytest

from ppipe.dataplane.feedback import EXACT_US
from ppipe.dataplane.reservation import ReservationScheduler
from ppipe.sim.simulator import SimConfig
from ppipe.sim.sweep import run_point


@pytest.mark.parametrize("policy", ["reservation", "reactive"])
def test_underloaded_is_fully_served(tiny, policy):
    plan, profiles, cluster = tiny
    res = run_point(plan, profiles, cluster, 0.3, config=SimConfig(duration_s=1.0, policy=policy))
    assert res.overall.requests > 400
    assert res.attainment == 1.0
    assert res.anomaly_count == 0
    assert res.probes_per_dispatch is not None and res.probes_per_dispatch >= 1.0


@pytest.mark.parametrize("policy", ["reservation", "reactive"])
def test_overloaded_drops_with_reasons_and_loses_nothing(tiny, policy):
    plan, profiles, cluster = tiny
    res = run_point(plan, profiles, cluster, 3.0, config=SimConfig(duration_s=1.0, policy=policy))
    o = res.overall
    assert o.unfinished == 0 and o.requests == o.ok + o.late + o.dropped
    assert o.dropped > 0.5 * o.requests
    assert set(o.drops_by_reason) == {"deadline-unreachable"}
    assert res.anomaly_count == 0
    # the reservation scheduler plans with the truth: what it dispatches finishes in time
    if policy == "reservation":
        assert o.late == 0


def test_jitter_with_and_without_feedback(tiny):
    """Feedback correction: with reports the scheduler plans on the truth and does no worse."""
    plan, profiles, cluster = tiny
    base = dict(duration_s=2.0, jitter_cv=0.3, seed=5)
    with_fb = run_point(plan, profiles, cluster, 0.8, config=SimConfig(**base, feedback="all"))
    without = run_point(plan, profiles, cluster, 0.8, config=SimConfig(**base, feedback="none"))
    for r in (with_fb, without):
        o = r.overall
        assert o.requests == o.ok + o.late + o.dropped and o.unfinished == 0
    assert with_fb.overall.late > 0  # jitter after dispatch still makes some late
    assert with_fb.attainment >= without.attainment - 0.01


def test_changed_only_feedback_gives_the_same_result_without_jitter(tiny):
    plan, profiles, cluster = tiny
    a = run_point(plan, profiles, cluster, 1.1, config=SimConfig(duration_s=1.0, feedback="all"))
    b = run_point(plan, profiles, cluster, 1.1, config=SimConfig(duration_s=1.0, feedback="changed"))
    assert [(r.outcome, r.completion_us) for r in a.records] == [(r.outcome, r.completion_us) for r in b.records]


def test_changed_only_feedback_gives_the_same_result_with_jitter(tiny):
    # A report that equals the reservation changes nothing in the tables (confirm), so
    # skipping it ("changed") takes the same decisions as sending it ("all").
    plan, profiles, cluster = tiny
    cfg = dict(duration_s=1.0, jitter_cv=0.2, seed=3)
    a = run_point(plan, profiles, cluster, 1.1, config=SimConfig(**cfg, feedback="all"))
    b = run_point(plan, profiles, cluster, 1.1, config=SimConfig(**cfg, feedback="changed"))
    assert a.overall.late > 0  # the jitter did move stages off their reservations
    assert [(r.outcome, r.completion_us, r.batch_ids) for r in a.records] == [(r.outcome, r.completion_us, r.batch_ids) for r in b.records]


def test_the_workers_report_only_stages_outside_the_report_tolerance(tiny, monkeypatch):
    """``report_tolerance_us`` (ppipe.dataplane.feedback, the rule ``ppipe serve`` feeds the
    reservation policy by): the wider it is, the fewer jittered stages report."""
    plan, profiles, cluster = tiny
    fed = []
    report = ReservationScheduler.report
    monkeypatch.setattr(ReservationScheduler, "report", lambda self, r: (fed.append(r), report(self, r))[1])
    counts = {}
    for tol in (EXACT_US, 2000.0, 1e12):
        fed.clear()
        res = run_point(plan, profiles, cluster, 0.8,
                        config=SimConfig(duration_s=1.0, jitter_cv=0.2, seed=3, feedback="changed", report_tolerance_us=tol))
        counts[tol] = len(fed)
        o = res.overall
        assert o.unfinished == 0 and o.requests == o.ok + o.late + o.dropped
    assert counts[EXACT_US] > counts[2000.0] > counts[1e12] == 0


def test_failure_with_the_real_scheduler(tiny):
    plan, profiles, cluster = tiny
    res = run_point(plan, profiles, cluster, 0.5, config=SimConfig(duration_s=1.0, failures=((0.3, "b-0/gpu0/s0"),)))
    o = res.overall
    assert o.unfinished == 0 and o.requests == o.ok + o.late + o.dropped
    assert all(b.stages[0].vgpu_id != "b-0/gpu0/s0" for b in res.batches if b.dispatch_us > 0.3e6)
    assert res.anomaly_count == 0


@pytest.mark.artifact
def test_paper_plan_holds_at_moderate_load(artifact_dir):
    """A real PPipe plan (artifact profiles, paper formulation) on HC2-L serves 60 % load fully."""
    import ppipe
    from ppipe.spec.artifact import load_artifact_model
    from ppipe.spec.cluster import load_cluster

    prof = load_artifact_model(artifact_dir, "repvgg-b3")
    cluster = load_cluster("HC2-L")
    plan = ppipe.plan(cluster, [prof], formulation="ppipe-atc25", slo_ms=5 * prof.manifest.latency_bs1_us["L4"] / 1e3, max_partitions=2)
    res = run_point(plan, {prof.name: prof}, cluster, 0.6, config=SimConfig(duration_s=0.5, feedback="changed"))
    assert res.overall.requests > 100
    assert res.attainment >= 0.99
    assert res.anomaly_count == 0
