"""The data plane's contract with its two drivers: the simulator and the runtime.

The scheduler is pure logic: it reads time from an injected :class:`Clock`, takes events
(a request arrived, a timer fired, a worker reported, a worker died) and returns
*decisions* (:class:`Dispatch`, :class:`Drop`, :class:`WakeAt`). It never sleeps, never
does I/O and never calls ``time.time()``. The simulator turns decisions into events under
a virtual clock; the runtime turns them into data-path messages under the wall clock.
Both use the same scheduler objects (docs/architecture.md, "The one-scheduler rule": the
scheduler that the simulator runs is the scheduler that `ppipe serve` runs).

Units: every time is in microseconds (``*_us``), on the clock's time line.

Driver contract (what the simulator and the runtime do with the decisions):

* ``Dispatch``: run the batch along ``stages`` in order. A stage's planned times are the
  scheduler's view; a faithful driver starts a stage at the latest of its planned start,
  the arrival of its input, and the moment its vGPU (and, for a transfer, the sender's
  uplink and the receiver's downlink) is free, serving each resource in order. Policies
  that do not reserve NICs (``reactive``) rely on the driver to model NIC contention.
  Same-server transfers (sender and receiver on one server) use no NIC.
* After each stage, call ``report(StageReport)`` with its real start/end (and, for stages
  after the first, the real transfer start/end into it); the scheduler corrects its tables.
* ``Drop``: answer the request with the reason. A Drop may name a request of a batch that
  is already in flight (``WORKER_FAILED`` after ``mark_failed``; ``DEADLINE_UNREACHABLE``
  from the reactive policy's late drops): the driver must not count that request as
  served; for ``WORKER_FAILED`` the batch cannot complete: the driver may cancel its
  remaining stages (the scheduler has released the reservations from the dead worker's
  stage on, and keeps those of earlier stages, which a driver may still run).
* A policy whose ``partial_dispatches`` attribute is true (``reactive-pool``) sends
  one-stage dispatches: a request then goes through several dispatches, one per
  partition, and waits where its last stage ran. A driver that runs whole paths only
  must refuse such a policy.
* A policy whose ``executes_as_planned`` attribute is true (``reservation``) reserves
  every vGPU and NIC use of a dispatch, never overlapping another: a faithful driver whose
  stages take exactly their planned latencies then runs every stage and transfer exactly
  at its planned times, and no report differs from the plan. (The simulator relies on it
  to skip simulating such stages one by one when there is no jitter.)
* ``WakeAt(t)``: call ``wake()`` at ``t``. Stale timers are harmless (``wake()`` does
  nothing for models that are not due).
* ``build_scheduler(...)`` returns an object that also has ``stats()`` (counters: probe()
  calls, dispatches, probes per dispatch, waits, drops per reason, corrections).
"""

from __future__ import annotations

import enum
from dataclasses import MISSING, dataclass, field, fields
from typing import Any, Callable, Protocol, Sequence, Union, runtime_checkable


def _record(cls):
    """``@dataclass(frozen=True)`` with a cheaper constructor (the same signature and fields).

    A frozen dataclass's generated ``__init__`` sets every field through
    ``object.__setattr__``, one call per field; these records are built several times per
    request on the simulator's and the runtime's hot paths (a 9-field Stage took ~4 us).
    This ``__init__`` stores straight into the instance dict (~1.0 us); equality, hashing,
    repr, immutability and pickling are the dataclass's own.
    """
    cls = dataclass(frozen=True)(cls)
    ns: dict[str, Any] = {}
    params = []
    for f in fields(cls):
        if f.default is not MISSING:
            ns[f"_d_{f.name}"] = f.default
            params.append(f"{f.name}=_d_{f.name}")
        elif f.default_factory is not MISSING:  # pragma: no cover - none of the records has one
            raise TypeError(f"{cls.__name__}.{f.name}: default factories are not supported")
        else:
            params.append(f.name)
    body = "".join(f"\n    d[{f.name!r}] = {f.name}" for f in fields(cls))
    exec(f"def __init__(self, {', '.join(params)}):\n    d = self.__dict__{body}\n", ns)
    init = ns["__init__"]
    init.__qualname__ = f"{cls.__qualname__}.__init__"
    init.__doc__ = cls.__init__.__doc__
    cls.__init__ = init
    return cls


