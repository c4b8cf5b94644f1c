"""Live plan switches of the scheduler's host, with no pause (:mod:`ppipe.dataplane.handover`).

A switch is prepared (the new plan's scheduler built, its new workers started, connected
and their NCCL or ring edges opened, while the old plan serves on), then committed in one
synchronous step on the loop (the scheduler hands its queue and tables over; new requests
go to the new plan), then drained: the old plan's batches finish on its workers, which
stop once they have ended, and the edges only the old plan used are closed. A prepared
switch may also be aborted (what it started is stopped). A server of several frontend
shards prepares and commits apart (:class:`ppipe.runtime.control.switch.ShardedSwitcher`).
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass, field
from typing import Any, Awaitable, Callable

from ppipe.dataplane.handover import SwitchingScheduler, kept_vgpus
from ppipe.errors import UserError
from ppipe.runtime.launch.handle import WorkerHandle
from ppipe.runtime.scheduler.calls import call_unawaited
from ppipe.runtime.workers.transport import relink
from ppipe.spec.plan import Plan
from ppipe.spec.profile import ModelProfile

log = logging.getLogger("ppipe.runtime")

StartWorkers = Callable[[list[str]], Awaitable[dict[str, WorkerHandle]]]
"""``await start_workers(vgpu_ids)``: these vGPUs of the new plan, started and loaded, by id."""
StopWorker = Callable[[WorkerHandle], None]
GenEdge = tuple[tuple[str, str], int]
"""An edge ``(sender, receiver)`` with its generation (:mod:`ppipe.runtime.workers.transport`)."""
StaleEdges = tuple[list[GenEdge], dict[str, WorkerHandle]]
"""Edges the new plan does not use, and the kept workers that hold their ends."""


class SwitchingMixin:
    """The :class:`~ppipe.runtime.scheduler.host.Runtime`'s plan switches (mixed into it).

    It replaces the runtime's ``plan``, ``profiles``, ``scheduler``, ``workers``,
    ``addresses``, ``nccl_links``, ``_placement`` and ``_lead_cap_us`` at the switch step,
    keeps ``switches``, ``_since``, ``_retiring``, ``_old_links``, ``_link_gen`` and
    ``_edge_seq``, and calls its ``_build_scheduler``, ``_apply``, ``_fail``, ``_watch`` and
    ``_next_stage_addresses``.
    """

    async def switch_plan(
        self,
        plan: Plan,
        profiles: dict[str, ModelProfile],
        start_workers: StartWorkers,
        stop_worker: StopWorker,
    ) -> dict[str, Any]:
        """Move to ``plan`` while serving, with no pause (:mod:`ppipe.dataplane.handover`).

        1. The new plan's scheduler is built (a plan that does not fit its profiles or the
           cluster is refused here, and nothing changes).
        2. Its workers that are not kept (:func:`~ppipe.dataplane.handover.kept_vgpus`) are
           started and load their blocks while the old plan serves.
        3. The switch, in one step on the loop: the scheduler hands over (queued requests
           move, the old plan's reservations still ahead are carried over); new requests
           go to the new plan; batches already sent finish on the old plan's workers.
        4. The old plan's workers that the new plan does not keep are stopped once their
           batches have ended (after at most the old plan's largest SLO + 1 s, the batches
           still open are answered with ``plan-switch``).

        Steps 1-2 are :meth:`prepare_switch`, 3-4 :meth:`commit_switch` (a server of several
        shards runs them apart, :class:`ppipe.runtime.control.switch.ShardedSwitcher`).

        Args:
            start_workers: ``await start_workers(vgpu_ids)`` starts these vGPUs of ``plan``,
                loaded, and returns ``{vgpu_id: handle}``; it raises (having stopped what it
                started) when one cannot start.
            stop_worker: stops a worker (given its :class:`~ppipe.runtime.launch.handle.WorkerHandle`).

        Returns:
            what happened: ``kept``, ``started``, ``retiring`` (vGPU counts), ``moved``
            (queued requests handed over), ``first_batch_id``, ``load_s`` (starting the
            workers), ``switch_us`` (the switch step itself) and ``retired`` (per GPU and
            NIC the old plan gives up, when its last reservation there ends, in us).

        Raises:
            UserError: the plan cannot replace the running one; the old plan keeps serving.
        """
        return await self.commit_switch(await self.prepare_switch(plan, profiles, start_workers, stop_worker))

    async def prepare_switch(
        self,
        plan: Plan,
        profiles: dict[str, ModelProfile],
        start_workers: StartWorkers,
        stop_worker: StopWorker,
    ) -> PreparedSwitch:
        """Steps 1-2 of :meth:`switch_plan`: the new scheduler, its new workers started and
        connected; the old plan serves on. :meth:`commit_switch` or :meth:`abort_switch` follows."""
        if self.nccl_links and self.links is None:
            raise UserError("this runtime sends feature maps over NCCL and was given no link opener to open the new plan's edges",
                            fix="pass links=LinkOpener(...) (ppipe serve does), or restart with the new plan")
        t0 = self.clock.true_now_us()
        current = self.scheduler.current if isinstance(self.scheduler, SwitchingScheduler) else self.scheduler
        new, margins = self._build_scheduler(plan, profiles)
        check_switchable(current, new)
        kept = kept_vgpus(current.topology, new.topology)
        fresh = sorted(p.vgpu_id for p in plan.placement if p.vgpu_id not in kept)
        handles = await start_workers(fresh) if fresh else {}
        prepared = PreparedSwitch(plan, dict(profiles), new, kept, {}, handles, stop_worker, load_s=0.0, margins=margins)
        try:
            addrs = await asyncio.gather(*(handles[v].open_data_path(self._inbox.address, self.data_secret) for v in fresh))
            prepared.fresh_addrs = dict(zip(fresh, addrs))
            await self._open_links(prepared)
        except BaseException:
            self.abort_switch(prepared)
            raise
        prepared.load_s = (self.clock.true_now_us() - t0) / 1e6
        return prepared

    async def _open_links(self, prepared: PreparedSwitch) -> None:
        """The new plan's transports (``self.links``): keep the NCCL edges between kept
        workers, open the others as this preparation's generation; None: every edge on the
        data path."""
        if self.links is None:
            return
        workers = {**{v: self.workers[v] for v in prepared.kept}, **prepared.handles}
        choice = await asyncio.to_thread(self.links.choose, prepared.plan, self.cluster, prepared.profiles, workers)
        self._link_gen += 1
        prepared.gen = self._link_gen
        prepared.links = relink(choice, prepared.kept, self.nccl_links, prepared.gen)
        prepared.opened = sorted(e for e, g in prepared.links.items() if g == prepared.gen)
        kinds = {e: choice[e][0] for e in prepared.opened}
        await asyncio.to_thread(self.links.open, workers, prepared.opened, prepared.gen, kinds)

    def abort_switch(self, prepared: PreparedSwitch) -> None:
        """Give up a prepared switch: close the edges it opened at kept workers and stop the
        workers it started (the old plan never stopped)."""
        self._close_edges([(e, prepared.gen) for e in prepared.opened], {v: self.workers[v] for v in prepared.kept})
        for h in prepared.handles.values():
            prepared.stop_worker(h)

    def _close_edges(self, edges: list[GenEdge], at: dict[str, Any]) -> None:
        """Tell the workers in ``at`` to close their ends of ``edges`` (``((sender, receiver),
        generation)``); not awaited: a worker already gone has nothing to close."""
        ends: dict[str, list[tuple[str, int]]] = {}
        for (a, b), gen in edges:
            for me, peer in ((a, b), (b, a)):
                if me in at:
                    ends.setdefault(me, []).append((peer, gen))
        for v, es in ends.items():
            call_unawaited(at[v].close_edges(es), f"{v}.close_edges")

    async def commit_switch(self, prepared: PreparedSwitch, embargo: dict[str, float | None] | None = None) -> dict[str, Any]:
        """Steps 3-4 of :meth:`switch_plan`.

        ``embargo``: GPUs and NICs another shard's old plan used, with when its reservations
        there end, or None where that shard has not switched yet (then :meth:`lift_embargo`
        follows); see :func:`ppipe.dataplane.handover.hand_over`.
        """
        record = self._switch_now(prepared, embargo or {})
        record["load_s"] = prepared.load_s
        live = [v for v in self.workers if v not in self.failed]
        await asyncio.gather(*(self.workers[v].connect_peers(self._next_stage_addresses(v)) for v in live),
                             return_exceptions=True)  # warming connections only: a dead worker's lifeline reports it
        task = asyncio.get_running_loop().create_task(self._drain(record["first_batch_id"], prepared.stop_worker,
                                                                  self._drain_timeout_s(), prepared.stale))
        self._lifelines.append(task)
        return record

    def lift_embargo(self, resource: str, until_us: float) -> None:
        """The shard that used ``resource`` before the switch has switched: it is busy until ``until_us``."""
        self._apply(self.scheduler.lift_embargo(resource, until_us))

    def _switch_now(self, prepared: PreparedSwitch, embargo: dict[str, float | None]) -> dict[str, Any]:
        """The switch step: synchronous, so no request sees half of it."""
        t0 = self.clock.true_now_us()
        plan, kept, handles, fresh_addrs = prepared.plan, prepared.kept, prepared.handles, prepared.fresh_addrs
        if not isinstance(self.scheduler, SwitchingScheduler):
            self.scheduler = SwitchingScheduler(self.scheduler)
        h = self.scheduler.switch(prepared.scheduler, embargo=embargo)
        retiring = {v: w for v, w in self.workers.items() if v not in kept}
        for v, w in retiring.items():
            self._retiring.append(RetiringWorker(v, w, since=self._since.pop(v, 0), until=h.first_batch_id))
            if self.failed.pop(v, None) is not None:
                self.metrics.failed.labels(v).set(0)
            revival = self._revivals.pop(v, None)
            if revival is not None:
                revival.cancel()
        prepared.stale = self._relink(prepared)
        self.plan, self._placement = plan, {p.vgpu_id: p for p in plan.placement}
        self._lead_cap_us = 0.25e3 * min(m.slo_ms for m in plan.models)
        self.profiles = dict(prepared.profiles)
        self.budgets.adopt(prepared.margins)
        self.workers = {**{v: self.workers[v] for v in kept}, **handles}
        self.addresses = {**{v: self.addresses[v] for v in kept}, **fresh_addrs}
        loop = asyncio.get_running_loop()
        for v, addr in fresh_addrs.items():
            self._since[v] = h.first_batch_id
            self._outbox.connect(addr)
            self._lifelines.append(loop.create_task(self._watch(v, handles[v])))
        for m in plan.models:
            self._queued.setdefault(m.name, 0)
        for hook in self.on_switch:
            hook()
        self._apply(h.decisions)
        record = {"kept": len(kept), "started": len(handles), "retiring": len(retiring), "moved": h.moved,
                  "first_batch_id": h.first_batch_id, "switch_us": self.clock.true_now_us() - t0, "at_us": t0,
                  "first_dispatch_us": None, "retired": dict(h.retired), "nccl_opened": len(prepared.opened)}
        self.switches.append(record)
        log.warning("switched to a new plan (%d vGPUs kept, %d started, %d finishing their batches; %d queued requests moved)",
                    len(kept), len(handles), len(retiring), h.moved)
        return record

    def _relink(self, prepared: PreparedSwitch) -> StaleEdges:
        """Make the prepared edges current; returns the edges the new plan does not use (to
        close once the old plan's batches end) and the kept workers that hold their ends."""
        if prepared.links is None:
            return [], {}
        stale = [(e, g) for e, g in self.nccl_links.items() if prepared.links.get(e) != g]
        self.nccl_links = dict(prepared.links)
        self._old_links += stale
        return stale, {v: self.workers[v] for v in prepared.kept}

    def _drain_timeout_s(self) -> float:
        return max((m.slo_ms for m in self.plan.models), default=0.0) / 1e3 + 1.0

    async def _drain(self, first_new: int, stop_worker: StopWorker, timeout_s: float,
                     stale_links: StaleEdges = ([], {})) -> None:
        """Stop the earlier plan's retiring workers once its batches (ids below ``first_new``) have
        ended, or after ``timeout_s``, answering the batches still open with ``plan-switch``;
        then close the NCCL edges it alone used (``stale_links``: the edges and the kept
        workers that hold their ends)."""
        deadline_us = self.clock.true_now_us() + timeout_s * 1e6
        while any(b < first_new for b in self._inflight) and self.clock.true_now_us() < deadline_us:
            await asyncio.sleep(0.02)
        for batch in [b for i, b in self._inflight.items() if i < first_new]:
            self._fail(batch, "plan-switch", f"the earlier plan's batch did not end within {timeout_s:.1f} s of the switch")
        for r in [r for r in self._retiring if r.until <= first_new]:
            r.stopping = True
            self._retiring.remove(r)
            try:
                stop_worker(r.handle)
            except Exception:  # pragma: no cover - a worker already gone
                log.debug("stopping %s of an earlier plan: already gone", r.vgpu_id)
        edges, holders = stale_links
        self._close_edges(edges, holders)
        self._old_links = [x for x in self._old_links if x not in edges]
        for (a, b), gen in edges:
            self._edge_seq.pop((a, b, gen), None)


def check_switchable(current: Any, new: Any) -> None:
    """A live switch hands a batching scheduler's queue and tables over; refuse other schedulers."""
    from ppipe.dataplane.batching import BatchingScheduler

    for s in (current, new):
        if not isinstance(s, BatchingScheduler):
            raise UserError(f"a live plan switch needs a batching data-plane policy; the server runs {type(s).__name__}",
                            fix="serve with --policy reservation (the paper's) or reactive")


@dataclass
class PreparedSwitch:
    """A plan switch whose new workers run, not yet committed (:meth:`Runtime.prepare_switch`)."""

    plan: Plan
    profiles: dict[str, ModelProfile]
    scheduler: Any  # the new plan's, fresh
    kept: frozenset[str]
    fresh_addrs: dict[str, str]  # new worker -> its data-path address
    handles: dict[str, WorkerHandle]  # new worker -> its handle
    stop_worker: StopWorker
    load_s: float
    margins: dict = field(default_factory=dict)  # the new plan's service margins (ppipe.runtime.scheduler.budgets)
    links: dict[tuple[str, str], int] | None = None  # the new plan's NCCL edges -> generation (None: no link opener)
    gen: int = 0  # the generation this preparation opened
    opened: list[tuple[str, str]] = field(default_factory=list)  # the edges it opened
    stale: StaleEdges = ([], {})  # at commit: the edges to close after the drain


@dataclass
class RetiringWorker:
    """A worker of an earlier plan that finishes the batches numbered in ``[since, until)``."""

    vgpu_id: str
    handle: WorkerHandle
    since: int
    until: int
    stopping: bool = False
