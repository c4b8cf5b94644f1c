"""The local launcher: a plan's workers as processes of this machine, without Ray.

Each vGPU's :class:`~ppipe.runtime.workers.worker.VgpuWorker` runs in a process of its
own, forked from a fork server that has imported the worker's code once (so the n-th
worker starts in milliseconds, not in the second a fresh interpreter takes). Before the
worker is built the process takes its vGPU's GPU pin and MPS share
(:func:`~ppipe.runtime.launch.deploy.worker_env`), then serves its data path on its own
event loop, the same code and the same TCP data path as a Ray actor's.

The host reaches a worker through a :class:`LocalWorkerHandle` over a private socket pair
(no port, nothing another user can reach): each call is a frame ``(id, method, args)``
answered by ``(id, ok, value)``, pickled (both ends are this program). The pair is also
the worker's lifeline: it ends when the worker's process does (killed, crashed, out of
memory), and a worker whose host is gone exits, so no worker outlives its server.

What it leaves out: NCCL and ring edges (every edge goes over the data path's TCP
connections) and several machines (that is Ray's: :mod:`ppipe.runtime.launch.ray_workers`).
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import multiprocessing
import os
import pickle
import signal
import socket
import struct
import sys
import time
from typing import Any, Awaitable, Callable

from ppipe.errors import UserError
from ppipe.runtime.launch.deploy import Deployment, worker_env, worker_specs
from ppipe.runtime.launch.handle import WorkerGone

log = logging.getLogger("ppipe.runtime")
HEADER = struct.Struct("!I")
CALLS = frozenset({"open_data_path", "connect_peers", "drop_peer", "close_edges", "ping"})
# imported once by the fork server, so that each worker's process starts with them loaded (uvloop where it is
# installed: the fork server skips a module it cannot import)
PRELOAD = ["ppipe.runtime.workers.worker", "ppipe.runtime.workers.backends", "ppipe.runtime.wire.datapath", "ppipe.runtime.memory",
           "ppipe.runtime.timerslack", "uvloop"]
PROCESS_NAME = "ppipe-vgpu"  # a worker process's name in ps and top (at most 15 characters)
_context: Any = None


def _fork_server() -> Any:
    """The multiprocessing context whose fork server has the worker's modules imported."""
    global _context
    if _context is None:
        _context = multiprocessing.get_context("forkserver")
        _context.set_forkserver_preload(PRELOAD)
    return _context


# ---- frames: a 4-byte length, then a pickle ---------------------------------------------------------------
def _frame(obj: Any) -> bytes:
    body = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
    return HEADER.pack(len(body)) + body


def _read_frame_blocking(sock: socket.socket) -> Any:
    def exactly(n: int) -> bytes:
        buf = bytearray()
        while len(buf) < n:
            chunk = sock.recv(n - len(buf))
            if not chunk:
                raise EOFError
            buf += chunk
        return bytes(buf)

    (n,) = HEADER.unpack(exactly(HEADER.size))
    return pickle.loads(exactly(n))


async def _read_frame(reader: asyncio.StreamReader) -> Any:
    (n,) = HEADER.unpack(await reader.readexactly(HEADER.size))
    return pickle.loads(await reader.readexactly(n))


def _portable(exc: BaseException) -> tuple:
    """An error as it crosses the pair: a UserError keeps its message, fix and file."""
    if isinstance(exc, UserError):
        return ("user", exc.message, exc.fix, exc.file)
    return ("other", f"{type(exc).__name__}: {exc}")


def _rebuilt(err: tuple) -> Exception:
    if err[0] == "user":
        return UserError(err[1], fix=err[2], file=err[3])
    return RuntimeError(err[1])


