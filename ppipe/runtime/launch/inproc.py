"""The in-process launcher: a plan's workers, the scheduler's host and the frontend on one loop.

What it runs: one :class:`~ppipe.runtime.workers.worker.VgpuWorker` per vGPU of the plan's
placement (:func:`start_inproc_workers`, the specs of
:func:`ppipe.runtime.launch.deploy.worker_specs`), each behind an
:class:`InprocWorkerHandle`, the :class:`~ppipe.runtime.launch.handle.WorkerHandle` the
host reaches it through; a :class:`~ppipe.runtime.scheduler.host.Runtime` over them whose
data path is on the loopback address; and, where asked, the HTTP frontend
(:func:`ppipe.runtime.ingress.http_server.create_app`), either under an in-process ASGI
client (:func:`inproc_serve`, ``http=True``) or under a real HTTP server on a thread of its
own for clients in other processes (:class:`InprocServer`). Every worker serves its data
path on the runtime's loop (``data_loop="current"``), so the code that runs is the code of
a served plan: the same stage messages over the same TCP connections, the same reports, the
same scheduler; only the launch and the lifelines differ. No Ray.

What it leaves out, by being one process on one thread:

- the workers' compute and the frontend share a core: a stage's work (an emulated stage's
  sleeps, whose last millisecond is a blocking kernel sleep; an ``ort`` stage's call)
  holds up the frontend and the other workers as it would not across processes, so
  timings are those of a loaded host. The emulated backend is the one meant here (its
  stages cost a wait, not a core); the others run, but one after another;
- the process's environment is shared: no worker is pinned to a GPU or an MPS share
  (a plan whose workers would need different pins is refused), none undoes a niceness;
- NCCL and ring edges (every edge goes over the data path's connections), re-creation of a
  failed worker (``respawn``), and a worker's death other than by :meth:`InprocWorkerHandle.kill`.
"""

from __future__ import annotations

import asyncio
import contextlib
from dataclasses import dataclass, field
from typing import Any, AsyncIterator

from ppipe.errors import UserError
from ppipe.runtime.launch.deploy import Deployment, worker_env, worker_specs
from ppipe.runtime.launch.handle import WorkerGone
from ppipe.runtime.workers.stage_clock import StageClock
from ppipe.runtime.workers.worker import VgpuWorker

LOOPBACK = "127.0.0.1"


class InprocWorkerHandle:
    """A :class:`~ppipe.runtime.launch.handle.WorkerHandle` on a worker in this process: each
    call awaits the worker's method on the calling loop.

    The worker is gone once :meth:`kill` has run: its data path is closed (as a dying
    process's would be), :meth:`lifeline` raises :class:`WorkerGone`, and so does every
    later call.
    """

    def __init__(self, worker: VgpuWorker):
        self.worker = worker
        self.vgpu_id = worker.spec.vgpu_id
        self.gone = False
        self._loop: asyncio.AbstractEventLoop | None = None  # the loop that serves the worker's data path
        self._killed: asyncio.Event | None = None

    def _alive(self) -> VgpuWorker:
        if self.gone:
            raise WorkerGone(f"worker {self.vgpu_id} was killed")
        return self.worker

    async def open_data_path(self, frontend: str, secret: bytes | None = None) -> str:
        worker = self._alive()
        self._loop = asyncio.get_running_loop()
        return await worker.open_data_path(frontend, secret)

    async def connect_peers(self, peers: list[str]) -> None:
        await self._alive().connect_peers(peers)

    async def lifeline(self) -> None:
        """Waits until :meth:`kill`, then raises :class:`WorkerGone`."""
        if not self.gone:
            if self._killed is None:
                self._killed = asyncio.Event()
            await self._killed.wait()
        raise WorkerGone(f"worker {self.vgpu_id} was killed")

    async def drop_peer(self, peer: str, gens: list[int] | None = None) -> int:
        return await self._alive().drop_peer(peer, gens)

    async def close_edges(self, edges: list[tuple[str, int]]) -> int:
        return await self._alive().close_edges(edges)

    def kill(self) -> None:
        """Close the worker's data path and end its lifeline; again: nothing. From any
        thread: off the worker's loop, the kill is handed to that loop (and done once it
        runs); after that loop has closed, the data path went with it."""
        loop = self._loop
        if loop is None or _running_loop() is loop:
            self._kill_here()
            return
        try:
            loop.call_soon_threadsafe(self._kill_here)
        except RuntimeError:  # the loop is closed: nothing of the data path is left to close
            self.gone = True

    def _kill_here(self) -> None:
        if self.gone:
            return
        self.gone = True
        self.worker.close_data_path()
        if self._killed is not None:
            self._killed.set()

    def __repr__(self) -> str:
        return f"InprocWorkerHandle({self.vgpu_id!r}{', gone' if self.gone else ''})"


def _running_loop() -> asyncio.AbstractEventLoop | None:
    try:
        return asyncio.get_running_loop()
    except RuntimeError:
        return None


