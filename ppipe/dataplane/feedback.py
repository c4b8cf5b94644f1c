"""Which stage reports the scheduler reads: the report tolerance, one rule for both drivers.

A stage that ran within ``tolerance_us`` of its reservation (its start and end, and where a
NIC transfer is reserved, that transfer's start and end) tells the reservation policy
nothing it acts on: its tables hold those times already, up to the tolerance. Its drivers
therefore feed :meth:`~ppipe.dataplane.api.Scheduler.report` only the stages that ran
outside it:

* ``ppipe serve``: a worker lets such a stage's report ride on to the next report
  (:mod:`ppipe.runtime.workers.stage_server`), and the scheduler's host keeps the reports
  within the tolerance (the last stage's too, which always comes: it holds the outputs)
  for its traces and metrics, and does not feed them to the scheduler.
* ``ppipe simulate``: its workers (feedback ``"changed"``) report only stages outside it.

So the tables are never more than the tolerance off what ran: a stage whose lateness
grows past it, from its own time or from what ran before it, reports. A batch none of
whose stages report is forgotten once its planned end has passed (the scheduler's
housekeeping), in the runtime as in the simulator.

The other policies read every report (their reports drive their late drops):
:func:`reads_every_report`.
"""

from __future__ import annotations

from typing import Any

DEFAULT_REPORT_TOLERANCE_US = 1000.0
"""``ppipe serve``'s and ``ppipe simulate``'s tolerance (``--report-tolerance-ms 1``)."""

EXACT_US = 1e-3
"""The simulator's own default (1 ns): a report that differs from the plan at all is read."""


def ran_as_reserved(report: Any, reserved: Any, tolerance_us: float) -> bool:
    """Whether a stage's reported times lie within ``tolerance_us`` of its reservation.

    ``report`` has ``start_us``, ``end_us``, ``transfer_start_us`` and ``transfer_end_us``
    (a report, or the simulator's record of the stage); ``reserved`` has ``start_us``,
    ``end_us``, ``transfer_start_us`` and ``transfer_us`` (the dispatch's
    :class:`~ppipe.dataplane.api.Stage`, or a stage message's reserved timing). The start
    and the end are compared; where a transfer into the stage is reserved
    (``transfer_start_us`` set and ``transfer_us > 0``), so are the reported transfer's
    start and end with ``transfer_start_us`` and ``transfer_start_us + transfer_us``.
    """
    if abs(report.start_us - reserved.start_us) > tolerance_us or abs(report.end_us - reserved.end_us) > tolerance_us:
        return False
    if reserved.transfer_start_us is None or not reserved.transfer_us:
        return True
    ts, te = report.transfer_start_us, report.transfer_end_us
    return (ts is not None and te is not None and abs(ts - reserved.transfer_start_us) <= tolerance_us
            and abs(te - reserved.transfer_start_us - reserved.transfer_us) <= tolerance_us)


def reads_every_report(scheduler: Any) -> bool:
    """Whether ``scheduler`` must get every stage's report: all policies but those that
    reserve every use of a dispatch (``executes_as_planned``), whose tables a report within
    the tolerance does not change."""
    return not getattr(scheduler, "executes_as_planned", False)
