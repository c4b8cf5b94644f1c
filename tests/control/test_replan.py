"""The re-plan controller (ppipe.control.replan) on a fake clock with a fake planner."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np
import pytest

from ppipe.control.replan import ReplanController, ReplanPolicy, kept_placements, plan_value, planner_replan
from ppipe.dataplane.testing import ManualClock
from ppipe.errors import UserError
from ppipe.sim.arrivals import poisson_arrivals, model_rng
from ppipe.sim.workloads import shifting_poisson_arrivals

MODELS = ["a", "b", "c"]
CAPACITY = 600.0  # the fake cluster's total capacity, req/s, shared as the weights say


@dataclass
class _M:
    name: str
    throughput_rps: float


@dataclass
class FakePlan:
    caps: dict
    placement: list = field(default_factory=list)

    @property
    def models(self):
        return [_M(m, c) for m, c in self.caps.items()]

    def model(self, name):
        return _M(name, self.caps[name])


class IdealPlanner:
    """Capacity exactly proportional to the weights; records its calls."""

    def __init__(self):
        self.calls: list[dict] = []

    def __call__(self, weights):
        self.calls.append(dict(weights))
        return FakePlan({m: CAPACITY * w for m, w in weights.items()})


def drive(arrivals: dict[str, np.ndarray], policy=ReplanPolicy(), end_s=None):
    """Feed arrivals in time order on a manual clock, polling after each; the controller and planner."""
    clock = ManualClock()
    planner = IdealPlanner()
    ctl = ReplanController(FakePlan({m: CAPACITY / 3 for m in MODELS}), planner, clock, policy)
    events = sorted((t, m) for m, ts in arrivals.items() for t in ts)
    for t, m in events:
        clock.t_us = t
        ctl.observe(m, t)
        ctl.poll()
    return ctl, planner


def steady(total_rps, duration_s, seed=0):
    return {m: poisson_arrivals(total_rps / 3, duration_s * 1e6, model_rng(seed, i)) for i, m in enumerate(MODELS)}


def test_steady_mix_below_the_trigger_never_calls_the_planner():
    ctl, planner = drive(steady(0.8 * CAPACITY, 300))
    assert planner.calls == [] and ctl.decisions == []


def test_steady_mix_above_the_trigger_replans_rarely_and_never_switches():
    # 95 % of capacity: the trigger fires, but the planner cannot do 10 % better
    ctl, planner = drive(steady(0.95 * CAPACITY, 300))
    assert ctl.decisions == []
    assert 1 <= len(planner.calls) <= 300 / 60 + 1  # hysteresis: at most one re-plan per min_interval, not one per 5 s check
    assert all(abs(w - 1 / 3) < 0.03 for c in planner.calls for w in c.values())


def test_shifting_mix_switches_at_least_min_interval_apart_with_weights_that_follow_the_rates():
    arr = shifting_poisson_arrivals(MODELS, 0.8 * CAPACITY, 1200e6, seed=2, period_s=600.0)
    ctl, planner = drive(arr)
    times = [d.at_us / 1e6 for d in ctl.decisions]
    assert len(times) >= 4
    assert all(b - a >= 60.0 for a, b in zip(times, times[1:]))
    for d in ctl.decisions:
        assert d.applied and d.z_new >= 1.1 * d.z_old
        assert math.isclose(sum(d.weights.values()), 1.0)
        # the planned-for rates lie near the true rates over [t, t + H] (a line extrapolated past a peak overshoots it: up to ~25 % here)
        t = d.at_us / 1e6
        grid = np.linspace(t, t + 60.0, 61)
        true = 0.8 * CAPACITY * (1 / 3 + 0.2 * np.sin(2 * np.pi * grid[None, :] / 600 + np.arange(3)[:, None] * 2 * np.pi / 3))
        for i, m in enumerate(MODELS):
            assert true[i].min() * 0.85 <= d.planned_for_rps[m] <= true[i].max() * 1.3, (t, m, d.planned_for_rps[m])


def test_min_interval_is_a_parameter():
    arr = shifting_poisson_arrivals(MODELS, 0.8 * CAPACITY, 1200e6, seed=2, period_s=600.0)
    ctl, _ = drive(arr, ReplanPolicy(min_interval_s=200.0))
    times = [d.at_us / 1e6 for d in ctl.decisions]
    assert times and all(b - a >= 200.0 for a, b in zip(times, times[1:]))


def test_a_gain_below_min_gain_is_not_applied():
    arr = shifting_poisson_arrivals(MODELS, 0.8 * CAPACITY, 600e6, seed=2, period_s=600.0)
    ctl, planner = drive(arr, ReplanPolicy(min_gain=10.0))  # no plan can be 11 x better
    assert planner.calls and ctl.decisions == [] and all(not a.applied for a in ctl.attempts)


def test_same_inputs_same_decisions():
    arr = shifting_poisson_arrivals(MODELS, 0.8 * CAPACITY, 900e6, seed=5, period_s=600.0)
    a, _ = drive(arr)
    b, _ = drive(arr)
    key = lambda c: [(d.at_us, d.weights, d.z_new) for d in c.decisions]
    assert key(a) == key(b) and key(a)


def test_estimate_of_a_ramp_recovers_rate_and_trend():
    # deterministic arrivals whose rate rises linearly: r(t) = 100 + 2 t req/s
    times = _deterministic(lambda t: 100 + 2 * t, 120)
    clock = ManualClock()
    exact = ReplanController(FakePlan({"a": 1e9}), IdealPlanner(), clock, ReplanPolicy(confidence_z=0.0))
    shrunk = ReplanController(FakePlan({"a": 1e9}), IdealPlanner(), clock)
    for x in times:
        exact.observe("a", x)
        shrunk.observe("a", x)
    rate, trend = exact.estimate(100e6)
    assert rate["a"] == pytest.approx(300.0, rel=0.02) and trend["a"] == pytest.approx(2.0, rel=0.05)
    assert exact.planned_for(rate, trend)["a"] == pytest.approx(300.0 + 2.0 * 60, rel=0.03)
    # the default shrinks the slope by 2 standard errors of a Poisson count's slope: sqrt(mean count / S_xx)
    _, t2 = shrunk.estimate(100e6)
    se = math.sqrt(240.0 / sum((k - 29.5) ** 2 for k in range(60)))
    assert t2["a"] == pytest.approx(trend["a"] - 2 * se, rel=0.02)


def test_a_steep_ramp_is_trusted_only_once_enough_bins_show_it():
    # the first check (warmup_s after the start) plans for the level; a full window adds the trend
    times = _deterministic(lambda t: 200 + 2 * t, 80)
    clock = ManualClock()
    ctl = ReplanController(FakePlan({"a": 1e9}), IdealPlanner(), clock)
    assert ctl.next_check_us == pytest.approx(5e6)  # warmup_s, not window_s
    for x in times:
        ctl.observe("a", x)
    rate5, trend5, err5 = ctl.estimate_with_error(5e6)
    # 5 bins: the slope's standard error (sqrt(205 / 10) = 4.5) exceeds the slope: the mean level, its error
    assert trend5["a"] == 0.0 and rate5["a"] == pytest.approx(205.0, rel=0.01) and err5["a"] == pytest.approx(math.sqrt(205 / 5), rel=0.01)
    rate, trend, err = ctl.estimate_with_error(70e6)  # bins 10..69: mean count 280, S_xx = 17,995
    slope = 2.0 - 2 * math.sqrt(280.0 / 17995.0)
    assert trend["a"] == pytest.approx(slope, rel=0.02) and rate["a"] == pytest.approx(280.0 + 30 * slope, rel=0.01)


def test_a_few_noisy_seconds_of_a_steady_mix_do_not_trigger():
    # Poisson counts at 80 % of capacity: over the first seconds a slope times H could pass
    # 90 %; the trigger takes the rates less 2 standard errors
    ctl, planner = drive(steady(0.8 * CAPACITY, 60, seed=3), ReplanPolicy(warmup_s=2.0, check_every_s=1.0))
    assert planner.calls == []


def test_plan_value_is_min_capacity_over_rate():
    assert plan_value(FakePlan({"a": 100.0, "b": 300.0}), {"a": 50.0, "b": 200.0}) == 1.5
    assert plan_value(FakePlan({"a": 100.0}), {"a": 0.0}) == math.inf


@pytest.mark.parametrize("kw, match", [
    ({"trigger_load": 1.5}, "trigger_load"),
    ({"window_s": 1.0, "bin_s": 1.0}, "window_s"),
    ({"min_share": 1.0}, "min_share"),
])
def test_bad_policy_is_refused(kw, match):
    with pytest.raises(UserError, match=match):
        ReplanPolicy(**kw)


def test_planner_replan_needs_a_max_min_plan():
    from types import SimpleNamespace

    plan = SimpleNamespace(settings=SimpleNamespace(objective="total"), models=[])
    with pytest.raises(UserError, match="max-min"):
        planner_replan(plan, {}, None)


def test_kept_placements_counts_unchanged_workers():
    from ppipe.dataplane.testing import ToyModel, ToyPartition, ToyPipeline, toy_cluster, toy_plan

    cluster = toy_cluster([("n", "A", 1, 3, 8.0)])
    part = lambda lo, hi, level, where: ToyPartition(lo, hi, "A", level, where)
    OLD = toy_plan(cluster, [ToyModel("m", 6.0, [ToyPipeline(2, [part(0, 0, 1, [("n-0", 0, 0)]), part(1, 1, 1, [("n-1", 0, 0)])])])])
    # n-0 kept; n-1 re-cut into two level-2 shares
    NEW = toy_plan(cluster, [ToyModel("m", 6.0, [ToyPipeline(2, [part(0, 0, 1, [("n-0", 0, 0)]),
                                                                part(1, 1, 2, [("n-1", 0, 0), ("n-1", 0, 1)])])])])
    assert kept_placements(OLD, NEW) == (1, len(NEW.placement))
    assert kept_placements(OLD, OLD) == (len(OLD.placement), len(OLD.placement))


def test_a_refused_decision_restores_the_plan_and_is_not_retried_at_once():
    arr = shifting_poisson_arrivals(MODELS, 0.8 * CAPACITY, 300e6, seed=2, period_s=600.0)
    clock = ManualClock()
    start = FakePlan({m: CAPACITY / 3 for m in MODELS})
    ctl = ReplanController(start, IdealPlanner(), clock)
    first = None
    for t, m in sorted((t, m) for m, ts in arr.items() for t in ts):
        clock.t_us = t
        ctl.observe(m, t)
        d = ctl.poll()
        if d is not None and first is None:
            first = d
            ctl.refused(d)
            assert ctl.plan is start and ctl.decisions == []
        elif d is not None:
            assert d.at_us - first.at_us >= 60e6  # the refused decision still counts for the interval
            break
    assert first is not None


def test_an_injected_estimator_replaces_the_arrival_counts():
    # a benchmark's oracle: the controller decides from the rates it is given, with no arrival observed
    clock = ManualClock()
    planner = IdealPlanner()
    rates = {"a": 300.0, "b": 100.0, "c": 100.0}  # "a" at 1.5 x its capacity of 200
    ctl = ReplanController(FakePlan({m: CAPACITY / 3 for m in MODELS}), planner, clock, ReplanPolicy(),
                           estimator=lambda now_us: (rates, {m: 0.0 for m in MODELS}, {m: 0.0 for m in MODELS}))
    clock.t_us = 5e6
    d = ctl.poll()
    assert d is not None and d.weights["a"] == pytest.approx(0.6) and planner.calls == [d.weights]


def test_an_idle_lead_in_before_the_first_arrival_is_no_trend():
    """A server idle for 40 s before its traffic (steady, 80 % of capacity) starts: the
    first check comes a warm-up after the first arrival, and reads no rise."""
    lead_in_us = 40e6
    arrivals = {m: ts + lead_in_us for m, ts in steady(0.8 * CAPACITY, 60).items()}
    ctl, planner = drive(arrivals)
    assert planner.calls == [] and ctl.decisions == []
    rate, trend = ctl.estimate(lead_in_us + 8e6)
    assert all(abs(g) < 0.5 * r for r, g in zip(rate.values(), trend.values()))  # no steep rise from the empty bins
    # without the restart, the idle bins would be read as a ramp from 0 to the rate
    late = ReplanController(FakePlan({m: CAPACITY / 3 for m in MODELS}), IdealPlanner(), ManualClock(), ReplanPolicy())
    assert late.next_check_us == 5e6
    late.observe("a", lead_in_us)
    assert late.next_check_us == lead_in_us + 5e6


def _deterministic(rate_fn, end_s: float, dt: float = 0.0005) -> np.ndarray:
    """Arrival times (us) of a deterministic stream whose rate is ``rate_fn(t)`` req/s."""
    t = np.arange(0, end_s, dt)
    cum = np.cumsum(rate_fn(t) * dt)
    return np.interp(np.arange(1, int(cum[-1])), cum, t) * 1e6


def test_a_rate_leaving_its_trough_is_planned_for_its_rise():
    # r(t) = 200 + 0.1 (t - 50)^2: at t = 60 the window (bins 0..59) holds the trough at 50;
    # the rate then rises to 200 + 0.1 x 80^2 = 840 by t + H = 130. A line through the
    # window has the slope at its centre (-2 req/s per s): it plans for the rate now.
    times = _deterministic(lambda t: 200 + 0.1 * (t - 50) ** 2, 70)
    clock = ManualClock()
    base = dict(min_interval_s=60, load_delay_s=10)
    exact = ReplanController(FakePlan({"a": 1e9}), IdealPlanner(), clock, ReplanPolicy(confidence_z=0, curvature_z=0, **base))
    shrunk = ReplanController(FakePlan({"a": 1e9}), IdealPlanner(), clock, ReplanPolicy(**base))
    line = ReplanController(FakePlan({"a": 1e9}), IdealPlanner(), clock, ReplanPolicy(curvature_min_s=None, **base))
    for x in times:
        for c in (exact, shrunk, line):
            c.observe("a", x)
    r, g, e, k = exact.estimate_all(60e6)
    assert r["a"] == pytest.approx(210.0, rel=0.02) and g["a"] == pytest.approx(2.0, abs=0.1) and k["a"] == pytest.approx(0.2, rel=0.02)
    assert exact.planned_for(r, g, k)["a"] == pytest.approx(840.0, rel=0.02)
    # the default shrinks the curvature by 2 standard errors of a Poisson count's: sqrt(mean count / S_qq)
    xs = np.arange(60) - 29.5
    s_qq = float(((xs**2 - (xs**2).mean()) ** 2).sum())
    mean_count = len(times[times < 60e6]) / 60
    _, _, _, k2 = shrunk.estimate_all(60e6)
    assert k2["a"] == pytest.approx(k["a"] - 2 * 2 * math.sqrt(mean_count / s_qq), rel=0.02)
    assert 600.0 < shrunk.planned_for(*shrunk.estimate(60e6), k2)["a"] < 840.0
    r1, g1, e1, k1 = line.estimate_all(60e6)
    assert k1["a"] == 0.0 and line.planned_for(r1, g1, k1)["a"] < 300.0


def test_a_falling_then_turning_rate_is_planned_for_its_highest_point_ahead():
    # r(t) = 1000 - 0.1 (t - 100)^2 over 0..60: rising to its peak 40 s after the check at 60
    times = _deterministic(lambda t: 1000 - 0.1 * (t - 100) ** 2, 70)
    ctl = ReplanController(FakePlan({"a": 1e9}), IdealPlanner(), ManualClock(),
                           ReplanPolicy(min_interval_s=60, load_delay_s=10, confidence_z=0, curvature_z=0))
    for x in times:
        ctl.observe("a", x)
    r, g, e, k = ctl.estimate_all(60e6)
    assert k["a"] == pytest.approx(-0.2, rel=0.02)
    assert ctl.planned_for(r, g, k)["a"] == pytest.approx(1000.0, rel=0.01)  # the vertex, not the line's 840 + 8 x 70
    assert ctl.planned_for(r, g)["a"] == pytest.approx(840.0 + 8.0 * 70, rel=0.02)


def test_no_curvature_before_its_least_span():
    times = _deterministic(lambda t: 200 + 0.1 * (t - 50) ** 2, 30)
    ctl = ReplanController(FakePlan({"a": 1e9}), IdealPlanner(), ManualClock(), ReplanPolicy(curvature_min_s=30.0))
    for x in times:
        ctl.observe("a", x)
    assert ctl.estimate_all(29e6)[3]["a"] == 0.0  # 29 bins
    assert ctl.estimate_all(30e6)[3]["a"] != 0.0  # 30 bins


def test_an_estimator_may_give_curvatures():
    clock = ManualClock()
    planner = IdealPlanner()
    zero = {m: 0.0 for m in MODELS}
    rates = {m: 150.0 for m in MODELS}
    curv = {"a": 0.02, "b": 0.0, "c": 0.0}  # "a" accelerates: 150 + 0.01 x 70^2 = 199 at t + H
    ctl = ReplanController(FakePlan({m: CAPACITY / 3 for m in MODELS}), planner, clock,
                           ReplanPolicy(min_interval_s=60, load_delay_s=10), estimator=lambda now_us: (rates, zero, zero, curv))
    clock.t_us = 5e6
    d = ctl.poll()
    assert d is not None and d.planned_for_rps["a"] == pytest.approx(199.0)


def test_bad_curvature_settings_are_refused():
    with pytest.raises(UserError, match="curvature_z"):
        ReplanPolicy(curvature_z=-1)
    with pytest.raises(UserError, match="curvature_min_s"):
        ReplanPolicy(curvature_min_s=1.0)


def test_a_re_plan_worse_than_the_current_plan_is_retried_at_the_next_check():
    """A time-limited solve on a busy host can stop on a poor incumbent: that is no mix the
    planner cannot improve on, so no hysteresis holds the next check back."""

    class FlakyPlanner(IdealPlanner):
        def __call__(self, weights):
            plan = super().__call__(weights)
            return FakePlan({m: 1.0 for m in weights}) if len(self.calls) == 1 else plan

    clock = ManualClock()
    planner = FlakyPlanner()
    rates = {"a": 300.0, "b": 100.0, "c": 100.0}  # "a" at 1.5 x its capacity of 200
    zero = {m: 0.0 for m in MODELS}
    ctl = ReplanController(FakePlan({m: CAPACITY / 3 for m in MODELS}), planner, clock, ReplanPolicy(),
                           estimator=lambda now_us: (rates, zero, zero))
    clock.t_us = 5e6
    assert ctl.poll() is None and len(ctl.attempts) == 1 and not ctl.attempts[0].applied
    clock.t_us = 10e6
    d = ctl.poll()
    assert d is not None and d.at_us == 10e6 and len(planner.calls) == 2


def test_a_longer_curvature_window_fits_the_curvature_there_and_the_level_and_slope_in_the_window():
    # r(t) = 200 + 0.1 (t - 50)^2 over 0..120: exact with either window; the curvature's
    # shrinkage is by the standard error of the 120 bins' fit, ~16 x smaller than 30 bins'
    times = _deterministic(lambda t: 200 + 0.1 * (t - 50) ** 2, 130)
    base = dict(min_interval_s=60, load_delay_s=10, window_s=30, curvature_min_s=30)
    exact = ReplanController(FakePlan({"a": 1e9}), IdealPlanner(), ManualClock(),
                             ReplanPolicy(confidence_z=0, curvature_z=0, curvature_window_s=120, **base))
    long = ReplanController(FakePlan({"a": 1e9}), IdealPlanner(), ManualClock(), ReplanPolicy(**base))  # the default: 120 s
    short = ReplanController(FakePlan({"a": 1e9}), IdealPlanner(), ManualClock(), ReplanPolicy(curvature_window_s=None, **base))
    for x in times:
        for c in (exact, long, short):
            c.observe("a", x)
    r, g, e, k = exact.estimate_all(120e6)
    assert r["a"] == pytest.approx(690.0, rel=0.01) and g["a"] == pytest.approx(14.0, rel=0.01) and k["a"] == pytest.approx(0.2, rel=0.01)

    def shrink(n: int) -> float:  # 2 x 2 standard errors of gamma over the last n bins
        xs = np.arange(n) - (n - 1) / 2
        s_qq = float(((xs**2 - (xs**2).mean()) ** 2).sum())
        return 4 * math.sqrt(len(times[(times >= (120 - n) * 1e6) & (times < 120e6)]) / n / s_qq)

    assert long.estimate_all(120e6)[3]["a"] == pytest.approx(0.2 - shrink(120), rel=0.01)
    assert short.estimate_all(120e6)[3]["a"] == pytest.approx(max(0.2 - shrink(30), 0.0), abs=1e-9)
    # the rate at t + H = 190 is 2160: the long window's curvature plans for most of it
    planned = {c: c.planned_for(*[v for i, v in enumerate(c.estimate_all(120e6)) if i != 2])["a"] for c in (long, short)}
    assert planned[short] < 1800.0 < planned[long] < 2160.0


def test_a_bad_curvature_window_is_refused():
    with pytest.raises(UserError, match="curvature_window_s"):
        ReplanPolicy(curvature_window_s=2.0)


class WarmPlanner(IdealPlanner):
    """IdealPlanner that takes a warm start, and records it."""

    def __init__(self):
        super().__init__()
        self.warm: list = []

    def __call__(self, weights, warm_start=None):
        self.warm.append(warm_start)
        return super().__call__(weights)


def _shifting_controller(planner):
    arr = shifting_poisson_arrivals(MODELS, 0.8 * CAPACITY, 600e6, seed=3, period_s=600.0)
    clock = ManualClock()
    ctl = ReplanController(FakePlan({m: CAPACITY / 3 for m in MODELS}), planner, clock)
    for t, m in sorted((t, m) for m, ts in arr.items() for t in ts):
        clock.t_us = t
        ctl.observe(m, t)
        ctl.poll()
    return ctl


def test_the_controller_passes_the_served_plan_as_warm_start_where_the_planner_takes_one():
    planner = WarmPlanner()
    ctl = _shifting_controller(planner)
    assert len(ctl.attempts) >= 2 and len(planner.warm) == len(ctl.attempts)
    # Each re-plan starts from the plan served at its check: the start, then each switch's plan.
    served = [FakePlan({m: CAPACITY / 3 for m in MODELS}).caps] + [d.plan.caps for d in ctl.decisions]
    for warm, attempt in zip(planner.warm, ctl.attempts):
        assert warm is not None and warm.caps in served
        before = [d for d in ctl.decisions if d.at_us < attempt.at_us]
        assert warm.caps == (before[-1].plan.caps if before else served[0])
    # A planner without the keyword is called with the weights alone (as before).
    plain = IdealPlanner()
    assert len(_shifting_controller(plain).attempts) == len(ctl.attempts) and plain.calls == planner.calls


def test_planner_replan_passes_the_warm_start_and_the_replan_gap(monkeypatch):
    from types import SimpleNamespace

    import ppipe.planner.api as api
    from ppipe.control.replan import REPLAN_GAP, takes_warm_start

    seen = []
    monkeypatch.setattr(api, "plan", lambda *a, **kw: seen.append(kw) or "new plan")
    settings = SimpleNamespace(objective="max-min", planner="ppipe", formulation="ppipe", gpu_rule="physical",
                               configs_per_template="many", batch_build=True, margin=0.4, max_partitions=3, headroom_util=0.8)
    served = SimpleNamespace(settings=settings, models=[SimpleNamespace(name="a", slo_ms=50.0)])
    replan = planner_replan(served, {"a": "profile a"}, "cluster", time_limit_s=9.0)
    assert takes_warm_start(replan) and not takes_warm_start(IdealPlanner())
    replan({"a": 1.0})
    other = SimpleNamespace(settings=settings, models=served.models)
    replan({"a": 1.0}, warm_start=other)
    assert [kw["warm_start"] for kw in seen] == [served, other]
    assert all(kw["gap"] == REPLAN_GAP and kw["time_limit_s"] == 9.0 for kw in seen)


def test_planner_replan_renames_the_new_plans_gpus_to_keep_the_served_plans_workers(monkeypatch):
    """The renaming of plan switches (keep_live) is the re-plan's own: the simulator's
    re-plans keep the vGPUs that ``ppipe serve``'s keep."""
    from types import SimpleNamespace

    import ppipe.planner.api as api
    import ppipe.planner.placement as placement

    monkeypatch.setattr(api, "plan", lambda *a, **kw: "new plan")
    renamed = []
    monkeypatch.setattr(placement, "keep_live_plan", lambda new, live, cluster: renamed.append((new, live, cluster)) or f"{new}, renamed")
    settings = SimpleNamespace(objective="max-min", planner="ppipe", formulation="ppipe", gpu_rule="physical",
                               configs_per_template="many", batch_build=True, margin=0.4, max_partitions=3, headroom_util=0.8)
    served = SimpleNamespace(settings=settings, models=[SimpleNamespace(name="a", slo_ms=50.0)])
    other = SimpleNamespace(settings=settings, models=served.models)
    replan = planner_replan(served, {"a": "profile a"}, "cluster", time_limit_s=9.0)
    assert replan({"a": 1.0}) == "new plan, renamed" and replan({"a": 1.0}, warm_start=other) == "new plan, renamed"
    assert renamed == [("new plan", served, "cluster"), ("new plan", other, "cluster")]
    assert replan({"a": 1.0}, warm_start=None) == "new plan"  # nothing served to keep
