"""Infer request bodies: read within a size limit and a timeout, then decoded.

**Reading** (:func:`read_body`): the whole body or a 413 (too large) or a 408 (it did not
arrive within the body timeout). A body over the limit is read on and dropped, so that a
client still sending it reads the 413 instead of a reset connection.

**Decoding** (:class:`BodyDecoder`): binary bodies and small JSON ones are decoded on the
event loop; large JSON bodies (over :data:`INLINE_DECODE_BYTES`) in a bounded pool of
worker processes, because decoding a ResNet-50 input takes milliseconds of C calls that
hold the GIL (a thread would stall the loop all the same). The decoder estimates when a
pool decode would end, so that the frontend can drop a JSON body whose decode would end
too late for its deadline at once, with a 503, instead of queueing it: JSON overload then
gives fast 503s instead of an endless queue.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import multiprocessing
import os

from ppipe.dataplane.decode import expected_end
from ppipe.runtime.ingress.decode_process import pool_decode_job, pool_process_init
from ppipe.runtime.ingress.protocol import InferRequest, ProtocolError, parse_infer_request
from ppipe.runtime.scheduler.host import DroppedError

INLINE_DECODE_BYTES = 64 * 1024
"""JSON bodies (or binary requests' JSON headers) up to this size are decoded on the event
loop (under a ms: orjson reads ~10 ns per byte here), where the pool's round trip would
add about as much again; larger ones go to the decode pool."""
MAX_QUEUED_DECODES = 256  # JSON bodies waiting for the pool; more are 503 queue-full
DECODE_S_PER_BYTE_PRIOR = 15e-9  # orjson.loads + np.asarray of numbers, before the first measurement


async def read_body(length: str | None, stream, max_bytes: int, timeout_s: float) -> bytes | memoryview:
    """The whole body that ``stream`` yields in chunks, within ``max_bytes`` and ``timeout_s``:
    a body that came whole as it came (``bytes``, or a memoryview of shared memory:
    :mod:`ppipe.runtime.ingress.http_transport`), else its chunks joined.

    Args:
        length: the request's Content-Length header, if any (a larger one is a 413 at once,
            the body still read and dropped).

    Raises:
        ProtocolError: 413 when the body exceeds ``max_bytes``; 408 when it did not arrive
            within ``timeout_s``.
    """
    declared = int(length) if length is not None and length.isascii() and length.isdigit() and len(length) <= 20 else None
    chunks, size = [], 0
    too_big = declared is not None and declared > max_bytes
    try:
        async with _timeout(timeout_s):
            async for chunk in stream:
                size += len(chunk)
                if size > max_bytes:
                    too_big = True
                if too_big:
                    # read the rest and drop it (up to 8x the limit) so that the client, still
                    # sending, reads our 413 instead of a reset connection
                    if size > 8 * max_bytes:
                        break
                    continue
                chunks.append(chunk)
    except TimeoutError:
        if size or declared is None:
            came = f"{size} bytes{f' of the {declared} announced' if declared is not None else ''} came"
        else:  # a body of declared length is handed on whole (http_transport), so none of it is counted here
            came = f"not all of the {declared} bytes announced came"
        raise ProtocolError(408, f"the request body did not arrive within {timeout_s:g} s ({came}); send the whole body at once") from None
    if too_big:
        raise ProtocolError(413, f"body of {declared or size} bytes exceeds the limit of {max_bytes} bytes")
    return chunks[0] if len(chunks) == 1 else b"".join(chunks)  # (a whole body as it came: bytes, or shared memory)


@contextlib.asynccontextmanager
async def _timeout_compat(seconds: float):
    """``asyncio.timeout`` for Python 3.10: cancel the current task after ``seconds``, as TimeoutError."""
    task, fired = asyncio.current_task(), []
    handle = asyncio.get_running_loop().call_later(seconds, lambda: (fired.append(1), task.cancel()))
    try:
        yield
    except asyncio.CancelledError:
        if fired:
            raise TimeoutError from None
        raise
    finally:
        handle.cancel()


_timeout = getattr(asyncio, "timeout", _timeout_compat)


def default_decode_workers() -> int:
    """Processes of the JSON decode pool: a quarter of the CPUs, 1 to 4 (the rest serve
    the event loop, the workers and Ray)."""
    return max(1, min(4, (os.cpu_count() or 1) // 4))


def _process_pool(workers: int) -> concurrent.futures.ProcessPoolExecutor:
    # spawn, never fork: the server process runs Ray's and uvicorn's threads. (So a script
    # that serves must guard its main code with `if __name__ == "__main__"`.)
    return concurrent.futures.ProcessPoolExecutor(workers, mp_context=multiprocessing.get_context("spawn"),
                                                  initializer=pool_process_init, initargs=(os.getpid(),))


class BodyDecoder:
    """Decodes infer request bodies: small and binary ones on the event loop, large JSON
    ones in a bounded pool of worker processes, with admission control.

    Admission: a decode in the pool is expected to end ``(queued bytes / workers + own
    bytes) x seconds-per-byte`` from now (:meth:`expected_end_s`), where seconds-per-byte is
    a moving average of the decodes' own times in the pool (not counting the time of moving
    the body there and the request back). The frontend drops a request whose decode would
    end after its deadline before queueing it.

    Args:
        workers: processes of the pool; 0 decodes everything on the event loop.
        inline_bytes: JSON parts up to this size are decoded on the loop.
        max_queued: bodies waiting in (or for) the pool; more raise ``DroppedError("queue-full")``.
        executor: ``f(workers) -> Executor`` of the pool; default a process pool (tests
            pass a thread pool and a ``job`` of known duration).
        job: what the pool runs, ``job(body, header_length) -> (request or ProtocolError, seconds)``.
    """

    def __init__(self, workers: int, inline_bytes: int = INLINE_DECODE_BYTES, max_queued: int = MAX_QUEUED_DECODES,
                 executor=None, job=pool_decode_job):
        if workers < 0:
            raise ValueError(f"decode workers must be >= 0, got {workers}")
        self.workers, self.inline_bytes, self.max_queued = workers, inline_bytes, max_queued
        self.s_per_byte = DECODE_S_PER_BYTE_PRIOR
        self.queued, self.queued_bytes = 0, 0
        self._make_executor = executor or _process_pool
        self._job = job
        self._pool: concurrent.futures.Executor | None = None

    def in_pool(self, body: bytes, header_length: str | None) -> bool:
        """Whether this body is decoded in the pool (its JSON part is large)."""
        if self.workers == 0:
            return False
        json_bytes = len(body)
        if header_length is not None and header_length.isdigit() and len(header_length) <= 20:
            json_bytes = min(json_bytes, int(header_length))
        return json_bytes > self.inline_bytes

    def expected_end_s(self, nbytes: int) -> float:
        """Seconds from now until a pool decode of ``nbytes`` submitted now would end."""
        return expected_end(0.0, self.queued_bytes * self.s_per_byte, self.workers, nbytes * self.s_per_byte)

    async def start(self) -> None:
        """Start the pool's processes now (each imports numpy: ~1 s), not on the first request."""
        if self.workers:
            loop = asyncio.get_running_loop()
            await asyncio.gather(*(loop.run_in_executor(self._executor(), self._job, b"{}", None) for _ in range(self.workers)))

    def stop(self) -> None:
        """Stop the pool's processes and wait for them (idle ones end at once; a decode in
        progress is bounded by the body limit). Not waiting would leave them behind where the
        server's process ends right after (uvicorn re-raises SIGTERM once it has shut down:
        no exit handler runs), each holding the server's stdout open."""
        if self._pool is not None:
            self._pool.shutdown(wait=True, cancel_futures=True)
            self._pool = None

    def _executor(self) -> concurrent.futures.Executor:
        if self._pool is None:
            self._pool = self._make_executor(self.workers)
        return self._pool

    async def decode(self, body: bytes, header_length: str | None) -> InferRequest:
        """Decode a body (on the loop or in the pool, see :meth:`in_pool`).

        Raises:
            ProtocolError: the body is malformed.
            DroppedError: queue-full (too many bodies waiting), worker-failed (a decode process died).
        """
        if not self.in_pool(body, header_length):
            return parse_infer_request(body, header_length)
        if self.queued >= self.max_queued:
            raise DroppedError("queue-full", f"{self.queued} JSON bodies are waiting to be decoded; send the binary tensor extension, or fewer requests")
        self.queued += 1
        self.queued_bytes += len(body)
        try:
            out, took_s = await asyncio.get_running_loop().run_in_executor(self._executor(), self._job, bytes(body), header_length)
        except concurrent.futures.process.BrokenProcessPool:
            self.stop()  # the next decode starts a new pool
            raise DroppedError("worker-failed", "a JSON decoding process died; retry the request") from None
        finally:
            self.queued -= 1
            self.queued_bytes -= len(body)
        self.s_per_byte = 0.8 * self.s_per_byte + 0.2 * took_s / max(1, len(body))
        if isinstance(out, ProtocolError):
            raise out
        return out
