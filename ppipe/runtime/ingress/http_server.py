"""The HTTP frontend: Open Inference Protocol v2 (KServe v2 REST) on starlette.

Endpoints::

    GET  /v2                        server metadata
    GET  /v2/health/live            200 while the process serves              (no token needed)
    GET  /v2/health/ready           200 while at least one model is ready, else 503 (no token needed)
    GET  /v2/models/{name}          model metadata (inputs, outputs, SLO)      404 unknown model
    GET  /v2/models/{name}/ready    200 while the model has a complete pipeline of live vGPUs, else 503
    POST /v2/models/{name}/infer    inference (JSON tensors or the binary extension)
    GET  /metrics                   Prometheus metrics
    GET  /v2/openapi.json           this API as OpenAPI 3.1 (ppipe.runtime.ingress.openapi)
    GET  /v2/admin/plan             the plan served and the switches made     (token needed, always)
    POST /v2/admin/plan             switch to the plan.yaml in the body       (token needed, always;
                                    ``ppipe apply``; ``?as_placed=1``: keep its placement as
                                    written; see ppipe.runtime.control.switch; on an ingress
                                    process, both are passed to the scheduler's own API:
                                    ppipe.runtime.ingress.admin_proxy)

**Readiness.** A server is ready while at least one of its models is ready (can serve a
request), so a load balancer keeps a server that lost the node of one model but still
serves the others; route by model with ``/v2/models/{name}/ready``, and weigh by
``ppipe_model_capacity_alive_ratio{model}`` on ``/metrics`` (the share of the model's
planned throughput that its live vGPUs provide; :func:`ppipe.runtime.scheduler.metrics.capacity_alive_ratio`).
This departs on purpose from the Open Inference Protocol's text, whose "server ready" says
that *all* models are ready: with models spread over machines, that rule takes a whole
server out of rotation for one lost machine (Triton makes the same choice an option,
``--strict-readiness``). A server of several frontend shards is ready once every shard has
started, and then while one of them is ready (:mod:`ppipe.runtime.ingress.shard_router`).

Status codes of ``infer`` (the body is always ``{"error": "..."}`` on failure):

    200  the outputs
    400  malformed request: bad JSON, wrong tensor name, shape, datatype or size
    401  missing or wrong bearer token (only when the server has a token)
    404  unknown model
    408  the body did not arrive within the body timeout (the connection is closed)
    413  body larger than the limit
    503  dropped: "dropped: <reason>: <detail>" with reason one of deadline-unreachable
         (by the data plane, or by the frontend when decoding the JSON body cannot end in
         time), queue-full (also: too many JSON bodies waiting to be decoded),
         no-pipeline, worker-failed (a worker on the request's path died);
         header ``Ppipe-Drop-Reason`` repeats the reason
    500  worker-error: the backend raised inside a live worker (or a bug; never a traceback)
    504  timeout: no decision for the request within SLO + grace (a bug; never silent)

A request may carry a batch of N samples (shape ``[N, ...]``); each sample is one request
to the scheduler and the answer holds all N, or the first error.

**Arrival and decoding.** A request arrives when its headers have been read; its deadline
and the latency metric count from then. Its body is read within a size limit (413) and a
body timeout (408), and decoded on the event loop or, for a large JSON body, in a pool of
processes (:mod:`ppipe.runtime.ingress.bodies`). A JSON body whose decode would end too
late for its deadline, by the pool's queue and its measured speed, is dropped at once with
a 503. The connection's own limits (header timeout, keep-alive, shutdown) are the HTTP
server's: :mod:`ppipe.runtime.ingress.http_transport`.
"""

from __future__ import annotations

import contextlib
import hmac
import logging
import math
import time
from typing import Any, Mapping

import numpy as np
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from ppipe.errors import UserError
from ppipe.runtime.ingress.bodies import BodyDecoder, default_decode_workers, read_body
from ppipe.runtime.ingress.fast_path import ClientGone, InferFastPath, error_body
from ppipe.runtime.ingress.images import ImagePool, default_image_workers
from ppipe.runtime.ingress.model_io import check_infer_inputs, model_metadata
from ppipe.runtime.ingress.protocol import HEADER_LENGTH, InferRequest, ProtocolError, brief, encode_infer_response, stacked_outputs
from ppipe.dataplane.decode import decode_slack_us, latest_end_us, refusal
from ppipe.runtime.scheduler.host import DroppedError, Runtime
from ppipe.runtime.wire.shared_inputs import prefault_input_slots

