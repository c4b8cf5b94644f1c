"""The infer fast path of the HTTP frontend: ``POST /v2/models/{name}/infer`` handled
around starlette (:class:`InferFastPath`), and the error bodies both paths answer with."""

from __future__ import annotations

import asyncio
import json
from typing import TYPE_CHECKING

from ppipe.runtime.ingress.protocol import HEADER_LENGTH

if TYPE_CHECKING:
    from ppipe.runtime.ingress.http_server import Frontend


def error_body(status: int, message: str, **headers: str) -> tuple[int, bytes, dict[str, str]]:
    return status, json.dumps({"error": message}).encode(), {"content-type": "application/json", **headers}


class ClientGone(Exception):
    """The client disconnected before its request body was read."""


class InferFastPath:
    """ASGI: ``POST /v2/models/{name}/infer`` straight to :meth:`~ppipe.runtime.ingress.http_server.Frontend.handle_infer`;
    every other request goes to the starlette app.

    Why: infer is the only hot endpoint, and starlette's per-request machinery (request
    object, routing, two middlewares, response object) was a sizeable share of the
    frontend's CPU per request at ~1,000 req/s on 2 cores. Same handler, same answers.
    """

    PREFIX, SUFFIX = "/v2/models/", "/infer"

    def __init__(self, app, frontend: "Frontend"):
        self.app, self.fe = app, frontend

    async def __call__(self, scope, receive, send) -> None:
        path = scope.get("path", "")
        if (
            scope["type"] == "http"
            and scope["method"] == "POST"
            and path.startswith(self.PREFIX)
            and path.endswith(self.SUFFIX)
            and "/" not in path[len(self.PREFIX) : -len(self.SUFFIX)]
            and len(path) > len(self.PREFIX) + len(self.SUFFIX)
        ):
            await self._infer(path[len(self.PREFIX) : -len(self.SUFFIX)], scope, receive, send)
        else:
            await self.app(scope, receive, send)

    async def _infer(self, name: str, scope, receive, send) -> None:
        want = {b"authorization": None, b"content-length": None, HEADER_LENGTH.encode(): None}
        for k, v in scope["headers"]:
            if k in want:
                want[k] = v.decode("latin-1")

        async def chunks():
            while True:
                msg = await receive()
                if msg["type"] == "http.disconnect":
                    raise ClientGone()
                yield msg.get("body", b"")
                if not msg.get("more_body", False):
                    return

        try:
            status, body, headers = await self.fe.handle_infer(
                name, want[b"authorization"], want[b"content-length"], want[HEADER_LENGTH.encode()], chunks()
            )
        except ClientGone:
            return
        except asyncio.CancelledError:
            # uvicorn cancels the requests still running when the graceful shutdown's time
            # is up: the client gets an answer that says so, not a silently closed connection
            if name in self.fe.models:
                self.fe.runtime.metrics.requests.labels(name, "503").inc()
            status, body, headers = error_body(503, "the server shut down before this request was answered; retry", connection="close")
        raw = [(k.encode("latin-1"), v.encode("latin-1")) for k, v in headers.items()]
        raw.append((b"content-length", str(len(body)).encode()))
        await send({"type": "http.response.start", "status": status, "headers": raw})
        await send({"type": "http.response.body", "body": body})
