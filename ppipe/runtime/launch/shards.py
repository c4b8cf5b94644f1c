"""Frontend shards: several processes serve one port, each scheduling its own models.

One frontend process (HTTP, decoding, the scheduler, the data path) uses one core, so its
CPU per request bounds the rate one process serves. ``ppipe serve --shards N`` runs N
frontend processes on the same port (``SO_REUSEPORT``: the kernel spreads connections
over them); shard 0 is the ``ppipe serve`` process, the others are Ray actors on the same
node (:class:`ShardServer`). Each shard owns some models: its scheduler, runtime and
workers serve only those. A request that reaches a shard for a model it does not own is
passed to the owner as it came (method, path, headers, body) over a data-path connection
(:class:`ShardRouter`) and answered from there, so every check, drop and metric happens
in the owner exactly as if the client had reached it directly.

Which models share a shard. A model's scheduling state is independent of another's
except for the NICs of the servers both send feature maps through. Shards are therefore
built from *NIC components* (:func:`nic_components`): models are joined when a server
hosts vGPUs of both in pipelines of two or more partitions (the only pipelines that
transfer). Shards never share a vGPU or a NIC, so the scheduler of the whole plan, the
one ``ppipe simulate`` runs, makes the same reservations as the shards' schedulers each
over its part: the simulator still predicts the sharded server, with no rule for sharing
a NIC at all. The components are packed into at most N shards by their planned load
(largest first, each to the least loaded shard).
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import math
import socket
from dataclasses import dataclass, field
from typing import Any, Callable

import orjson

from ppipe.spec.plan import Plan

log = logging.getLogger("ppipe.runtime")

# Frontend CPU per request used to size the default shard count (scripts/bench_serve.py
# measures it; a shard is sized to stay below TARGET_BUSY of its core at the planned rate).
FRONTEND_CPU_S_PER_REQUEST = 1.5e-3
TARGET_BUSY = 0.7


# ---- which models each shard owns (pure) ------------------------------------------------------
def nic_components(plan: Plan) -> list[list[str]]:
    """The plan's models grouped so that no two groups share a vGPU or a transferring NIC.

    Two models are in one group when some server hosts vGPUs of both in pipelines of two
    or more partitions. Groups are sorted, and each group's models in plan order.
    """
    order = [m.name for m in plan.models]
    parent = {m: m for m in order}

    def find(x: str) -> str:
        while parent[x] != x:
            parent[x] = parent[parent[x]]
            x = parent[x]
        return x

    multi = {(m.name, i) for m in plan.models for i, pl in enumerate(m.pipelines) if len(pl.partitions) > 1}
    first_on: dict[str, str] = {}
    for p in plan.placement:
        if (p.model, p.pipeline) not in multi:
            continue
        other = first_on.setdefault(p.server, p.model)
        parent[find(p.model)] = find(other)
    groups: dict[str, list[str]] = {}
    for m in order:
        groups.setdefault(find(m), []).append(m)
    return sorted(groups.values(), key=lambda g: order.index(g[0]))


def model_load(plan: Plan, model: str) -> float:
    """A model's frontend work at its planned rate: requests plus stage reports per second."""
    mp = plan.model(model)
    total = sum(pl.throughput_rps for pl in mp.pipelines) or mp.throughput_rps
    stages = sum(pl.throughput_rps * len(pl.partitions) for pl in mp.pipelines) / total if total else 1.0
    return mp.throughput_rps * (1.0 + stages / max(1, min(pl.batch for pl in mp.pipelines)))


def assign_shards(plan: Plan, n: int) -> list[list[str]]:
    """Split the plan's models into at most ``n`` shards of whole NIC components, balancing
    their planned load (largest component first, to the least loaded shard; ties by index)."""
    if n < 1:
        raise ValueError(f"n must be >= 1, got {n}")
    comps = nic_components(plan)
    comps.sort(key=lambda g: -sum(model_load(plan, m) for m in g))
    shards: list[list[str]] = [[] for _ in range(min(n, len(comps)))]
    load = [0.0] * len(shards)
    for g in comps:
        k = min(range(len(shards)), key=lambda i: (load[i], i))
        shards[k].extend(g)
        load[k] += sum(model_load(plan, m) for m in g)
    order = [m.name for m in plan.models]
    for s in shards:
        s.sort(key=order.index)
    return sorted(shards, key=lambda s: order.index(s[0]))


