"""``ppipe serve --replan auto``: the re-plan controller on the wall clock, switching plans live.

The controller (:class:`ppipe.control.replan.ReplanController`) is the one the simulator
runs under its virtual clock (``ppipe simulate --replan auto``); here it runs on the
runtime's clock:

* every arrival the runtime takes is logged (``Runtime.arrival_log``, one list append on
  the request's path; on a server of shards, every shard's runtime) and fed to the
  controller before each check;
* a check (``poll``) runs in a thread, and the planner it may call runs in a separate
  process: a MILP solve holds its process's GIL for seconds, which the frontend's event
  loop must not wait for;
* a decision is applied like ``ppipe apply``: the new plan's workers start while the old
  plan serves, and the switch itself is one step on the loop
  (:class:`ppipe.runtime.control.switch.PlanSwitcher`). The re-plan has renamed the new plan's
  GPUs to keep the served plan's workers (:func:`ppipe.control.replan.planner_replan`, as in
  the simulator); the switcher's own renaming, against the plan served when the switch
  happens, changes nothing unless that plan has changed since. A switch that fails is logged and handed back to the controller
  (``refused``), which goes on from the plan actually served.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import multiprocessing
from typing import Any

log = logging.getLogger("ppipe.runtime")


def _replan_job(plan: Any, profiles: dict, cluster: Any, time_limit_s: float, weights: dict[str, float]) -> Any:
    """In the planning process: the planner with ``plan``'s settings and new weights."""
    from ppipe.control.replan import planner_replan

    return planner_replan(plan, profiles, cluster, time_limit_s=time_limit_s)(weights)


def _warm_up(plan: Any, profiles: dict, cluster: Any, time_limit_s: float) -> None:
    """In the planning process, at the server's start: one re-plan of the served plan at its
    own weights (the result is dropped), so that the first real re-plan pays neither the
    process's start nor the planner's and solvers' imports, and the process holds its
    working memory from the start (most of what a first re-plan adds is the solvers'
    libraries: docs/benchmarks.md, "What holds the soak's memory")."""
    _replan_job(plan, profiles, cluster, time_limit_s, {m.name: m.weight for m in plan.models})


class ReplanLoop:
    """Runs the re-plan controller for a serving runtime (a companion of the HTTP app).

    Args:
        switcher: the server's :class:`~ppipe.runtime.control.switch.PlanSwitcher` (its runtime is served).
        policy: the controller's tunables (:class:`ppipe.control.replan.ReplanPolicy`).
        time_limit_s: the planner's time limit per re-plan.
        replan: ``replan(weights) -> Plan`` instead of the planner in its process (tests).

    Raises:
        UserError: the served plan was not made with the max-min objective.
    """

    def __init__(self, switcher: Any, policy: Any, time_limit_s: float = 1.5, replan: Any = None):
        from ppipe.control.replan import planner_replan

        self.switcher, self.runtime = switcher, switcher.runtime
        self.policy, self.time_limit_s = policy, time_limit_s
        dep = switcher.dep
        if replan is None:
            planner_replan(dep.plan, dep.profiles, dep.cluster, time_limit_s=time_limit_s)  # refuses a plan it cannot re-make
        self.controller: Any = None
        self._injected_replan = replan
        self._pool: concurrent.futures.ProcessPoolExecutor | None = None
        self.warmed: concurrent.futures.Future | None = None  # the planning process's warm-up (None: no process)
        self._task: asyncio.Task | None = None

    async def start(self) -> None:
        from ppipe.control.replan import ReplanController

        self.controller = ReplanController(self.switcher.dep.plan, self._injected_replan or self._replan, self.runtime.clock, self.policy)
        await self.switcher.log_arrivals(True)
        if self._injected_replan is None:
            self._pool = concurrent.futures.ProcessPoolExecutor(max_workers=1, mp_context=multiprocessing.get_context("spawn"))
            dep = self.switcher.dep  # the process starts now, not at the first re-plan
            self.warmed = self._pool.submit(_warm_up, dep.plan, dep.profiles, dep.cluster, self.time_limit_s)
        self._task = asyncio.get_running_loop().create_task(self._run())

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)
        try:
            await self.switcher.log_arrivals(False)
        except Exception:  # a shard already gone at shutdown
            log.debug("re-plan: could not stop logging arrivals", exc_info=True)

    def _replan(self, weights: dict[str, float]) -> Any:
        """The controller's ``replan``: the planner in the planning process (called from the check's thread)."""
        dep = self.switcher.dep
        return self._pool.submit(_replan_job, dep.plan, dep.profiles, dep.cluster, self.time_limit_s, weights).result()

    async def _run(self) -> None:
        while True:
            await asyncio.sleep(self.policy.check_every_s)
            await self._feed()
            decision = await asyncio.to_thread(self.controller.poll)
            if decision is not None:
                await self._apply(decision)

    async def _feed(self) -> None:
        """Hand the arrivals logged since the last check (on every shard) to the controller."""
        for model, t_us in await self.switcher.take_arrivals():
            self.controller.observe(model, t_us)

    async def _apply(self, decision: Any) -> None:
        from ppipe.errors import UserError

        log.warning("re-plan: %s is at %.0f%% of its capacity; a plan for weights %s raises min(capacity/rate) %.2f -> %.2f "
                    "(planner %.1f s); switching", decision.trigger, 100.0 / max(decision.z_old, 1e-9),
                    {m: round(w, 3) for m, w in decision.weights.items()}, decision.z_old, decision.z_new, decision.planner_s)
        try:
            await self.switcher.apply(decision.plan, "re-plan", keep_live=True)
        except UserError as exc:
            log.error("re-plan: the switch was refused: %s", exc.render())
            self.controller.refused(decision)
        except Exception:
            log.exception("re-plan: the switch failed; the old plan keeps serving")
            self.controller.refused(decision)
