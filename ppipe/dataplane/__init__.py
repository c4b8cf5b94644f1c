"""The data plane: reservation tables, probe/reserve, adaptive batching, drop policy.

Pure logic with an injected clock (no threads, sockets, sleeping or wall-clock reads).
Entry point: :func:`build_scheduler`. Policies: ``reservation`` (the paper's §5.4,
:mod:`ppipe.dataplane.reservation`), ``reactive`` (the baseline of §7.4 without
reservations, whole-path dispatches: runs under the simulator and the runtime,
:mod:`ppipe.dataplane.reactive`) and ``reactive-pool`` (the same baseline stage by stage,
each pool batching on its own: needs a driver that takes one-stage dispatches, i.e. the
simulator, :mod:`ppipe.dataplane.reactive_pool`); add more with :func:`register_policy`.

Example (a driver's loop, here with a manual clock)::

    from ppipe.dataplane import Request, build_scheduler
    from ppipe.dataplane.testing import ManualClock

    clock = ManualClock()
    sched = build_scheduler(plan, profiles, cluster, clock, policy="reservation", max_queue=256)
    for decision in sched.submit(Request(0, "resnet", arrival_us=0.0, deadline_us=50_000.0)):
        ...  # Dispatch -> run its stages and report(StageReport) each; Drop -> answer;
             # WakeAt -> call sched.wake() then
    sched.stats()  # probes, dispatches, probes_per_dispatch, drops per reason, ...

Module map: ``api`` (the contract), ``tables`` (reservation tables, earliest_slot),
``topology`` (the plan compiled for the hot path), ``batching`` (Algorithm 1, feedback,
failures), ``reservation`` / ``reactive`` / ``reactive_pool`` (policies), ``options``,
``registry`` (build_scheduler), ``testing`` (toy worlds, a manual clock, a replay loop).
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
from ppipe.dataplane.reactive_pool import ReactivePoolScheduler
from ppipe.dataplane.registry import POLICIES, build_scheduler, register_policy
from ppipe.dataplane.reservation import ReservationScheduler
from ppipe.dataplane.tables import ReservationTable, earliest_slot

register_policy("reservation")(ReservationScheduler)
register_policy("reactive")(ReactiveScheduler)
register_policy("reactive-pool")(ReactivePoolScheduler)

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
    "ReactivePoolScheduler",
    "ReservationScheduler",
    "ReservationTable",
    "earliest_slot",
    "POLICIES",
    "build_scheduler",
    "register_policy",
]
