"""The allocator of a serving process: large blocks from the heap, freed pages given back on a timer.

Why: a serving process allocates a buffer for each request's input (0.6 MB for ResNet-50,
12.8 MB for atss) and each feature map, and frees it when the request moves on. glibc
serves a block above its mmap threshold (128 KiB at first) by a fresh ``mmap``, whose
pages fault in one by one as they are written (a fault per 4 KiB page, dear on a VM), and
returns it with ``munmap`` when freed.
Its dynamic rule raises the threshold after such a free, but it also gives the heap's top
back to the system whenever more than the trim threshold lies free there, so a process
whose buffers come and go keeps faulting. :func:`keep_large_blocks_in_heap` fixes the
mmap threshold at 32 MiB (glibc's ceiling on 64-bit) and the trim threshold far above it:
every buffer a plan sends comes from the arenas and reuses their pages, with no fault and
no system call. What that would keep after a burst is given back by :func:`trim_heap`:
``malloc_trim(0)`` returns the free pages of every arena (``MADV_DONTNEED``) in one call,
cheap when there is little to give back; called every few seconds, off any request's path
(:func:`trim_heap_periodically`), it bounds the process's memory by what is in use, not by
its largest burst (docs/benchmarks.md, "Thirty minutes of faults", has the figures).

What it cannot give back is a page that still holds one live block, and each arena (glibc
makes up to 8 per core, one per thread that allocates while the others are busy: the
event loop, gRPC's threads, the image decoders) fragments on its own. :func:`limit_arenas`
caps them at :data:`SERVER_ARENAS`: fewer, fuller arenas hold fewer half-used pages
(``scripts/soak.py --tracemalloc`` shows that what a soak adds is native memory, not
Python objects; docs/benchmarks.md has the figures). :func:`tune_for_serving` does both.

The garbage collector: :func:`freeze_startup_objects` takes what a process holds once it
has started out of the collector's sight, so that no full collection walks it again.

Elsewhere than glibc (musl, macOS) there is no ``mallopt`` or ``malloc_trim``: these do
nothing, and :func:`trim_heap_periodically` says so once in the log.
"""

from __future__ import annotations

import asyncio
import ctypes
import logging
import time

log = logging.getLogger(__name__)

TRIM_INTERVAL_S = 5.0
SERVER_ARENAS = 2
M_ARENA_MAX = -8  # glibc's mallopt parameters
M_TRIM_THRESHOLD = -1
M_MMAP_THRESHOLD = -3
HEAP_BLOCK_LIMIT = 32 * 1024 * 1024  # blocks up to this come from the arenas (glibc's ceiling on 64-bit)
TRIM_THRESHOLD = 1024 * 1024 * 1024  # free heap top kept between trims (trim_heap gives it back)


def _process_symbols() -> ctypes.CDLL:
    """The symbols this process has loaded, libc's among them (``dlopen(NULL)``): no lookup
    of libc's file, which ``ctypes.util.find_library`` does by running ``ldconfig``."""
    return ctypes.CDLL(None)


def _libc_malloc_trim():
    try:
        return _process_symbols().malloc_trim
    except (OSError, AttributeError):
        return None


_MALLOC_TRIM = _libc_malloc_trim()


def _mallopt(param: int, value: int) -> bool:
    try:
        return bool(_process_symbols().mallopt(param, value))
    except (OSError, AttributeError):
        return False


def limit_arenas(arenas: int = SERVER_ARENAS) -> bool:
    """Let glibc create at most ``arenas`` malloc arenas in this process from now on
    (``mallopt(M_ARENA_MAX)``; threads share them under their locks). False where not glibc."""
    return _mallopt(M_ARENA_MAX, arenas)


def keep_large_blocks_in_heap() -> bool:
    """Serve blocks up to :data:`HEAP_BLOCK_LIMIT` from the arenas and keep their freed pages
    until :func:`trim_heap` (``mallopt`` of the mmap and trim thresholds). False where not glibc."""
    return _mallopt(M_MMAP_THRESHOLD, HEAP_BLOCK_LIMIT) and _mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD)


def tune_for_serving() -> None:
    """A serving process's allocator (before its threads start): :func:`limit_arenas` and
    :func:`keep_large_blocks_in_heap`; pair it with :func:`trim_heap_periodically`."""
    limit_arenas()
    keep_large_blocks_in_heap()


def trim_heap() -> float:
    """Return the heap's free pages to the system; the call's seconds (0 where not glibc)."""
    if _MALLOC_TRIM is None:
        return 0.0
    t0 = time.perf_counter()
    _MALLOC_TRIM(0)
    return time.perf_counter() - t0


async def trim_heap_periodically(interval_s: float = TRIM_INTERVAL_S) -> None:
    """Every ``interval_s``, :func:`trim_heap` (on the loop: it takes the allocator's locks,
    so a thread would stall the loop's allocations as long), and the same for the free
    slots of the process's shared-input arena
    (:func:`~ppipe.runtime.wire.shared_inputs.trim_process_arena`)."""
    from ppipe.runtime.wire.shared_inputs import trim_process_arena

    if _MALLOC_TRIM is None:
        log.info("no malloc_trim in this C library: freed heap memory stays with the process")
    while True:
        await asyncio.sleep(interval_s)
        trim_process_arena()
        secs = trim_heap()
        if secs > 0.005:
            log.debug("malloc_trim took %.1f ms", secs * 1e3)


def freeze_startup_objects(collect: bool = True) -> None:
    """Move every object alive now out of the garbage collector's sight (``gc.freeze``).

    Why: a full (generation 2) collection walks every tracked object, and a serving
    process holds hundreds of thousands after start-up (Ray, pydantic schemas, profiles,
    the scheduler's tables). Walking them stops the event loop for tens of milliseconds,
    which stalls every request in flight and misses SLOs of the same order. Frozen
    start-up objects are never scanned again; what is allocated later is collected as usual.

    ``collect=False`` freezes without collecting first: for a process forked from a fork
    server, nearly everything it holds is the fork server's, and a collection writes to
    the header of every object it walks, which copies each of their shared pages into the
    child (the start-up garbage it would free is a few objects).
    """
    import gc

    if collect:
        gc.collect()
    gc.freeze()
