"""Passing requests between frontend shards: the ASGI router in front of each shard's app.

On a server of several frontend shards (``ppipe serve --shards N``,
:mod:`ppipe.runtime.launch.shards`) every shard serves the same port, and the kernel
spreads connections over them; each shard schedules only its own part of the plan
(:mod:`ppipe.runtime.control.shard_plan`): whole models (``--shard-by models``), or its
group of servers, so that one model may live on several shards (``--shard-by servers``).
Each shard decides where a request for a model goes by :class:`Routes`: the one shard that
serves the model, or, where several do, the next turn of this shard's smooth weighted
round robin over them, weighted by their capacity for the model (the deal of
:class:`ppipe.dataplane.split.SplitScheduler`, which the simulator runs). Every shard deals
what it receives, so the split follows capacity however the kernel spreads connections.
A request whose turn falls on another shard is passed there as it came (method, path,
headers, body) over a data-path connection (:class:`ShardRouter`) and answered from there,
so every check, drop and metric happens in that shard exactly as if the client had reached
it directly; a passed request is served where it lands, never dealt again. The messages
are those of :mod:`ppipe.runtime.wire.shard_messages`.

A shard that is down (its process died and is being restarted, or the server is stopping)
is ``None`` among the peers (:meth:`ShardRouter.set_peers`): its models' requests get an
explicit 503 at once, and those already waiting for its answer get one too, so that no
request waits for an answer that cannot come. ``/metrics`` meanwhile answers with the
other shards' series and ``ppipe_shard_up{shard="i"} 0`` for the one that is down.
"""

from __future__ import annotations

import asyncio
import contextvars
import itertools
import logging
from typing import Any, Iterator, Mapping, Sequence

import numpy as np
import orjson

from ppipe.dataplane.split import Dealer, owner_table
from ppipe.runtime.scheduler.metrics import merge_metrics  # noqa: F401 (the router's scrape merges with it; tests import it from here)
from ppipe.runtime.wire.frames import WireError, pack, unpack
from ppipe.runtime.wire.shard_messages import (
    GrpcAnswer, HttpRequest, PassAnswer, PassGrpc, PassRequest, ShardEnvelope, join_metadata, split_metadata,
)

log = logging.getLogger("ppipe.runtime")

_JSON = [(b"content-type", b"application/json")]
# what a shard that cannot pass requests yet (or cannot be reached) answers
_STARTING = (503, _JSON, b'{"error": "the server is starting; retry shortly"}')


# set while a shard serves a request another shard passed to it: it is served here, not dealt again
_PASSED: contextvars.ContextVar[bool] = contextvars.ContextVar("ppipe_shard_passed", default=False)


class Routes:
    """Where each model's requests go from shard ``index``: model -> [(shard, weight)].

    Args:
        table: model -> the shard that serves it (``int``), or the shards that do with their
            weights (their capacity for it); shards of weight 0 are left out.
        index: the shard these routes are of.

    :meth:`get` (``routes.get(model, default)``, as a dict of owners is read) gives the
    shard for the next request of a model: the only one, or the next turn of a smooth
    weighted round robin over several (``ppipe.dataplane.split``'s dealer), each call one
    turn. Within the handling of a request another shard passed here, it is this shard.
    """

    def __init__(self, table: Mapping[str, int | Sequence[tuple[int, float]]], index: int):
        self.index = index
        self.table: dict[str, tuple[tuple[int, float], ...]] = owner_table(table)
        self._dealers = {m: Dealer([w for _, w in e]) for m, e in self.table.items() if len(e) > 1}

    def get(self, model: str, default: Any = None) -> Any:
        """The shard to serve the next request of ``model`` (``default`` for a model no shard serves)."""
        entries = self.table.get(model)
        if entries is None:
            return default
        if _PASSED.get():
            return self.index
        dealer = self._dealers.get(model)
        return entries[0][0] if dealer is None else entries[dealer.next()][0]

    def shards_of(self, model: str) -> list[int]:
        """The shards that serve ``model``."""
        return [k for k, _ in self.table.get(model, ())]

    def values(self) -> list[int]:
        """Every (model, shard) pair's shard: ``set(routes.values())`` is the shards that serve something."""
        return [k for entries in self.table.values() for k, _ in entries]

    def shards(self) -> list[int]:
        """The shards that serve some model, in order."""
        return sorted(set(self.values()))

    def __contains__(self, model: object) -> bool:
        return model in self.table

    def __iter__(self) -> Iterator[str]:
        return iter(self.table)

    def __len__(self) -> int:
        return len(self.table)

    def split(self) -> bool:
        """Whether some model lives on several shards."""
        return bool(self._dealers)