def auto_shards(plan: Plan, cores: int) -> int:
    """The default shard count: what the planned rate needs at ``FRONTEND_CPU_S_PER_REQUEST``
    (each shard at most ``TARGET_BUSY`` busy), no more than the NIC components, and no more
    than the cores but one (the workers and Ray's daemons need CPU too)."""
    rate = sum(m.throughput_rps for m in plan.models)
    need = math.ceil(rate * FRONTEND_CPU_S_PER_REQUEST / TARGET_BUSY)
    return max(1, min(need, len(nic_components(plan)), cores - 1))


def sub_plan(plan: Plan, models: list[str]) -> Plan:
    """The plan restricted to ``models`` (their pipelines and their vGPUs' placement)."""
    keep = set(models)
    return plan.model_copy(update={
        "models": [m for m in plan.models if m.name in keep],
        "placement": [p for p in plan.placement if p.model in keep],
    })


def shard_owners(old: Plan, owner: dict[str, int], new: Plan, n: int, source: str = "the new plan") -> dict[str, int]:
    """Which shard serves each model of ``new`` when a server of ``n`` shards switches to it.

    A model keeps its shard; a new model joins the shard of the models it shares NICs with
    (:func:`nic_components` of ``new``), else the least loaded shard (planned load; ties by
    index), larger components first.

    Raises:
        UserError: ``new`` joins models of two shards through a NIC, or leaves a shard
            with no model: the server cannot switch to it live.
    """
    from ppipe.errors import UserError

    load = [0.0] * n
    for m in new.models:
        if m.name in owner:
            load[owner[m.name]] += model_load(new, m.name)
    out: dict[str, int] = {}
    for comp in sorted(nic_components(new), key=lambda g: -sum(model_load(new, m) for m in g)):
        shards = sorted({owner[m] for m in comp if m in owner})
        if len(shards) > 1:
            raise UserError(f"{source}: the plan sends feature maps of {', '.join(comp)} through the NICs of one server, "
                            f"but shards {', '.join(map(str, shards))} of this server serve them and keep their models",
                            fix="restart `ppipe serve` with the new plan (its shards are cut anew), or serve with --shards 1")
        k = shards[0] if shards else min(range(n), key=lambda i: (load[i], i))
        for m in comp:
            if m not in owner:
                load[k] += model_load(new, m)
            out[m] = k
    idle = sorted(set(range(n)) - set(out.values()))
    if idle:
        raise UserError(f"{source}: the plan leaves shard{'s' if len(idle) > 1 else ''} {', '.join(map(str, idle))} of this "
                        "server with no model to serve (a shard keeps its models across a switch)",
                        fix="restart `ppipe serve` with the new plan, or serve with --shards 1")
    return out


def shard_resources(plan: Plan, owner: dict[str, int]) -> dict[str, set[int]]:
    """The shards that use each physical GPU (``"<server>/gpu<i>"``) and each NIC (a
    server's uplink or downlink, where it sends or receives feature maps) under ``plan``."""
    from ppipe.dataplane.api import downlink, uplink
    from ppipe.dataplane.handover import physical_gpu

    multi = {(m.name, i) for m in plan.models for i, pl in enumerate(m.pipelines) if len(pl.partitions) > 1}
    out: dict[str, set[int]] = {}
    for p in plan.placement:
        k = owner[p.model]
        out.setdefault(physical_gpu(p.vgpu_id), set()).add(k)
        if (p.model, p.pipeline) in multi:
            for res in (uplink(p.server), downlink(p.server)):
                out.setdefault(res, set()).add(k)
    return out