log = logging.getLogger(__name__)

DEFAULT_MAX_BODY_BYTES = 64 * 1024 * 1024
DEFAULT_BODY_TIMEOUT_S = 30.0  # headers read -> whole body read (a 64 MB body at ~20 Mbit/s)

_UNAUTHORIZED = "missing or wrong bearer token (Authorization: Bearer <token>)"

DROP_STATUS = {"timeout": 504, "worker-error": 500, "unknown-model": 404}


def _error(status: int, message: str, **headers: str) -> JSONResponse:
    return JSONResponse({"error": message}, status_code=status, headers=headers or None)


class Frontend:
    """The request handlers around a :class:`Runtime`.

    Args:
        runtime: what serves the requests.
        token: the bearer token every endpoint but ``/v2/health/live|ready`` needs; None: no token.
        max_body_bytes: larger bodies get a 413.
        body_timeout_s: a body not read within this after the headers gets a 408.
        decode_workers: processes of the JSON decode pool (:class:`BodyDecoder`); default
            :func:`default_decode_workers`; 0 decodes on the event loop.
    """

    def __init__(
        self,
        runtime: Runtime,
        token: str | None = None,
        max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
        body_timeout_s: float = DEFAULT_BODY_TIMEOUT_S,
        decode_workers: int | None = None,
    ):
        self.runtime, self.token, self.max_body_bytes = runtime, token, max_body_bytes
        self.body_timeout_s = body_timeout_s
        self.decoder = BodyDecoder(default_decode_workers() if decode_workers is None else decode_workers)
        self.images = ImagePool(default_image_workers())
        self.models: dict[str, Any] = {}  # shared with the gRPC frontend: updated in place
        self.refresh_models()
        if hasattr(runtime, "on_switch"):
            runtime.on_switch.append(self.refresh_models)
        self.switcher: Any = None  # a PlanSwitcher where this server may switch plans
        self.admin_proxy: Any = None  # an AdminProxy on an ingress process: the scheduler switches plans

    def refresh_models(self) -> None:
        """Take the models of the runtime's plan (at start, and after each plan switch)."""
        plan = self.runtime.plan
        self.models.clear()
        self.models.update({m.name: m for m in plan.models})
        # each model's decode slack (ppipe.dataplane.decode): the slack its plan leaves less the
        # runtime's margins; a runtime without budgets (an ingress process) has its plan's slack
        budgets = getattr(self.runtime, "budgets", None)
        slack = decode_slack_us(budgets.margins if budgets is not None else {})
        self._decode_slack_us = {m.name: slack.get(m.name, m.slo_ms * 1e3 - min((p.latency_us for p in m.pipelines), default=0.0))
                                 for m in plan.models}

    # ---- helpers ----------------------------------------------------------------------
    def _authorized(self, request: Request) -> bool:
        return self._token_ok(request.headers.get("authorization"))

    def _token_ok(self, authorization: str | None) -> bool:
        if not self.token:
            return True
        return hmac.compare_digest((authorization or "").encode(), f"Bearer {self.token}".encode())

    async def _body(self, length: str | None, stream) -> bytes:
        """The whole body, within the size limit (413) and the body timeout (408): :func:`read_body`."""
        return await read_body(length, stream, self.max_body_bytes, self.body_timeout_s)

    def _metadata(self, name: str) -> dict[str, Any]:
        """Model ``name``'s v2 metadata (the gRPC frontend answers with it too)."""
        return model_metadata(name, self.models[name], self.runtime.profiles[name].manifest)

    async def _samples(self, name: str, body: bytes, header_length: str | None, arrival_us: float) -> tuple[InferRequest, str, np.ndarray]:
        """Decode a body and check it against the model: (request, input name, samples as
        the model's input tensor; encoded images prepared, :meth:`images_to_tensor`).

        A body decoded in the pool is dropped (``DroppedError``, deadline-unreachable) when
        its decode cannot end in time for its deadline: before it is queued, by the pool's
        estimate, and after, by the clock (once it is known to be well-formed: a malformed
        body gets its 400 whatever the time).

        Raises:
            ProtocolError: the body is malformed or does not fit the model.
            DroppedError: as above, or the decoder's queue-full / worker-failed.
        """
        dec, man = self.decoder, self.runtime.profiles[name].manifest
        if not dec.in_pool(body, header_length):
            req = await dec.decode(body, header_length)
            in_name, arr = check_infer_inputs(name, man, req.inputs, req.requested_outputs)
        else:
            req, in_name, arr = await self._decode_in_pool(name, body, header_length, arrival_us)
        return req, in_name, await self.images_to_tensor(name, arr, arrival_us)

    async def _decode_in_pool(self, name: str, body: bytes, header_length: str | None, arrival_us: float):
        dec, man = self.decoder, self.runtime.profiles[name].manifest
        latest_us = latest_end_us(arrival_us, self._decode_slack_us[name])  # decode admission (ppipe.dataplane.decode)
        try:
            self._admit(latest_us, dec.expected_end_s(len(body)),
                        f"decoding this {len(body)}-byte JSON body", f"{dec.queued} JSON bodies are decoding ahead of it; "
                        "the binary tensor extension needs no decoding")
            req = await dec.decode(body, header_length)
            in_name, arr = check_infer_inputs(name, man, req.inputs, req.requested_outputs)
            self._check_late(latest_us, "decoding the JSON body")
        except DroppedError as exc:  # the data plane's drops are counted by the runtime; these here
            self.runtime.metrics.drops.labels(name, exc.reason).inc()
            raise
        return req, in_name, arr

    async def images_to_tensor(self, name: str, arr: np.ndarray, arrival_us: float) -> np.ndarray:
        """``arr`` as it is, or, where it holds encoded images, the model's input tensor made
        of them (:class:`ppipe.runtime.ingress.images.ImagePool`), admitted as the pool's
        JSON decodes are: dropped when the images would be ready too late for the deadline.
        The gRPC frontend calls it too.

        Raises:
            ProtocolError: an image does not decode (400), or this server has no OpenCV (415).
            DroppedError: deadline-unreachable, queue-full.
        """
        if arr.dtype != object:
            return arr
        man, images = self.runtime.profiles[name].manifest, self.images
        latest_us = latest_end_us(arrival_us, self._decode_slack_us[name])
        nbytes = sum(len(b) for b in arr)
        try:
            self._admit(latest_us, images.expected_end_s(nbytes), f"decoding these {len(arr)} image(s) of {nbytes} bytes",
                        f"{images.queued} requests of images are decoding ahead of them; plan with a larger --margin or SLO "
                        "to leave time for decoding, or send the input tensor")
            out = await images.prepare(list(arr), man.preprocess, man.input)
            self._check_late(latest_us, "decoding the images")
        except DroppedError as exc:
            self.runtime.metrics.drops.labels(name, exc.reason).inc()
            raise
        return out

    def _admit(self, latest_us: float, expected_s: float, what: str, ahead: str) -> None:
        """Raise deadline-unreachable when work expected to take ``expected_s`` from now would end after ``latest_us``."""
        late_us = refusal(self.runtime.clock.true_now_us() + expected_s * 1e6, latest_us)
        if late_us is not None:
            raise DroppedError("deadline-unreachable", f"{what} would end {late_us / 1e3:.0f} ms too late for the SLO ({ahead})")

    def _check_late(self, latest_us: float, what: str) -> None:
        late_us = refusal(self.runtime.clock.true_now_us(), latest_us)
        if late_us is not None:
            raise DroppedError("deadline-unreachable", f"{what} ended {late_us / 1e3:.0f} ms too late for the SLO")

    # ---- endpoints -----------------------------------------------------------------------
    async def server_metadata(self, request: Request) -> Response:
        from ppipe import __version__

        if not self._authorized(request):
            return _error(401, _UNAUTHORIZED)
        return JSONResponse({"name": "ppipe", "version": __version__, "extensions": ["binary_tensor_data"]})

    async def openapi(self, request: Request) -> Response:
        """GET /v2/openapi.json: this API as OpenAPI 3.1 (:mod:`ppipe.runtime.ingress.openapi`)."""
        from ppipe import __version__
        from ppipe.runtime.ingress.openapi import openapi_document

        if not self._authorized(request):
            return _error(401, _UNAUTHORIZED)
        return JSONResponse(openapi_document(list(self.models), __version__))

    async def live(self, request: Request) -> Response:
        return JSONResponse({"live": True})

    async def ready(self, request: Request) -> Response:
        started = self.runtime.started
        ok = started and any(self.runtime.model_ready(m) for m in self.models)  # see "Readiness" above
        return JSONResponse({"ready": ok, "started": started}, status_code=200 if ok else 503)

    async def model_metadata(self, request: Request) -> Response:
        if not self._authorized(request):
            return _error(401, _UNAUTHORIZED)
        name = request.path_params["name"]
        if name not in self.models:
            return _error(404, f"unknown model '{name}'; this server has: {', '.join(self.models)}")
        return JSONResponse(self._metadata(name))

    async def model_ready(self, request: Request) -> Response:
        if not self._authorized(request):
            return _error(401, _UNAUTHORIZED)
        name = request.path_params["name"]
        if name not in self.models:
            return _error(404, f"unknown model '{name}'; this server has: {', '.join(self.models)}")
        ok = self.runtime.started and self.runtime.model_ready(name)
        return JSONResponse({"name": name, "ready": ok}, status_code=200 if ok else 503)

    async def infer(self, request: Request) -> Response:
        """The starlette route of infer (the app normally answers infer on its fast path,
        :class:`~ppipe.runtime.ingress.fast_path.InferFastPath`, with the same handler)."""
        h = request.headers
        status, body, headers = await self.handle_infer(
            request.path_params["name"], h.get("authorization"), h.get("content-length"), h.get(HEADER_LENGTH), request.stream()
        )
        return Response(body, status_code=status, headers=headers)

    async def handle_infer(
        self, name: str, authorization: str | None, content_length: str | None, header_length: str | None, stream
    ) -> tuple[int, bytes, dict[str, str]]:
        """Serve one infer request; returns (status, body, headers). ``stream`` yields the body's chunks.

        The request arrives now (headers read): its deadline and the latency metric count
        from here, through the body's reading and decoding. Every answer but 401 and 404
        (which name no served model) is counted in ``ppipe_requests_total``. A 200 says how
        long the server held the request in a ``Server-Timing`` header (W3C Server Timing:
        ``ppipe;dur=MS``, from its arrival to its answer's encoding), so that a client can
        tell the server's part of its latency from the network's and its own.
        """
        if not self._token_ok(authorization):
            return error_body(401, _UNAUTHORIZED)
        m = self.runtime.metrics
        if name not in self.models:
            return error_body(404, f"unknown model '{name}'; this server has: {', '.join(self.models)}")
        if not self.runtime.started:
            m.requests.labels(name, "503").inc()
            return error_body(503, "the server is starting; retry shortly")
        t0 = time.perf_counter()  # (not the loop's clock: uvloop's counts whole milliseconds)
        arrival_us = self.runtime.clock.true_now_us()
        try:
            try:
                body = await self._body(content_length, stream)
                req, in_name, arr = await self._samples(name, body, header_length, arrival_us)
            except ProtocolError as exc:
                m.requests.labels(name, str(exc.status)).inc()
                extra = {"connection": "close"} if exc.status == 408 else {}  # the rest of the body may still come
                return error_body(exc.status, exc.message, **extra)
            if arr.shape[0] == 1:
                results = [await self.runtime.infer(name, {in_name: arr[0]}, arrival_us=arrival_us)]
            else:
                results = await self.runtime.infer_samples(name, [{in_name: s} for s in arr], arrival_us=arrival_us)
        except DroppedError as exc:
            status = DROP_STATUS.get(exc.reason, 503)
            m.requests.labels(name, str(status)).inc()
            return error_body(status, str(exc), **{"ppipe-drop-reason": exc.reason})
        except (ClientGone, ClientDisconnect):
            raise
        except Exception:  # a bug: never a traceback to the client, always counted; the log has it
            log.exception("infer of model '%s' failed", name)
            m.requests.labels(name, "500").inc()
            return error_body(500, "internal error in the server (its log has the details)")
        outputs = stacked_outputs(results)
        if req.requested_outputs:
            outputs = {k: v for k, v in outputs.items() if k in req.requested_outputs}
        body_out, headers = encode_infer_response(name, outputs, req.id, req.binary_output)
        m.bound(m.requests, name, "200").inc()
        held_s = time.perf_counter() - t0
        m.bound(m.latency, name).observe(held_s)
        headers["server-timing"] = f"ppipe;dur={held_s * 1e3:.3f}"
        return 200, body_out, headers

    # ---- plan switches (ppipe.runtime.control.switch) --------------------------------------------------
    def _admin_refusal(self, request: Request) -> Response | None:
        if not self.token:
            return _error(403, "plan switches over HTTP need a token: start `ppipe serve` with --token "
                               "(or send the server SIGHUP to re-read its plan file)")
        if not self._authorized(request):
            return _error(401, _UNAUTHORIZED)
        if self.switcher is None and self.admin_proxy is None:
            return _error(409, "this server cannot switch plans: its app was built without a plan switcher (`ppipe serve` builds one)")
        return None

    async def admin_plan_status(self, request: Request) -> Response:
        """GET /v2/admin/plan: the models served now and the switches made so far."""
        refusal = self._admin_refusal(request)
        if refusal is not None:
            return refusal
        if self.admin_proxy is not None:
            return await self._forward_admin(request, b"")
        plan = self.switcher.dep.plan  # the whole plan served (on a server of shards, every shard's part)
        return JSONResponse({"cluster": plan.cluster, "models": [m.name for m in plan.models], "vgpus": len(plan.placement),
                             "switches": self.switcher.records})

    async def admin_plan_apply(self, request: Request) -> Response:
        """POST /v2/admin/plan with a plan.yaml as the body: switch to it (``ppipe apply``)."""
        from ppipe.runtime.control.switch import PartialSwitch, SwitchBusy

        refusal = self._admin_refusal(request)
        if refusal is not None:
            return refusal
        try:
            body = await self._body(request.headers.get("content-length"), request.stream())
        except ProtocolError as exc:
            return _error(exc.status, exc.message)
        if self.admin_proxy is not None:
            return await self._forward_admin(request, body)
        try:
            text = body.decode("utf-8")
            plan = self.switcher.plan_from_text(text, "request body")
            as_placed = request.query_params.get("as_placed", "").lower() in ("1", "true", "yes")
            record = await self.switcher.apply(plan, "request body", keep_live=not as_placed)
        except UnicodeDecodeError:
            return _error(400, "request body: the plan must be UTF-8 YAML or JSON text")
        except SwitchBusy as exc:
            return _error(409, exc.render())
        except UserError as exc:
            return _error(400, exc.render())
        except PartialSwitch as exc:  # shards of a server that serve two plans now: say so
            return _error(503, str(exc))
        except Exception as exc:  # a worker that could not start, Ray gone: the old plan still serves
            log.exception("plan switch failed")
            return _error(503, f"the plan switch failed ({type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}); "
                               "the old plan keeps serving")
        return JSONResponse(record)

    async def _forward_admin(self, request: Request, body: bytes) -> Response:
        """The scheduler's answer to this admin request (:class:`~ppipe.runtime.ingress.admin_proxy.AdminProxy`)."""
        path = request.url.path + (f"?{request.url.query}" if request.url.query else "")
        status, data = await self.admin_proxy.forward(request.method, path, body, request.headers.get("authorization"))
        return Response(data, status_code=status, media_type="application/json")

    async def metrics(self, request: Request) -> Response:
        if not self._authorized(request):
            return _error(401, _UNAUTHORIZED)
        render = getattr(self.runtime, "render_metrics", None)  # where the server's processes are several: all of them
        return Response(render() if render else self.runtime.metrics.render(), media_type="text/plain; version=0.0.4")


