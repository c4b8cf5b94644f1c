"""Exact execution (``SimConfig.execution="auto"``) writes a batch's stage times from its
plan at dispatch instead of simulating every transfer and stage as events. It is only
used where the events cannot differ from the plan, and must give exactly their records."""

from __future__ import annotations

import pytest

from ppipe.errors import UserError
from ppipe.sim.simulator import SimConfig, Simulator
from ppipe.sim.sweep import run_point


def _records(res):
    return [
        (r.id, r.model, r.arrival_us, r.dispatch_us, r.completion_us, r.drop_reason, r.drop_where, r.drop_detail, tuple(r.batch_ids))
        for r in res.records
    ]


def _batches(res):
    return [
        (b.batch_id, b.model, b.pipeline, b.request_ids, b.dispatch_us,
         [(s.partition, s.vgpu_id, s.start_us, s.end_us, s.transfer_start_us, s.transfer_end_us) for s in b.stages])
        for b in res.batches
    ]


def _assert_same(fast, slow):
    assert fast.events < slow.events  # the shortcut did run
    assert (fast.execution, slow.execution) == ("exact", "events")
    assert _records(fast) == _records(slow)
    assert _batches(fast) == _batches(slow)
    assert fast.stopped_at_s == slow.stopped_at_s
    for vid, vg in slow.vgpus.items():
        # (summed in another order: equal up to rounding)
        assert fast.vgpus[vid].busy_in_window_us == pytest.approx(vg.busy_in_window_us, rel=1e-9, abs=1e-6)
    assert fast.utilization == pytest.approx(slow.utilization, rel=1e-9)


def _both(plan, profiles, cluster, load, **cfg):
    fast = run_point(plan, profiles, cluster, load, config=SimConfig(**cfg, execution="auto"))
    slow = run_point(plan, profiles, cluster, load, config=SimConfig(**cfg, execution="events"))
    return fast, slow


@pytest.mark.parametrize("load", [0.5, 1.1, 2.0])
@pytest.mark.parametrize("feedback", ["changed", "none"])
def test_exact_execution_gives_the_event_simulations_records(tiny, load, feedback):
    plan, profiles, cluster = tiny
    fast, slow = _both(plan, profiles, cluster, load, duration_s=1.0, seed=2, feedback=feedback)
    _assert_same(fast, slow)
    assert slow.overall.ok > 0
    if load > 1:
        assert slow.overall.dropped > 0  # overload: drops at dispatch, queues in the tables


@pytest.mark.parametrize("prune_every", [4096, 3])
def test_exact_execution_stops_early_where_the_events_stop(tiny, monkeypatch, prune_every):
    # Batches in flight at the stop had their stages written at dispatch: the ones after
    # the stop must be undone, and the stop time must be the events' (last event handled).
    # (prune_every=3: ended batches are forgotten all along, as in long runs.)
    import ppipe.sim.simulator as simulator

    monkeypatch.setattr(simulator, "_EXACT_PRUNE_EVERY", prune_every)
    plan, profiles, cluster = tiny
    fast, slow = _both(plan, profiles, cluster, 2.5, duration_s=5.0, seed=1, feedback="changed", stop_below=0.99)
    assert slow.stopped_at_s is not None
    assert any(s.start_us < 0 for b in slow.batches for s in b.stages)  # some stage never started
    _assert_same(fast, slow)


@pytest.mark.parametrize(
    "cfg",
    [
        dict(feedback="all"),
        dict(feedback="changed", jitter_cv=0.1),
        dict(feedback="changed", failures=((0.2, "b-0/gpu0/s0"),)),
        dict(feedback="changed", policy="reactive"),
        dict(feedback="changed", execution="events"),
    ],
)
def test_the_events_run_where_reality_may_differ_from_the_plan(tiny, cfg):
    plan, profiles, cluster = tiny
    assert Simulator(plan, profiles, cluster, SimConfig(**cfg)).exact is False


def test_exact_execution_is_used_by_default_where_it_is_exact(tiny):
    plan, profiles, cluster = tiny
    assert Simulator(plan, profiles, cluster, SimConfig(feedback="changed")).exact is True


def test_unknown_execution_mode_is_a_user_error(tiny):
    plan, profiles, cluster = tiny
    with pytest.raises(UserError, match="execution must be one of"):
        Simulator(plan, profiles, cluster, SimConfig(execution="fast"))


@pytest.mark.artifact
@pytest.mark.parametrize("load", [1.0, 1.3])
def test_exact_execution_on_a_paper_plan_with_nic_transfers(artifact_dir, load):
    """Three models on HC2-S (L4 + T4 servers): pipelines that cross servers, several per model."""
    import ppipe
    from ppipe.spec.artifact import load_artifact_model
    from ppipe.spec.cluster import load_cluster

    profs = [load_artifact_model(artifact_dir, n) for n in ("repvgg-b3", "googlenet-v3-pytorch", "colorization-v2")]
    cluster = load_cluster("HC2-S")
    plan = ppipe.plan(cluster, profs, formulation="ppipe-atc25", weights=[0.30, 0.33, 0.37])
    fast, slow = _both(plan, {p.name: p for p in profs}, cluster, load, duration_s=1.0, seed=5, feedback="changed")
    assert any(s.transfer_start_us is not None for b in slow.batches for s in b.stages)
    _assert_same(fast, slow)


def test_a_dispatch_to_an_unknown_vgpu_falls_back_to_the_events(tiny):
    # A scheduler bug under exact execution is still recorded as the events record it.
    from sim_fakes import FakeScheduler

    class Buggy(FakeScheduler):
        executes_as_planned = True

        def _dispatch(self, request):
            out = super()._dispatch(request)
            d = out[0]
            if request.id == 3 and hasattr(d, "stages"):
                bad = d.stages[1].__class__(**{**d.stages[1].__dict__, "vgpu_id": "nowhere"})
                out = [d.__class__(**{**d.__dict__, "stages": (d.stages[0], bad)})]
            return out

    plan, profiles, cluster = tiny
    sim = Simulator(plan, profiles, cluster, SimConfig(duration_s=0.01, feedback="changed"), lambda *a: Buggy(*a))
    assert sim.exact is True
    res = run_point(plan, profiles, cluster, 0.5, config=SimConfig(duration_s=0.05, feedback="changed"),
                    scheduler_factory=lambda *a: Buggy(*a))
    assert res.anomaly_count == 1 and "unknown vGPU nowhere" in res.anomalies[0]
    assert len({b.batch_id for b in res.batches}) == len(res.batches)  # no batch recorded twice
    assert sum(r.batch_ids.count(r.batch_ids[0]) > 1 for r in res.records if r.batch_ids) == 0


def test_exact_execution_ends_at_the_horizon_where_the_events_end(tiny):
    # No drain: batches dispatched near the end of the window are still in flight at the
    # horizon; their stages after it never ran and their requests are unfinished.
    plan, profiles, cluster = tiny
    fast, slow = _both(plan, profiles, cluster, 1.1, duration_s=0.5, seed=4, feedback="changed", drain_s=0.0)
    assert slow.overall.unfinished > 0
    _assert_same(fast, slow)
