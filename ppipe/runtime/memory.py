"""Give freed heap memory back to the system after a burst (glibc's ``malloc_trim``).

Why: a serving process allocates a buffer of each request's input (0.6 MB for ResNet-50)
and frees it when answered. glibc serves a block that large by ``mmap`` at first, but each
freed mmapped block raises its threshold (up to 32 MB), so after the first few every input
comes from the heap's arenas, and what a burst of requests in flight took stays with the
process when they are answered. Fixing the threshold instead (``mallopt(M_MMAP_THRESHOLD)``)
would return each block at once but pay its page faults on every request, on the latency
path. ``malloc_trim(0)`` returns the free pages of every arena (``MADV_DONTNEED``) in one
call, cheap when there is little to give back: called every few seconds, off any request's
path, it bounds the process's memory by what is in use, not by its largest burst
(docs/benchmarks.md, "Thirty minutes of faults", has the figures).

What it cannot give back is a page that still holds one live block, and each arena (glibc
makes up to 8 per core, one per thread that allocates while the others are busy: the
event loop, gRPC's threads, the image decoders) fragments on its own. :func:`limit_arenas`
caps them at :data:`SERVER_ARENAS`: fewer, fuller arenas hold fewer half-used pages
(``scripts/soak.py --tracemalloc`` shows that what a soak adds is native memory, not
Python objects; docs/benchmarks.md has the figures).

Elsewhere than glibc (musl, macOS) there is no ``malloc_trim``: :func:`trim_heap` does
nothing and says so once in the log.
"""

from __future__ import annotations

import asyncio
import ctypes
import ctypes.util
import logging
import time

log = logging.getLogger(__name__)

TRIM_INTERVAL_S = 5.0
SERVER_ARENAS = 2
M_ARENA_MAX = -8  # glibc's mallopt parameter


def _libc_malloc_trim():
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        return libc.malloc_trim
    except (OSError, AttributeError):
        return None


_MALLOC_TRIM = _libc_malloc_trim()


def limit_arenas(arenas: int = SERVER_ARENAS) -> bool:
    """Let glibc create at most ``arenas`` malloc arenas in this process from now on
    (``mallopt(M_ARENA_MAX)``; threads share them under their locks). False where not glibc."""
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        return bool(libc.mallopt(M_ARENA_MAX, arenas))
    except (OSError, AttributeError):
        return False


def trim_heap() -> float:
    """Return the heap's free pages to the system; the call's seconds (0 where not glibc)."""
    if _MALLOC_TRIM is None:
        return 0.0
    t0 = time.perf_counter()
    _MALLOC_TRIM(0)
    return time.perf_counter() - t0


async def trim_heap_periodically(interval_s: float = TRIM_INTERVAL_S) -> None:
    """Every ``interval_s``, :func:`trim_heap` (on the loop: it takes the allocator's locks,
    so a thread would stall the loop's allocations as long)."""
    if _MALLOC_TRIM is None:
        log.info("no malloc_trim in this C library: freed heap memory stays with the process")
        return
    while True:
        await asyncio.sleep(interval_s)
        secs = trim_heap()
        if secs > 0.005:
            log.debug("malloc_trim took %.1f ms", secs * 1e3)