def incoming_resources(old: Plan, old_owner: dict[str, int], new: Plan, new_owner: dict[str, int],
                       switching: set[int]) -> dict[int, dict[str, set[int]]]:
    """For each shard, the GPUs and NICs it uses under ``new`` that other shards of
    ``switching`` (those whose part of the plan changes) used under ``old``: shard ->
    resource -> those shards. A shard that does not switch keeps its resources as they are."""
    before, after = shard_resources(old, old_owner), shard_resources(new, new_owner)
    out: dict[int, dict[str, set[int]]] = {}
    for res, takers in sorted(after.items()):
        for k in sorted(takers):
            givers = (before.get(res, set()) & switching) - {k}
            if givers:
                out.setdefault(k, {})[res] = givers
    return out


_STARTING = (503, [(b"content-type", b"application/json")], b'{"error": "the server is starting; retry shortly"}')


def merge_readiness(answers: list[tuple[int, list, bytes]]) -> tuple[int, list, bytes]:
    """The server's ``/v2/health/ready`` from its shards' answers ``(status, headers, body)``:
    not ready while some shard has not started (its runtime is not up, or it cannot be
    reached yet: a load balancer that sent requests then would get "starting" 503s for that
    shard's models), then ready while some shard is (it has a ready model). Returns the
    answer to give: a starting shard's, a ready one's, or the first shard's 503."""
    def starting(answer: tuple[int, list, bytes]) -> bool:
        if answer[0] == 200:
            return False
        try:
            body = orjson.loads(answer[2])
        except orjson.JSONDecodeError:
            return False
        if isinstance(body, dict) and "started" in body:  # a shard's own readiness
            return body["started"] is False
        return answer[2] == _STARTING[2]  # a shard that cannot pass requests yet, or cannot be reached

    waiting = [a for a in answers if starting(a)]
    good = [a for a in answers if a[0] == 200]
    return waiting[0] if waiting else good[0] if good else answers[0]


def merge_metrics(texts: list[bytes]) -> bytes:
    """Prometheus text expositions of several shards as one: each family once, with the
    samples of every shard (the shards' label sets are disjoint: models, vGPUs)."""
    families: dict[str, list[str]] = {}
    samples: dict[str, list[str]] = {}
    for text in texts:
        current = None
        for line in text.decode().splitlines():
            if line.startswith("# HELP ") or line.startswith("# TYPE "):
                current = line.split()[2]
                head = families.setdefault(current, [])
                if line not in head:
                    head.append(line)
                samples.setdefault(current, [])
            elif line.strip():
                samples.setdefault(current or "", []).append(line)
    out = []
    for name, head in families.items():
        out += head + samples.pop(name, [])
    for rest in samples.values():
        out += rest
    return ("\n".join(out) + "\n").encode()


