"""Batches between the scheduler's host and the workers: sending a dispatch, taking reports.

A dispatched batch goes to its first worker as one :class:`~ppipe.runtime.wire.messages.StageMsg`
with the batch's inputs, the reserved route and each stage's reservation in wall time; a
stage that receives over an NCCL or ring edge gets its own message without tensors, so
that both ends of the edge are posted at once. Workers report over the data path (one
message per stage, or one carrying the reports of stages that ran as reserved); each
report goes to the scheduler, the last stage's answers the batch's requests.
"""

from __future__ import annotations

import logging
from bisect import insort

import msgspec
import numpy as np

from ppipe.dataplane.api import Dispatch, DropReason, StageReport
from ppipe.dataplane.feedback import ran_as_reserved, reads_every_report
from ppipe.runtime.scheduler.inflight import BatchTrace, DroppedError, InFlight
from ppipe.runtime.scheduler.ingresses import RemoteInput
from ppipe.runtime.wire.datapath import DataPathFull
from ppipe.runtime.wire.frames import Rows, WireError, pack, unpack
from ppipe.runtime.wire.messages import EdgeRef, Reservation, StageLinks, StageMsg, StageReport as StageReportMsg
from ppipe.runtime.wire.shared_inputs import shared_arena_for

log = logging.getLogger("ppipe.runtime")


