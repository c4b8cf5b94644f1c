"""The runtime's margins as data-plane rules (ppipe.dataplane.margins): a dispatch lead, an
answer budget, the input's transfer, and the check that a plan leaves room for them."""

from __future__ import annotations

import pytest

from ppipe.dataplane import build_scheduler
from ppipe.dataplane.api import Dispatch, Drop, DropReason, Request, WakeAt
from ppipe.dataplane.margins import (DEFAULT_WAKE_LEAD_US, adaptive_cap_us, check_margins, margins_of, service_margins, serving_options,
                                     simulated_serving_options)
from ppipe.dataplane.options import SchedulerOptions
from ppipe.dataplane.testing import ManualClock, ToyModel, ToyPartition, ToyPipeline, fig5_world, toy_cluster, toy_plan, toy_profile
from ppipe.errors import UserError
from ppipe.spec.profile import ModelProfile, TensorSpec

SLO_US = 5000.0
PATH_US = 100.0 + 10.0 + 200.0  # fig5 at batch 1: block 0, 10 kB over 8 Gbit/s, block 1


def _submit(s, t: float = 0.0, rid: int = 0):
    return s.submit(Request(rid, "m", t, t + SLO_US))


def test_the_dispatch_lead_moves_every_reservation_and_counts_in_the_deadline():
    s, _ = fig5_world(batch=1, dispatch_lead_us=700.0)
    (d,) = _submit(s)
    assert isinstance(d, Dispatch)
    assert d.stages[0].start_us == pytest.approx(700.0)  # not before the dispatch can be at its worker
    assert d.stages[-1].start_us + d.stages[-1].infer_us == pytest.approx(700.0 + PATH_US)
    s, _ = fig5_world(batch=1, dispatch_lead_us=SLO_US - PATH_US + 1.0)  # the lead leaves the path no time
    (d,) = _submit(s)
    assert isinstance(d, Drop) and d.reason is DropReason.DEADLINE_UNREACHABLE


def test_the_answer_budget_ends_batches_early_but_is_no_deadline_of_the_request():
    s, _ = fig5_world(batch=1, answer_budget_us=SLO_US - PATH_US - 1.0)
    (d,) = _submit(s)
    assert isinstance(d, Dispatch) and d.requests[0].deadline_us == SLO_US  # the request keeps its SLO
    s, _ = fig5_world(batch=1, answer_budget_us=SLO_US - PATH_US + 1.0)
    (d,) = _submit(s)
    assert isinstance(d, Drop) and d.reason is DropReason.DEADLINE_UNREACHABLE


def test_a_head_within_the_drop_budget_is_served_at_once_and_only_one_beyond_it_is_dropped():
    """The answer budget leaves the path no time, the smaller drop budget does: the request is
    dispatched (a batch of what is queued, at once), not dropped; beyond the drop budget too,
    it is dropped; and a drop budget above the answer budget changes nothing."""
    tight = SLO_US - PATH_US + 1.0  # no path ends by the deadline less this
    s, _ = fig5_world(batch=4, answer_budget_us=tight, drop_budget_us=SLO_US - PATH_US - 1.0)
    (d,) = _submit(s)
    assert isinstance(d, Dispatch) and d.batch == 1 and d.requests[0].deadline_us == SLO_US
    assert d.stages[-1].start_us + d.stages[-1].infer_us == pytest.approx(PATH_US)
    for drop_budget in (tight + 1.0, 2 * SLO_US):
        s, _ = fig5_world(batch=4, answer_budget_us=tight, drop_budget_us=drop_budget)
        (d,) = _submit(s)
        assert isinstance(d, Drop) and d.reason is DropReason.DEADLINE_UNREACHABLE
    assert SchedulerOptions(answer_budget_us=500.0, drop_budget_us={"m": 900.0}).drop_budget("m") == 500.0  # never above
    assert SchedulerOptions(answer_budget_us=500.0, drop_budget_us={"m": 200.0}).drop_budget("other") == 500.0
    with pytest.raises(ValueError, match="drop_budget_us must be >= 0"):
        SchedulerOptions(drop_budget_us=-1.0)


def test_a_waiting_batch_wakes_on_the_clocks_timeline_and_leaves_at_its_last_moment():
    lead, budget = 800.0, 300.0
    s, clock = fig5_world(batch=4, dispatch_lead_us=lead, answer_budget_us=budget)
    (w,) = _submit(s)
    assert isinstance(w, WakeAt)
    # the batch of one planned from now + lead ends at the deadline less the budget
    assert w.t_us == pytest.approx(SLO_US - budget - PATH_US - lead)
    clock.advance_to(w.t_us)
    (d,) = s.wake()
    assert isinstance(d, Dispatch)
    assert d.stages[0].start_us == pytest.approx(w.t_us + lead)
    assert d.stages[-1].start_us + d.stages[-1].infer_us == pytest.approx(SLO_US - budget)