# ---- passing requests between shards ------------------------------------------------------------------
class ShardRouter:
    """ASGI: serves the models this shard owns with ``app``; passes the others to their owners.

    Args:
        app: this shard's app (:func:`ppipe.runtime.ingress.http_server.create_app`).
        index: this shard's number.
        owner: model name -> the shard that owns it (every model of the plan).

    Requests under ``/v2/models/{name}`` go to the owner of ``name`` (names no shard owns
    stay here, for the 404), those under ``/v2/admin/`` (plan switches) to shard 0. ``/v2/health/ready`` and ``/metrics`` ask every shard and
    combine the answers (:func:`merge_readiness`); everything else is answered here. Between shards, a request is one
    data-path message (header: method, path, query, headers; the body as bytes), and so is
    its answer; the owner replays it into its own app.
    """

    def __init__(self, app: Any, index: int, owner: dict[str, int]):
        self.app, self.index, self.owner = app, index, dict(owner)
        self.peers: list[str] | None = None  # every shard's router address, by index
        self.address: str | None = None
        self._inbox = None
        self._outbox = None
        self._ids = itertools.count()
        self._waiting: dict[int, asyncio.Future] = {}
        self.grpc: Any = None  # this shard's GrpcFrontend, where it serves gRPC too

    # lifecycle (a companion of the app: started and stopped on the server's loop)
    async def start(self) -> None:
        from ppipe.runtime.wire.datapath import Inbox, LOOPBACK, Outbox

        self._inbox, self._outbox = Inbox(self._on_message, LOOPBACK), Outbox()
        self.address = self._inbox.address

    async def stop(self) -> None:
        for f in self._waiting.values():
            if not f.done():
                f.set_exception(ConnectionError("the shard is stopping"))
        if self._inbox is not None:
            self._inbox.close()
            self._outbox.close()

    def set_peers(self, addresses: list[str]) -> None:
        self.peers = list(addresses)

    # ASGI
    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        path = scope.get("path", "")
        if path.startswith("/v2/models/"):
            name = path[len("/v2/models/"):].split("/", 1)[0]
            target = self.owner.get(name, self.index)
            if target != self.index:
                return await self._pass(target, scope, receive, send)
        elif path.startswith("/v2/admin/") and self.index != 0:  # plan switches: shard 0 runs them
            return await self._pass(0, scope, receive, send)
        elif path in ("/v2/health/ready", "/metrics") and len(set(self.owner.values())) > 1:
            return await self._gather(path, scope, receive, send)
        await self.app(scope, receive, send)

    async def _pass(self, target: int, scope, receive, send) -> None:
        body = await _read_body(receive)
        if body is None:
            return  # the client left
        status, headers, out = await self._ask(target, scope, body)
        await _respond(send, status, headers, out)

    async def _gather(self, path: str, scope, receive, send) -> None:
        body = await _read_body(receive)
        if body is None:
            return
        shards = sorted(set(self.owner.values()))
        answers = await asyncio.gather(*(self._ask(i, scope, body) for i in shards))
        bad = [a for a in answers if a[0] != 200]
        if path == "/metrics" and not bad:
            merged = merge_metrics([a[2] for a in answers])
            await _respond(send, 200, [(b"content-type", b"text/plain; version=0.0.4")], merged)
        elif path == "/metrics":  # an error (401) as the first shard that gave it
            await _respond(send, *bad[0])
        else:
            await _respond(send, *merge_readiness(answers))

    async def ready(self) -> bool:
        """Whether the server is ready, by :func:`merge_readiness` of every shard's answer."""
        scope = {"method": "GET", "path": "/v2/health/ready", "query_string": b"", "headers": [], "http_version": "1.1"}
        answers = await asyncio.gather(*(self._ask(i, scope, b"") for i in sorted(set(self.owner.values()))))
        return merge_readiness(answers)[0] == 200

    async def ask_grpc(self, target: int, rpc: str, request: bytes, metadata: list) -> tuple[str | None, str, list, bytes]:
        """Shard ``target``'s gRPC answer to ``rpc`` (:meth:`GrpcFrontend.serve_passed
        <ppipe.runtime.ingress.grpc_server.GrpcFrontend.serve_passed>`): ``(code, message, trailing, response)``."""
        if self.peers is None:
            return "UNAVAILABLE", "the server is starting; retry shortly", [], b""
        from ppipe.runtime.wire.frames import pack

        rid = next(self._ids)
        fut = self._waiting[rid] = asyncio.get_running_loop().create_future()
        head = {"op": "grpc", "id": rid, "from": self.address, "rpc": rpc, "metadata": [list(m) for m in metadata]}
        try:
            self._outbox.send(self.peers[target], pack(head, {"body": _bytes_array(request)}))
            return await fut
        except Exception as exc:
            log.warning("shard %d could not reach shard %d: %s", self.index, target, exc)
            return "UNAVAILABLE", "a shard of this server did not answer", [], b""
        finally:
            self._waiting.pop(rid, None)

    async def _ask(self, target: int, scope, body: bytes) -> tuple[int, list, bytes]:
        """Answer of shard ``target`` (this one in-process) to the request ``scope`` + ``body``."""
        if target == self.index:
            return await self._replay_here(_wire_scope(scope), body)
        if self.peers is None:
            return _STARTING
        from ppipe.runtime.wire.frames import pack

        rid = next(self._ids)
        fut = self._waiting[rid] = asyncio.get_running_loop().create_future()
        head = {"op": "request", "id": rid, "from": self.address, **_wire_scope(scope)}
        try:
            self._outbox.send(self.peers[target], pack(head, {"body": _bytes_array(body)}))
            return await fut
        except Exception as exc:
            log.warning("shard %d could not reach shard %d: %s", self.index, target, exc)
            return 503, [(b"content-type", b"application/json")], b'{"error": "a shard of this server did not answer"}'
        finally:
            self._waiting.pop(rid, None)

    def _on_message(self, message) -> None:
        from ppipe.runtime.wire.frames import unpack

        head, tensors = unpack(message)
        body = tensors["body"].tobytes() if "body" in tensors else b""
        op = head.get("op")
        if op in ("request", "grpc"):
            serve = self._serve_peer if op == "request" else self._serve_grpc
            task = asyncio.get_running_loop().create_task(serve(head, body))
            task.add_done_callback(lambda t: t.cancelled() or t.exception())
        elif op == "answer":
            fut = self._waiting.get(head["id"])
            if fut is not None and not fut.done():
                if "grpc" in head:
                    fut.set_result((*head["grpc"], body))
                else:
                    fut.set_result((head["status"], [tuple(h) for h in head["headers"]], body))

    async def _replay_here(self, head: dict[str, Any], body: bytes) -> tuple[int, list, bytes]:
        """This shard's app's answer; its readiness is "starting" until it can pass requests
        to the other shards (a request for their models reaching it would get a 503)."""
        if head["path"] == "/v2/health/ready" and self.peers is None:
            return _STARTING
        return await _replay(self.app, head, body)

    async def _serve_peer(self, head: dict[str, Any], body: bytes) -> None:
        from ppipe.runtime.wire.frames import pack

        try:
            status, headers, out = await self._replay_here(head, body)
        except Exception:
            log.exception("shard %d: a passed request failed", self.index)
            status, headers, out = 500, [(b"content-type", b"application/json")], b'{"error": "internal error in a shard"}'
        self._outbox.send(head["from"], pack({"op": "answer", "id": head["id"], "status": status, "headers": headers},
                                             {"body": _bytes_array(out)}))


    async def _serve_grpc(self, head: dict[str, Any], body: bytes) -> None:
        from ppipe.runtime.wire.frames import pack

        if self.grpc is None:
            answer = ("UNIMPLEMENTED", "this shard does not serve gRPC", [], b"")
        else:
            try:
                answer = await self.grpc.serve_passed(head["rpc"], body, head["metadata"])
            except Exception:
                log.exception("shard %d: a passed gRPC call failed", self.index)
                answer = ("INTERNAL", "internal error in a shard", [], b"")
        self._outbox.send(head["from"], pack({"op": "answer", "id": head["id"], "grpc": [answer[0], answer[1], [list(t) for t in answer[2]]]},
                                             {"body": _bytes_array(answer[3])}))