class PairCalls:
    """Calls over a socket pair to a child process, answered in any order: each frame is
    ``(call id, *call)`` out and ``(call id, ok, value)`` back. The reader starts on the
    first loop that calls. When the pair ends, ``on_end()`` (a coroutine: reap the process,
    release what it held) says why, as ``(why, exception type)``; the calls waiting and
    every later one then fail with that exception, and :meth:`wait_gone` returns.

    The local launcher's worker handles and local shards' handles both call through one.
    """

    def __init__(self, sock: socket.socket, on_end: Callable[[], Awaitable[tuple[str, type[Exception]]]]):
        self._sock, self._on_end = sock, on_end
        self._ids = itertools.count(1)
        self._waiting: dict[int, asyncio.Future] = {}
        self._writer: asyncio.StreamWriter | None = None
        self._opening: asyncio.Task | None = None
        self._gone: asyncio.Event | None = None
        self.why_gone: str | None = None
        self._error: type[Exception] = ConnectionError

    async def call(self, *call: Any) -> Any:
        """Send ``call``, return its answer (or raise its error, or the pair's end)."""
        await self._ensure_open()
        if self.why_gone is not None:
            raise self._error(self.why_gone)
        call_id = next(self._ids)
        fut = asyncio.get_running_loop().create_future()
        self._waiting[call_id] = fut
        assert self._writer is not None
        self._writer.write(_frame((call_id, *call)))
        return await fut

    async def wait_gone(self) -> None:
        """Returns once the pair has ended (and ``on_end`` has run)."""
        await self._ensure_open()
        assert self._gone is not None
        await self._gone.wait()

    def close(self) -> None:
        """Close the pair's writer (the reader then ends)."""
        if self._writer is not None:
            self._writer.close()

    async def _ensure_open(self) -> None:
        if self._opening is None:
            self._gone = asyncio.Event()
            self._opening = asyncio.ensure_future(self._open())
        await asyncio.shield(self._opening)

    async def _open(self) -> None:
        reader, self._writer = await asyncio.open_connection(sock=self._sock)
        asyncio.ensure_future(self._read_answers(reader))

    async def _read_answers(self, reader: asyncio.StreamReader) -> None:
        try:
            while True:
                call_id, ok, value = await _read_frame(reader)
                fut = self._waiting.pop(call_id, None)
                if fut is not None and not fut.done():
                    fut.set_result(value) if ok else fut.set_exception(_rebuilt(value))
        except (asyncio.IncompleteReadError, ConnectionError, OSError):
            pass
        self.why_gone, self._error = await self._on_end()
        for fut in self._waiting.values():
            if not fut.done():
                fut.set_exception(self._error(self.why_gone))
        self._waiting.clear()
        assert self._gone is not None
        self._gone.set()


# ---- the worker's process ----------------------------------------------------------------------------------
def _worker_main(sock: socket.socket, spec: Any, backend: str, backend_options: dict | None, env: dict[str, str]) -> None:
    """The worker process: pin, build the worker, answer the host's calls until the pair ends."""
    from ppipe.runtime.workers.worker import pin_cuda_env

    _name_process(PROCESS_NAME)
    pin_cuda_env(env)
    try:
        with asyncio.Runner(loop_factory=_loop_factory()) as runner:
            runner.run(_serve_host(sock, spec, backend, backend_options))
    finally:
        os._exit(0)  # the host is gone or killed us: no thread of the data path lingers


def _name_process(name: str) -> None:
    """What ``ps``/``top`` show as the process's name (Linux; elsewhere it keeps Python's)."""
    try:
        with open("/proc/self/comm", "w") as fh:
            fh.write(name[:15])
    except OSError:
        pass


def serve_child(argv: list[str] | None, name: str, serve: Callable[[socket.socket, Any], Awaitable[None]],
                loop_factory: Any = None) -> None:
    """The body of a child process that ``ppipe serve`` starts with a socket pair (a frontend
    shard, an ingress): ``argv[0]`` is the pair's fd; the first frame on it says what to
    serve, and ``serve(sock, that)`` runs on a loop of ``loop_factory`` (asyncio's by
    default). The process is named ``name``, ignores SIGINT (the server stops its children
    itself, in order), and ends with ``os._exit`` so that no thread of it lingers."""
    fd = int((sys.argv[1:] if argv is None else argv)[0])
    _name_process(name)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    sock = socket.socket(fileno=fd)
    try:
        start = _read_frame_blocking(sock)
        with asyncio.Runner(loop_factory=loop_factory) as runner:
            runner.run(serve(sock, start))
    except (EOFError, OSError):
        pass  # the server is gone before it said what to serve
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)


