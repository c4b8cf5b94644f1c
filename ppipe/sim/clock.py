"""Virtual time: the :class:`VirtualClock` the data plane reads, and the event loop that moves it.

Only :class:`EventLoop` moves time. Handlers change state and *return* their follow-up
events (the loop schedules them); nothing else pushes the clock forward.

The one ordering of same-time events
-------------------------------------
Events are ordered by ``(time_us, priority, seq)``: time first; at equal times by the
event's :class:`Priority` class; within a class, in the order they were scheduled (FIFO,
``seq`` is a global counter). The classes, in the order they run at equal times:

1. ``WORKER`` -- the simulated hardware: a stage's input becomes ready, a stage ends, a
   feature-map transfer ends. The physical world moves first so that the reports a
   worker sends (``Scheduler.report``) reach the scheduler before it decides anything
   else at that instant.
2. ``FAILURE`` -- a vGPU dies. Before arrivals, so that a request arriving at the same
   instant is never routed to a worker that is already dead.
3. ``ARRIVAL`` -- a request reaches the frontend. Before timers, so that a scheduler
   woken at ``t`` sees every request that arrived up to and including ``t`` (a batch
   that waited "until the last moment" counts a request that arrives at that moment).
4. ``TIMER`` -- ``Clock.call_at`` callbacks, among them the scheduler's ``WakeAt``.

``tests/sim/test_clock.py`` shows every pair of this order.
"""

from __future__ import annotations

import enum
import heapq
import math
from typing import Callable, Iterable


class Priority(enum.IntEnum):
    """Class of an event; lower runs first at equal times (see the module docstring)."""

    WORKER = 0
    FAILURE = 1
    ARRIVAL = 2
    TIMER = 3


class Event:
    """A thing that happens at ``time_us``. Subclasses set ``priority`` and implement ``handle``.

    ``handle`` changes state and returns the follow-up events (or ``None``); it never
    schedules anything itself and never moves the clock.
    """

    __slots__ = ("time_us",)
    priority: Priority = Priority.TIMER

    def __init__(self, time_us: float):
        self.time_us = time_us

    def handle(self) -> Iterable["Event"] | None:  # pragma: no cover - abstract
        raise NotImplementedError

    def __repr__(self) -> str:
        return f"{type(self).__name__}(t={self.time_us:.3f}us)"


class CallbackEvent(Event):
    """``Clock.call_at(t, fn)``: run ``fn()`` at ``t`` in the TIMER class."""

    __slots__ = ("fn",)
    priority = Priority.TIMER

    def __init__(self, time_us: float, fn: Callable[[], object]):
        super().__init__(time_us)
        self.fn = fn

    def handle(self) -> Iterable[Event] | None:
        out = self.fn()
        # A callback may return follow-up events (the simulator's own timers do); plain
        # callbacks from the data plane return None.
        return out if isinstance(out, (list, tuple)) else None


class VirtualClock:
    """The :class:`ppipe.dataplane.api.Clock` of the simulator. Read-only for everyone but the loop."""

    __slots__ = ("_now_us", "_loop")

    def __init__(self, loop: "EventLoop"):
        self._now_us = 0.0
        self._loop = loop

    def now_us(self) -> float:
        return self._now_us

    def call_at(self, t_us: float, fn: Callable[[], object]) -> CallbackEvent:
        """Run ``fn`` at ``t_us`` (or now, if ``t_us`` is in the past), in the TIMER class."""
        ev = CallbackEvent(max(float(t_us), self._now_us), fn)
        self._loop.schedule(ev)
        return ev


class EventLoop:
    """A heap of events ordered by ``(time, priority, seq)``; the only thing that moves time.

    Attributes:
        clock: the virtual clock this loop drives.
        processed: number of events handled so far.
    """

    def __init__(self) -> None:
        self._heap: list[tuple[float, int, int, Event]] = []
        self._seq = 0
        self.clock = VirtualClock(self)
        self.processed = 0

    def schedule(self, event: Event) -> None:
        """Add an event. Events in the past are refused: time never goes back."""
        t = event.time_us
        if t < self.clock._now_us:
            raise ValueError(f"{event!r} is scheduled before now ({self.clock._now_us:.3f} us)")
        if not math.isfinite(t):
            raise ValueError(f"{event!r} has a non-finite time")
        self._seq += 1
        heapq.heappush(self._heap, (t, int(event.priority), self._seq, event))

    def schedule_all(self, events: Iterable[Event] | None) -> None:
        if events:
            for ev in events:
                self.schedule(ev)

    def __len__(self) -> int:
        return len(self._heap)

    def peek_time_us(self) -> float | None:
        return self._heap[0][0] if self._heap else None

    def run(self, until_us: float = math.inf) -> int:
        """Handle events in order while the next one is at or before ``until_us``.

        Returns:
            the number of events handled by this call.
        """
        heap = self._heap
        clock = self.clock
        pop = heapq.heappop
        push = heapq.heappush
        pushpop = heapq.heappushpop
        n = 0
        # The last follow-up of a handler is not pushed at once: the next iteration pushes it
        # and pops the earliest event in one step (heappushpop). Same order as push-then-pop;
        # a follow-up due before everything queued (often one at the same instant) then
        # never enters the heap.
        pending = None
        while True:
            if pending is None:
                if not heap or heap[0][0] > until_us:
                    break
                t, _prio, _seq, ev = pop(heap)
            else:
                entry = pushpop(heap, pending) if heap else pending
                pending = None
                if entry[0] > until_us:
                    push(heap, entry)
                    break
                t, _prio, _seq, ev = entry
            clock._now_us = t
            follow = ev.handle()
            n += 1
            if follow:
                for f in follow:
                    ft = f.time_us
                    if ft < t:
                        if pending is not None:
                            push(heap, pending)
                        raise ValueError(f"{ev!r} returned {f!r}, which is in the past")
                    self._seq += 1
                    if pending is not None:
                        push(heap, pending)
                    pending = (ft, f.priority, self._seq, f)  # IntEnum: compared as int, only on time ties
        self.processed += n
        return n