def _wire_scope(scope) -> dict[str, Any]:
    """What of an ASGI scope travels to another shard."""
    return {
        "method": scope["method"], "path": scope["path"], "query": scope.get("query_string", b""),
        "headers": [[k, v] for k, v in scope["headers"] if k != b"content-length"],
        "http_version": scope.get("http_version", "1.1"), "client": list(scope.get("client") or ("", 0)),
    }


async def _replay(app: Any, head: dict[str, Any], body: bytes) -> tuple[int, list, bytes]:
    """Run one request (as :func:`_wire_scope` describes it) through ``app``; returns its answer."""
    scope = {
        "type": "http", "asgi": {"version": "3.0"}, "http_version": head["http_version"], "method": head["method"],
        "scheme": "http", "path": head["path"], "raw_path": head["path"].encode(), "query_string": head["query"],
        "root_path": "", "headers": [(bytes(k), bytes(v)) for k, v in head["headers"]] + [(b"content-length", str(len(body)).encode())],
        "client": tuple(head["client"]), "server": None,
    }
    sent = False
    done = asyncio.Event()

    async def receive():
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        await done.wait()
        return {"type": "http.disconnect"}

    answer: dict[str, Any] = {"status": 500, "headers": [], "body": []}

    async def send(msg):
        if msg["type"] == "http.response.start":
            answer["status"], answer["headers"] = msg["status"], [(bytes(k), bytes(v)) for k, v in msg.get("headers", [])]
        elif msg["type"] == "http.response.body":
            answer["body"].append(msg.get("body", b""))

    try:
        await app(scope, receive, send)
    finally:
        done.set()
    headers = [(k, v) for k, v in answer["headers"] if k.lower() != b"content-length"]
    return answer["status"], headers, b"".join(answer["body"])


