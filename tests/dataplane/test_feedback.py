"""The report tolerance (ppipe.dataplane.feedback): which stage reports the scheduler reads,
the same rule in the runtime's host and the simulator's workers."""

from __future__ import annotations

from ppipe.dataplane.api import Stage, StageReport
from ppipe.dataplane.feedback import ran_as_reserved, reads_every_report
from ppipe.dataplane.reservation import ReservationScheduler


def _stage(transfer_start_us, transfer_us):
    return Stage(1, "v", "s", 0, 1, transfer_start_us, transfer_us, 1000.0, 1000.0)


def test_ran_as_reserved_compares_start_end_and_a_reserved_transfer_within_the_tolerance():
    rep = StageReport(1, 1, "v", 1000.0, 2000.0, 500.0, 900.0)
    assert ran_as_reserved(rep, Stage(1, "v", "s", 0, 1, None, 0.0, 1000.5, 999.0), 1.0)  # no transfer reserved: not compared
    assert not ran_as_reserved(rep, Stage(1, "v", "s", 0, 1, None, 0.0, 1002.0, 998.0), 1.0)  # started 2 us early
    assert not ran_as_reserved(rep, Stage(1, "v", "s", 0, 1, None, 0.0, 1000.0, 998.0), 1.0)  # ended 2 us late
    assert ran_as_reserved(rep, _stage(500.0, 400.0), 1.0)
    assert not ran_as_reserved(rep, _stage(500.0, 300.0), 1.0)  # the transfer ended 100 us late
    assert ran_as_reserved(rep, _stage(500.0, 300.0), 100.0)
    assert not ran_as_reserved(StageReport(1, 1, "v", 1000.0, 2000.0), _stage(500.0, 400.0), 1.0)  # a reserved transfer not reported


def test_only_a_policy_that_reserves_every_use_skips_reports():
    from ppipe.dataplane.reactive import ReactiveScheduler

    assert not reads_every_report(ReservationScheduler)
    assert reads_every_report(ReactiveScheduler)
