"""What the simulator records: one :class:`RequestRecord` per request, one :class:`BatchRecord` per batch.

Every request ends in exactly one :class:`Outcome`: completed on time, completed late,
dropped (with a :class:`~ppipe.dataplane.api.DropReason`, a detail and *where*: in the
queue or after which stage), or unfinished (still pending when the simulation's drain
horizon passed -- only a scheduler that forgets a request can produce that).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field


class Outcome(str, enum.Enum):
    OK = "ok"
    LATE = "late"
    DROPPED = "dropped"
    UNFINISHED = "unfinished"


QUEUE = "queue"
"""``RequestRecord.drop_where`` of a request dropped before any of its stages ran."""


@dataclass(slots=True)
class StageRun:
    """What really happened to one stage of a batch (the simulated worker's view)."""

    partition: int
    vgpu_id: str
    server: str
    planned_start_us: float
    planned_infer_us: float
    start_us: float = -1.0
    end_us: float = -1.0
    transfer_start_us: float | None = None
    transfer_end_us: float | None = None


@dataclass(slots=True)
class BatchRecord:
    batch_id: int
    model: str
    pipeline: int
    request_ids: tuple[int, ...]
    dispatch_us: float
    stages: list[StageRun] = field(default_factory=list)

    @property
    def batch(self) -> int:
        return len(self.request_ids)


@dataclass(slots=True)
class RequestRecord:
    """The life of one request. Times in us on the simulation's time line (-1 = never)."""

    id: int
    model: str
    arrival_us: float
    deadline_us: float
    dispatch_us: float = -1.0
    batch_ids: list[int] = field(default_factory=list)
    completion_us: float = -1.0
    drop_reason: str | None = None
    drop_where: str | None = None
    drop_detail: str = ""

    @property
    def outcome(self) -> Outcome:
        if self.drop_reason is not None:
            return Outcome.DROPPED
        if self.completion_us < 0:
            return Outcome.UNFINISHED
        return Outcome.OK if self.completion_us <= self.deadline_us else Outcome.LATE

    @property
    def latency_us(self) -> float | None:
        return self.completion_us - self.arrival_us if self.completion_us >= 0 and self.drop_reason is None else None


RECORD_COLUMNS = (
    "id", "model", "arrival_us", "deadline_us", "dispatch_us", "completion_us", "outcome", "latency_us",
    "drop_reason", "drop_where", "drop_detail", "batch_ids", "stages",
)


def write_records_csv(path, records, batches) -> None:
    """One row per request; ``stages`` = ``partition@vgpu:start-end`` per stage run, ``;``-separated.

    A request in several batches (a policy that dispatches stage by stage) lists every
    batch and every stage it went through.
    """
    import csv
    from pathlib import Path

    by_id = {b.batch_id: b for b in batches}
    with Path(path).open("w", newline="") as fh:
        w = csv.writer(fh)
        w.writerow(RECORD_COLUMNS)
        for r in records:
            stages = []
            for bid in r.batch_ids:
                b = by_id.get(bid)
                for st in b.stages if b else ():
                    if st.start_us >= 0:
                        stages.append(f"{st.partition}@{st.vgpu_id}:{st.start_us:.3f}-{st.end_us:.3f}")
            lat = r.latency_us
            w.writerow([
                r.id, r.model, f"{r.arrival_us:.3f}", f"{r.deadline_us:.3f}",
                f"{r.dispatch_us:.3f}" if r.dispatch_us >= 0 else "", f"{r.completion_us:.3f}" if r.completion_us >= 0 else "",
                r.outcome.value, f"{lat:.3f}" if lat is not None else "", r.drop_reason or "", r.drop_where or "",
                r.drop_detail, ";".join(map(str, r.batch_ids)), ";".join(stages),
            ])