async def _http_error(request: Request, exc: HTTPException) -> Response:
    """Starlette's own errors (no such path: 404, wrong method: 405) as ``{"error": ...}``;
    they name no model, so they need no token check."""
    hint = f"; this server answers {_ENDPOINTS}" if exc.status_code in (404, 405) else ""
    return _error(exc.status_code, f"{exc.detail}: {request.method} {brief(request.url.path)}{hint}", **(exc.headers or {}))


async def _internal_error(request: Request, exc: Exception) -> Response:
    log.error("%s %s failed", request.method, request.url.path, exc_info=exc)
    return _error(500, "internal error in the server (its log has the details)")


_ENDPOINTS = ("GET /v2, /v2/health/live, /v2/health/ready, /v2/openapi.json, /v2/models/NAME, /v2/models/NAME/ready, /metrics, "
              "/v2/admin/plan; "
              "POST /v2/models/NAME/infer, /v2/admin/plan")


def _input_bytes(profiles: Mapping[str, Any]) -> list[int]:
    """Bytes of one sample's input tensor of each model that declares its input."""
    out = []
    for p in profiles.values():
        spec = p.manifest.input
        if spec is not None and spec.fixed:
            out.append(math.prod(spec.shape) * np.dtype(spec.dtype).itemsize)
    return out


