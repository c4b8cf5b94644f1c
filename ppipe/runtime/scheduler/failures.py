"""Failures the scheduler's host handles: workers that die, reports that stop coming.

- A worker is gone when its handle's ``lifeline`` call ends (:class:`~ppipe.runtime.launch.handle.WorkerGone`).
  Its vGPU is given to ``scheduler.mark_failed`` once, the batches in flight that the
  data plane's failure cut loses (:mod:`ppipe.dataplane.failure`) are answered
  ``worker-failed``, and its live NCCL peers are told to abort their edges with it (a
  receive from it would never complete). A worker of an earlier plan
  that dies while finishing that plan's batches fails only those batches.
- A dispatched batch whose reports stop coming (a connection between two workers broke
  and took its message with it) is answered ``worker-failed`` once it is ``report_grace_s``
  (at least the model's SLO) past its planned end (the data plane's report deadline).
- With a ``respawn`` function, a failed vGPU's worker is re-created until it is up, then
  handed back to the scheduler (``mark_recovered``).
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

from ppipe.dataplane.api import DropReason
from ppipe.dataplane.failure import failure_cut, report_deadline_us
from ppipe.runtime.launch.handle import WorkerGone, WorkerHandle
from ppipe.runtime.scheduler.calls import call_unawaited

log = logging.getLogger("ppipe.runtime")


class FailuresMixin:
    """The :class:`~ppipe.runtime.scheduler.host.Runtime`'s failure handling (mixed into it).

    It works on the runtime's state, chiefly ``workers``, ``failed``, ``addresses``, ``respawn``,
    ``nccl_links``, ``_inflight``, ``_since``, ``_retiring``, ``_revivals``, ``_old_links``
    and ``_lifelines``, and calls its ``_apply``, ``_fail`` and ``_next_stage_addresses``.
    """

    def mark_failed(self, vgpu_id: str) -> None:
        """Tell the scheduler (once) that a vGPU's current worker is gone; it stops routing to
        it. The batches in flight whose remaining stages include it are answered with
        ``worker-failed``."""
        if vgpu_id in self.failed:
            return
        self.failed[vgpu_id] = self.clock.true_now_us()
        self.metrics.failed.labels(vgpu_id).set(1)
        p = self._placement.get(vgpu_id)
        log.warning("vGPU %s (server %s) lost; the scheduler stops routing to it%s", vgpu_id, p.server if p else "?",
                    f"; re-creating it every {self.respawn_interval_s:g} s" if self.respawn is not None else "")
        since = self._since.get(vgpu_id, 0)
        if since:  # a worker started by a plan switch: earlier plans' vGPU of this id was another worker
            self._apply(self.scheduler.mark_failed(vgpu_id, since_batch_id=since))
        else:
            self._apply(self.scheduler.mark_failed(vgpu_id))
        self._fail_batches_through(vgpu_id, since, float("inf"))
        if self.respawn is not None and not any(vgpu_id in e for e in self.nccl_edges) and vgpu_id not in self._revivals:
            self._revivals[vgpu_id] = asyncio.get_running_loop().create_task(self._revive(vgpu_id))
        # its NCCL peers abort their edges with it: a receive from it would never complete
        self._drop_edges_with(vgpu_id, self.nccl_links.items())

    def _drop_edges_with(self, vgpu_id: str, links: Any) -> None:
        """Tell the live peers of ``vgpu_id`` on ``links`` (``((sender, receiver), generation)``
        pairs) to abort those edges."""
        for (a, b), gen in links:
            other = b if a == vgpu_id else a if b == vgpu_id else None
            if other is not None and other not in self.failed and other in self.workers:
                call_unawaited(self.workers[other].drop_peer(vgpu_id, [gen]), f"{other}.drop_peer({vgpu_id})")

    def _fail_batches_through(self, vgpu_id: str, since: int, until: float) -> None:
        """Answer ``worker-failed`` to the batches numbered in ``[since, until)`` that the
        failure cut of ``vgpu_id`` loses (:func:`~ppipe.dataplane.failure.failure_cut`, on
        the stages this host knows done); forget its stages of those that go on."""
        for batch in list(self._inflight.values()):
            if not since <= batch.d.batch_id < until:
                continue
            if failure_cut(batch.route, [j < batch.next_stage for j in range(len(batch.route))], vgpu_id) is not None:
                self._fail(batch, DropReason.WORKER_FAILED.value, f"vGPU {vgpu_id} failed while running the batch")
            else:  # its stage ran (a later stage has reported): its own report may never come
                batch.unreported -= {j for j, v in enumerate(batch.route) if v == vgpu_id}
                if not batch.unreported:
                    del self._inflight[batch.d.batch_id]

    async def _watch(self, vgpu_id: str, handle: WorkerHandle) -> None:
        """Await the worker's ``lifeline`` call, which returns or raises :class:`WorkerGone`
        only when the worker stops (its launcher tells as soon as its process or node is gone)."""
        try:
            await handle.lifeline()
            detail = "its lifeline returned"
        except WorkerGone as exc:
            detail = _first_line(exc)
        log.debug("vGPU %s is gone: %s", vgpu_id, detail)
        handle.kill()  # an unreachable (not dead) worker must not come back beside its re-creation
        if self.workers.get(vgpu_id) is handle:
            self.mark_failed(vgpu_id)
            return
        old = next((r for r in self._retiring if r.handle is handle), None)
        if old is not None and not old.stopping:  # an earlier plan's worker died while finishing its batches
            log.warning("vGPU %s of an earlier plan failed while finishing its batches", vgpu_id)
            self._apply(self.scheduler.mark_failed(vgpu_id, since_batch_id=old.since, until_batch_id=old.until))
            self._fail_batches_through(vgpu_id, old.since, old.until)
            self._drop_edges_with(vgpu_id, self._old_links)

    async def _sweep_overdue(self) -> None:
        """Answer the batches whose reports stopped coming (see ``report_grace_s``), four times
        per grace period."""
        slo_us = {m.name: m.slo_ms * 1e3 for m in self.plan.models}
        while True:
            await asyncio.sleep(self.report_grace_s / 4)
            now = self.clock.now_us()
            if self.switches:
                slo_us.update({m.name: m.slo_ms * 1e3 for m in self.plan.models})
            for batch in list(self._inflight.values()):
                d = batch.d
                if now > report_deadline_us(d.stages[-1].end_us, self.report_grace_s * 1e6, slo_us.get(d.model, 0.0)):
                    if len(batch.route) - 1 not in batch.unreported:  # answered; an earlier stage's report is lost
                        del self._inflight[d.batch_id]
                        continue
                    waiting = batch.route[min(batch.next_stage, len(batch.route) - 1)]
                    log.warning("batch %d: no report from vGPU %s; answered worker-failed", d.batch_id, waiting)
                    self._fail(batch, DropReason.WORKER_FAILED.value,
                               f"no report from vGPU {waiting} within {max(self.report_grace_s * 1e6, slo_us.get(d.model, 0.0)) / 1e6:.1f} s "
                               "of the batch's planned end (a lost data-path connection)")

    async def _revive(self, vgpu_id: str) -> None:
        """Re-create a failed vGPU's worker until it is up, then route to it again."""
        tries = 0
        while True:
            await asyncio.sleep(self.respawn_interval_s)
            tries += 1
            handle = None
            try:
                handle = await self.respawn(vgpu_id)
                addr = await handle.open_data_path(self._inbox.address, self.data_secret)
                self.addresses[vgpu_id] = addr
                await handle.connect_peers(self._next_stage_addresses(vgpu_id))
            except asyncio.CancelledError:
                if handle is not None:
                    handle.kill()
                raise
            except Exception as exc:
                if handle is not None:  # created, but not usable: not left running beside the next try
                    handle.kill()
                log.info("vGPU %s is not back yet (try %d): %s", vgpu_id, tries, _first_line(exc))
                continue
            break
        self.workers[vgpu_id] = handle
        self._outbox.connect(addr)
        del self.failed[vgpu_id]
        self._revivals.pop(vgpu_id, None)
        self.metrics.failed.labels(vgpu_id).set(0)
        self._lifelines.append(asyncio.get_running_loop().create_task(self._watch(vgpu_id, handle)))
        p = self._placement.get(vgpu_id)
        log.warning("vGPU %s (server %s) is back after %d tries; the scheduler routes to it again", vgpu_id, p.server if p else "?", tries)
        self._apply(self.scheduler.mark_recovered(vgpu_id))


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__