def _loop_factory() -> Any:
    """uvloop's event loop where it is installed (its timers and sockets cost less), else asyncio's."""
    try:
        import uvloop
    except ImportError:
        return None
    return uvloop.new_event_loop


async def _serve_host(sock: socket.socket, spec: Any, backend: str, backend_options: dict | None) -> None:
    from ppipe.runtime.memory import freeze_startup_objects, trim_heap_periodically, tune_for_serving
    from ppipe.runtime.timerslack import tighten_timer_slack
    from ppipe.runtime.workers.worker import VgpuWorker

    reader, writer = await asyncio.open_connection(sock=sock)
    try:
        worker = VgpuWorker(spec, backend, backend_options, data_loop="current")
    except BaseException as exc:  # the host reports it (a missing sub-model is the user's to fix)
        writer.write(_frame((0, False, _portable(exc))))
        await writer.drain()
        return
    freeze_startup_objects(collect=False)  # forked: its objects are the fork server's
    tune_for_serving()  # inputs and feature maps reuse the heap's pages; a burst's go back on a timer
    tighten_timer_slack()  # its stages start and end on time (ppipe.runtime.timerslack)
    tasks: set[asyncio.Task] = {asyncio.ensure_future(trim_heap_periodically())}
    writer.write(_frame((0, True, await worker.ping())))
    try:
        while True:
            call_id, method, args = await _read_frame(reader)
            task = asyncio.ensure_future(_answer(writer, worker, call_id, method, args))
            tasks.add(task)
            task.add_done_callback(tasks.discard)
    except (asyncio.IncompleteReadError, ConnectionError):
        pass  # the host closed the pair or died: this worker ends with it
    finally:
        worker.close_data_path()


async def _answer(writer: asyncio.StreamWriter, worker: Any, call_id: int, method: str, args: tuple) -> None:
    try:
        if method not in CALLS:
            raise RuntimeError(f"no call {method!r} on a local worker")
        reply = (call_id, True, await getattr(worker, method)(*args))
    except Exception as exc:
        reply = (call_id, False, _portable(exc))
    writer.write(_frame(reply))


# ---- the host's side ---------------------------------------------------------------------------------------
class LocalWorkerHandle:
    """A :class:`~ppipe.runtime.launch.handle.WorkerHandle` on a worker process of this machine.

    Calls go over the pair (:class:`PairCalls`); when the pair ends, the calls waiting and
    every later one fail with :class:`WorkerGone`, and :meth:`lifeline` ends.
    """

    def __init__(self, vgpu_id: str, process: Any, sock: socket.socket, info: dict[str, Any]):
        self.vgpu_id, self.process, self.info = vgpu_id, process, info
        self._pid = process.pid  # kept: a closed Process has none
        self._calls = PairCalls(sock, self._ended)

    @property
    def pid(self) -> int:
        return self._pid

    @property
    def why_gone(self) -> str | None:
        return self._calls.why_gone

    async def open_data_path(self, frontend: str, secret: bytes | None = None) -> str:
        return await self._call("open_data_path", frontend, secret)

    async def connect_peers(self, peers: list[str]) -> None:
        await self._call("connect_peers", peers)

    async def drop_peer(self, peer: str, gens: list[int] | None = None) -> int:
        return await self._call("drop_peer", peer, gens)

    async def close_edges(self, edges: list[tuple[str, int]]) -> int:
        return await self._call("close_edges", edges)

    async def ping(self) -> dict[str, Any]:
        return await self._call("ping")

    async def lifeline(self) -> None:
        """Waits until the worker's process is gone, then raises :class:`WorkerGone`."""
        await self._calls.wait_gone()
        raise WorkerGone(self.why_gone or f"worker {self.vgpu_id} is gone")

    def kill(self) -> None:
        """SIGKILL the worker's process (no wait); its pair then ends, and with it the lifeline."""
        try:
            self.process.kill()
        except (OSError, ValueError, AttributeError):
            pass  # already reaped or closed

    async def _call(self, method: str, *args: Any) -> Any:
        return await self._calls.call(method, args)

    async def _ended(self) -> tuple[str, type[Exception]]:
        await asyncio.to_thread(self.process.join, 2.0)  # reap it
        why = f"worker {self.vgpu_id} (pid {self.pid}) is gone: exit code {self.process.exitcode}"
        self._release()
        return why, WorkerGone

    def _release(self) -> None:
        """Close the pair and the process's sentinel pipe: a server that re-creates workers
        and switches plans for days must not keep two fds of each worker it ever had."""
        self._calls.close()
        try:
            self.process.close()
        except ValueError:  # still running (it outlived the join): its finalizer closes them
            pass

    def __repr__(self) -> str:
        return f"LocalWorkerHandle({self.vgpu_id!r}, pid {self.pid})"


