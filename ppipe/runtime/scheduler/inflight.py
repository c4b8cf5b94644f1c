"""What the scheduler's host keeps of requests and batches until they are answered.

A submitted request is :class:`Pending` until its one answer (outputs or a
:class:`DroppedError`); a dispatched batch is :class:`InFlight` until every stage has
reported or the batch failed, and leaves a :class:`BatchTrace` (kept for tests and
debugging when the host is asked to).
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import Any, Callable

from ppipe.dataplane.api import Dispatch, Request
from ppipe.runtime.wire.messages import StageReport as StageReportMsg


class DroppedError(Exception):
    """A request that will not be served; ``reason`` is a :class:`DropReason` value or 'timeout'/'worker-error'."""

    def __init__(self, reason: str, detail: str = ""):
        self.reason = reason
        self.detail = detail
        super().__init__(f"dropped: {reason}" + (f": {detail}" if detail else ""))


class Answer:
    """The answer slot of a request that nobody awaits here (an ingress process's): the part
    of :class:`asyncio.Future` that the host uses (``done``, ``set_result``,
    ``set_exception``, ``exception``), which hands the answer to ``on_answer`` (the error,
    or None) at once, where a future would schedule a loop callback for it.

    An ingress's requests are awaited in the ingress (the last worker answers it there);
    the scheduler only needs to forget them, or tell the ingress an error, so a future, its
    callback and the loop turn that runs it would be work per request for nothing.
    """

    __slots__ = ("_done", "_error", "_on_answer")

    def __init__(self, on_answer: Callable[[BaseException | None], None]):
        self._done, self._error, self._on_answer = False, None, on_answer

    def done(self) -> bool:
        return self._done

    def exception(self) -> BaseException | None:
        return self._error

    def set_result(self, _outputs: Any) -> None:
        self._settle(None)

    def set_exception(self, error: BaseException) -> None:
        self._settle(error)

    def _settle(self, error: BaseException | None) -> None:
        if self._done:
            raise asyncio.InvalidStateError("the request has its answer already")
        self._done, self._error = True, error
        self._on_answer(error)


@dataclass
class Pending:
    """A submitted request until its answer (its outputs or an error)."""

    request: Request
    future: asyncio.Future | Answer
    slo_deadline_us: float  # arrival + SLO (the request's deadline is earlier by the answer budget)
    dispatched: bool = False
    timer: Any = None  # its timeout (asyncio.TimerHandle; None: an ingress's, timed out by a sweep)


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