async def _read_body(receive) -> bytes | None:
    chunks = []
    while True:
        msg = await receive()
        if msg["type"] == "http.disconnect":
            return None
        chunks.append(msg.get("body", b""))
        if not msg.get("more_body", False):
            return b"".join(chunks)


async def _respond(send, status: int, headers: list, body: bytes) -> None:
    raw = [(bytes(k), bytes(v)) for k, v in headers] + [(b"content-length", str(len(body)).encode())]
    await send({"type": "http.response.start", "status": status, "headers": raw})
    await send({"type": "http.response.body", "body": body})


def _bytes_array(data: bytes):
    import numpy as np

    return np.frombuffer(data, dtype=np.uint8)


def reuseport_socket(host: str, port: int) -> socket.socket:
    """A listening TCP socket on ``host:port`` that other shards may bind too (``SO_REUSEPORT``)."""
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    sock.bind((host, port))
    sock.listen(2048)
    sock.set_inheritable(True)
    return sock



# ---- a shard's server ------------------------------------------------------------------------------------
@dataclass(frozen=True)
class ServeSettings:
    """How every shard serves (the flags of ``ppipe serve``).

    Attributes:
        runtime: keyword arguments of :class:`ppipe.runtime.scheduler.host.Runtime` (policy,
            scheduler options, dispatch lead, answer budget, the link opener of plan switches).
        app: keyword arguments of :func:`ppipe.runtime.ingress.http_server.create_app` (token, body
            limits and timeouts, decode workers).
        server: keyword arguments of :func:`ppipe.runtime.ingress.http_server.uvicorn_config` (timeouts).
        workers: how a failed vGPU's worker is re-created (``backend``,
            ``backend_options`` of :func:`ppipe.runtime.launch.deploy.respawn_worker`); empty: never.
        grpc: keyword arguments of :class:`ppipe.runtime.ingress.grpc_server.GrpcServer` (host,
            port, token, message limit); empty: no gRPC frontend.
    """

    runtime: dict[str, Any] = field(default_factory=dict)
    app: dict[str, Any] = field(default_factory=dict)
    server: dict[str, Any] = field(default_factory=dict)
    workers: dict[str, Any] = field(default_factory=dict)
    grpc: dict[str, Any] = field(default_factory=dict)


