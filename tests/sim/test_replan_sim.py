"""The simulator with re-planning on (SimConfig.replan): the controller on the virtual clock,
switches through SwitchingScheduler, old batches finishing on their old vGPU states."""

from __future__ import annotations

import pytest

from ppipe.control.replan import ReplanPolicy, plan_value
from ppipe.dataplane.testing import ToyModel, ToyPartition, ToyPipeline, toy_cluster, toy_plan, toy_profile
from ppipe.errors import UserError
from ppipe.sim.records import Outcome
from ppipe.sim.simulator import ReplanSetup, SimConfig, Simulator
from ppipe.sim.workloads import shifting_poisson_arrivals

CLUSTER = toy_cluster([("n", "A", 1, 6, 8.0)])  # n-0 .. n-5, one GPU each
PROFILES = {m: toy_profile(m, {"A": [5_000.0, 5_000.0]}, out_bytes=[1000, 10], batches=(1,)) for m in ("m1", "m2")}
PER_GPU_RPS = 100.0  # 10 ms per request at batch 1


def _plan(n_m1: int):
    """m1 on n-0 .. n-(n_m1-1), m2 on the rest; whole model on one vGPU each."""
    pools = {"m1": [(f"n-{i}", 0, 0) for i in range(n_m1)], "m2": [(f"n-{i}", 0, 0) for i in range(n_m1, 6)]}
    plan = toy_plan(CLUSTER, [ToyModel(m, 60.0, [ToyPipeline(1, [ToyPartition(0, 1, "A", 1, pools[m])])]) for m in ("m1", "m2")])
    models = [m.model_copy(update={"throughput_rps": PER_GPU_RPS * len(pools[m.name])}) for m in plan.models]
    return plan.model_copy(update={"models": models})


PLANS = [_plan(n) for n in (1, 2, 3, 4, 5)]


class PickBest:
    """A planner that returns the best of PLANS for the weights (max-min of capacity / weight)."""

    def __init__(self):
        self.calls = 0

    def __call__(self, weights):
        self.calls += 1
        return max(PLANS, key=lambda p: plan_value(p, weights))


POLICY = ReplanPolicy(window_s=6.0, check_every_s=1.0, min_interval_s=10.0, load_delay_s=2.0)


def _run(replan: bool, seed: int = 0, **cfg):
    arrivals = shifting_poisson_arrivals(["m1", "m2"], 480.0, 60e6, seed, period_s=60.0)
    setup = ReplanSetup(PickBest(), POLICY, load_delay_s=2.0) if replan else None
    config = SimConfig(duration_s=60.0, seed=seed, feedback=cfg.pop("feedback", "changed"), replan=setup, **cfg)
    return Simulator(PLANS[2], PROFILES, CLUSTER, config).run(arrivals)


def _fingerprint(sim):
    return [(r.id, r.model, r.arrival_us, r.completion_us, r.drop_reason, tuple(r.batch_ids)) for r in sim.records]


def _outcomes(sim):
    return {o: sum(1 for r in sim.records if r.outcome is o) for o in Outcome}


def test_replanning_switches_and_serves_the_shifting_mix_better():
    static, auto = _run(False), _run(True)
    log = auto.switch_log
    assert len(log) >= 3
    assert all(b["decided_s"] - a["decided_s"] >= 10.0 for a, b in zip(log, log[1:]))
    assert all(s["switched_s"] == pytest.approx(s["decided_s"] + 2.0) for s in log)
    assert all(s["z_new"] >= 1.1 * s["z_old"] for s in log)
    assert 0 < min(s["kept"] for s in log) and max(s["kept"] for s in log) < 6  # some workers kept, some moved
    ok = lambda sim: sum(r.outcome is Outcome.OK for r in sim.records) / len(sim.records)
    assert ok(auto) > ok(static) + 0.05, (ok(auto), ok(static))


@pytest.mark.parametrize("cfg", [{}, {"jitter_cv": 0.2, "feedback": "all"}], ids=["exact", "events-with-reports"])
def test_one_answer_per_request_across_switches(cfg):
    sim = _run(True, **cfg)
    assert sim.switch_log and sim.anomaly_count == 0, sim.anomalies  # a misrouted report or a double answer is an anomaly
    assert all(r is not None for r in sim.records)
    assert _outcomes(sim)[Outcome.UNFINISHED] == 0
    # every dispatched batch ran on vGPUs of the plan that dispatched it, and finished
    for b in sim.batches:
        assert all(st.end_us >= st.start_us >= 0 for st in b.stages)


def test_exact_execution_across_switches_equals_the_events():
    a, b = _run(True), _run(True, execution="events")
    assert a.exact and not b.exact
    assert _fingerprint(a) == _fingerprint(b)


def test_same_seed_same_run():
    a, b = _run(True, seed=3), _run(True, seed=3)
    strip = lambda log: [{k: v for k, v in s.items() if k != "planner_s"} for s in log]
    assert _fingerprint(a) == _fingerprint(b) and strip(a.switch_log) == strip(b.switch_log)


def test_replan_off_leaves_the_run_as_it_was():
    a = _run(False)
    assert a.controller is None and a.switch_log == [] and type(a.scheduler).__name__ != "SwitchingScheduler"


def test_a_negative_load_delay_is_refused():
    with pytest.raises(UserError, match="load delay"):
        Simulator(PLANS[2], PROFILES, CLUSTER, SimConfig(replan=ReplanSetup(PickBest(), load_delay_s=-1.0)))


def test_stop_overall_cuts_a_run_that_one_model_sinks():
    # static plan, shifting mix: m1 overflows at its peak (t ~ 15 s) while m2 stays on time
    # until its own peak (t ~ 45 s), so the per-model early stop waits for that; the overall
    # one stops once 1 % of all requests is missed
    per_model, overall = _run(False, stop_below=0.99), _run(False, stop_below=0.99, stop_overall=True)
    assert overall.stopped_at_us is not None and per_model.stopped_at_us is not None
    assert overall.stopped_at_us < 30e6 < per_model.stopped_at_us
    missed = sum(r.outcome in (Outcome.DROPPED, Outcome.LATE) for r in overall.records)
    assert missed > 0.01 * sum(len(v) for v in shifting_poisson_arrivals(["m1", "m2"], 480.0, 60e6, 0, period_s=60.0).values())


def test_a_per_pool_policy_is_refused_before_the_run():
    with pytest.raises(UserError, match="whole paths"):
        Simulator(PLANS[2], PROFILES, CLUSTER, SimConfig(policy="reactive-pool", replan=ReplanSetup(PickBest())))
