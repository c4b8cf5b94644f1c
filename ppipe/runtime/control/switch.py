"""Live plan switches of a running ``ppipe serve``: ``ppipe apply``, ``POST /v2/admin/plan`` and SIGHUP.

:class:`PlanSwitcher` turns a new plan (a file, or YAML text from the admin endpoint) into
a :meth:`Runtime.switch_plan <ppipe.runtime.scheduler.host.Runtime.switch_plan>` call: it checks the
plan against the running cluster, loads its profiles, starts the workers the new plan
needs (on Ray, in a thread, while the old plan serves) and stops the retiring ones when
the runtime has drained them. One switch runs at a time; a second one asked for meanwhile
is refused (:class:`SwitchBusy`), never queued.

A server of several frontend shards (``ppipe serve --shards N``) switches with
:class:`ShardedSwitcher`: each model stays on its shard, every shard whose part of the plan
changes starts its new workers, then the shards commit, the ones that give GPUs or NICs
up before the ones that take them over (:func:`ppipe.dataplane.handover.hand_over`'s
embargo covers a cycle of such moves). It asks the shards through handles, one message per
request (:mod:`ppipe.runtime.control.shard_control`).

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
from ppipe.runtime.control.shard_control import (
    Abort, Commit, LogArrivals, Lift, Prepare, SetOwner, ShardControl, ShardHandle, TakeArrivals,
)
from ppipe.spec.base import validate_data
from ppipe.spec.plan import Plan, load_plan
from ppipe.spec.profile import load_profile_ref

log = logging.getLogger("ppipe.runtime")


def plan_from_text(text: str, source: str = "request body") -> Plan:
    """Parse and validate plan YAML (or JSON) text; errors name ``source`` and the field."""
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise UserError(f"{source}: not valid YAML: {str(exc).splitlines()[0]}", fix="send the plan.yaml that `ppipe plan` wrote") from None
    return validate_data(Plan, data, source)


class SwitchBusy(UserError):
    """Another plan switch is running."""


class SwitchRefused(SwitchBusy):
    """This server does not switch plans at all (its shards split the plan's servers); like a
    busy switch, answered 409 with the reason, and the old plan serves on."""


class PartialSwitch(RuntimeError):
    """Some shards of the server switched to a new plan and others could not (a shard's
    process failed between its prepare and its commit): the server serves a mix of plans."""


class PlanSwitcher:
    """Switches a runtime to new plans, starting and stopping its workers.

    Args:
        runtime: the running :class:`~ppipe.runtime.scheduler.host.Runtime` (its loop is this one's).
        dep: the :class:`~ppipe.runtime.launch.deploy.Deployment` being served (cluster, profiles, plan file).
        backend, backend_options: how new workers run (as ``ppipe serve`` started the first ones).
        start_timeout_s: a new worker must have loaded its blocks within this.
        launcher: what starts new workers (:mod:`ppipe.runtime.launch.launchers`: ``local`` or ``ray``).
    """

    def __init__(self, runtime: Any, dep: Any, backend: str = "ort", backend_options: dict[str, Any] | None = None,
                 start_timeout_s: float = 300.0, launcher: str = "ray"):
        from ppipe.runtime.launch.launchers import respawn_function, start_function

        self.runtime, self.dep = runtime, dep
        self.backend, self.backend_options = backend, dict(backend_options or {})
        self._start_workers, self._respawn_worker = start_function(launcher), respawn_function(launcher)
        self.start_timeout_s = start_timeout_s
        self.started: list[Any] = []  # every worker this switcher started (for shutdown)
        self._lock = asyncio.Lock()
        # imported now, at start-up: a first import inside a switch (scipy's takes ~1 s) would
        # hold the GIL while requests are being served
        import scipy.optimize  # noqa: F401  (keep_live's matching)

        import ppipe.planner.placement  # noqa: F401

    @property
    def records(self) -> list[dict[str, Any]]:
        """What each switch so far did (the runtime's records)."""
        return self.runtime.switches

    # ---- what a switch is asked with -----------------------------------------------------
    def plan_from_text(self, text: str, source: str = "request body") -> Plan:
        return plan_from_text(text, source)

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
        from ppipe.runtime.launch.deploy import worker_specs

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
        from ppipe.planner.placement import keep_live_plan

        return keep_live_plan(plan, self.dep.plan, self.dep.cluster)  # the whole plan served (the runtime's, or every shard's)

    def _served_ref(self, model: str) -> str | None:
        try:
            return self.dep.plan.model(model).profile
        except KeyError:
            return None

    async def _start(self, dep: Any, vgpu_ids: list[str]) -> dict[str, Any]:
        handles = await asyncio.to_thread(self._start_workers, dep, self.backend, self.backend_options, self.start_timeout_s, set(vgpu_ids))
        self.started.extend(handles.values())
        return handles

    def _stop(self, handle: Any) -> None:
        handle.kill()

    # ---- one shard's part of a sharded switch (driven by ShardedSwitcher) ----------------
    async def prepare(self, dep: Any) -> dict[str, int]:
        """Start the workers of ``dep`` (this shard's part of the new plan, checked) that
        are not kept; the old plan serves on until :meth:`commit`."""
        self._prepared = await self.runtime.prepare_switch(dep.plan, dep.profiles, lambda ids: self._start(dep, ids), self._stop)
        self._prepared_dep = dep
        return {"kept": len(self._prepared.kept), "started": len(self._prepared.handles)}

    async def commit(self, embargo: dict[str, float | None]) -> dict[str, Any]:
        """Switch to the prepared plan (``Runtime.commit_switch``)."""
        prepared, dep = self._prepared, self._prepared_dep
        self._prepared = self._prepared_dep = None
        record = await self.runtime.commit_switch(prepared, embargo)
        self.dep = dep
        self._point_respawn(dep)
        return record

    async def abort(self) -> None:
        """Stop the workers a :meth:`prepare` started; the old plan serves on."""
        prepared, self._prepared = getattr(self, "_prepared", None), None
        if prepared is not None:
            self.runtime.abort_switch(prepared)

    async def lift(self, resource: str, until_us: float) -> None:
        self.runtime.lift_embargo(resource, until_us)

    # ---- the arrivals a re-plan loop counts (ppipe.runtime.control.replan) ------------------------
    async def log_arrivals(self, on: bool) -> None:
        """Start (or stop) logging each request's (model, arrival) in the runtime."""
        self.runtime.arrival_log = [] if on else None

    async def take_arrivals(self) -> list[tuple[str, float]]:
        """The arrivals logged since the last call."""
        out, self.runtime.arrival_log = self.runtime.arrival_log or [], []
        return out

    def _point_respawn(self, dep: Any) -> None:
        """Re-created workers (after a failure) are the new plan's."""
        if self.runtime.respawn is None:
            return
        async def respawn(vgpu_id: str) -> Any:
            handle = await asyncio.to_thread(self._respawn_worker, dep, vgpu_id, self.backend, self.backend_options)
            self.started.append(handle)
            return handle

        self.runtime.respawn = respawn


class ShardedSwitcher(PlanSwitcher):
    """Plan switches of a server of several frontend shards (``ppipe serve --shards N``).

    Args:
        local: shard 0's :class:`PlanSwitcher` (its runtime is this process's).
        dep: the whole deployment served (every shard's models).
        owner: model -> the shard that serves it.
        others: the other shards' handles (:class:`ppipe.runtime.launch.ray_shards.RayShard` or
            :class:`ppipe.runtime.launch.local_shards.LocalShard`), by index - 1.
        router: shard 0's :class:`ppipe.runtime.ingress.shard_router.ShardRouter` (its owner map follows the switches).

    A switch, with the old plan serving until each shard commits:

    1. the new plan is checked against the cluster and renamed to keep live workers, as
       on one shard;
    2. each model keeps its shard, and a new model goes with the models it shares NICs
       with, else to the least loaded shard; a new plan that joins models of two shards
       through a NIC, or leaves a shard with no model, is refused (restart instead);
    3. every shard whose part changed starts its new workers (:meth:`PlanSwitcher.prepare`);
       one failing stops what every shard started, and the old plan serves on;
    4. the shards commit in waves: a shard whose new vGPUs or NICs sit on GPUs or NICs that
       other shards' old plans used waits for those shards, and gets from their commits
       when their last reservations there end; in a cycle, the lowest shard commits first
       with an embargo that the later commits lift;
    5. every shard's router learns the new owners. A new model's owner is told at once
       after step 3, so that from its owner's commit on every shard passes its requests
       there (before that commit the owner answers 404, as before the switch).
    """

    def __init__(self, local: PlanSwitcher, dep: Any, owner: dict[str, int], others: list[ShardHandle], router: Any):
        super().__init__(local.runtime, dep, local.backend, local.backend_options, local.start_timeout_s)
        self.owner = dict(owner)
        self.shards: list[ShardHandle] = [ShardControl(local, router), *others]  # by index; shard 0 in-process
        self.started = local.started
        self._records: list[dict[str, Any]] = []
        self._broken = ""  # why switches are refused: an earlier one failed part-way

    @property
    def records(self) -> list[dict[str, Any]]:
        return self._records

    async def apply(self, plan: Plan, source: str, keep_live: bool = True) -> dict[str, Any]:
        if self._lock.locked():
            raise SwitchBusy("a plan switch is already running", fix="wait for it to end (GET /v2/admin/plan shows the last one)")
        if self._broken:
            raise PartialSwitch(self._broken)
        async with self._lock:
            t0 = time.perf_counter()
            dep = await asyncio.to_thread(self._prepare, plan, source, keep_live)
            owner, subs, givers, unchanged_vgpus = self._split(dep, source)
            results = await asyncio.gather(*(self.shards[i].call(Prepare(sub)) for i, sub in subs.items()), return_exceptions=True)
            failed = [r for r in results if isinstance(r, BaseException)]
            if failed:
                await asyncio.gather(*(self.shards[i].call(Abort()) for i in subs), return_exceptions=True)
                raise failed[0]
            if set(owner) - set(self.owner):  # new models: route them to their shard before it commits
                await self._tell_owners({**self.owner, **owner})
            done: dict[int, dict[str, Any]] = {}
            try:
                records = await self._commit_in_waves(sorted(subs), givers, done)
            except Exception as exc:
                self._broken = (f"a plan switch failed part-way ({type(exc).__name__}: {exc}): shards "
                                f"{sorted(done) or 'none'} serve the plan from {source}, shards "
                                f"{sorted(set(subs) - set(done))} the one before; restart `ppipe serve` to serve one plan")
                log.error("%s", self._broken)
                raise PartialSwitch(self._broken) from exc
            self.owner, self.dep = owner, dep
            await self._tell_owners(owner)
            record = self._summary(records, unchanged_vgpus)
            record.update(seconds=time.perf_counter() - t0, source=source, models=[m.name for m in dep.plan.models])
            self._records.append(record)
            log.warning("plan from %s is now served; %d of %d shards switched (%.2f s)", source, len(subs),
                        len(self.shards), record["seconds"])
            return record

    def _split(self, dep: Any, source: str) -> tuple[dict[str, int], dict[int, Any], dict[int, dict[str, set[int]]], int]:
        """Steps 2 and 4's inputs: the new owners, the part of each shard whose part changes
        (a deployment), what each takes from the others, and the vGPUs of the other shards."""
        from ppipe.runtime.control.shard_plan import incoming_resources, shard_owners, sub_plan

        n = len(self.shards)
        owner = shard_owners(self.dep.plan, self.owner, dep.plan, n, source)
        subs, unchanged_vgpus = {}, 0
        for i in range(n):
            new = sub_plan(dep.plan, [m for m, k in owner.items() if k == i])
            if new == sub_plan(self.dep.plan, [m for m, k in self.owner.items() if k == i]):
                unchanged_vgpus += len(new.placement)
            else:
                subs[i] = replace(dep, plan=new, profiles={m.name: dep.profiles[m.name] for m in new.models})
        givers = incoming_resources(self.dep.plan, self.owner, dep.plan, owner, set(subs))
        return owner, subs, givers, unchanged_vgpus

    async def _tell_owners(self, owner: dict[str, int]) -> None:
        await asyncio.gather(*(shard.call(SetOwner(owner)) for shard in self.shards))

    @staticmethod
    def _summary(records: dict[int, dict[str, Any]], unchanged_vgpus: int) -> dict[str, Any]:
        """One switch's record from the shards' (``shards``): counts summed (the vGPUs of the
        shards that did not switch are kept), the slowest loading and switch step."""
        out: dict[str, Any] = {k: sum(r[k] for r in records.values()) for k in ("kept", "started", "retiring", "moved")}
        out["kept"] += unchanged_vgpus
        out["load_s"] = max((r["load_s"] for r in records.values()), default=0.0)
        out["switch_us"] = max((r["switch_us"] for r in records.values()), default=0.0)
        out["shards"] = {str(i): r for i, r in sorted(records.items())}
        return out

    async def _commit_in_waves(self, changed: list[int], givers: dict[int, dict[str, set[int]]],
                               done: dict[int, dict[str, Any]] | None = None) -> dict[int, dict[str, Any]]:
        """Step 4 of the class doc; returns (and fills ``done`` with) each shard's ``commit_switch`` record."""
        done = {} if done is None else done
        embargoed: dict[int, set[str]] = {}  # shard -> resources it holds under embargo
        pending = sorted(changed)
        while pending:
            wave = [i for i in pending if all(g in done for gs in givers.get(i, {}).values() for g in gs)] or pending[:1]
            embargoes = {i: {res: self._until(done, res, gs) for res, gs in givers.get(i, {}).items()} for i in wave}
            records = await asyncio.gather(*(self.shards[i].call(Commit(embargoes[i])) for i in wave), return_exceptions=True)
            done.update((i, r) for i, r in zip(wave, records) if not isinstance(r, BaseException))
            for i in wave:
                if i in done:
                    embargoed[i] = {res for res, until in embargoes[i].items() if until is None}
            failed = [r for r in records if isinstance(r, BaseException)]
            if failed:
                await self._give_up_embargoes(done, embargoed)
                raise failed[0]
            pending = [i for i in pending if i not in done]
            lifts = [(i, res, self._until(done, res, givers[i][res])) for i, held in embargoed.items() for res in sorted(held)]
            lifts = [(i, res, until) for i, res, until in lifts if until is not None]
            await asyncio.gather(*(self.shards[i].call(Lift(res, until)) for i, res, until in lifts))
            for i, res, _ in lifts:
                embargoed[i].discard(res)
        return done

    async def _give_up_embargoes(self, done: dict[int, dict[str, Any]], embargoed: dict[int, set[str]]) -> None:
        """A giver failed to commit: lift the committed shards' embargoes at the latest its old
        reservations can end (its requests' deadlines: now + the old plan's largest SLO, + 1 s),
        so that they serve on (their held requests are submitted)."""
        from ppipe.runtime.clock import wall_us

        until = wall_us() + 1e3 * max(m.slo_ms for m in self.dep.plan.models) + 1e6
        lifts = [(i, res) for i, held in embargoed.items() if i in done for res in sorted(held)]
        await asyncio.gather(*(self.shards[i].call(Lift(res, until)) for i, res in lifts), return_exceptions=True)

    @staticmethod
    def _until(done: dict[int, dict[str, Any]], resource: str, resource_givers: set[int]) -> float | None:
        """When the givers' old reservations on ``resource`` end (0: none left); None while
        one of them has not committed."""
        if any(g not in done for g in resource_givers):
            return None
        return max((done[g]["retired"].get(resource, 0.0) for g in resource_givers), default=0.0)

    # the arrivals a re-plan loop counts (ppipe.runtime.control.replan): every shard's
    async def log_arrivals(self, on: bool) -> None:
        await asyncio.gather(*(shard.call(LogArrivals(on)) for shard in self.shards))

    async def take_arrivals(self) -> list[tuple[str, float]]:
        logs = await asyncio.gather(*(shard.call(TakeArrivals()) for shard in self.shards))
        return sorted((a for log_ in logs for a in log_), key=lambda a: a[1])


class SplitServersSwitcher(ShardedSwitcher):
    """The plan switcher of a server whose shards split the plan's servers
    (``ppipe serve --shard-by servers``): it refuses every switch (:class:`SwitchRefused`),
    and the old plan serves on. A switch there would have to move servers between shards
    and re-weight every router's deal in one step, which the sharded switch does not do;
    restarting ``ppipe serve`` with the new plan splits it anew. What a re-plan loop reads
    (the shards' arrival logs) and ``GET /v2/admin/plan`` work as on any server of shards.
    """

    async def apply(self, plan: Plan, source: str, keep_live: bool = True) -> dict[str, Any]:
        raise SwitchRefused(f"{source}: this server's shards split the plan's servers (--shard-by servers), "
                            "and such a server does not switch plans live; the plan it serves keeps serving",
                            fix="restart `ppipe serve` with the new plan, or serve with --shard-by models to switch plans live")


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
