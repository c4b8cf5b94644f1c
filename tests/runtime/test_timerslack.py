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
def test_the_bench_sends_its_arrivals_from_a_tightened_thread():
    """`ppipe bench`'s open loop waits for each arrival on a serving thread's slack: its lag counts as latency."""
    import asyncio

    import numpy as np

    from ppipe.runtime.client.bench import _send_open_loop, _Tally

    class Answers:
        errors = ()

        async def post(self):
            return 200, {}

    def run():
        assert tighten_timer_slack(50_000)
        tally = _Tally(100.0, None)
        asyncio.run(_send_open_loop(np.array([0.0, 500.0, 1000.0]), Answers(), tally))
        return timer_slack_ns(), tally.ok

    assert _in_a_thread(run) == (SERVING_TIMER_SLACK_NS, 3)
