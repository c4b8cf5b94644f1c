"""What the scheduler's host keeps of requests and batches until they are answered.

A submitted request is :class:`Pending` until its one answer (outputs or a
:class:`DroppedError`); a dispatched batch is :class:`InFlight` until every stage has
reported or the batch failed, and leaves a :class:`BatchTrace` (kept for tests and
debugging when the host is asked to).
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import Any

from ppipe.dataplane.api import Dispatch, Request
from ppipe.runtime.wire.messages import StageReport as StageReportMsg


class DroppedError(Exception):
    """A request that will not be served; ``reason`` is a :class:`DropReason` value or 'timeout'/'worker-error'."""

    def __init__(self, reason: str, detail: str = ""):
        self.reason = reason
        self.detail = detail
        super().__init__(f"dropped: {reason}" + (f": {detail}" if detail else ""))


@dataclass
class Pending:
    """A submitted request until its answer (its outputs or an error)."""

    request: Request
    future: asyncio.Future
    slo_deadline_us: float  # arrival + SLO (the request's deadline is earlier by the answer budget)
    dispatched: bool = False
    timer: Any = None  # its timeout (asyncio.TimerHandle)


@dataclass
class BatchTrace:
    """What happened to one dispatched batch (kept for tests and debugging)."""

    batch_id: int
    model: str
    route: list[str]
    request_ids: list[int]
    dispatched_us: float = 0.0
    reports: list[StageReportMsg] = field(default_factory=list)  # in stage order
    reserved_us: list[tuple[float, float]] = field(default_factory=list)  # per stage: reserved (start, end), scheduler time
    arrivals_us: list[float] = field(default_factory=list)  # its requests' arrivals (true timeline)
    answered_us: float | None = None  # when the last stage's report was taken (true timeline)
    error: str | None = None


@dataclass
class InFlight:
    """A dispatched batch until its last report or its failure."""

    d: Dispatch
    trace: BatchTrace | None  # None where the runtime keeps no traces
    route: list[str]
    next_stage: int = 0  # every stage before it has ended (its report, or a later stage's, arrived)
    unreported: set[int] = field(default_factory=set)

    def __post_init__(self) -> None:
        self.unreported = set(range(len(self.route)))

