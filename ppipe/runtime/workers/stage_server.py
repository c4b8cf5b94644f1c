"""A worker's end of the data path: run each stage message, forward the output, report.

A :class:`~ppipe.runtime.wire.messages.StageMsg` names the whole reserved route and its
workers' addresses, so after stage k the output goes to ``addresses[k+1]`` as stage k+1's
message without asking anyone, unless that edge is NCCL or a ring (then the frontend has
posted stage k+1 itself and the tensors go over the edge). Where worker k+1 is on this
machine, the message names where the output lies in this worker's shared memory instead
of carrying it (:mod:`ppipe.runtime.wire.handoff`; stage k+1 checks its seals once it ran).

The report (the stage's wall-clock stamps, with the model's outputs after the last stage,
or ``error`` when the stage failed) goes to the frontend at once, or rides on: with a
``tolerance_us`` in the message, a stage that ran as reserved -- start, end and NIC
transfer each within the tolerance of its reservation
(:func:`~ppipe.dataplane.feedback.ran_as_reserved`) -- adds its report to the next
stage message's ``carried`` instead, and the next report that goes to the frontend (the
last stage's, a late stage's or a failed one's, or the one before an NCCL edge) takes the
list along. A stage's report tells the scheduler something only where reality left the
reservation, so the common batch costs the frontend one report message instead of one per
stage, and each worker but the last one send instead of two.

Where ingress processes hold the requests (:mod:`ppipe.runtime.ingress.remote`), a batch's
inputs come to its first worker from each of them as stage-0 messages that carry some of
its rows (``part``); the worker keeps them (:class:`_Parts`) until every row is in, puts
them together in row order and runs the batch once. The last stage then answers each
ingress with its rows of the outputs (``answers``: an
:class:`~ppipe.runtime.wire.messages.Answer` each) and reports to the scheduler without
them. Parts of a batch that never completes (an ingress died before sending its rows) are
let go ``STALE_PARTS_US`` after the batch's reserved end; the scheduler fails that batch
on its own (its reports never come).
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass
from typing import Any, Awaitable, Callable, Iterable

import msgspec
import numpy as np

from ppipe.dataplane.feedback import ran_as_reserved
from ppipe.runtime.clock import wall_us
from ppipe.runtime.wire.datapath import LOOPBACK, DataPathFull, Inbox, Outbox, is_loopback_address, node_host
from ppipe.runtime.wire.addresses import on_this_machine
from ppipe.runtime.wire.frames import SharedTensorError, WireError, pack, unpack
from ppipe.runtime.wire.handoff import HOLD_GRACE_US, MapHandoff
from ppipe.runtime.wire.messages import Answer, StageMsg, StageReport

log = logging.getLogger("ppipe.runtime")


@dataclass(frozen=True)
class StageResult:
    """What a stage produced: its report and its output tensors (to the next stage, fp16;
    after the last stage, the model's outputs; None when they went over an NCCL or ring
    edge), which left the worker at ``sent_us`` (wall clock)."""

    report: StageReport
    tensors: dict[str, Any] | None
    sent_us: float


StageRunner = Callable[[StageMsg, "dict[str, Any] | None"], Awaitable[StageResult]]

STALE_PARTS_US = 10e6  # parts of a batch still incomplete this long after its reserved end are let go


class _Parts:
    """The stage-0 messages of one batch received so far, each with its rows of the inputs."""

    def __init__(self) -> None:
        self.rows = 0
        self.pieces: list[tuple[int, dict[str, Any]]] = []  # (offset, tensors)
        self.last: StageMsg | None = None

    def add(self, msg: StageMsg, tensors: dict[str, Any]) -> None:
        offset, rows = msg.part
        if any(off == offset for off, _ in self.pieces):
            raise ValueError(f"rows from {offset} of batch {msg.batch_id} came twice")
        self.pieces.append((offset, tensors))
        self.rows += rows
        self.last = msg

    def joined(self) -> dict[str, Any]:
        """The inputs in row order: each tensor the rows of every part, concatenated."""
        self.pieces.sort(key=lambda p: p[0])
        return {n: np.concatenate([t[n] for _, t in self.pieces]) for n in self.pieces[0][1]}


class StageServer:
    """Serves stage messages on a worker's inbox with ``run`` (as
    :meth:`ppipe.runtime.workers.worker.VgpuWorker.run_stage`): ``await run(message,
    tensors)`` -> :class:`StageResult`; ``tensors`` is None on a message without any (its
    input comes over an edge).

    Args:
        vgpu_id: the worker's vGPU (in error reports).
        run: the stage runner.
        secret: the server's data-path secret: the inbox reads only connections that prove
            it, and the outbox's connections prove it (None: not authenticated).
    """

    def __init__(self, vgpu_id: str, run: StageRunner, secret: bytes | None = None, now_us: Callable[[], float] = wall_us):
        self.vgpu_id, self.run, self.secret, self.now_us = vgpu_id, run, secret, now_us
        self.inbox: Inbox | None = None
        self.outbox = Outbox(secret)
        self.frontend: str | None = None
        self._tasks: set[asyncio.Task] = set()
        self._parts: dict[int, _Parts] = {}  # batch id -> the parts of its inputs received so far
        self.handoff = MapHandoff.for_this_process()  # the maps to workers on this machine

    def open(self, frontend: str, host: str | None = None) -> str:
        """Bind this worker's inbox (on the loopback address when the frontend is on it) and
        connect to the frontend's; returns the inbox's address."""
        if self.inbox is None:
            self.inbox = Inbox(self._on_message, host or (LOOPBACK if is_loopback_address(frontend) else node_host()), self.secret)
        self.frontend = frontend
        self.outbox.connect(frontend)
        return self.inbox.address

    def connect(self, peers: Iterable[str]) -> None:
        """Connect to the next stage's workers ahead of the first batch."""
        for addr in peers:
            self.outbox.connect(addr)

    def close(self) -> None:
        if self.inbox is not None:
            self.inbox.close()
        self.outbox.close()
        for t in list(self._tasks):
            t.cancel()

    def _on_message(self, message: memoryview | bytes) -> None:
        try:
            msg, tensors = unpack(message, StageMsg)
        except SharedTensorError as exc:  # a well-formed stage whose inputs cannot be read here: its batch fails, with why
            log.warning("%s: cannot read batch %s's shared inputs: %s", self.vgpu_id, exc.header.batch_id, exc)
            self._report(StageReport(exc.header.batch_id, exc.header.stage, self.vgpu_id, error=f"SharedTensorError: {exc}"),
                         exc.header.carried)
            return
        except WireError as exc:
            log.warning("%s: dropped a malformed stage message: %s", self.vgpu_id, exc)
            return
        if msg.part is not None:
            msg, tensors = self._take_part(msg, tensors)
            if msg is None:
                return
        task = asyncio.get_running_loop().create_task(self._stage(msg, tensors or None))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def _take_part(self, msg: StageMsg, tensors: dict[str, Any]) -> tuple[StageMsg | None, dict[str, Any]]:
        """A stage-0 message with some rows of a batch's inputs: ``(message, inputs)`` once every
        row is in (the last part's message, without ``part``), else ``(None, {})``."""
        if msg.stage != 0:
            log.warning("%s: dropped stage %d of batch %s: only stage 0 comes in parts", self.vgpu_id, msg.stage, msg.batch_id)
            return None, {}
        if msg.part == (0, msg.batch):
            return msgspec.structs.replace(msg, part=None), tensors
        self._let_go_of_stale_parts()
        parts = self._parts.setdefault(msg.batch_id, _Parts())
        try:
            parts.add(msg, tensors)
        except ValueError as exc:
            log.warning("%s: dropped a part: %s", self.vgpu_id, exc)
            return None, {}
        if parts.rows < msg.batch:
            return None, {}
        del self._parts[msg.batch_id]
        return msgspec.structs.replace(parts.last, part=None), parts.joined()

    def _let_go_of_stale_parts(self) -> None:
        now = self.now_us()
        for b, parts in list(self._parts.items()):
            if parts.last is not None and now > parts.last.timing[-1].end_us + STALE_PARTS_US:
                log.warning("%s: let go of batch %s's inputs: %d of %d rows came", self.vgpu_id, b, parts.rows, parts.last.batch)
                del self._parts[b]

    async def _stage(self, msg: StageMsg, tensors: dict[str, Any] | None) -> None:
        k = msg.stage
        link = msg.links[k] if msg.links is not None else None
        try:
            result = await self.run(msg, tensors)
        except Exception as exc:
            self._report(StageReport(msg.batch_id, k, self.vgpu_id, error=f"{type(exc).__name__}: {exc}"), msg.carried)
            return
        report = result.report
        if k + 1 == len(msg.route) and msg.answers:
            self._answer(msg, result.tensors or {})
            self._report(report, msg.carried)
            return
        if k + 1 == len(msg.route) or (link is not None and link.send is not None):
            self._report(report, msg.carried, result.tensors if k + 1 == len(msg.route) else None)
            return
        tol = msg.tolerance_us
        rides_on = tol is not None and ran_as_reserved(report, msg.timing[k], tol)
        forward = msgspec.structs.replace(msg, stage=k + 1, sent_us=result.sent_us, carried=(*msg.carried, report) if rides_on else (), seals=())
        try:
            self.outbox.send(msg.addresses[k + 1], self._forward(forward, result.tensors))
            if rides_on:
                return
        except DataPathFull as exc:
            report = msgspec.structs.replace(report, error=f"DataPathFull: {exc}")
        self._report(report, msg.carried)

    def _forward(self, forward: StageMsg, tensors: dict[str, Any] | None) -> list[Any]:
        """The next stage's message: its maps in this worker's shared memory where that stage's
        worker is on this machine (:mod:`ppipe.runtime.wire.handoff`), else on the socket."""
        to = forward.addresses[forward.stage]
        if tensors and self.handoff is not None and on_this_machine(to):
            held_until = forward.timing[forward.stage].end_us + HOLD_GRACE_US
            placed = self.handoff.place(tensors, held_until, self.now_us())
            if placed is not None:
                return pack(msgspec.structs.replace(forward, seals=placed[1]), placed[0], self.handoff.arena)
        return pack(forward, tensors)

    def _answer(self, msg: StageMsg, outputs: dict[str, Any]) -> None:
        """Send each ingress its rows of the batch's outputs (views, not copies)."""
        for to in msg.answers:
            rows = slice(to.offset, to.offset + len(to.rids))
            try:
                self.outbox.send(to.address, pack(Answer(msg.batch_id, to.rids), {n: a[rows] for n, a in outputs.items()}))
            except DataPathFull:
                log.error("%s: ingress %s stopped reading; batch %s's answers to it are lost", self.vgpu_id, to.address, msg.batch_id)

    def _report(self, report: StageReport, carried: tuple[StageReport, ...], outputs: dict[str, Any] | None = None) -> None:
        """Send a report to the frontend, with the earlier stages' reports that rode on to here."""
        if carried:
            report = msgspec.structs.replace(report, carried=carried)
        try:
            self.outbox.send(self.frontend, pack(report, outputs))
        except DataPathFull:
            log.error("%s: the frontend stopped reading reports; batch %s's report is lost", self.vgpu_id, report.batch_id)
