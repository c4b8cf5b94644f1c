"""A worker's end of the data path: run each stage message, forward the output, report.

A :class:`~ppipe.runtime.wire.messages.StageMsg` names the whole reserved route and its
workers' addresses, so after stage k the output goes to ``addresses[k+1]`` as stage k+1's
message without asking anyone, unless that edge is NCCL or a ring (then the frontend has
posted stage k+1 itself and the tensors go over the edge).

The report (the stage's wall-clock stamps, with the model's outputs after the last stage,
or ``error`` when the stage failed) goes to the frontend at once, or rides on: with a
``tolerance_us`` in the message, a stage that ran as reserved -- start, end and NIC
transfer each within the tolerance of its reservation
(:func:`~ppipe.runtime.wire.messages.ran_as_reserved`) -- adds its report to the next
stage message's ``carried`` instead, and the next report that goes to the frontend (the
last stage's, a late stage's or a failed one's, or the one before an NCCL edge) takes the
list along. A stage's report tells the scheduler something only where reality left the
reservation, so the common batch costs the frontend one report message instead of one per
stage, and each worker but the last one send instead of two.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass
from typing import Any, Awaitable, Callable, Iterable

import msgspec

from ppipe.runtime.wire.datapath import LOOPBACK, DataPathFull, Inbox, Outbox, is_loopback_address, node_host
from ppipe.runtime.wire.frames import WireError, pack, unpack
from ppipe.runtime.wire.messages import StageMsg, StageReport, ran_as_reserved

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

    def __init__(self, vgpu_id: str, run: StageRunner, secret: bytes | None = None):
        self.vgpu_id, self.run, self.secret = vgpu_id, run, secret
        self.inbox: Inbox | None = None
        self.outbox = Outbox(secret)
        self.frontend: str | None = None
        self._tasks: set[asyncio.Task] = set()

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
        except WireError as exc:
            log.warning("%s: dropped a malformed stage message: %s", self.vgpu_id, exc)
            return
        task = asyncio.get_running_loop().create_task(self._stage(msg, tensors or None))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _stage(self, msg: StageMsg, tensors: dict[str, Any] | None) -> None:
        k = msg.stage
        link = msg.links[k] if msg.links is not None else None
        try:
            result = await self.run(msg, tensors)
        except Exception as exc:
            self._report(StageReport(msg.batch_id, k, self.vgpu_id, error=f"{type(exc).__name__}: {exc}"), msg.carried)
            return
        report = result.report
        if k + 1 == len(msg.route) or (link is not None and link.send is not None):
            self._report(report, msg.carried, result.tensors if k + 1 == len(msg.route) else None)
            return
        tol = msg.tolerance_us
        rides_on = tol is not None and ran_as_reserved(report, msg.timing[k], tol)
        forward = msgspec.structs.replace(msg, stage=k + 1, sent_us=result.sent_us, carried=(*msg.carried, report) if rides_on else ())
        try:
            self.outbox.send(msg.addresses[k + 1], pack(forward, result.tensors))
            if rides_on:
                return
        except DataPathFull as exc:
            report = msgspec.structs.replace(report, error=f"DataPathFull: {exc}")
        self._report(report, msg.carried)

    def _report(self, report: StageReport, carried: tuple[StageReport, ...], outputs: dict[str, Any] | None = None) -> None:
        """Send a report to the frontend, with the earlier stages' reports that rode on to here."""
        if carried:
            report = msgspec.structs.replace(report, carried=carried)
        try:
            self.outbox.send(self.frontend, pack(report, outputs))
        except DataPathFull:
            log.error("%s: the frontend stopped reading reports; batch %s's report is lost", self.vgpu_id, report.batch_id)
