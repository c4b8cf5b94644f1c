"""The HTTP frontend: Open Inference Protocol v2 (KServe v2 REST) on starlette.

Endpoints::

    GET  /v2                        server metadata
    GET  /v2/health/live            200 while the process serves
    GET  /v2/health/ready           200 when every model is ready, else 503
    GET  /v2/models/{name}          model metadata (inputs, outputs, SLO)      404 unknown model
    GET  /v2/models/{name}/ready    200 / 503
    POST /v2/models/{name}/infer    inference (JSON tensors or the binary extension)
    GET  /metrics                   Prometheus metrics

Status codes of ``infer`` (the body is always ``{"error": "..."}`` on failure):

    200  the outputs
    400  malformed request: bad JSON, wrong tensor name, shape, datatype or size
    401  missing or wrong bearer token (only when the server has a token)
    404  unknown model
    413  body larger than the limit
    503  dropped by the data plane: "dropped: <reason>: <detail>" with reason one of
         deadline-unreachable, queue-full, no-pipeline, worker-failed (a worker on the
         request's path died); header ``Ppipe-Drop-Reason`` repeats the reason
    500  worker-error: the backend raised inside a live worker
    504  timeout: no decision for the request within SLO + grace (a bug; never silent)

A request may carry a batch of N samples (shape ``[N, ...]``); each sample is one request
to the scheduler and the answer holds all N, or the first error.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import json
from typing import Any

import numpy as np
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from ppipe.runtime.driver import DroppedError, Runtime
from ppipe.runtime.protocol import DATATYPES, InferInput, ProtocolError, encode_infer_response, parse_infer_request, HEADER_LENGTH

DEFAULT_MAX_BODY_BYTES = 64 * 1024 * 1024
MAX_SAMPLES_PER_REQUEST = 256

DROP_STATUS = {"timeout": 504, "worker-error": 500}


def _error(status: int, message: str, **headers: str) -> JSONResponse:
    return JSONResponse({"error": message}, status_code=status, headers=headers or None)


class Frontend:
    """The request handlers around a :class:`Runtime`."""

    def __init__(self, runtime: Runtime, token: str | None = None, max_body_bytes: int = DEFAULT_MAX_BODY_BYTES):
        self.runtime, self.token, self.max_body_bytes = runtime, token, max_body_bytes
        self.models = {m.name: m for m in runtime.plan.models}

    # ---- helpers ----------------------------------------------------------------------
    def _authorized(self, request: Request) -> bool:
        return self._token_ok(request.headers.get("authorization"))

    def _token_ok(self, authorization: str | None) -> bool:
        if not self.token:
            return True
        return hmac.compare_digest((authorization or "").encode(), f"Bearer {self.token}".encode())

    async def _body(self, length: str | None, stream) -> bytes:
        declared = int(length) if length is not None and length.isdigit() else None
        chunks, size = [], 0
        too_big = declared is not None and declared > self.max_body_bytes
        async for chunk in stream:
            size += len(chunk)
            if size > self.max_body_bytes:
                too_big = True
            if too_big:
                # read the rest and drop it (up to 8x the limit) so that the client, still
                # sending, reads our 413 instead of a reset connection
                if size > 8 * self.max_body_bytes:
                    break
                continue
            chunks.append(chunk)
        if too_big:
            raise ProtocolError(413, f"body of {declared or size} bytes exceeds the limit of {self.max_body_bytes} bytes")
        return b"".join(chunks)

    def _metadata(self, name: str) -> dict[str, Any]:
        mp = self.models[name]
        man = self.runtime.profiles[name].manifest
        dt = {v: k for k, v in DATATYPES.items()}
        inputs = (
            [{"name": man.input.name, "datatype": dt.get(man.input.dtype, man.input.dtype.upper()), "shape": [-1, *man.input.shape]}]
            if man.input
            else [{"name": "input", "datatype": "FP32", "shape": [-1], "note": "any name and shape: the profile has no input spec"}]
        )
        outputs = [{"name": o.name, "datatype": dt.get(o.dtype, o.dtype.upper()), "shape": [-1, *o.shape]} for o in man.outputs]
        return {
            "name": name,
            "versions": ["1"],
            "platform": "ppipe",
            "inputs": inputs,
            "outputs": outputs,
            "parameters": {"slo_ms": mp.slo_ms, "pipelines": len(mp.pipelines), "planned_throughput_rps": mp.throughput_rps},
        }

    def _samples(self, name: str, body: bytes, header_length: str | None):
        req = parse_infer_request(body, header_length)
        in_name, arr = check_infer_inputs(name, self.runtime.profiles[name].manifest, req.inputs, req.requested_outputs)
        return req, in_name, arr

    # ---- endpoints -----------------------------------------------------------------------
    async def server_metadata(self, request: Request) -> Response:
        from ppipe import __version__

        return JSONResponse({"name": "ppipe", "version": __version__, "extensions": ["binary_tensor_data"]})

    async def live(self, request: Request) -> Response:
        return JSONResponse({"live": True})

    async def ready(self, request: Request) -> Response:
        ok = self.runtime.started and all(self.runtime.model_ready(m) for m in self.models)
        return JSONResponse({"ready": ok}, status_code=200 if ok else 503)

    async def model_metadata(self, request: Request) -> Response:
        if not self._authorized(request):
            return _error(401, "missing or wrong bearer token (Authorization: Bearer <token>)")
        name = request.path_params["name"]
        if name not in self.models:
            return _error(404, f"unknown model '{name}'; this server has: {', '.join(self.models)}")
        return JSONResponse(self._metadata(name))

    async def model_ready(self, request: Request) -> Response:
        name = request.path_params["name"]
        if name not in self.models:
            return _error(404, f"unknown model '{name}'; this server has: {', '.join(self.models)}")
        ok = self.runtime.started and self.runtime.model_ready(name)
        return JSONResponse({"name": name, "ready": ok}, status_code=200 if ok else 503)

    async def infer(self, request: Request) -> Response:
        """The starlette route of infer (the app normally answers infer on its fast path,
        :class:`_InferFastPath`, with the same handler)."""
        h = request.headers
        status, body, headers = await self.handle_infer(
            request.path_params["name"], h.get("authorization"), h.get("content-length"), h.get(HEADER_LENGTH), request.stream()
        )
        return Response(body, status_code=status, headers=headers)

    async def handle_infer(
        self, name: str, authorization: str | None, content_length: str | None, header_length: str | None, stream
    ) -> tuple[int, bytes, dict[str, str]]:
        """Serve one infer request; returns (status, body, headers). ``stream`` yields the body's chunks."""
        if not self._token_ok(authorization):
            return _error_body(401, "missing or wrong bearer token (Authorization: Bearer <token>)")
        m = self.runtime.metrics
        if name not in self.models:
            return _error_body(404, f"unknown model '{name}'; this server has: {', '.join(self.models)}")
        t0 = asyncio.get_running_loop().time()
        try:
            body = await self._body(content_length, stream)
            req, in_name, arr = self._samples(name, body, header_length)
        except ProtocolError as exc:
            m.requests.labels(name, str(exc.status)).inc()
            return _error_body(exc.status, exc.message)
        try:
            if arr.shape[0] == 1:
                results = [await self.runtime.infer(name, {in_name: arr[0]})]
            else:
                results = await asyncio.gather(*(self.runtime.infer(name, {in_name: s}) for s in arr))
        except DroppedError as exc:
            status = DROP_STATUS.get(exc.reason, 503)
            m.requests.labels(name, str(status)).inc()
            return _error_body(status, str(exc), **{"ppipe-drop-reason": exc.reason})
        outputs = {k: np.stack([r[k] for r in results]) for k in results[0]}
        if req.requested_outputs:
            outputs = {k: v for k, v in outputs.items() if k in req.requested_outputs}
        body_out, headers = encode_infer_response(name, outputs, req.id, req.binary_output)
        m.bound(m.requests, name, "200").inc()
        m.bound(m.latency, name).observe(asyncio.get_running_loop().time() - t0)
        return 200, body_out, headers

    async def metrics(self, request: Request) -> Response:
        if not self._authorized(request):
            return _error(401, "missing or wrong bearer token (Authorization: Bearer <token>)")
        return Response(self.runtime.metrics.render(), media_type="text/plain; version=0.0.4")


