"""``ppipe serve --replan auto``'s loop (ppipe.runtime.control.replan.ReplanLoop): arrivals logged by
the runtime reach the controller, a decision is applied through the switcher, a refused
switch is handed back to the controller."""

from __future__ import annotations

import asyncio
import time
from types import SimpleNamespace

from ppipe.control.replan import ReplanPolicy
from ppipe.dataplane.testing import ToyModel, ToyPartition, ToyPipeline, toy_cluster, toy_plan
from ppipe.errors import UserError
from ppipe.runtime.control.replan import ReplanLoop
from ppipe.runtime.control.switch import PlanSwitcher

CLUSTER = toy_cluster([("n", "A", 1, 2, 8.0)])


def _plan(cap_a: float, cap_b: float):
    plan = toy_plan(CLUSTER, [ToyModel(m, 100.0, [ToyPipeline(1, [ToyPartition(0, 0, "A", 1, [(f"n-{i}", 0, 0)])])])
                              for i, m in enumerate("ab")])
    return plan.model_copy(update={"models": [plan.models[0].model_copy(update={"throughput_rps": cap_a}),
                                              plan.models[1].model_copy(update={"throughput_rps": cap_b})]})


class _Clock:
    def now_us(self) -> float:
        return time.monotonic() * 1e6


class _Runtime:
    def __init__(self, plan):
        self.plan, self.clock, self.arrival_log = plan, _Clock(), None


class _Switcher:
    """A plan switcher that records what it is asked to apply (arrivals: the real one's)."""

    log_arrivals = PlanSwitcher.log_arrivals
    take_arrivals = PlanSwitcher.take_arrivals

    def __init__(self, plan, refuse: bool):
        self.runtime, self.dep, self.refuse, self.applied = _Runtime(plan), SimpleNamespace(plan=plan), refuse, []

    async def apply(self, plan, source, keep_live=True):
        self.applied.append((plan, source, keep_live))
        if self.refuse:
            raise UserError("the plan does not fit (test)")
        self.runtime.plan = self.dep.plan = plan
        return {}


def _run(refuse: bool):
    old, new = _plan(10.0, 100.0), _plan(60.0, 60.0)
    switcher = _Switcher(old, refuse)
    asked = []
    policy = ReplanPolicy(window_s=2.0, bin_s=0.5, check_every_s=0.05, min_interval_s=0.0, load_delay_s=0.0)
    loop = ReplanLoop(switcher, policy, replan=lambda w: asked.append(w) or new)

    async def main():
        await loop.start()
        rt = switcher.runtime
        t0 = rt.clock.now_us()
        # 2.5 s of arrivals: "a" at 20 req/s (twice its capacity), "b" at 5 req/s, logged as the runtime logs them
        rt.arrival_log.extend(("a", t0 - 2.5e6 + i * 5e4) for i in range(50))
        rt.arrival_log.extend(("b", t0 - 2.5e6 + i * 2e5) for i in range(13))
        loop.controller.next_check_us = t0  # (the controller waits its warm-up, 5 s or the window if shorter, before its first check)
        for _ in range(100):
            await asyncio.sleep(0.02)
            if switcher.applied:
                break
        await asyncio.sleep(0.05)
        await loop.stop()
        return loop

    return asyncio.run(main()), switcher, asked, old, new


def test_a_shift_is_replanned_and_applied_through_the_switcher():
    loop, switcher, asked, old, new = _run(refuse=False)
    assert asked and asked[0]["a"] > asked[0]["b"]  # weights follow the observed mix
    assert switcher.applied and switcher.applied[0][0] is new and switcher.applied[0][1] == "re-plan"
    assert loop.controller.plan is new and switcher.runtime.arrival_log is None  # stopped: nothing logged any more


def test_a_refused_switch_leaves_the_controller_on_the_served_plan():
    loop, switcher, asked, old, new = _run(refuse=True)
    assert switcher.applied and loop.controller.plan is old and switcher.runtime.plan is old


def test_the_planning_process_starts_and_plans_once_with_the_server(tmp_path):
    # The first re-plan must not wait for a process to spawn and import the planner and its
    # solvers, and the server's processes are at their working size after its warm-up.
    from ppipe.planner.api import plan as make_plan
    from ppipe.runtime.launch.deploy import load_deployment

    make_plan(place=True).save(tmp_path / "plan.yaml")
    dep = load_deployment(str(tmp_path / "plan.yaml"), None)
    switcher = _Switcher(dep.plan, refuse=False)
    switcher.dep = dep
    loop = ReplanLoop(switcher, ReplanPolicy(window_s=60.0, bin_s=1.0, check_every_s=30.0))

    async def main():
        await loop.start()
        try:
            await asyncio.wait_for(asyncio.wrap_future(loop.warmed), timeout=120)
            return len(loop._pool._processes)
        finally:
            await loop.stop()

    assert asyncio.run(main()) == 1
