"""A serving thread's timer slack: how late the kernel may end its timed waits.

Linux may end a thread's timed wait (``nanosleep``, an ``epoll_wait`` timeout) up to the
thread's *timer slack* after the time asked, 50 us by default, so that wake-ups coalesce.
A serving process waits on timers all the time: a worker for a batch's reserved start and
for the end of an emulated stage, the scheduler's host for the data plane's wake-ups. Each
such wait then ends up to the slack late, on top of the wake-up's own latency, and the
stages of a pipeline add those delays up: stage k+1 starts after stage k's late end, so a
route of n stages, with two waits each, slips by up to ``2 n`` slacks per batch, and every
batch reserved behind it on the same vGPUs slips with it.

:func:`tighten_timer_slack` sets the calling thread's slack to :data:`SERVING_TIMER_SLACK_NS`
(``prctl(PR_SET_TIMERSLACK)``); threads it starts afterwards inherit it, so a process
calls it on its serving thread before it starts others. Elsewhere than Linux it does nothing.
"""

from __future__ import annotations

import ctypes
import functools
import sys

SERVING_TIMER_SLACK_NS = 1_000
"""The timer slack of a serving thread (ns): a microsecond, against the kernel's default of 50 us."""

_PR_SET_TIMERSLACK, _PR_GET_TIMERSLACK = 29, 30  # <linux/prctl.h>


@functools.cache
def _prctl():
    """libc's ``prctl`` (Linux), or None; looked up once per process."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        fn = ctypes.CDLL(None, use_errno=True).prctl  # this process's symbols, libc's among them
    except (OSError, AttributeError):
        return None
    fn.restype = ctypes.c_long
    return fn


def tighten_timer_slack(slack_ns: int = SERVING_TIMER_SLACK_NS) -> bool:
    """Set this thread's timer slack to ``slack_ns``; False where the system has no such setting."""
    prctl = _prctl()
    return prctl is not None and prctl(_PR_SET_TIMERSLACK, ctypes.c_ulong(slack_ns), 0, 0, 0) == 0


def timer_slack_ns() -> int | None:
    """This thread's timer slack (ns), as the kernel reports it; None where it does not."""
    prctl = _prctl()
    if prctl is None:
        return None
    value = prctl(_PR_GET_TIMERSLACK, 0, 0, 0, 0)
    return None if value < 0 else int(value)
