"""Frontend shards: several processes serve one port, each scheduling its own models.

One frontend process (HTTP, decoding, the scheduler, the data path) uses one core, so its
CPU per request bounds the rate one process serves. ``ppipe serve --shards N`` runs N
frontend processes on the same port (``SO_REUSEPORT``: the kernel spreads connections
over them, :func:`reuseport_socket`); shard 0 is the ``ppipe serve`` process, each other
one a :class:`ShardServer` in a process of its own on this machine. Each shard serves a
part of the plan (:mod:`ppipe.runtime.control.shard_plan` says which): whole models, or
its group of servers' sub-plan (``--shard-by servers``: a shard is started with that
sub-plan as its deployment's plan). Its scheduler, runtime and workers serve only that
part (:func:`build_shard`), and its router passes the requests it deals to other shards
there (:class:`ppipe.runtime.ingress.shard_router.ShardRouter`).

What runs the other shards follows the launcher: local processes under the local launcher
(:mod:`ppipe.runtime.launch.local_shards`: each shard starts its own workers), Ray actors
on this node under Ray (:mod:`ppipe.runtime.launch.ray_shards`: given shard 0's workers at
first). Either way shard 0 holds a handle on each (what it was started with,
:class:`ShardStart`, and what it serves since), tells every shard where the others'
routers are (:class:`PeerExchange`) with the typed requests of
:mod:`ppipe.runtime.control.shard_control`, and restarts a shard that dies
(:class:`ShardSupervisor`) as it last served.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import socket
from dataclasses import dataclass, field
from typing import Any, Callable, Protocol

from ppipe.runtime.control.shard_control import SetPeers, ShardControl, ShardHandle, ShardRequest
from ppipe.runtime.control.shard_plan import assign_shards, parse_shards, sub_plan  # noqa: F401 (ppipe.runtime.cli imports the first two from here)
from ppipe.runtime.ingress.shard_router import Routes, ShardRouter

log = logging.getLogger("ppipe.runtime")
RESTART_DELAYS_S = (0.5, 1.0, 2.0, 5.0, 10.0, 30.0)  # between tries to restart a shard; the last repeats


def reuseport_socket(host: str, port: int, listen: bool = True) -> socket.socket:
    """A TCP socket bound to ``host:port`` that other shards may bind too (``SO_REUSEPORT``),
    listening, or (``listen=False``) left for the server to listen on once it serves: until
    then the kernel deals it no connection of the shared port."""
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    sock.bind((host, port))
    if listen:
        sock.listen(2048)
    sock.set_inheritable(True)
    return sock


# ---- a shard's server ------------------------------------------------------------------------------------
@dataclass(frozen=True)
class ServeSettings:
    """How every shard serves (the flags of ``ppipe serve``).

    Attributes:
        runtime: keyword arguments of :class:`ppipe.runtime.scheduler.host.Runtime` (policy,
            scheduler options, dispatch lead, answer budget, the link opener of plan switches,
            the server's data-path secret, which the shards' routers prove to each other too).
        app: keyword arguments of :func:`ppipe.runtime.ingress.http_server.create_app` (token, body
            limits and timeouts, decode workers).
        server: keyword arguments of :func:`ppipe.runtime.ingress.http_transport.uvicorn_config` (timeouts, the body limit).
        workers: how workers are started and a failed vGPU's worker re-created (``launcher``,
            ``backend``, ``backend_options`` of :mod:`ppipe.runtime.launch.launchers`); empty: never.
        grpc: keyword arguments of :class:`ppipe.runtime.ingress.grpc_server.GrpcServer` (host,
            port, token, message limit); empty: no gRPC frontend.
    """

    runtime: dict[str, Any] = field(default_factory=dict)
    app: dict[str, Any] = field(default_factory=dict)
    server: dict[str, Any] = field(default_factory=dict)
    workers: dict[str, Any] = field(default_factory=dict)
    grpc: dict[str, Any] = field(default_factory=dict)


def build_shard(dep: Any, models: list[str], workers: dict[str, Any], edges: dict, settings: ServeSettings, index: int,
                owner: dict[str, Any], companions: Callable[[Any, ShardRouter | None], list[Any]] | None = None,
                on_shutdown: Callable[[], None] | None = None):
    """One shard's runtime and app: ``dep``'s plan (the whole plan, or the shard's servers'
    sub-plan) restricted to ``models``, their workers and edges; returns ``(asgi_app,
    runtime, router)`` (``router`` None for a single shard; where ingress processes take
    the requests, ``settings.runtime["accept_ingresses"]``, an
    :class:`~ppipe.runtime.scheduler.ingresses.IngressDirectory` in its place and the
    shard's own app). ``owner``: where each model's requests go
    (:class:`~ppipe.runtime.ingress.shard_router.Routes`).

    ``companions(runtime, router)`` gives more companions of the shard's app (the peer
    exchange, plan switches), started after the router on the app's loop; the gRPC
    frontend (``settings.grpc``) comes last."""
    from ppipe.runtime.scheduler.host import Runtime
    from ppipe.runtime.ingress.http_server import create_app

    plan = sub_plan(dep.plan, models)
    mine = {p.vgpu_id for p in plan.placement}
    respawn = None
    if settings.workers:
        from ppipe.runtime.launch.launchers import respawn_function

        options = dict(settings.workers)
        respawn_worker = respawn_function(options.pop("launcher", "ray"))

        async def respawn(vgpu_id: str) -> Any:
            return await asyncio.to_thread(respawn_worker, dep, vgpu_id, **options)

    rt = Runtime(plan, {m: dep.profiles[m] for m in models}, dep.cluster, {v: h for v, h in workers.items() if v in mine},
                 edges={e: t for e, t in edges.items() if e[0] in mine}, respawn=respawn, **settings.runtime)
    several = len(Routes(owner, index).shards()) > 1
    if several and settings.runtime.get("accept_ingresses"):  # ingress processes deal the requests: no router
        from ppipe.runtime.scheduler.ingresses import IngressDirectory

        directory = IngressDirectory(rt, index, owner)
        extra = list(companions(rt, directory)) if companions else []
        return create_app(rt, companions=extra, on_shutdown=on_shutdown, **settings.app), rt, directory
    router = ShardRouter(None, index, owner, settings.runtime.get("data_secret")) if several else None
    extra = list(companions(rt, router)) if companions else []
    if settings.grpc:
        from ppipe.runtime.ingress.grpc_server import GrpcServer

        # started by the app's lifespan on uvicorn's loop, the runtime's (see create_app)
        extra.append(GrpcServer(rt, router=router, **settings.grpc))
    app = create_app(rt, companions=([router] if router else []) + extra, on_shutdown=on_shutdown, **settings.app)
    if router is None:
        return app, rt, None
    router.app = app
    return router, rt, router


class ShardServer:
    """Shard ``index`` (> 0) of ``ppipe serve --shards``, in a process of its own (a local
    process or a Ray actor): its runtime and app served by uvicorn on its own thread and
    loop, on the shared port; shard 0's requests answered by :meth:`control`. ``workers``
    None: it starts its part's workers itself (:meth:`_start_workers`), as a restarted Ray
    shard does."""

    def __init__(self, index: int, dep: Any, models: list[str], workers: dict[str, Any] | None, edges: dict, settings: ServeSettings,
                 owner: dict[str, Any], host: str, port: int):
        self.index, self.host, self.port = index, host, port
        self._args = (dep, models, workers, edges, settings, index, owner)
        self.server = None
        self.router: ShardRouter | None = None
        self._control: ShardControl | None = None  # this shard's answers to shard 0's requests

    async def start(self) -> str:
        """Start serving; returns this shard's router address (for :class:`PeerExchange`)."""
        from dataclasses import replace

        from ppipe.runtime.ingress.http_transport import BackgroundServer
        from ppipe.runtime.control.switch import PlanSwitcher

        dep, models, settings = self._args[0], self._args[1], self._args[4]
        if self._args[2] is None:  # a restarted shard starts its part's workers itself
            workers, edges = await asyncio.to_thread(self._start_workers)
            self._args = (dep, models, workers, edges, *self._args[4:])
        app, rt, self.router = build_shard(*self._args)
        mine = replace(dep, plan=sub_plan(dep.plan, models), profiles={m: dep.profiles[m] for m in models})
        self._control = ShardControl(PlanSwitcher(rt, mine, **settings.workers), self.router)
        # where ingress processes hold the port, a shard's own API listens on loopback only
        sock = socket.create_server(("127.0.0.1", 0)) if settings.runtime.get("accept_ingresses") else reuseport_socket(self.host, self.port)
        self.server = BackgroundServer(app, sockets=[sock], **settings.server)
        await asyncio.get_running_loop().run_in_executor(None, self.server.__enter__)
        return self.router.address

    def _start_workers(self) -> tuple[dict[str, Any], dict]:
        """The workers of this shard's part and their links, started by this process (the
        settings' launcher and transport): ``(workers, edges)``."""
        from ppipe.runtime.launch.serving import start_workers_and_links

        dep, models, settings = self._args[0], self._args[1], self._args[4]
        options, links = settings.workers, settings.runtime.get("links")
        mine = {p.vgpu_id for p in sub_plan(dep.plan, models).placement}
        return start_workers_and_links(dep, options.get("backend", "ort"), options.get("backend_options") or {},
                                       "tcp" if links is None else links.requested, options.get("launcher", "ray"), only=mine)

    # shard 0's requests (peers, plan switches: ppipe.runtime.control.switch.ShardedSwitcher), run on its loop
    async def _on_loop(self, coro) -> Any:
        return await asyncio.wrap_future(asyncio.run_coroutine_threadsafe(coro, self.server.loop))

    async def control(self, request: ShardRequest) -> Any:
        """This shard's answer to one of shard 0's requests, computed on the shard's loop by
        its :class:`~ppipe.runtime.control.shard_control.ShardControl`."""
        return await self._on_loop(self._control.call(request))

    async def stop(self) -> None:
        if self.server is not None:
            await asyncio.get_running_loop().run_in_executor(None, self.server.__exit__, None, None, None)