def start_local_workers(dep: Deployment, backend: str = "ort", backend_options: dict[str, Any] | None = None,
                        start_timeout_s: float = 300.0, only: set[str] | None = None,
                        incarnation: int = 0) -> dict[str, LocalWorkerHandle]:
    """Start one worker process per vGPU of ``dep``'s placement (of ``only``, if given);
    returns {vgpu_id: :class:`LocalWorkerHandle`} once every worker has built its backend.
    The signature is :func:`ppipe.runtime.launch.deploy.start_workers`'s (``incarnation``
    is not needed here: processes have no names to free).

    Raises:
        UserError: the placement is incomplete, a backend cannot load its partition, or a
            worker did not start within ``start_timeout_s``; the workers started are stopped.
    """
    ctx = _fork_server()
    specs = [s for s in worker_specs(dep) if only is None or s.vgpu_id in only]
    started: list[tuple[Any, Any, socket.socket]] = []
    try:
        for spec in specs:
            ours, theirs = socket.socketpair()
            proc = ctx.Process(target=_worker_main, name=f"ppipe-vgpu {spec.vgpu_id}", daemon=True,
                               args=(theirs, spec, backend, backend_options, worker_env(spec, backend)))
            proc.start()
            theirs.close()
            started.append((spec, proc, ours))
        return {spec.vgpu_id: LocalWorkerHandle(spec.vgpu_id, proc, sock, _wait_ready(spec, proc, sock, start_timeout_s))
                for spec, proc, sock in _in_deadline(started, start_timeout_s)}
    except BaseException:
        for _, proc, sock in started:
            proc.kill()
            sock.close()
        raise


def _in_deadline(started: list, timeout_s: float):
    deadline = time.monotonic() + timeout_s
    for spec, proc, sock in started:
        sock.settimeout(max(0.001, deadline - time.monotonic()))
        yield spec, proc, sock


def _wait_ready(spec: Any, proc: Any, sock: socket.socket, timeout_s: float) -> dict[str, Any]:
    """The worker's first frame: its ping once built, or the error that stopped it."""
    try:
        _, ok, value = _read_frame_blocking(sock)
    except socket.timeout:
        raise UserError(f"worker {spec.vgpu_id} did not load its blocks within {timeout_s:.0f} s",
                        fix="a larger --start-timeout, or a lighter backend") from None
    except (EOFError, OSError):
        proc.join(2.0)
        raise UserError(f"worker {spec.vgpu_id} exited while starting (exit code {proc.exitcode})",
                        fix="see the worker's error above") from None
    sock.settimeout(None)
    if not ok:
        raise _rebuilt(value)
    return value


def respawn_local_worker(dep: Deployment, vgpu_id: str, backend: str = "ort", backend_options: dict[str, Any] | None = None,
                         start_timeout_s: float = 60.0, incarnation: int | None = None) -> LocalWorkerHandle:
    """Start vGPU ``vgpu_id``'s worker anew (after its process died); blocks until it is
    built. Raises RuntimeError where it cannot start (the host then retries later)."""
    try:
        return start_local_workers(dep, backend, backend_options, start_timeout_s, {vgpu_id})[vgpu_id]
    except UserError as exc:
        raise RuntimeError(str(exc)) from None