@runtime_checkable
class Clock(Protocol):
    """Time source for the data plane. ``call_at`` is used by drivers to honour WakeAt."""

    def now_us(self) -> float: ...

    def call_at(self, t_us: float, fn: Callable[[], None]) -> Any: ...


class DropReason(str, enum.Enum):
    """Why a request was dropped. Every dropped request carries one."""

    DEADLINE_UNREACHABLE = "deadline-unreachable"  # even batch 1 on the best path finishes too late
    WORKER_FAILED = "worker-failed"  # a worker on its path died while it was in flight
    NO_PIPELINE = "no-pipeline"  # the model has no live pipeline (all its workers failed)
    QUEUE_FULL = "queue-full"  # admission control: the model's queue is at its bound
    UNKNOWN_MODEL = "unknown-model"


@_record
class Request:
    """One inference request as the scheduler sees it."""

    id: int
    model: str
    arrival_us: float
    deadline_us: float
    payload: Any = field(default=None, compare=False, repr=False)  # runtime: input tensor; sim: None


ResourceId = str
"""``"vgpu:<server>/gpu<i>/s<j>"``, ``"up:<server>"`` (NIC uplink) or ``"down:<server>"``."""


def vgpu_resource(vgpu_id: str) -> ResourceId:
    return f"vgpu:{vgpu_id}"


def uplink(server: str) -> ResourceId:
    return f"up:{server}"


def downlink(server: str) -> ResourceId:
    return f"down:{server}"


@_record
class Reservation:
    """A planned busy interval of one resource."""

    resource: ResourceId
    start_us: float
    duration_us: float

    @property
    def end_us(self) -> float:
        return self.start_us + self.duration_us


@_record
class Stage:
    """One partition of a dispatched batch: where and when it runs."""

    partition: int  # index in the pipeline
    vgpu_id: str  # VgpuPlacement.vgpu_id
    server: str
    first_block: int
    last_block: int
    transfer_start_us: float | None  # feature map into this stage (None for the first)
    transfer_us: float
    start_us: float  # planned inference start
    infer_us: float  # planned inference duration

    @property
    def end_us(self) -> float:
        return self.start_us + self.infer_us


@_record
class Dispatch:
    """Run ``requests`` as one batch along ``stages``; resources are already reserved."""

    batch_id: int
    model: str
    pipeline: int
    requests: tuple[Request, ...]
    stages: tuple[Stage, ...]
    reservations: Sequence[Reservation]  # a tuple (or the scheduler's ReservationList, which builds it on first use)

    @property
    def batch(self) -> int:
        return len(self.requests)

    @property
    def finish_us(self) -> float:
        return self.stages[-1].end_us


@_record
class Drop:
    """The request will not be served; the driver must answer it with ``reason``."""

    request: Request
    reason: DropReason
    detail: str = ""


@_record
class WakeAt:
    """Call :meth:`Scheduler.wake` at ``t_us`` (or earlier if another event comes)."""

    t_us: float


Decision = Union[Dispatch, Drop, WakeAt]


@_record
class StageReport:
    """A worker's report of what really happened to one stage of a batch."""

    batch_id: int
    partition: int
    vgpu_id: str
    start_us: float
    end_us: float
    transfer_start_us: float | None = None
    transfer_end_us: float | None = None


class Scheduler(Protocol):
    """What the simulator and the runtime drive. Implementations live in this package.

    Every method returns the decisions it took, in the order the driver must apply them.
    """

    def submit(self, request: Request) -> list[Decision]: ...

    def wake(self) -> list[Decision]: ...

    def report(self, report: StageReport) -> list[Decision]: ...

    def mark_failed(self, vgpu_id: str) -> list[Decision]: ...

    def mark_recovered(self, vgpu_id: str) -> list[Decision]: ...

    # optional: ``withdraw(request_ids)`` takes queued requests back (the driver answers them)