def start_inproc_workers(dep: Deployment, backend: str = "emulated", backend_options: dict[str, Any] | None = None,
                         clock: StageClock | None = None, only: set[str] | None = None) -> dict[str, InprocWorkerHandle]:
    """Build one worker per vGPU of ``dep``'s placement (of ``only``, if given), in this
    process, each serving its data path on the loop that opens it; returns {vGPU id: handle}.

    Args:
        backend, backend_options: as :func:`ppipe.runtime.launch.deploy.start_workers`'s.
        clock: the workers' :class:`~ppipe.runtime.workers.stage_clock.StageClock` (None: the
            wall clock). The host's scheduler reads the wall clock whatever this is, so a
            served plan needs one that keeps wall time; others suit tests of the workers.

    Raises:
        UserError: the plan's placement is incomplete (:func:`worker_specs`), a backend
            cannot load its partition, or the workers would need different GPU pins.
    """
    specs = [s for s in worker_specs(dep) if only is None or s.vgpu_id in only]
    pins = {tuple(sorted(worker_env(s, backend).items())) for s in specs} - {()}
    if len(pins) > 1:
        raise UserError(
            f"in one process the {backend} workers of this plan would share one GPU pin, and they need {len(pins)} "
            "(CUDA_VISIBLE_DEVICES, MPS shares)",
            fix="launch them on Ray (`ppipe serve`), or rehearse the plan in process with backend 'emulated'",
        )
    return {s.vgpu_id: InprocWorkerHandle(VgpuWorker(s, backend, backend_options, clock=clock, data_loop="current"))
            for s in specs}


def kill_all(workers: dict[str, InprocWorkerHandle]) -> None:
    """Kill every worker of ``workers`` (those gone already are left as they are)."""
    for handle in workers.values():
        handle.kill()


def inproc_runtime(dep: Deployment, workers: dict[str, InprocWorkerHandle], **runtime_options: Any):
    """A :class:`~ppipe.runtime.scheduler.host.Runtime` over in-process workers, its data
    path on the loopback address; ``runtime_options``: the Runtime's keywords."""
    from ppipe.runtime.scheduler.host import Runtime

    runtime_options.setdefault("data_host", LOOPBACK)
    return Runtime(dep.plan, dep.profiles, dep.cluster, workers, **runtime_options)


@dataclass
class InprocServing:
    """What :func:`inproc_serve` runs: the runtime, its workers and, with ``http=True``, an
    HTTP client of the frontend (``base_url`` ``http://inproc``) that calls the app in
    process, on the same loop."""

    runtime: Any
    workers: dict[str, InprocWorkerHandle]
    client: Any = None
    ingresses: list[Any] = field(default_factory=list)


@contextlib.asynccontextmanager
async def inproc_serve(dep: Deployment, *, backend: str = "emulated", backend_options: dict[str, Any] | None = None,
                       clock: StageClock | None = None, http: bool = False, app_options: dict[str, Any] | None = None,
                       ingresses: int = 0, **runtime_options: Any) -> AsyncIterator[InprocServing]:
    """Serve ``dep`` in this process, on the running loop: workers (:func:`start_inproc_workers`),
    a started runtime over them (:func:`inproc_runtime`) and, with ``http``, the frontend's
    app (``app_options``: :func:`~ppipe.runtime.ingress.http_server.create_app`'s keywords;
    JSON bodies are decoded on this loop too unless they name ``decode_workers``, as no
    process is started) behind an ``httpx.AsyncClient`` over ``httpx.ASGITransport``. On exit the app (or the
    runtime) is stopped, pending requests answered ``shutdown``, and every worker killed.

    ``ingresses`` > 0: the requests go through that many
    :class:`~ppipe.runtime.ingress.remote.IngressRuntime` (``InprocServing.ingresses``; the
    app, with ``http``, serves over the first), which hold the tensors, and the runtime
    decides on their metadata (``accept_ingresses``), all on this loop.
    """
    workers = start_inproc_workers(dep, backend, backend_options, clock)
    try:
        if ingresses:
            runtime_options["accept_ingresses"] = True
        runtime = inproc_runtime(dep, workers, **runtime_options)
        if ingresses:
            async with _ingresses(dep, runtime, workers, ingresses, http, app_options) as serving:
                yield serving
            return
        if not http:
            await runtime.start()
            try:
                yield InprocServing(runtime, workers)
            finally:
                await runtime.stop()
            return
        import httpx

        from ppipe.runtime.ingress.http_server import create_app

        app = create_app(runtime, **{"decode_workers": 0, **(app_options or {})})
        async with _app_lifespan(app):
            async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://inproc") as client:
                yield InprocServing(runtime, workers, client)
    finally:
        kill_all(workers)


