"""A serving thread's timer slack (:mod:`ppipe.runtime.timerslack`)."""

from __future__ import annotations

import sys
import threading

import pytest

from ppipe.runtime.timerslack import SERVING_TIMER_SLACK_NS, tighten_timer_slack, timer_slack_ns

linux_only = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="timer slack is a Linux setting")


def _in_a_thread(fn):
    """``fn()``'s result, run in a thread of its own (the setting is per thread: the test's stays as it was)."""
    out = []
    t = threading.Thread(target=lambda: out.append(fn()))
    t.start()
    t.join()
    return out[0]


@linux_only
def test_a_thread_tightened_waits_on_a_microsecond_and_the_threads_it_starts_inherit_it():
    def tightened():
        assert tighten_timer_slack(50_000)  # the kernel's default (another test may have tightened this process's)
        before = timer_slack_ns()
        ok = tighten_timer_slack()
        return before, ok, timer_slack_ns(), _in_a_thread(timer_slack_ns)

    before, ok, after, child = _in_a_thread(tightened)
    assert before == 50_000
    assert ok and after == child == SERVING_TIMER_SLACK_NS


@linux_only
def test_the_bench_times_its_arrivals_on_a_tightened_thread_of_their_own():
    """`ppipe bench`'s arrivals are timed on their own thread at a serving thread's slack
    (its lag counts as latency), in order, each not before its time; the loop's thread is
    left as it was."""
    import asyncio
    import threading
    import time

    import numpy as np

    from ppipe.runtime.client.bench import _send_open_loop, _tick_arrivals, _Tally

    fired = []

    def fire(t):
        fired.append((t, time.perf_counter(), timer_slack_ns()))

    t0 = time.perf_counter() + 0.01
    _in_a_thread(lambda: _tick_arrivals(np.array([0.0, 2000.0, 4000.0]), t0, fire, threading.Event()))
    assert [f[0] for f in fired] == [t0, t0 + 0.002, t0 + 0.004, None]
    assert all(at >= t for t, at, _ in fired[:3])
    assert {slack for _, _, slack in fired} == {SERVING_TIMER_SLACK_NS}

    class Answers:
        errors = ()

        async def post(self):
            return 200, {}

    def run():
        assert tighten_timer_slack(50_000)
        tally = _Tally(100.0, None)
        asyncio.run(_send_open_loop(np.array([0.0, 500.0, 1000.0]), Answers(), tally))
        return timer_slack_ns(), tally.ok

    assert _in_a_thread(run) == (50_000, 3)


@linux_only
def test_a_stopped_ticker_fires_nothing_more():
    import threading
    import time

    import numpy as np

    from ppipe.runtime.client.bench import _tick_arrivals

    stop = threading.Event()
    stop.set()
    fired = []
    _tick_arrivals(np.array([0.0, 1e6]), time.perf_counter() + 0.5, fired.append, stop)
    assert fired == []
