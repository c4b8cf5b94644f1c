"""The data plane: reservation tables, probe/reserve, adaptive batching, drop policy.

Pure logic with an injected clock (no threads, sockets, sleeping or wall-clock reads).
Entry point: :func:`build_scheduler`. Policies: ``reservation`` (the paper's §5.4,
:mod:`ppipe.dataplane.reservation`) and ``reactive`` (the per-pool baseline of §7.4,
:mod:`ppipe.dataplane.reactive`); add more with :func:`register_policy`.
"""

from ppipe.dataplane.api import (
    Clock,
    Decision,
    Dispatch,
    Drop,
    DropReason,
    Request,
    Reservation,
    Scheduler,
    Stage,
    StageReport,
    WakeAt,
)
from ppipe.dataplane.batching import BatchingScheduler, ProbeResult
from ppipe.dataplane.options import SchedulerOptions
from ppipe.dataplane.reactive import ReactiveScheduler
from ppipe.dataplane.registry import POLICIES, build_scheduler, register_policy
from ppipe.dataplane.reservation import ReservationScheduler
from ppipe.dataplane.tables import ReservationTable, earliest_slot

register_policy("reservation")(ReservationScheduler)
register_policy("reactive")(ReactiveScheduler)

__all__ = [
    "Clock",
    "Decision",
    "Dispatch",
    "Drop",
    "DropReason",
    "Request",
    "Reservation",
    "Scheduler",
    "Stage",
    "StageReport",
    "WakeAt",
    "BatchingScheduler",
    "ProbeResult",
    "SchedulerOptions",
    "ReactiveScheduler",
    "ReservationScheduler",
    "ReservationTable",
    "earliest_slot",
    "POLICIES",
    "build_scheduler",
    "register_policy",
]
