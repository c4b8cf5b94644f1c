"""What a process of the JSON decode pool runs (:class:`~ppipe.runtime.ingress.bodies.BodyDecoder`).

The pool's processes are spawned, so each imports the module of the function it runs.
This one imports only the protocol's decoder and the heap trim, not the server (its
scheduler and data plane): a decode process starts in a fraction of the time.
"""

from __future__ import annotations

import os

from ppipe.runtime.ingress.protocol import decode_job
from ppipe.runtime.memory import trim_heap


def pool_decode_job(body: bytes, header_length: str | None):
    """:func:`decode_job` in a pool process, after giving the last job's freed memory back
    (:func:`ppipe.runtime.memory.trim_heap`: microseconds): a process that decoded one large
    body would otherwise keep that body's heap for good."""
    trim_heap()
    return decode_job(body, header_length)


def pool_process_init(server_pid: int) -> None:
    """A decode process leaves Ctrl-C to the server, which shuts the pool down in order (a
    terminal sends SIGINT to the whole process group), and ends when the server ends: a
    server killed with SIGKILL shuts nothing down, and its pool's processes would stay for
    good, blocked on their queue, holding the server's stdout."""
    import signal

    signal.signal(signal.SIGINT, signal.SIG_IGN)
    _end_with(server_pid)


def _end_with(server_pid: int) -> None:
    """SIGTERM this process when its parent ends (Linux's parent-death signal; elsewhere
    nothing), and exit now if the parent ``server_pid`` is already gone."""
    import signal
    import sys

    if not sys.platform.startswith("linux"):
        return
    import ctypes

    PR_SET_PDEATHSIG = 1
    ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)
    if os.getppid() != server_pid:  # it ended before the signal was set
        os._exit(0)