class ShardMetrics:
    """A companion of shard 0's app where ingresses take the requests of several schedulers
    (``--ingress N --shards K``): every ``every_s`` it asks each other shard for its metrics
    (:class:`~ppipe.runtime.control.shard_control.Scrape`) and keeps the last answer in the
    runtime's ``shard_metrics``, which the server's ``/metrics`` merges; a shard that does not
    answer (down, restarting) is left out until it does."""

    def __init__(self, runtime: Any, shards: list[ShardHandle], every_s: float = 1.0):
        self.runtime, self.shards, self.every_s = runtime, list(shards), every_s
        self._task: asyncio.Task | None = None

    async def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._scrape())

    async def _scrape(self) -> None:
        from ppipe.runtime.control.shard_control import Scrape

        while True:
            texts = await asyncio.gather(*(asyncio.wait_for(s.call(Scrape()), self.every_s * 2) for s in self.shards),
                                         return_exceptions=True)
            for j, text in enumerate(texts, 1):
                if isinstance(text, bytes):
                    self.runtime.shard_metrics[j] = text
                else:
                    self.runtime.shard_metrics.pop(j, None)
            await asyncio.sleep(self.every_s)

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()


class PeerExchange:
    """A companion of shard 0's app: once its router listens, tells every shard where all
    routers are (``addresses``: the other shards' router addresses, from their start)."""

    def __init__(self, router: ShardRouter, shards: list[ShardHandle], addresses: list[str | None]):
        self.router, self.shards, self.addresses = router, list(shards), list(addresses)

    @property
    def everyone(self) -> list[str | None]:
        """Every shard's router address, by index (None: that shard is down)."""
        return [self.router.address, *self.addresses]

    async def start(self) -> None:
        await self.tell_peers()

    async def tell_peers(self) -> None:
        """Send :attr:`everyone` to every shard that is up (this one in-process).

        Raises:
            Exception: the first shard's failure to hear it (every other shard heard it)."""
        everyone = tuple(self.everyone)
        self.router.set_peers(list(everyone))
        results = await asyncio.gather(*(s.call(SetPeers(everyone)) for s, a in zip(self.shards, self.addresses) if a is not None),
                                       return_exceptions=True)
        failed = [r for r in results if isinstance(r, BaseException)]
        if failed:
            raise failed[0]

    async def stop(self) -> None:
        return None