class ShardDown(ConnectionError):
    """The shard a request was passed to is down: it died (and is being restarted) or stops."""


def _down(target: int) -> ShardDown:
    return ShardDown(f"shard {target} of this server is down (restarting or stopping); its models' requests "
                     "fail until it is back: retry shortly")


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


class ShardRouter:
    """ASGI: serves this shard's requests with ``app``; passes the others to the shards they are dealt to.

    Args:
        app: this shard's app (:func:`ppipe.runtime.ingress.http_server.create_app`).
        index: this shard's number.
        owner: every model of the plan -> the shard that serves it, or the shards that do
            with their weights, [(shard, weight)] (:class:`Routes`; ``--shard-by servers``).
        secret: the server's data-path secret: connections between shards prove it (None:
            not authenticated).

    Requests under ``/v2/models/{name}`` go where :attr:`owner` (a :class:`Routes`) deals
    them (names no shard serves stay here, for the 404), those under ``/v2/admin/`` (plan
    switches) to shard 0.
    ``/v2/health/ready`` and ``/metrics`` ask every shard and combine the answers
    (:func:`merge_readiness`, :func:`merge_metrics`; the metrics of the shards that are up,
    while another is down); everything else is answered here.
    Between shards, a request is one data-path message (:class:`PassRequest
    <ppipe.runtime.wire.shard_messages.PassRequest>`, the body as its tensor), and so is its
    answer; the shard it is passed to replays it into its own app. A message that does not decode is logged
    and dropped.
    """

    def __init__(self, app: Any, index: int, owner: Mapping[str, Any], secret: bytes | None = None):
        self.app, self.index, self.secret = app, index, secret
        self.owner = owner
        self.peers: list[str] | None = None  # every shard's router address, by index
        self.address: str | None = None
        self._inbox = None
        self._outbox = None
        self._ids = itertools.count()
        self._waiting: dict[int, asyncio.Future] = {}  # id -> (answer message, body)
        self._target: dict[int, int] = {}  # id -> the shard that is to answer it
        self.grpc: Any = None  # this shard's GrpcFrontend, where it serves gRPC too

    @property
    def owner(self) -> Routes:
        """Where each model's requests go (:class:`Routes`); set it with a dict of owners or of weighted shards."""
        return self._routes

    @owner.setter
    def owner(self, table: Mapping[str, Any]) -> None:
        self._routes = Routes(table.table if isinstance(table, Routes) else table, self.index)

    # lifecycle (a companion of the app: started and stopped on the server's loop)
    async def start(self) -> None:
        from ppipe.runtime.wire.datapath import Inbox, LOOPBACK, Outbox

        self._inbox, self._outbox = Inbox(self._on_message, LOOPBACK, self.secret), Outbox(self.secret)
        self.address = self._inbox.address

    async def stop(self) -> None:
        for f in self._waiting.values():
            if not f.done():
                f.set_exception(ConnectionError("the shard is stopping"))
        if self._inbox is not None:
            self._inbox.close()
            self._outbox.close()

    def set_peers(self, addresses: list[str | None]) -> None:
        """Every shard's router address, by index (``None``: that shard is down). A request
        waiting for a shard whose address changes (it died, or came back as a new process)
        fails now with :class:`ShardDown`: its answer would never come."""
        old, self.peers = self.peers, list(addresses)
        if old is None:
            return
        changed = {i for i, a in enumerate(old) if a is not None and (i >= len(self.peers) or self.peers[i] != a)}
        for rid, target in list(self._target.items()):
            fut = self._waiting.get(rid)
            if target in changed and fut is not None and not fut.done():
                fut.set_exception(_down(target))

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
        elif path in ("/v2/health/ready", "/metrics") and len(self.owner.shards()) > 1:
            return await self._gather(path, scope, receive, send)
        await self.app(scope, receive, send)

    async def _pass(self, target: int, scope, receive, send) -> None:
        body = await _read_body(receive)
        if body is None:
            return  # the client left
        status, headers, out = await self._ask(target, scope, body)
        await _respond(send, status, headers, out)

    async def _gather(self, path: str, scope, receive, send) -> None:
        """``/v2/health/ready`` or ``/metrics`` from every shard's answer. Readiness is
        :func:`merge_readiness`'s. Metrics are the merge of the shards that answered 200,
        with ``ppipe_shard_up`` saying which did not (a shard that is down answers 503: its
        series are missing from this scrape, the others' are kept); a refusal (401: a bad
        token) is given as the first shard gave it, and so is a 503 when no shard answered."""
        body = await _read_body(receive)
        if body is None:
            return
        shards = self.owner.shards()
        answers = await asyncio.gather(*(self._ask(i, scope, body) for i in shards))
        if path == "/v2/health/ready":
            return await _respond(send, *merge_readiness(answers))
        refused = [a for a in answers if 400 <= a[0] < 500]
        got = [(i, a) for i, a in zip(shards, answers) if a[0] == 200]
        if refused or not got:  # a bad token (401) as the first shard that gave it; no shard answered: its 503
            return await _respond(send, *(refused or answers)[0])
        merged = merge_metrics([a[2] for _, a in got], [i for i, _ in got] if self.owner.split() else None,
                               up={i: a[0] == 200 for i, a in zip(shards, answers)})
        await _respond(send, 200, [(b"content-type", b"text/plain; version=0.0.4")], merged)

    async def ready(self) -> bool:
        """Whether the server is ready, by :func:`merge_readiness` of every shard's answer."""
        scope = {"method": "GET", "path": "/v2/health/ready", "query_string": b"", "headers": [], "http_version": "1.1"}
        answers = await asyncio.gather(*(self._ask(i, scope, b"") for i in self.owner.shards()))
        return merge_readiness(answers)[0] == 200

    # asking another shard
    async def ask_grpc(self, target: int, rpc: str, request: bytes, metadata: list) -> tuple[str | None, str, list, bytes]:
        """Shard ``target``'s gRPC answer to ``rpc`` (:meth:`GrpcFrontend.serve_passed
        <ppipe.runtime.ingress.grpc_server.GrpcFrontend.serve_passed>`): ``(code, message, trailing, response)``."""
        if self.peers is None:
            return "UNAVAILABLE", "the server is starting; retry shortly", [], b""
        rid = next(self._ids)
        try:
            msg = PassGrpc(rid, self.address, rpc, *split_metadata(metadata))
            answer, body = await self._send_and_wait(target, msg, request)
            if not isinstance(answer, GrpcAnswer):
                raise WireError(f"a {type(answer).__name__} answered a gRPC call")
            return answer.code, answer.message, join_metadata(answer.trailing, answer.binary_trailing), body
        except ShardDown as exc:
            return "UNAVAILABLE", str(exc), [], b""
        except Exception as exc:
            log.warning("shard %d could not reach shard %d: %s", self.index, target, exc)
            return "UNAVAILABLE", "a shard of this server did not answer", [], b""

    async def _ask(self, target: int, scope, body: bytes) -> tuple[int, list, bytes]:
        """Answer of shard ``target`` (this one in-process) to the request ``scope`` + ``body``."""
        request = _wire_scope(scope)
        if target == self.index:
            return await self._replay_here(request, body)
        if self.peers is None:
            return _STARTING
        try:
            answer, out = await self._send_and_wait(target, PassRequest(next(self._ids), self.address, request), body)
            if not isinstance(answer, PassAnswer):
                raise WireError(f"a {type(answer).__name__} answered an HTTP request")
            return answer.status, list(answer.headers), out
        except ShardDown as exc:
            return 503, _JSON, orjson.dumps({"error": str(exc)})
        except Exception as exc:
            log.warning("shard %d could not reach shard %d: %s", self.index, target, exc)
            return 503, _JSON, b'{"error": "a shard of this server did not answer"}'

    async def _send_and_wait(self, target: int, msg: PassRequest | PassGrpc, body: bytes) -> tuple[Any, bytes]:
        """Send ``msg`` with ``body`` to shard ``target``; its answer and the answer's body."""
        address = self.peers[target]
        if address is None:
            raise _down(target)
        fut = self._waiting[msg.id] = asyncio.get_running_loop().create_future()
        self._target[msg.id] = target
        try:
            self._outbox.send(address, pack(ShardEnvelope(msg), {"body": _bytes_array(body)}))
            return await fut
        finally:
            self._waiting.pop(msg.id, None)
            self._target.pop(msg.id, None)

    # what other shards send
    def _on_message(self, message) -> None:
        try:
            envelope, tensors = unpack(message, ShardEnvelope)
        except WireError as exc:
            log.warning("shard %d: dropped a malformed message from another shard: %s", self.index, exc)
            return
        body = tensors["body"].tobytes() if "body" in tensors else b""
        msg = envelope.msg
        if isinstance(msg, (PassRequest, PassGrpc)):
            serve = self._serve_peer(msg, body) if isinstance(msg, PassRequest) else self._serve_grpc(msg, body)
            task = asyncio.get_running_loop().create_task(serve)
            task.add_done_callback(lambda t: t.cancelled() or t.exception())
        else:  # an answer
            fut = self._waiting.get(msg.id)
            if fut is not None and not fut.done():
                fut.set_result((msg, body))

    async def _replay_here(self, request: HttpRequest, body: bytes) -> tuple[int, list, bytes]:
        """This shard's app's answer; its readiness is "starting" until it can pass requests
        to the other shards (a request for their models reaching it would get a 503)."""
        if request.path == "/v2/health/ready" and self.peers is None:
            return _STARTING
        return await _replay(self.app, request, body)

    async def _serve_peer(self, msg: PassRequest, body: bytes) -> None:
        try:
            status, headers, out = await self._replay_here(msg.request, body)
        except Exception:
            log.exception("shard %d: a passed request failed", self.index)
            status, headers, out = 500, _JSON, b'{"error": "internal error in a shard"}'
        answer = PassAnswer(msg.id, status, tuple(headers))
        self._outbox.send(msg.reply_to, pack(ShardEnvelope(answer), {"body": _bytes_array(out)}))

    async def _serve_grpc(self, msg: PassGrpc, body: bytes) -> None:
        if self.grpc is None:
            code, message, trailing, out = "UNIMPLEMENTED", "this shard does not serve gRPC", [], b""
        else:
            try:
                _PASSED.set(True)  # this task's context: the call is served here, not dealt again
                code, message, trailing, out = await self.grpc.serve_passed(msg.rpc, body, join_metadata(msg.metadata, msg.binary_metadata))
            except Exception:
                log.exception("shard %d: a passed gRPC call failed", self.index)
                code, message, trailing, out = "INTERNAL", "internal error in a shard", [], b""
        answer = GrpcAnswer(msg.id, code, message, *split_metadata(trailing))
        self._outbox.send(msg.reply_to, pack(ShardEnvelope(answer), {"body": _bytes_array(out)}))


def _wire_scope(scope) -> HttpRequest:
    """What of an ASGI scope travels to another shard."""
    return HttpRequest(
        method=scope["method"], path=scope["path"], query=scope.get("query_string", b""),
        headers=tuple((k, v) for k, v in scope["headers"] if k != b"content-length"),
        http_version=scope.get("http_version", "1.1"), client=tuple(scope.get("client") or ("", 0)),
    )


async def _replay(app: Any, request: HttpRequest, body: bytes) -> tuple[int, list, bytes]:
    """Run one request (as :func:`_wire_scope` describes it) through ``app``; returns its answer."""
    scope = {
        "type": "http", "asgi": {"version": "3.0"}, "http_version": request.http_version, "method": request.method,
        "scheme": "http", "path": request.path, "raw_path": request.path.encode(), "query_string": request.query,
        "root_path": "", "headers": [*request.headers, (b"content-length", str(len(body)).encode())],
        "client": request.client, "server": None,
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


def _bytes_array(data: bytes) -> np.ndarray:
    return np.frombuffer(data, dtype=np.uint8)
