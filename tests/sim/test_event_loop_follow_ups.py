"""The event loop's fast path for follow-ups keeps the one ordering of events.

The loop holds a handler's last follow-up back and pushes it together with the next pop
(heappushpop). These cases pin that this is invisible: FIFO within a class at one
instant, classes in order, the ``until_us`` boundary, and timers a handler sets itself.
"""

from __future__ import annotations

from ppipe.sim.clock import Event, EventLoop, Priority


class _E(Event):
    __slots__ = ("priority", "name", "log", "follow", "also")

    def handle(self):
        self.log.append((self.name, self.time_us))
        if self.also:
            self.also()
        return list(self.follow)


def ev(t, prio, name, log, follow=(), also=None):
    e = _E.__new__(_E)
    Event.__init__(e, t)
    e.priority, e.name, e.log, e.follow, e.also = prio, name, log, follow, also
    return e


def names(log):
    return [n for n, _ in log]


def test_follow_ups_at_the_same_instant_queue_behind_what_is_already_there():
    log: list = []
    loop = EventLoop()
    x = ev(1.0, Priority.WORKER, "x", log)
    y = ev(1.0, Priority.ARRIVAL, "y", log)
    loop.schedule(ev(1.0, Priority.WORKER, "w1", log, follow=[y, x]))
    loop.schedule(ev(1.0, Priority.WORKER, "w2", log))
    loop.schedule(ev(1.0, Priority.ARRIVAL, "a", log))
    loop.run()
    # w2 was queued before x; y (an arrival) after a; x (a worker event) before both arrivals
    assert names(log) == ["w1", "w2", "x", "a", "y"]


def test_a_follow_up_due_first_runs_next_and_later_ones_wait_their_turn():
    log: list = []
    loop = EventLoop()
    loop.schedule(ev(1.0, Priority.TIMER, "t1", log, follow=[ev(3.0, Priority.TIMER, "late", log), ev(1.5, Priority.TIMER, "soon", log)]))
    loop.schedule(ev(2.0, Priority.TIMER, "t2", log))
    loop.run()
    assert log == [("t1", 1.0), ("soon", 1.5), ("t2", 2.0), ("late", 3.0)]


def test_a_follow_up_past_the_horizon_stays_queued_for_the_next_run():
    log: list = []
    loop = EventLoop()
    loop.schedule(ev(4.0, Priority.WORKER, "e", log, follow=[ev(6.0, Priority.WORKER, "f", log)]))
    assert loop.run(until_us=5.0) == 1
    assert names(log) == ["e"] and len(loop) == 1 and loop.peek_time_us() == 6.0
    assert loop.clock.now_us() == 4.0
    assert loop.run() == 1
    assert names(log) == ["e", "f"] and len(loop) == 0 and loop.processed == 2


def test_a_timer_set_inside_a_handler_runs_before_the_follow_ups_it_returns():
    log: list = []
    loop = EventLoop()

    def set_timer():
        loop.clock.call_at(2.0, lambda: log.append(("timer", loop.clock.now_us())))

    loop.schedule(ev(2.0, Priority.TIMER, "h", log, follow=[ev(2.0, Priority.TIMER, "f", log)], also=set_timer))
    loop.run()
    assert names(log) == ["h", "timer", "f"]  # scheduled first (during the handler), runs first
