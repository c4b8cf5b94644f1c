"""The clock a worker stamps its stages with and waits on: wall time by default, injectable.

A worker reads time for two things: the stamps of its stage reports (received, start, end,
a transfer's end) and the waits before a stage (its reserved start, an emulated latency or
NIC transfer). Both go through one :class:`StageClock`, so a test can hand the worker a
clock of its own (one that jumps to the time a wait asks for, say) and check the stamps a
stage reports without sleeping, and an in-process rehearsal could run on a clock other than
the host's.
"""

from __future__ import annotations

from typing import Protocol

from ppipe.runtime.clock import sleep_near, sleep_until, wall_us


class StageClock(Protocol):
    """Wall-clock microseconds (``now_us``), a wait until such a time (``sleep_until``), and a
    wait until about that time, within a loop timer's error of it (``sleep_near``: for a
    wait that a precise one follows).

    The stamps are absolute wall time, comparable across processes, because the host maps
    them onto its scheduler's timeline (:meth:`ppipe.runtime.clock.WallClock.from_wall_us`).
    """

    def now_us(self) -> float: ...

    async def sleep_until(self, t_us: float) -> None: ...

    async def sleep_near(self, t_us: float) -> None: ...


class WallStageClock:
    """The real clock: :func:`ppipe.runtime.clock.wall_us`, :func:`ppipe.runtime.clock.sleep_until`
    (a loop timer, then a kernel sleep for the last millisecond) and
    :func:`ppipe.runtime.clock.sleep_near` (the loop timer alone)."""

    now_us = staticmethod(wall_us)
    sleep_until = staticmethod(sleep_until)
    sleep_near = staticmethod(sleep_near)

    def __repr__(self) -> str:
        return "WallStageClock()"


WALL_CLOCK = WallStageClock()
"""The clock of a worker that is given none."""