@dataclass(frozen=True)
class ShardStart:
    """What shard ``index`` is started with: the first frame on its pair.

    Attributes:
        index: the shard's number (> 0).
        dep: a :class:`~ppipe.runtime.launch.deploy.Deployment` that holds its models (the
            whole one at first, or its servers' sub-plan with ``--shard-by servers``; the
            shard's part after a plan switch).
        models: the models it serves.
        settings: every shard's :class:`~ppipe.runtime.launch.shards.ServeSettings`.
        owner: model -> the shard that serves it, or [(shard, weight)] where several do
            (every model's; :class:`~ppipe.runtime.ingress.shard_router.Routes`).
        host, port: the shared address it binds (``SO_REUSEPORT``).
        log_arrivals: start with the re-plan loop's arrival log on.
        start_timeout_s: its workers must have loaded their blocks within this.
    """

    index: int
    dep: Any
    models: list[str]
    settings: Any
    owner: dict[str, Any]
    host: str
    port: int
    log_arrivals: bool = False
    start_timeout_s: float = 300.0


class RestartableShard(ShardHandle, Protocol):
    """A shard that :class:`ShardSupervisor` restarts: ``lifeline()`` returns once it is
    gone (``why_gone`` says how; its requests then fail at once, ConnectionError), ``reset()``
    forgets the gone one, ``restart()`` (blocking) starts it again as it last served and
    returns its router address, ``up()`` lets requests reach it again, ``terminate()`` asks
    it to stop."""

    address: str | None
    why_gone: str | None

    def describe(self) -> str: ...

    async def lifeline(self) -> None: ...

    def reset(self) -> None: ...

    def restart(self) -> str: ...

    def up(self) -> None: ...

    def terminate(self) -> None: ...


