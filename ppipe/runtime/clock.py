"""The wall clock that the runtime hands to the data plane's scheduler.

The scheduler's timeline starts at 0 when the clock is made; ``now_us`` counts wall-clock
microseconds since then. Workers (other processes, maybe other hosts) stamp events with
the absolute wall time (:func:`wall_us`); :meth:`WallClock.from_wall_us` maps those stamps
onto the scheduler's timeline. Across hosts this assumes their clocks are synchronised
(NTP/PTP); a skew shows up one-to-one as an error in the feedback the scheduler gets.

The dispatch lead (a decision takes effect only when its message reaches the first
worker) is the data plane's rule, not the clock's: :mod:`ppipe.dataplane.margins`, so
that the simulator runs it too.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any, Callable


def wall_us() -> float:
    """Absolute wall time in microseconds (``time.time_ns`` based; comparable across processes)."""
    return time.time_ns() / 1e3


PRECISE_TAIL_S = 0.001
"""The last part of a timed wait that :func:`sleep_until` sleeps in the kernel, not on the loop."""


async def sleep_until(t_wall_us: float) -> None:
    """Wait until the wall clock reaches ``t_wall_us``, to a fraction of a millisecond.

    An event loop's timers have a resolution of 1 ms (epoll's timeout and libuv's clock are
    in ms) and fire late by up to that much; a worker that waits for a reserved start and
    then for an emulated inference would slip by about a millisecond per stage. So the loop
    sleeps until ``PRECISE_TAIL_S`` before the time, and a blocking ``time.sleep`` (a
    kernel timer, no spinning) takes the rest. The loop is held for at most that tail
    (about the timers' own error): what arrives meanwhile waits in the socket buffers.
    """
    left_s = (t_wall_us - wall_us()) / 1e6
    if left_s > PRECISE_TAIL_S:
        await asyncio.sleep(left_s - PRECISE_TAIL_S)
        left_s = (t_wall_us - wall_us()) / 1e6
    if left_s > 0:
        time.sleep(left_s)


async def sleep_near(t_wall_us: float) -> None:
    """Wait on the loop's timer only, until ``PRECISE_TAIL_S`` before ``t_wall_us`` (or not
    at all when that is past): one wake-up, which the timer's lateness (up to a millisecond)
    brings to about ``t_wall_us``. For a wait that a precise one follows (the emulated
    backend's, from the reserved start)."""
    left_s = (t_wall_us - wall_us()) / 1e6 - PRECISE_TAIL_S
    if left_s > 0:
        await asyncio.sleep(left_s)


class WallClock:
    """A :class:`ppipe.dataplane.api.Clock` on an asyncio event loop.

    Args:
        loop: the loop that runs the scheduler; ``call_at`` callbacks run on it. Defaults to
            the running loop.
        origin_wall_us: absolute wall time of t=0 (default: now).
    """

    def __init__(self, loop: asyncio.AbstractEventLoop | None = None, origin_wall_us: float | None = None):
        self._loop = loop or asyncio.get_running_loop()
        self.origin_wall_us = wall_us() if origin_wall_us is None else origin_wall_us

    def now_us(self) -> float:
        """Wall-clock microseconds since t=0."""
        return wall_us() - self.origin_wall_us

    def true_now_us(self) -> float:
        """The same as :meth:`now_us` (callers that mean arrivals and deadlines say so)."""
        return wall_us() - self.origin_wall_us

    def call_at(self, t_us: float, fn: Callable[[], None]) -> asyncio.TimerHandle:
        """Run ``fn`` on the loop at scheduler time ``t_us`` (at once if that has passed).

        The loop's own clock is monotonic and the timeline is wall time; the delay is
        converted, so a wall-clock step during a wait shifts one timer, not the timeline.
        """
        delay_s = max(0.0, (t_us - self.now_us()) / 1e6)
        if delay_s > 0:
            delay_s += 1e-5  # round up: a timer must not fire before t_us (asyncio may run it a tick early)
        return self._loop.call_at(self._loop.time() + delay_s, fn)

    def wall_now_us(self) -> float:
        """Absolute wall time now (:func:`wall_us`): the stamp a message to a worker carries."""
        return wall_us()

    def from_wall_us(self, t_wall_us: float) -> float:
        """A worker's absolute wall stamp on the scheduler's timeline."""
        return t_wall_us - self.origin_wall_us

    def to_wall_us(self, t_us: float) -> float:
        return t_us + self.origin_wall_us

    def __repr__(self) -> str:
        return f"WallClock(origin_wall_us={self.origin_wall_us:.0f})"


__all__: list[Any] = ["WallClock", "sleep_until", "wall_us"]
