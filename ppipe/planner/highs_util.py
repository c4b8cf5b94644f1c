"""One place that makes ``highspy.Highs`` objects, without HiGHS's banner on stdout.

highspy's ``Highs()`` constructor prints "Running HiGHS x.y.z (git hash ...): Copyright ..."
and a notice line to the process's stdout the first time it runs in a process, from C++
and before any option (``output_flag``) can be set. That text would land in ``ppipe plan``'s
output, in JSON/YAML written to stdout and in every benchmark. :func:`new_highs` builds the
first object with file descriptor 1 pointed at ``/dev/null`` (the C library's buffer is
flushed before stdout is given back, so nothing leaks later); HiGHS prints the banner once
per process, so later objects are built plainly.
"""

from __future__ import annotations

import ctypes
import os
import sys
import threading

_lock = threading.Lock()
_banner_done = False


def _flush_c_stdout() -> None:
    try:
        ctypes.CDLL(None).fflush(None)
    except (OSError, AttributeError, TypeError):  # no C library to reach: nothing buffered there to flush
        pass


def _construct_silenced(factory):
    """``factory()`` with the OS-level stdout sent to /dev/null while it runs."""
    try:
        sys.stdout.flush()
    except (AttributeError, ValueError):  # stdout replaced or closed: nothing of ours is buffered
        pass
    try:
        saved = os.dup(1)
    except OSError:  # no file descriptor 1 at all: nothing can be printed anyway
        return factory()
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        try:
            os.dup2(devnull, 1)
        finally:
            os.close(devnull)
        try:
            return factory()
        finally:
            _flush_c_stdout()
            os.dup2(saved, 1)
    finally:
        os.close(saved)


def new_highs():
    """A ``highspy.Highs`` with ``output_flag`` off, its banner kept off stdout."""
    import highspy

    global _banner_done
    with _lock:
        if _banner_done:
            h = highspy.Highs()
        else:
            h = _construct_silenced(highspy.Highs)
            _banner_done = True
    h.setOptionValue("output_flag", False)
    return h
