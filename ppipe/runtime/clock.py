"""The wall clock that the runtime hands to the data plane's scheduler.

The scheduler's timeline starts at 0 when the clock is made; ``now_us`` counts wall-clock
microseconds since then. Workers (other processes, maybe other hosts) stamp events with
the absolute wall time (:func:`wall_us`); :meth:`WallClock.from_wall_us` maps those stamps
onto the scheduler's timeline. Across hosts this assumes their clocks are synchronised
(NTP/PTP); a skew shows up one-to-one as an error in the feedback the scheduler gets.

**Dispatch lead.** A decision takes effect only when its message reaches the first worker
and that worker wakes up: on a busy host, up to a few ms later. A scheduler that reserves
a vGPU from "now"
therefore starts every batch late, and at high load, where reservations sit back to back,
the lateness cascades. With ``lead_us`` the clock tells the scheduler that it is
``lead_us`` later than it is: every reservation starts no sooner than the message can arrive,
and timers fire ``lead_us`` early on the wall clock (so a batch that waits still leaves in
time). Request arrivals, deadlines and the workers' reports stay on the true timeline
(:meth:`WallClock.true_now_us`, :meth:`WallClock.from_wall_us`), so the lead never loosens
an SLO; it only makes the plan of each decision start later. The simulator's clock has
no lead: its decisions take effect at once.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any, Callable


def wall_us() -> float:
    """Absolute wall time in microseconds (``time.time_ns`` based; comparable across processes)."""
    return time.time_ns() / 1e3


class WallClock:
    """A :class:`ppipe.dataplane.api.Clock` on an asyncio event loop.

    Args:
        loop: the loop that runs the scheduler; ``call_at`` callbacks run on it. Defaults to
            the running loop.
        origin_wall_us: absolute wall time of t=0 (default: now).
        lead_us: the dispatch lead (see the module's docstring); 0 = the true time.
    """

    def __init__(self, loop: asyncio.AbstractEventLoop | None = None, origin_wall_us: float | None = None, lead_us: float = 0.0):
        if lead_us < 0:
            raise ValueError(f"lead_us must be >= 0, got {lead_us}")
        self._loop = loop or asyncio.get_running_loop()
        self.origin_wall_us = wall_us() if origin_wall_us is None else origin_wall_us
        self.lead_us = lead_us

    def now_us(self) -> float:
        """The scheduler's "now": the true time plus the dispatch lead."""
        return wall_us() - self.origin_wall_us + self.lead_us

    def true_now_us(self) -> float:
        """The true time on the scheduler's timeline (arrivals, deadlines)."""
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

    def from_wall_us(self, t_wall_us: float) -> float:
        """A worker's absolute wall stamp on the scheduler's timeline."""
        return t_wall_us - self.origin_wall_us

    def to_wall_us(self, t_us: float) -> float:
        return t_us + self.origin_wall_us

    def __repr__(self) -> str:
        return f"WallClock(origin_wall_us={self.origin_wall_us:.0f}, lead_us={self.lead_us:g})"


__all__: list[Any] = ["WallClock", "wall_us"]