class BatchesMixin:
    """The :class:`~ppipe.runtime.scheduler.host.Runtime`'s side of the data path (mixed into it).

    It works on the runtime's state, chiefly ``clock``, ``scheduler``, ``addresses``, ``failed``,
    ``nccl_links``, ``traces``, ``_inflight``, ``_edge_seq``, ``_outbox`` and calls its
    ``_apply``, ``_answer``, ``_answer_error``, ``_answer_was_late`` and ``_mark_dispatched``.
    """

    def _dispatch(self, d: Dispatch) -> None:
        if self.switches and self.switches[-1]["first_dispatch_us"] is None and d.batch_id >= self.switches[-1]["first_batch_id"]:
            self.switches[-1]["first_dispatch_us"] = self.clock.true_now_us()
        for r in d.requests:
            self._mark_dispatched(r)
        by_size = self.metrics.batch_sizes.get(d.model)
        if by_size is None:
            by_size = self.metrics.batch_sizes[d.model] = {}
        by_size[len(d.requests)] = by_size.get(len(d.requests), 0) + 1
        route = [s.vgpu_id for s in d.stages]
        if self._warming is not None:
            self._warming.update(route)
        trace = None
        if self.keep_traces:
            trace = BatchTrace(d.batch_id, d.model, route, [r.id for r in d.requests], self.clock.true_now_us(),
                               reserved_us=[(s.start_us, s.start_us + s.infer_us) for s in d.stages],
                               arrivals_us=[r.arrival_us for r in d.requests])
            self.traces.append(trace)
            del self.traces[: -self.keep_traces]
        batch = InFlight(d, trace, route)
        gone = next((v for v in route if v not in self.addresses or v in self.failed), None)
        if gone is not None:
            self._fail(batch, DropReason.WORKER_FAILED.value, f"vGPU {gone} was marked failed before the batch was sent")
            return
        self._inflight[d.batch_id] = batch
        try:
            self._send_stages(d, route)
        except DataPathFull as exc:
            self._fail(batch, DropReason.WORKER_FAILED.value, str(exc))

    def _send_stages(self, d: Dispatch, route: list[str]) -> None:
        """Send stage 0's message (the batch's inputs) and, for every stage that receives over
        NCCL, its message without tensors (both ends of an NCCL edge are posted at once).
        Where ingress processes hold the inputs, stage 0 gets the refs (or small bytes) their
        arrivals offered (:meth:`~ppipe.runtime.scheduler.ingresses.IngressesMixin._forwarded_inputs`),
        or else the ingresses send it their rows themselves
        (:meth:`~ppipe.runtime.scheduler.ingresses.IngressesMixin._send_remote_inputs`)."""
        to_wall = self.clock.to_wall_us
        timing = tuple(
            Reservation(None if s.transfer_start_us is None else to_wall(s.transfer_start_us), s.transfer_us,
                        to_wall(s.start_us), to_wall(s.start_us + s.infer_us))
            for s in d.stages
        )
        links = self._links(route)
        addrs = tuple(self.addresses[v] for v in route)
        remote = self.accept_ingresses and isinstance(d.requests[0].payload, RemoteInput)  # (not a warm-up's zeros)
        answers = self._answers_to(d) if remote else ()
        message = StageMsg(d.batch_id, 0, tuple(route), addrs, d.batch, timing, links, self.report_tolerance_us,
                           self.clock.wall_now_us(), answers=answers)
        if remote:
            forwarded = self._forwarded_inputs(d, addrs[0])
            if forwarded is None:
                self._send_remote_inputs(d, message)
            else:
                self.forwarded_batches += 1
                self._outbox.send(addrs[0], pack(message, forwarded))
        else:
            self._outbox.send(addrs[0], pack(message, _stacked_inputs(d), shared_arena_for(addrs[0])))
        for j in range(1, len(route)):
            if links is not None and links[j] is not None and links[j].recv is not None:
                self._outbox.send(addrs[j], pack(msgspec.structs.replace(message, stage=j, sent_us=None)))

    def _links(self, route: list[str]) -> tuple[StageLinks | None, ...] | None:
        """The NCCL and ring edges of a route, each numbered with its edge's next message and
        named by its generation (None: the route has none)."""
        if not self.nccl_links:
            return None
        sends: list[EdgeRef | None] = [None] * len(route)
        recvs: list[EdgeRef | None] = [None] * len(route)
        for j in range(1, len(route)):
            gen = self.nccl_links.get((route[j - 1], route[j]))
            if gen is not None:
                key = (route[j - 1], route[j], gen)
                seq = self._edge_seq.get(key, 0)
                self._edge_seq[key] = seq + 1
                sends[j - 1] = EdgeRef(route[j], seq, gen)
                recvs[j] = EdgeRef(route[j - 1], seq, gen)
        return tuple(None if s is None and r is None else StageLinks(s, r) for s, r in zip(sends, recvs))

    def _on_report(self, message: memoryview | bytes) -> None:
        """A worker's report (the data path's callback): feed the scheduler; the last stage's
        report answers every request of the batch with its row of the outputs.

        Reports of one batch come from different workers over different connections, so
        they may arrive in any order: stage k+1's before stage k's. A message may also hold
        the reports of earlier stages that ran as reserved (``carried``, see
        :class:`~ppipe.runtime.workers.stage_server.StageServer`); they are taken first, in stage order.
        The batch is answered by the last stage's report and forgotten once every stage has
        reported.
        """
        self.report_messages += 1
        try:
            rep, outputs = unpack(message, StageReportMsg)
        except WireError as exc:
            log.warning("dropped a malformed report: %s", exc)
            return
        batch = self._inflight.get(rep.batch_id)
        if batch is None:  # a batch already failed (a worker on its route died)
            return
        if rep.carried:
            feed = self.report_tolerance_us is None or reads_every_report(self.scheduler)
            for earlier in rep.carried:
                if earlier.batch_id != rep.batch_id:
                    self.refuse("report-of-another-batch", f"a report of batch {rep.batch_id} carried one of batch {earlier.batch_id}")
                    return
                if not self._take_report(batch, earlier, {}, feed):
                    return
        self._take_report(batch, rep, outputs, True)

    def _take_report(self, batch: InFlight, rep: StageReportMsg, outputs: dict[str, np.ndarray], feed: bool) -> bool:
        """Take one stage's report of ``batch``; False once the batch is no longer in flight
        (it failed here, or a report was refused). ``feed``: give it to the scheduler unless it
        ran as reserved (a carried report, when its tolerance lets it ride, is not fed at all)."""
        k = rep.stage
        if not 0 <= k < len(batch.route):
            log.warning("dropped a report of stage %s of batch %s, whose route has %d stages", k, rep.batch_id, len(batch.route))
            return False
        if rep.vgpu_id != batch.route[k]:
            self.refuse("report-from-another-vgpu", f"batch {rep.batch_id} stage {k} went to {batch.route[k]}, its report says {rep.vgpu_id}")
            return False
        if k not in batch.unreported:
            self.refuse("repeated-report", f"batch {rep.batch_id} stage {k} has reported already")
            return False
        if rep.error is not None:
            log.warning("batch %s failed on %s: %s", batch.d.batch_id, rep.vgpu_id, rep.error)
            self._fail(batch, "worker-error", rep.error.splitlines()[0] if rep.error else "error")
            return False
        batch.unreported.discard(k)
        if k >= batch.next_stage:
            batch.next_stage = k + 1
        if batch.trace is not None:  # in stage order, whatever order the reports came in
            insort(batch.trace.reports, msgspec.structs.replace(rep, carried=()), key=lambda r: r.stage)
        busy = self.metrics.busy_s
        busy[rep.vgpu_id] = busy.get(rep.vgpu_id, 0.0) + max(0.0, rep.end_us - rep.start_us) / 1e6
        if feed:
            self._report(batch.d, k, rep)
        if k == len(batch.route) - 1:
            now = self.clock.true_now_us()
            if batch.trace is not None:
                batch.trace.answered_us = now
            self._answer_was_late(batch.d.model, now - batch.d.stages[-1].end_us)
            for i, r in enumerate(batch.d.requests):
                self._answer(r.id, {n: a[i] for n, a in outputs.items()})
        if not batch.unreported:
            del self._inflight[batch.d.batch_id]
        return True

    def refuse(self, reason: str, detail: str) -> None:
        """Count a refused data-path connection or report (``ppipe_datapath_refused_total``),
        and log it: the first of each reason as a warning, the repeats at debug level."""
        level = logging.DEBUG if reason in self._refusals_seen else logging.WARNING
        log.log(level, "data path: refused (%s): %s", reason, detail)
        self._refusals_seen.add(reason)
        self.metrics.refused.labels(reason).inc()

    def _fail(self, batch: InFlight, reason: str, detail: str) -> None:
        """Answer every request of a batch with an error and forget the batch. A request the
        scheduler has dropped already (it drops a dead vGPU's batches itself) keeps that
        answer, and each request's drop is counted once."""
        self._inflight.pop(batch.d.batch_id, None)
        if batch.trace is not None:
            batch.trace.error = f"{reason}: {detail}"
        for r in batch.d.requests:
            if self._answer_error(r.id, DroppedError(reason, detail)) and reason == DropReason.WORKER_FAILED.value:
                self.metrics.drops.labels(batch.d.model, reason).inc()

    def _report(self, d: Dispatch, k: int, rep: StageReportMsg) -> None:
        """Feed the scheduler a stage's report, unless it ran as reserved: its times are the
        tables' already, up to the report tolerance (:mod:`ppipe.dataplane.feedback`)."""
        c = self.clock
        sr = StageReport(
            batch_id=d.batch_id,
            partition=d.stages[k].partition,
            vgpu_id=rep.vgpu_id,
            start_us=c.from_wall_us(rep.start_us),
            end_us=c.from_wall_us(rep.end_us),
            transfer_start_us=None if rep.transfer_start_us is None else c.from_wall_us(rep.transfer_start_us),
            transfer_end_us=None if rep.transfer_end_us is None else c.from_wall_us(rep.transfer_end_us),
        )
        tol = self.report_tolerance_us
        if tol is not None and not reads_every_report(self.scheduler) and ran_as_reserved(sr, d.stages[k], tol):
            return
        self._apply(self.scheduler.report(sr))


def _stacked_inputs(d: Dispatch) -> dict[str, Rows]:
    """A batch's inputs, each as its requests' rows (stacked on the wire, or named where they
    lie in shared memory: :func:`~ppipe.runtime.wire.frames.pack`)."""
    return {n: Rows([r.payload[n] for r in d.requests]) for n in d.requests[0].payload}