def build_shard(dep: Any, models: list[str], workers: dict[str, Any], edges: dict, settings: ServeSettings, index: int,
                owner: dict[str, int], companions: Callable[[Any, "ShardRouter | None"], list[Any]] | None = None,
                on_shutdown: Callable[[], None] | None = None):
    """One shard's runtime and app: the plan restricted to ``models``, their workers and
    edges; returns ``(asgi_app, runtime, router)`` (``router`` None for a single shard).

    ``companions(runtime, router)`` gives more companions of the shard's app (the peer
    exchange, plan switches), started after the router on the app's loop; the gRPC
    frontend (``settings.grpc``) comes last."""
    from ppipe.runtime.scheduler.host import Runtime
    from ppipe.runtime.ingress.http_server import create_app

    plan = sub_plan(dep.plan, models)
    mine = {p.vgpu_id for p in plan.placement}
    respawn = None
    if settings.workers:
        from ppipe.runtime.launch.deploy import respawn_worker

        async def respawn(vgpu_id: str) -> Any:
            return await asyncio.to_thread(respawn_worker, dep, vgpu_id, **settings.workers)

    rt = Runtime(plan, {m: dep.profiles[m] for m in models}, dep.cluster, {v: h for v, h in workers.items() if v in mine},
                 edges={e: t for e, t in edges.items() if e[0] in mine}, respawn=respawn, **settings.runtime)
    router = ShardRouter(None, index, owner) if len(set(owner.values())) > 1 else None
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
    """Shard ``index`` (> 0) of ``ppipe serve --shards``, as a Ray actor on the head node:
    its runtime and app served by uvicorn on its own thread and loop, on the shared port."""

    def __init__(self, index: int, dep: Any, models: list[str], workers: dict[str, Any], edges: dict, settings: ServeSettings,
                 owner: dict[str, int], host: str, port: int):
        from ppipe.runtime.workers.worker import _undo_ray_niceness

        _undo_ray_niceness()  # on every request's path, like the workers
        self.index, self.host, self.port = index, host, port
        self._args = (dep, models, workers, edges, settings, index, owner)
        self.server = None
        self.router: ShardRouter | None = None

    async def start(self) -> str:
        """Start serving; returns this shard's router address (for :meth:`set_peers`)."""
        from dataclasses import replace

        from ppipe.runtime.ingress.http_server import BackgroundServer
        from ppipe.runtime.control.switch import PlanSwitcher

        dep, models, settings = self._args[0], self._args[1], self._args[4]
        app, rt, self.router = build_shard(*self._args)
        mine = replace(dep, plan=sub_plan(dep.plan, models), profiles={m: dep.profiles[m] for m in models})
        self.switcher = PlanSwitcher(rt, mine, **settings.workers)
        self.server = BackgroundServer(app, sockets=[reuseport_socket(self.host, self.port)], **settings.server)
        await asyncio.get_running_loop().run_in_executor(None, self.server.__enter__)
        return self.router.address

    async def set_peers(self, addresses: list[str]) -> None:
        self.server.loop.call_soon_threadsafe(self.router.set_peers, addresses)

    # this shard's part of plan switches (ppipe.runtime.control.switch.ShardedSwitcher), run on its loop
    async def _on_loop(self, coro) -> Any:
        return await asyncio.wrap_future(asyncio.run_coroutine_threadsafe(coro, self.server.loop))

    async def switcher_call(self, method: str, *args: Any) -> Any:
        """``await self.switcher.<method>(*args)`` on the shard's loop (:class:`ppipe.runtime.control.switch.ShardedSwitcher`)."""
        return await self._on_loop(getattr(self.switcher, method)(*args))

    async def set_owner(self, owner: dict[str, int]) -> None:
        self.server.loop.call_soon_threadsafe(setattr, self.router, "owner", dict(owner))

    async def stop(self) -> None:
        if self.server is not None:
            await asyncio.get_running_loop().run_in_executor(None, self.server.__exit__, None, None, None)


def here_strategy():
    """Ray scheduling on this process's node (shards share its port)."""
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    return NodeAffinitySchedulingStrategy(node_id=ray.get_runtime_context().get_node_id(), soft=False)


def parse_shards(value: str, plan: Plan, cores: int) -> int:
    """``--shards``: ``auto`` (:func:`auto_shards`) or a count >= 1 (capped by the plan's
    NIC components when it is packed)."""
    if value == "auto":
        return auto_shards(plan, cores)
    try:
        n = int(value)
    except ValueError:
        n = 0
    if n < 1:
        from ppipe.errors import UserError

        raise UserError(f"--shards must be 'auto' or a count >= 1, got '{value}'", fix="e.g. --shards 2, or leave it at auto")
    return n


def shard_actor_class():
    """:class:`ShardServer` as a Ray actor class."""
    import ray

    return ray.remote(num_cpus=0, max_concurrency=16)(ShardServer)


class PeerExchange:
    """A companion of shard 0's app: once its router listens, tells every shard where all
    routers are (the shard actors' addresses came back from their ``start``)."""

    def __init__(self, router: ShardRouter, actors: list[Any], addresses: list[str]):
        self.router, self.actors, self.addresses = router, actors, addresses

    async def start(self) -> None:
        everyone = [self.router.address, *self.addresses]
        self.router.set_peers(everyone)
        await asyncio.gather(*(a.set_peers.remote(everyone) for a in self.actors))

    async def stop(self) -> None:
        return None