@contextlib.asynccontextmanager
async def _ingresses(dep: Deployment, runtime: Any, workers: dict[str, InprocWorkerHandle], n: int, http: bool, app_options: dict[str, Any] | None) -> AsyncIterator[InprocServing]:
    """A started runtime with ``n`` started ingresses that have heard from it (and, with
    ``http``, the app over the first)."""
    from ppipe.runtime.ingress.remote import IngressRuntime

    await runtime.start()
    front = [IngressRuntime(i, runtime.ingress_address, dep.plan, dep.profiles, secret=runtime.data_secret, host=LOOPBACK)
             for i in range(n)]
    try:
        for ing in front[1:] if http else front:  # the app starts the first itself
            await ing.start()
        if not http:
            await _heard(front)
            yield InprocServing(runtime, workers, None, front)
            return
        import httpx

        from ppipe.runtime.ingress.http_server import create_app

        app = create_app(front[0], **{"decode_workers": 0, **(app_options or {})})
        async with _app_lifespan(app):
            await _heard(front)
            async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://inproc") as client:
                yield InprocServing(runtime, workers, client, front)
    finally:
        for ing in front:
            await ing.stop()
        await runtime.stop()


async def _heard(front: list[Any], timeout_s: float = 10.0) -> None:
    """Wait until every ingress has heard from the scheduler (its hello answered)."""
    async with asyncio.timeout(timeout_s):
        while not all(i.started for i in front):
            await asyncio.sleep(0.001)


@contextlib.asynccontextmanager
async def _app_lifespan(app: Any) -> AsyncIterator[None]:
    """Run an ASGI app's lifespan (startup on entry, shutdown on exit) on the running loop,
    as a server would; ``httpx.ASGITransport`` runs none. A failed startup raises its error."""
    to_app: asyncio.Queue = asyncio.Queue()
    from_app: asyncio.Queue = asyncio.Queue()
    task = asyncio.get_running_loop().create_task(
        app({"type": "lifespan", "asgi": {"version": "3.0", "spec_version": "2.0"}, "state": {}}, to_app.get, from_app.put))
    await to_app.put({"type": "lifespan.startup"})
    started = await _lifespan_reply(task, from_app)
    if started["type"] != "lifespan.startup.complete":
        await asyncio.gather(task, return_exceptions=False)  # the app's own error, where it raised one
        raise RuntimeError(f"the app did not start: {started.get('message', started['type'])}")
    try:
        yield
    finally:
        await to_app.put({"type": "lifespan.shutdown"})
        await _lifespan_reply(task, from_app)
        await task


async def _lifespan_reply(task: asyncio.Task, from_app: asyncio.Queue) -> dict[str, Any]:
    """The app's next lifespan message, or its error where it ends without one."""
    reply = asyncio.ensure_future(from_app.get())
    await asyncio.wait({reply, task}, return_when=asyncio.FIRST_COMPLETED)
    if reply.done():
        return reply.result()
    reply.cancel()
    task.result()  # raises the app's error
    raise RuntimeError("the app's lifespan ended without a reply")


class InprocServer:
    """Serve a deployment in this process behind a real HTTP server, for clients in other
    processes (``ppipe bench``): the workers are built here, and the runtime, their data
    paths and the frontend all run on the loop of one server thread
    (:class:`~ppipe.runtime.ingress.http_transport.BackgroundServer`). A context manager;
    :attr:`url` is the frontend's address; on exit the server stops and the workers are killed.

    Args:
        dep: what to serve.
        backend, backend_options, clock: the workers' (:func:`start_inproc_workers`).
        app_options: :func:`~ppipe.runtime.ingress.http_server.create_app`'s keywords (JSON
            bodies decoded on the server's loop unless they name ``decode_workers``).
        runtime_options: the Runtime's keywords (:func:`inproc_runtime`).
    """

    def __init__(self, dep: Deployment, backend: str = "emulated", backend_options: dict[str, Any] | None = None,
                 clock: StageClock | None = None, app_options: dict[str, Any] | None = None, **runtime_options: Any):
        self.dep, self.backend, self.backend_options, self.clock = dep, backend, backend_options, clock
        self.app_options, self.runtime_options = {"decode_workers": 0, **(app_options or {})}, runtime_options
        self.workers: dict[str, InprocWorkerHandle] = {}
        self.runtime: Any = None
        self.server: Any = None
        self.url = ""

    def __enter__(self) -> "InprocServer":
        from ppipe.runtime.ingress.http_server import create_app
        from ppipe.runtime.ingress.http_transport import BackgroundServer

        self.workers = start_inproc_workers(self.dep, self.backend, self.backend_options, self.clock)
        try:
            self.runtime = inproc_runtime(self.dep, self.workers, **self.runtime_options)
            app = create_app(self.runtime, on_shutdown=lambda: kill_all(self.workers), **self.app_options)
            self.server = BackgroundServer(app).__enter__()
        except BaseException:
            kill_all(self.workers)
            raise
        self.url = self.server.url
        return self

    def __exit__(self, *exc: Any) -> None:
        try:
            self.server.__exit__(*exc)
        finally:
            kill_all(self.workers)  # where the server's shutdown did not run (it hung, or its thread died)