class ShardSupervisor(PeerExchange):
    """A companion of shard 0's app: tells every shard where the routers are
    (:class:`PeerExchange`), watches each shard's lifeline and restarts a shard that dies
    (meanwhile it is down in every router); at stop, tells the shards that shard 0 is down
    and asks them to stop.

    ``shards``: :class:`RestartableShard` handles (a local process's
    :class:`~ppipe.runtime.launch.local_shards.LocalShard`, a Ray actor's
    :class:`~ppipe.runtime.launch.ray_shards.RayShard`)."""

    def __init__(self, router: Any, shards: list["RestartableShard"]):
        super().__init__(router, shards, [s.address for s in shards])
        self._watching: list[asyncio.Task] = []
        self._stopping = False
        self.restarts = 0  # shards restarted so far

    async def start(self) -> None:
        await super().start()
        self._watching = [asyncio.ensure_future(self._watch(i, s)) for i, s in enumerate(self.shards, 1)]

    async def _watch(self, index: int, shard: "RestartableShard") -> None:
        while True:
            await shard.lifeline()
            if self._stopping:
                return
            log.error("%s; its models' requests are answered 503 until it is back; restarting it", shard.why_gone)
            self.addresses[index - 1] = None
            await self._tell()
            shard.reset()
            for attempt in itertools.count():
                try:
                    self.addresses[index - 1] = await asyncio.to_thread(shard.restart)
                    break
                except Exception as exc:
                    delay = RESTART_DELAYS_S[min(attempt, len(RESTART_DELAYS_S) - 1)]
                    log.error("shard %d did not restart (%s); trying again in %.1f s", index, exc, delay)
                    await asyncio.sleep(delay)
                    if self._stopping:
                        return
            shard.up()
            self.restarts += 1
            await self._tell()
            log.warning("%s is back: restarted", shard.describe())

    async def _tell(self) -> None:
        """Every router learns the addresses; a shard that fails to hear it is its watcher's to restart."""
        try:
            await self.tell_peers()
        except Exception as exc:
            log.warning("a shard did not hear the new router addresses: %s", exc)

    async def stop(self) -> None:
        self._stopping = True
        for t in self._watching:
            t.cancel()
        down = (None, *self.addresses)  # requests the shards pass to shard 0 fail at once from now on
        try:
            await asyncio.wait_for(asyncio.gather(*(s.call(SetPeers(down)) for s, a in zip(self.shards, self.addresses)
                                                    if a is not None), return_exceptions=True), timeout=5.0)
        except asyncio.TimeoutError:
            pass
        for s in self.shards:
            s.terminate()