def create_app(runtime: Runtime, token: str | None = None, max_body_bytes: int = DEFAULT_MAX_BODY_BYTES, on_shutdown=None,
               companions=(), body_timeout_s: float = DEFAULT_BODY_TIMEOUT_S, decode_workers: int | None = None):
    """The ASGI app; starts the runtime (clock, scheduler, data path, lifelines) and the JSON decode
    pool on the server's loop. ``token``, ``max_body_bytes``, ``body_timeout_s`` and
    ``decode_workers``: see :class:`Frontend`.

    ``companions`` are other frontends of the same runtime (the gRPC server): objects with
    ``async start()`` and ``async stop()``, started after the runtime and stopped before it,
    on this same loop, because the runtime's scheduler may only be called from its loop.

    Infer requests take a fast path around starlette (:class:`~ppipe.runtime.ingress.fast_path.InferFastPath`); the rest
    (health, metadata, metrics, lifespan) is a starlette app.
    """
    fe = Frontend(runtime, token=token, max_body_bytes=max_body_bytes, body_timeout_s=body_timeout_s, decode_workers=decode_workers)

    @contextlib.asynccontextmanager
    async def lifespan(app):
        await runtime.start()
        prefault_input_slots(_input_bytes(runtime.profiles))  # a fresh server's first bodies find their pages in place
        started = []
        try:
            await fe.decoder.start()
            for c in companions:
                await c.start()
                started.append(c)
            yield
        finally:
            for c in reversed(started):
                await c.stop()
            fe.decoder.stop()
            fe.images.stop()
            await runtime.stop()
            if on_shutdown is not None:
                on_shutdown()

    routes = [
        Route("/v2/models/{name}/infer", fe.infer, methods=["POST"]),  # first: the hot path matches at once
        Route("/v2", fe.server_metadata, methods=["GET"]),
        Route("/v2/health/live", fe.live, methods=["GET"]),
        Route("/v2/openapi.json", fe.openapi, methods=["GET"]),
        Route("/v2/health/ready", fe.ready, methods=["GET"]),
        Route("/v2/models/{name}", fe.model_metadata, methods=["GET"]),
        Route("/v2/models/{name}/ready", fe.model_ready, methods=["GET"]),
        Route("/metrics", fe.metrics, methods=["GET"]),
        Route("/v2/admin/plan", fe.admin_plan_status, methods=["GET"]),
        Route("/v2/admin/plan", fe.admin_plan_apply, methods=["POST"]),
    ]
    app = Starlette(routes=routes, lifespan=lifespan, exception_handlers={HTTPException: _http_error, Exception: _internal_error})
    app.state.frontend = fe
    return InferFastPath(app, fe)
