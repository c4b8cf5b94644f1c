"""Live plan switches of a running ``ppipe serve``: ``ppipe apply``, ``POST /v2/admin/plan`` and SIGHUP.

:class:`PlanSwitcher` turns a new plan (a file, or YAML text from the admin endpoint) into
a :meth:`Runtime.switch_plan <ppipe.runtime.driver.Runtime.switch_plan>` call: it checks the
plan against the running cluster, loads its profiles, starts the workers the new plan
needs (on Ray, in a thread, while the old plan serves) and stops the retiring ones when
the runtime has drained them. One switch runs at a time; a second one asked for meanwhile
is refused (:class:`SwitchBusy`), never queued.

Relative profile folders of a plan sent as text are looked up on the server, against the
folder of the plan ``ppipe serve`` was started with (``ppipe apply`` sends absolute folders
when they exist on the machine it runs on).
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import yaml

from ppipe.errors import UserError
from ppipe.spec.base import validate_data
from ppipe.spec.plan import Plan, load_plan
from ppipe.spec.profile import load_profile_ref

log = logging.getLogger("ppipe.runtime")


class SwitchBusy(UserError):
    """Another plan switch is running."""


class PlanSwitcher:
    """Switches a runtime to new plans, starting and stopping workers on Ray.

    Args:
        runtime: the running :class:`~ppipe.runtime.driver.Runtime` (its loop is this one's).
        dep: the :class:`~ppipe.runtime.deploy.Deployment` being served (cluster, profiles, plan file).
        backend, backend_options: how new workers run (as ``ppipe serve`` started the first ones).
        start_timeout_s: a new worker must have loaded its blocks within this.
    """

    def __init__(self, runtime: Any, dep: Any, backend: str = "ort", backend_options: dict[str, Any] | None = None,
                 start_timeout_s: float = 300.0):
        self.runtime, self.dep = runtime, dep
        self.backend, self.backend_options = backend, dict(backend_options or {})
        self.start_timeout_s = start_timeout_s
        self.started: list[Any] = []  # every worker this switcher started (for shutdown)
        self._lock = asyncio.Lock()
        # imported now, at start-up: a first import inside a switch (scipy's takes ~1 s) would
        # hold the GIL while requests are being served
        import scipy.optimize  # noqa: F401  (keep_live's matching)

        import ppipe.planner.placement  # noqa: F401

    # ---- what a switch is asked with -----------------------------------------------------
    def plan_from_text(self, text: str, source: str = "request body") -> Plan:
        """Parse and validate plan YAML (or JSON) text; errors name ``source`` and the field."""
        try:
            data = yaml.safe_load(text)
        except yaml.YAMLError as exc:
            raise UserError(f"{source}: not valid YAML: {str(exc).splitlines()[0]}", fix="send the plan.yaml that `ppipe plan` wrote") from None
        return validate_data(Plan, data, source)

    def plan_from_file(self, path: str | Path) -> Plan:
        return load_plan(path)

    # ---- the switch ---------------------------------------------------------------------
    async def apply(self, plan: Plan, source: str, keep_live: bool = True) -> dict[str, Any]:
        """Switch to ``plan``; returns what happened (see ``Runtime.switch_plan``) with ``seconds``.

        ``keep_live``: first rename the plan's GPUs within each server group so that as many
        of its vGPUs as possible keep their running worker
        (:func:`ppipe.planner.placement.keep_live`; the same plan on other names of
        equal GPUs); False serves the placement as written.

        Raises:
            SwitchBusy: a switch is running.
            UserError: the plan does not fit the running cluster or its profiles; the old
                plan keeps serving.
        """
        if self._lock.locked():
            raise SwitchBusy("a plan switch is already running", fix="wait for it to end (GET /v2/admin/plan shows the last one)")
        async with self._lock:
            t0 = time.perf_counter()
            # off the loop: loading profiles (an artifact's CSVs take ~1 s) would stall every request
            dep = await asyncio.to_thread(self._prepare, plan, source, keep_live)
            plan = dep.plan
            record = await self.runtime.switch_plan(plan, dep.profiles, lambda ids: self._start(dep, ids), self._stop)
            self.dep = dep
            self._point_respawn(dep)
            record = {**record, "seconds": time.perf_counter() - t0, "source": source,
                      "models": [m.name for m in plan.models]}
            log.warning("plan from %s is now served (%.2f s)", source, record["seconds"])
            return record

    def _deployment(self, plan: Plan, source: str) -> Any:
        """The new plan with the running cluster and its profiles; checks its placement."""
        from ppipe.runtime.deploy import worker_specs

        cluster = self.dep.cluster
        if plan.cluster != cluster.name:
            raise UserError(f"{source}: the plan is for cluster '{plan.cluster}', this server runs '{cluster.name}'",
                            fix=f"plan for '{cluster.name}' (ppipe plan --cluster ...)")
        base = Path(self.dep.plan_file).resolve().parent if self.dep.plan_file else None
        profiles = {}
        for m in plan.models:
            try:
                profiles[m.name] = self.dep.profiles[m.name] if m.profile == self._served_ref(m.name) else load_profile_ref(m.profile, base)
            except UserError as exc:
                raise UserError(f"{source}: model '{m.name}': {exc.message}",
                                fix="make the profile folder exist on the server, or give its absolute path") from None
        dep = replace(self.dep, plan=plan, profiles=profiles, plan_file=self.dep.plan_file)
        worker_specs(replace(dep, plan_file=source))  # placement covers every pool, servers exist
        return dep

    def _prepare(self, plan: Plan, source: str, keep_live: bool) -> Any:
        return self._deployment(self._keeping_live(plan) if keep_live else plan, source)

    def _keeping_live(self, plan: Plan) -> Plan:
        from ppipe.planner.placement import keep_live

        live = self.runtime.plan
        if plan.cluster != live.cluster or not plan.placement:
            return plan  # refused by _deployment, with its reason
        placement = keep_live(plan.placement, plan.models, live.placement, live.models, self.dep.cluster)
        return plan.model_copy(update={"placement": placement})

    def _served_ref(self, model: str) -> str | None:
        try:
            return self.dep.plan.model(model).profile
        except KeyError:
            return None

    async def _start(self, dep: Any, vgpu_ids: list[str]) -> dict[str, Any]:
        from ppipe.runtime.deploy import start_workers

        handles = await asyncio.to_thread(start_workers, dep, self.backend, self.backend_options, self.start_timeout_s, set(vgpu_ids))
        self.started.extend(handles.values())
        return handles

    def _stop(self, handle: Any) -> None:
        import ray

        ray.kill(handle)

    def _point_respawn(self, dep: Any) -> None:
        """Re-created workers (after a failure) are the new plan's."""
        if self.runtime.respawn is None:
            return
        from ppipe.runtime.deploy import respawn_worker

        async def respawn(vgpu_id: str) -> Any:
            handle = await asyncio.to_thread(respawn_worker, dep, vgpu_id, self.backend, self.backend_options)
            self.started.append(handle)
            return handle

        self.runtime.respawn = respawn


class SighupReload:
    """On SIGHUP, re-read the plan file ``ppipe serve`` was started with and switch to it.

    A companion of the HTTP app (started and stopped on the runtime's loop). The outcome
    is logged: one line for the switch, or the error (the old plan keeps serving).
    """

    def __init__(self, switcher: PlanSwitcher, plan_file: str | Path):
        self.switcher, self.plan_file = switcher, str(plan_file)
        self._tasks: set[asyncio.Task] = set()

    async def start(self) -> None:
        import signal

        loop = asyncio.get_running_loop()
        try:
            loop.add_signal_handler(signal.SIGHUP, self._on_signal)
        except (NotImplementedError, RuntimeError, ValueError):  # not the main thread, or no SIGHUP here
            log.info("SIGHUP reloading is off: this loop cannot take signals")

    def _on_signal(self) -> None:
        task = asyncio.get_running_loop().create_task(self.reload())
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def reload(self) -> dict[str, Any] | None:
        """Switch to the plan file's current content; None (and a logged error) when refused."""
        log.warning("SIGHUP: re-reading %s", self.plan_file)
        try:
            plan = self.switcher.plan_from_file(self.plan_file)
            return await self.switcher.apply(plan, self.plan_file)
        except UserError as exc:
            log.error("the plan in %s is not served: %s", self.plan_file, exc.render())
        except Exception:
            log.exception("the plan in %s is not served; the old plan keeps serving", self.plan_file)
        return None

    async def stop(self) -> None:
        import signal

        try:
            asyncio.get_running_loop().remove_signal_handler(signal.SIGHUP)
        except (NotImplementedError, RuntimeError, ValueError):
            pass
        for t in list(self._tasks):
            t.cancel()