def test_the_wake_lead_dispatches_a_waiting_batch_that_much_earlier_and_the_simulator_runs_it():
    lead, budget, wake = 800.0, 300.0, 2000.0
    s, _ = fig5_world(batch=4, dispatch_lead_us=lead, answer_budget_us=budget, wake_lead_us=wake)
    (w,) = _submit(s)
    assert w.t_us == pytest.approx(SLO_US - budget - PATH_US - lead - wake)
    # `ppipe simulate` stands for `ppipe serve` with the runtime's margins and its wake lead
    assert simulated_serving_options() == {**serving_options(), "wake_lead_us": DEFAULT_WAKE_LEAD_US}
    assert "wake_lead_us" not in simulated_serving_options(wake_lead_us=0.0)


def _world_with_input(batch: int, input_shape=(3, 100, 100)):
    cluster = toy_cluster([("n", "A", 1, 3, 8.0)])
    prof = toy_profile("m", {"A": [100.0, 200.0]}, out_bytes=[10_000, 10], batches=(1, 2, 4))
    prof = ModelProfile(manifest=prof.manifest.model_copy(update={"input": TensorSpec(name="x", shape=list(input_shape))}), table=prof.table)
    plan = toy_plan(cluster, [ToyModel("m", SLO_US / 1e3, [ToyPipeline(batch, [
        ToyPartition(0, 0, "A", 1, [("n-0", 0, 0)]), ToyPartition(1, 1, "A", 1, [("n-1", 0, 0), ("n-2", 0, 0)])])])])
    return plan, {"m": prof}, cluster


def test_the_input_transfer_joins_the_lead_at_the_planned_batch():
    plan, profiles, cluster = _world_with_input(batch=4)
    bits = 3 * 100 * 100 * 4 * 8
    s = build_scheduler(plan, profiles, cluster, ManualClock(), policy="reservation", dispatch_lead_us=50.0, input_transfer_lead=True)
    assert s.lead_us("m") == pytest.approx(50.0 + 4 * bits * 1e-3 / 8.0)  # 4 samples over 8 Gbit/s
    off = build_scheduler(plan, profiles, cluster, ManualClock(), policy="reservation", dispatch_lead_us=50.0)
    assert off.lead_us("m") == 50.0  # the paper's data plane counts no input transfer


def test_margins_and_slack_of_a_plan():
    plan, profiles, cluster = _world_with_input(batch=4)
    margins = service_margins(plan, profiles, cluster, SchedulerOptions(**serving_options(1000.0, 500.0)))
    x = margins["m"]
    assert x.slack_us == pytest.approx(SLO_US - PATH_US)  # the smallest batch, no waiting
    assert x.lead_us == pytest.approx(1000.0 + x.input_us) and x.budget_us == 500.0 and x.reachable
    assert adaptive_cap_us(x) == pytest.approx(0.5 * (x.slack_us - x.reserved_us))
    check_margins(margins)  # room for them: no error


def test_a_plan_that_leaves_no_room_for_the_margins_is_refused_with_what_it_needs():
    plan, profiles, cluster = _world_with_input(batch=1)
    margins = service_margins(plan, profiles, cluster, SchedulerOptions(**serving_options(3000.0, 2000.0)))
    assert not margins["m"].reachable
    with pytest.raises(UserError, match=r"m: the fastest path leaves 4\.69 ms of its SLO, the runtime needs 5\.\d\d ms") as err:
        check_margins(margins)
    assert "--margin" in err.value.fix


def test_the_reactive_pool_baseline_refuses_margins_it_cannot_apply():
    with pytest.raises(UserError, match="reactive-pool baseline does not apply"):
        fig5_world(policy="reactive-pool", dispatch_lead_us=100.0)
    assert margins_of(fig5_world()[0].topology, SchedulerOptions())["m"].reserved_us == 0.0


def test_negative_margins_are_refused_by_name():
    with pytest.raises(UserError, match="answer_budget_us must be >= 0"):
        SchedulerOptions.from_kwargs({"answer_budget_us": {"m": -1.0}})
    with pytest.raises(UserError, match="dispatch_lead_us"):
        SchedulerOptions.from_kwargs({"dispatch_lead_us": -1.0})