def _error_body(status: int, message: str, **headers: str) -> tuple[int, bytes, dict[str, str]]:
    return status, json.dumps({"error": message}).encode(), {"content-type": "application/json", **headers}


class _ClientGone(Exception):
    """The client disconnected before its request body was read."""


class _InferFastPath:
    """ASGI: ``POST /v2/models/{name}/infer`` straight to :meth:`Frontend.handle_infer`;
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
                    raise _ClientGone()
                yield msg.get("body", b"")
                if not msg.get("more_body", False):
                    return

        try:
            status, body, headers = await self.fe.handle_infer(
                name, want[b"authorization"], want[b"content-length"], want[HEADER_LENGTH.encode()], chunks()
            )
        except _ClientGone:
            return
        raw = [(k.encode("latin-1"), v.encode("latin-1")) for k, v in headers.items()]
        raw.append((b"content-length", str(len(body)).encode()))
        await send({"type": "http.response.start", "status": status, "headers": raw})
        await send({"type": "http.response.body", "body": body})


def check_infer_inputs(name: str, man, inputs: list[InferInput], requested_outputs: list[str]) -> tuple[str, np.ndarray]:
    """Check a decoded infer request against model ``name``'s manifest ``man``: one input
    of the manifest's name, datatype and shape [N, ...], 1..MAX_SAMPLES_PER_REQUEST samples,
    only known outputs requested. The REST and the gRPC frontends both call it.

    Returns:
        (input name, its array of N samples).

    Raises:
        ProtocolError: 400, naming the field at fault and what it must be.
    """
    if len(inputs) != 1:
        raise ProtocolError(400, f"model '{name}' takes 1 input tensor, got {len(inputs)}")
    t = inputs[0]
    arr = t.array
    if man.input is not None:
        spec = man.input
        if t.name != spec.name:
            raise ProtocolError(400, f"model '{name}' has input '{spec.name}', not '{t.name}'")
        if np.dtype(spec.dtype) != arr.dtype:
            want = {v: k for k, v in DATATYPES.items()}.get(np.dtype(spec.dtype).name, spec.dtype)
            raise ProtocolError(400, f"input '{t.name}' must have datatype {want}, got {_dt(arr.dtype)}")
        if list(arr.shape[1:]) != list(spec.shape) or arr.ndim != len(spec.shape) + 1:
            raise ProtocolError(
                400, f"input '{t.name}' must have shape [N, {', '.join(map(str, spec.shape))}], got {list(arr.shape)}"
            )
    elif arr.ndim < 1:
        raise ProtocolError(400, f"input '{t.name}' needs a leading batch axis")
    n = arr.shape[0]
    if not 1 <= n <= MAX_SAMPLES_PER_REQUEST:
        raise ProtocolError(400, f"input '{t.name}' holds {n} samples; send 1..{MAX_SAMPLES_PER_REQUEST} per request")
    known = [o.name for o in man.outputs]
    for o in requested_outputs:
        if known and o not in known:
            raise ProtocolError(400, f"model '{name}' has no output '{o}' (outputs: {', '.join(known)})")
    return t.name, arr


def _dt(dtype: np.dtype) -> str:
    return {v: k for k, v in DATATYPES.items()}.get(np.dtype(dtype).name, str(dtype))


def create_app(runtime: Runtime, token: str | None = None, max_body_bytes: int = DEFAULT_MAX_BODY_BYTES, on_shutdown=None,
               companions=()):
    """The ASGI app; starts the runtime (clock, scheduler, health loop) on the server's loop.

    ``companions`` are other frontends of the same runtime (the gRPC server): objects with
    ``async start()`` and ``async stop()``, started after the runtime and stopped before it,
    on this same loop, because the runtime's scheduler may only be called from its loop.

    Infer requests take a fast path around starlette (:class:`_InferFastPath`); the rest
    (health, metadata, metrics, lifespan) is a starlette app.
    """
    fe = Frontend(runtime, token=token, max_body_bytes=max_body_bytes)

    @contextlib.asynccontextmanager
    async def lifespan(app):
        await runtime.start()
        started = []
        try:
            for c in companions:
                await c.start()
                started.append(c)
            yield
        finally:
            for c in reversed(started):
                await c.stop()
            await runtime.stop()
            if on_shutdown is not None:
                on_shutdown()

    routes = [
        Route("/v2/models/{name}/infer", fe.infer, methods=["POST"]),  # first: the hot path matches at once
        Route("/v2", fe.server_metadata, methods=["GET"]),
        Route("/v2/health/live", fe.live, methods=["GET"]),
        Route("/v2/health/ready", fe.ready, methods=["GET"]),
        Route("/v2/models/{name}", fe.model_metadata, methods=["GET"]),
        Route("/v2/models/{name}/ready", fe.model_ready, methods=["GET"]),
        Route("/metrics", fe.metrics, methods=["GET"]),
    ]
    app = Starlette(routes=routes, lifespan=lifespan)
    app.state.frontend = fe
    return _InferFastPath(app, fe)


class BackgroundServer:
    """Run an ASGI app with uvicorn in a thread (tests, ``scripts/bench_serve.py``).

    Args:
        app: the app (its lifespan runs on the thread's loop).
        host, port: where to bind; port 0 picks a free port (see :attr:`url`).
    """

    def __init__(self, app, host: str = "127.0.0.1", port: int = 0, log_level: str = "warning"):
        import uvicorn

        self.config = uvicorn.Config(app, host=host, port=port, log_level=log_level, lifespan="on", access_log=False)
        self.server = uvicorn.Server(self.config)
        self.thread = None
        self.url = ""

    def __enter__(self) -> "BackgroundServer":
        import threading
        import time

        self.thread = threading.Thread(target=self.server.run, name="ppipe-frontend", daemon=True)
        self.thread.start()
        deadline = time.monotonic() + 60
        while not self.server.started:
            if not self.thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError("the frontend did not start (see the log above)")
            time.sleep(0.02)
        sock = self.server.servers[0].sockets[0]
        host, port = sock.getsockname()[:2]
        self.url = f"http://{host}:{port}"
        return self

    def __exit__(self, *exc) -> None:
        self.server.should_exit = True
        if self.thread is not None:
            self.thread.join(timeout=30)
