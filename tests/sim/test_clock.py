"""The virtual clock and the one ordering of same-time events."""

from __future__ import annotations

import pytest

from ppipe.dataplane.api import Clock
from ppipe.sim.clock import Event, EventLoop, Priority


class _P(Event):
    __slots__ = ("priority", "name", "log", "follow")

    def handle(self):
        self.log.append((self.name, self.time_us))
        return list(self.follow)


def ev(t, prio, name, log, follow=()):
    e = _P.__new__(_P)
    Event.__init__(e, t)
    e.priority, e.name, e.log, e.follow = prio, name, log, follow
    return e


def test_virtual_clock_is_a_clock():
    loop = EventLoop()
    assert isinstance(loop.clock, Clock)
    assert loop.clock.now_us() == 0.0


def test_same_time_order_worker_failure_arrival_timer():
    log: list = []
    loop = EventLoop()
    # scheduled in the reverse of the order they must run in
    loop.schedule(ev(5.0, Priority.TIMER, "timer", log))
    loop.schedule(ev(5.0, Priority.ARRIVAL, "arrival", log))
    loop.schedule(ev(5.0, Priority.FAILURE, "failure", log))
    loop.schedule(ev(5.0, Priority.WORKER, "worker", log))
    loop.schedule(ev(1.0, Priority.TIMER, "early-timer", log))
    loop.run()
    assert [n for n, _ in log] == ["early-timer", "worker", "failure", "arrival", "timer"]


def test_fifo_within_a_class_and_follow_ups_join_the_order():
    log: list = []
    loop = EventLoop()
    # Arrivals (class 2) run before the timer (class 3), in the order scheduled; the
    # WORKER event the timer returns for the same instant runs right after it (time never
    # goes back, and the classes order only what is pending at once).
    loop.schedule(ev(2.0, Priority.ARRIVAL, "a1", log))
    loop.schedule(ev(2.0, Priority.ARRIVAL, "a2", log))
    loop.schedule(ev(2.0, Priority.TIMER, "t", log, follow=[ev(2.0, Priority.WORKER, "w-after-timer", log)]))
    loop.run()
    assert [n for n, _ in log] == ["a1", "a2", "t", "w-after-timer"]


def test_only_the_loop_moves_time_and_never_backwards():
    loop = EventLoop()
    seen = []
    loop.clock.call_at(10.0, lambda: seen.append(loop.clock.now_us()))
    loop.clock.call_at(3.0, lambda: seen.append(loop.clock.now_us()))
    assert loop.clock.now_us() == 0.0
    loop.run(until_us=5.0)
    assert seen == [3.0] and loop.clock.now_us() == 3.0
    loop.run()
    assert seen == [3.0, 10.0]
    # call_at in the past runs "now", never earlier
    loop.clock.call_at(1.0, lambda: seen.append(loop.clock.now_us()))
    loop.run()
    assert seen[-1] == 10.0
    with pytest.raises(ValueError, match="before now"):
        loop.schedule(ev(2.0, Priority.TIMER, "late", []))


def test_follow_up_in_the_past_is_refused():
    loop = EventLoop()
    loop.schedule(ev(5.0, Priority.WORKER, "x", [], follow=[ev(4.0, Priority.WORKER, "y", [])]))
    with pytest.raises(ValueError, match="in the past"):
        loop.run()
