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
                                    written; see ppipe.runtime.control.switch)

**Readiness.** A server is ready while at least one of its models is ready (can serve a
request), so a load balancer keeps a server that lost the node of one model but still
serves the others; route by model with ``/v2/models/{name}/ready``, and weigh by
``ppipe_model_capacity_alive_ratio{model}`` on ``/metrics`` (the share of the model's
planned throughput that its live vGPUs provide; :func:`ppipe.runtime.scheduler.metrics.capacity_alive_ratio`).
This departs on purpose from the Open Inference Protocol's text, whose "server ready" says
that *all* models are ready: with models spread over machines, that rule takes a whole
server out of rotation for one lost machine (Triton makes the same choice an option,
``--strict-readiness``). A server of several frontend shards is ready once every shard has
started, and then while one of them is ready (:mod:`ppipe.runtime.launch.shards`).

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
and the latency metric count from then. Binary bodies and small JSON ones are decoded on
the event loop; large JSON bodies (over :data:`INLINE_DECODE_BYTES`) in a bounded pool of
worker processes (:class:`BodyDecoder`), because decoding a ResNet-50 input is
~15 ms in C calls that hold the GIL (a thread would stall the loop all the same).
A JSON body whose decode would end too late for its deadline, by the pool's queue and
its measured speed, is dropped at once with a 503, so that JSON overload gives fast 503s
instead of an endless queue.

**Slow clients.** The request line and headers must arrive within a header timeout, the
body within a body timeout (408), an idle keep-alive connection is closed after a few
seconds, and a graceful shutdown waits for in-flight requests only so long
(:func:`uvicorn_config`).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import hmac
import json
import logging
import multiprocessing
import os
from typing import Any

import numpy as np
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from ppipe.errors import UserError
from ppipe.runtime.scheduler.host import DroppedError, Runtime
from ppipe.runtime.ingress.protocol import (
    DATATYPES,
    brief,
    HEADER_LENGTH,
    InferInput,
    InferRequest,
    ProtocolError,
    brief,
    decode_job,
    encode_infer_response,
    parse_infer_request,
)

log = logging.getLogger(__name__)

DEFAULT_MAX_BODY_BYTES = 64 * 1024 * 1024
MAX_SAMPLES_PER_REQUEST = 256

# Slow clients (see uvicorn_config and Frontend): what a connection may take.
DEFAULT_HEADER_TIMEOUT_S = 10.0  # connection made (or last response sent) -> request line and headers read
DEFAULT_BODY_TIMEOUT_S = 30.0  # headers read -> whole body read (a 64 MB body at ~20 Mbit/s)
DEFAULT_KEEP_ALIVE_S = 5.0  # an idle keep-alive connection is closed after this (uvicorn's timeout_keep_alive)
DEFAULT_SHUTDOWN_TIMEOUT_S = 10.0  # graceful shutdown: in-flight requests get this long, then are cancelled
MAX_HEADER_BYTES = 64 * 1024  # request line + headers; more is a 431

INLINE_DECODE_BYTES = 64 * 1024
"""JSON bodies (or binary requests' JSON headers) up to this size are decoded on the event
loop (under a ms: orjson reads ~10 ns per byte here), where the pool's round trip would
add about as much again; larger ones go to the decode pool."""
MAX_QUEUED_DECODES = 256  # JSON bodies waiting for the pool; more are 503 queue-full
DECODE_S_PER_BYTE_PRIOR = 15e-9  # orjson.loads + np.asarray of numbers, before the first measurement

_UNAUTHORIZED = "missing or wrong bearer token (Authorization: Bearer <token>)"


def default_decode_workers() -> int:
    """Processes of the JSON decode pool: a quarter of the CPUs, 1 to 4 (the rest serve
    the event loop, the workers and Ray)."""
    return max(1, min(4, (os.cpu_count() or 1) // 4))


def _process_pool(workers: int) -> concurrent.futures.ProcessPoolExecutor:
    # spawn, never fork: the server process runs Ray's and uvicorn's threads. (So a script
    # that serves must guard its main code with `if __name__ == "__main__"`.)
    return concurrent.futures.ProcessPoolExecutor(workers, mp_context=multiprocessing.get_context("spawn"),
                                                  initializer=_ignore_interrupts)


def _ignore_interrupts() -> None:
    """A decode process leaves Ctrl-C to the server, which shuts the pool down in order (a
    terminal sends SIGINT to the whole process group)."""
    import signal

    signal.signal(signal.SIGINT, signal.SIG_IGN)


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
                 executor=None, job=decode_job):
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
        return (self.queued_bytes / max(1, self.workers) + nbytes) * self.s_per_byte

    async def start(self) -> None:
        """Start the pool's processes now (each imports numpy: ~1 s), not on the first request."""
        if self.workers:
            loop = asyncio.get_running_loop()
            await asyncio.gather(*(loop.run_in_executor(self._executor(), self._job, b"{}", None) for _ in range(self.workers)))

    def stop(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)
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
            out, took_s = await asyncio.get_running_loop().run_in_executor(self._executor(), self._job, body, header_length)
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


DECODE_SHARE_OF_SLACK = 0.5
"""A pool decode must be expected to end within this share of the model's slack (SLO less its
fastest pipeline and the answer budget), else the request is dropped before decoding: under
JSON overload, the decode queue then stays short enough that what it admits is served."""

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
        self.models: dict[str, Any] = {}  # shared with the gRPC frontend: updated in place
        self.refresh_models()
        if hasattr(runtime, "on_switch"):
            runtime.on_switch.append(self.refresh_models)
        self.switcher: Any = None  # a PlanSwitcher where this server may switch plans

    def refresh_models(self) -> None:
        """Take the models of the runtime's plan (at start, and after each plan switch)."""
        plan = self.runtime.plan
        self.models.clear()
        self.models.update({m.name: m for m in plan.models})
        # the latest a JSON decode may end, from arrival: the SLO less the fastest pipeline
        # and the runtime's margins (later, no schedule can meet the deadline)
        budgets = getattr(self.runtime, "budgets", None)
        margins = budgets.margins if budgets is not None else {}
        self._decode_slack_us = {
            m.name: (margins[m.name].slack_us - margins[m.name].reserved_us) if m.name in margins
            else m.slo_ms * 1e3 - min((p.latency_us for p in m.pipelines), default=0.0)
            for m in plan.models
        }

    # ---- helpers ----------------------------------------------------------------------
    def _authorized(self, request: Request) -> bool:
        return self._token_ok(request.headers.get("authorization"))

    def _token_ok(self, authorization: str | None) -> bool:
        if not self.token:
            return True
        return hmac.compare_digest((authorization or "").encode(), f"Bearer {self.token}".encode())

    async def _body(self, length: str | None, stream) -> bytes:
        """The whole body, within the size limit (413) and the body timeout (408)."""
        declared = int(length) if length is not None and length.isascii() and length.isdigit() and len(length) <= 20 else None
        chunks, size = [], 0
        too_big = declared is not None and declared > self.max_body_bytes
        try:
            async with _timeout(self.body_timeout_s):
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
        except TimeoutError:
            of = f" of the {declared} announced" if declared is not None else ""
            raise ProtocolError(
                408, f"the request body did not arrive within {self.body_timeout_s:g} s ({size} bytes{of} came); send the whole body at once"
            ) from None
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

    async def _samples(self, name: str, body: bytes, header_length: str | None, arrival_us: float) -> tuple[InferRequest, str, np.ndarray]:
        """Decode a body and check it against the model: (request, input name, samples).

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
            return (req, *check_infer_inputs(name, man, req.inputs, req.requested_outputs))
        # the decode must leave the pipeline at least half of the slack: a request decoded at
        # the last moment would find the pipeline's queue (and the estimate's error) in its way
        latest_us = arrival_us + DECODE_SHARE_OF_SLACK * self._decode_slack_us[name]
        try:
            end_us = self.runtime.clock.true_now_us() + dec.expected_end_s(len(body)) * 1e6
            if end_us > latest_us:
                raise DroppedError(
                    "deadline-unreachable",
                    f"decoding this {len(body)}-byte JSON body would end {(end_us - latest_us) / 1e3:.0f} ms too late for the SLO "
                    f"({dec.queued} JSON bodies are decoding ahead of it); the binary tensor extension needs no decoding",
                )
            req = await dec.decode(body, header_length)
            in_name, arr = check_infer_inputs(name, man, req.inputs, req.requested_outputs)
            late_us = self.runtime.clock.true_now_us() - latest_us
            if late_us > 0:
                raise DroppedError("deadline-unreachable", f"decoding the JSON body ended {late_us / 1e3:.0f} ms too late for the SLO")
        except DroppedError as exc:  # the data plane's drops are counted by the runtime; these here
            self.runtime.metrics.drops.labels(name, exc.reason).inc()
            raise
        return req, in_name, arr

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
        :class:`_InferFastPath`, with the same handler)."""
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
        (which name no served model) is counted in ``ppipe_requests_total``.
        """
        if not self._token_ok(authorization):
            return _error_body(401, _UNAUTHORIZED)
        m = self.runtime.metrics
        if name not in self.models:
            return _error_body(404, f"unknown model '{name}'; this server has: {', '.join(self.models)}")
        if not self.runtime.started:
            m.requests.labels(name, "503").inc()
            return _error_body(503, "the server is starting; retry shortly")
        t0 = asyncio.get_running_loop().time()
        arrival_us = self.runtime.clock.true_now_us()
        try:
            try:
                body = await self._body(content_length, stream)
                req, in_name, arr = await self._samples(name, body, header_length, arrival_us)
            except ProtocolError as exc:
                m.requests.labels(name, str(exc.status)).inc()
                extra = {"connection": "close"} if exc.status == 408 else {}  # the rest of the body may still come
                return _error_body(exc.status, exc.message, **extra)
            if arr.shape[0] == 1:
                results = [await self.runtime.infer(name, {in_name: arr[0]}, arrival_us=arrival_us)]
            else:
                results = await self.runtime.infer_samples(name, [{in_name: s} for s in arr], arrival_us=arrival_us)
        except DroppedError as exc:
            status = DROP_STATUS.get(exc.reason, 503)
            m.requests.labels(name, str(status)).inc()
            return _error_body(status, str(exc), **{"ppipe-drop-reason": exc.reason})
        except (_ClientGone, ClientDisconnect):
            raise
        except Exception:  # a bug: never a traceback to the client, always counted; the log has it
            log.exception("infer of model '%s' failed", name)
            m.requests.labels(name, "500").inc()
            return _error_body(500, "internal error in the server (its log has the details)")
        outputs = {k: np.stack([r[k] for r in results]) for k in results[0]}
        if req.requested_outputs:
            outputs = {k: v for k, v in outputs.items() if k in req.requested_outputs}
        body_out, headers = encode_infer_response(name, outputs, req.id, req.binary_output)
        m.bound(m.requests, name, "200").inc()
        m.bound(m.latency, name).observe(asyncio.get_running_loop().time() - t0)
        return 200, body_out, headers

    # ---- plan switches (ppipe.runtime.control.switch) --------------------------------------------------
    def _admin_refusal(self, request: Request) -> Response | None:
        if not self.token:
            return _error(403, "plan switches over HTTP need a token: start `ppipe serve` with --token "
                               "(or send the server SIGHUP to re-read its plan file)")
        if not self._authorized(request):
            return _error(401, _UNAUTHORIZED)
        if self.switcher is None:
            return _error(409, "this server cannot switch plans: its app was built without a plan switcher (`ppipe serve` builds one)")
        return None

    async def admin_plan_status(self, request: Request) -> Response:
        """GET /v2/admin/plan: the models served now and the switches made so far."""
        refusal = self._admin_refusal(request)
        if refusal is not None:
            return refusal
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

    async def metrics(self, request: Request) -> Response:
        if not self._authorized(request):
            return _error(401, _UNAUTHORIZED)
        return Response(self.runtime.metrics.render(), media_type="text/plain; version=0.0.4")


def _error_body(status: int, message: str, **headers: str) -> tuple[int, bytes, dict[str, str]]:
    return status, json.dumps({"error": message}).encode(), {"content-type": "application/json", **headers}


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
        except asyncio.CancelledError:
            # uvicorn cancels the requests still running when the graceful shutdown's time
            # is up: the client gets an answer that says so, not a silently closed connection
            if name in self.fe.models:
                self.fe.runtime.metrics.requests.labels(name, "503").inc()
            status, body, headers = _error_body(503, "the server shut down before this request was answered; retry", connection="close")
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
            raise ProtocolError(400, f"model '{name}' has input '{spec.name}', not {brief(t.name)}")
        if np.dtype(spec.dtype) != arr.dtype:
            want = {v: k for k, v in DATATYPES.items()}.get(np.dtype(spec.dtype).name, spec.dtype)
            raise ProtocolError(400, f"input '{t.name}' must have datatype {want}, got {_dt(arr.dtype)}")
        if list(arr.shape[1:]) != list(spec.shape) or arr.ndim != len(spec.shape) + 1:
            raise ProtocolError(
                400, f"input '{t.name}' must have shape [N, {', '.join(map(str, spec.shape))}], got {list(arr.shape)}"
            )
    elif arr.ndim < 1:
        raise ProtocolError(400, f"input {brief(t.name)} needs a leading batch axis")
    n = arr.shape[0]
    if not 1 <= n <= MAX_SAMPLES_PER_REQUEST:
        raise ProtocolError(400, f"input {brief(t.name)} holds {n} samples; send 1..{MAX_SAMPLES_PER_REQUEST} per request")
    known = [o.name for o in man.outputs]
    for o in requested_outputs:
        if known and o not in known:
            raise ProtocolError(400, f"model '{name}' has no output {brief(o)} (outputs: {', '.join(known)})")
    return t.name, arr


def _dt(dtype: np.dtype) -> str:
    return {v: k for k, v in DATATYPES.items()}.get(np.dtype(dtype).name, str(dtype))


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


def create_app(runtime: Runtime, token: str | None = None, max_body_bytes: int = DEFAULT_MAX_BODY_BYTES, on_shutdown=None,
               companions=(), body_timeout_s: float = DEFAULT_BODY_TIMEOUT_S, decode_workers: int | None = None):
    """The ASGI app; starts the runtime (clock, scheduler, data path, lifelines) and the JSON decode
    pool on the server's loop. ``token``, ``max_body_bytes``, ``body_timeout_s`` and
    ``decode_workers``: see :class:`Frontend`.

    ``companions`` are other frontends of the same runtime (the gRPC server): objects with
    ``async start()`` and ``async stop()``, started after the runtime and stopped before it,
    on this same loop, because the runtime's scheduler may only be called from its loop.

    Infer requests take a fast path around starlette (:class:`_InferFastPath`); the rest
    (health, metadata, metrics, lifespan) is a starlette app.
    """
    fe = Frontend(runtime, token=token, max_body_bytes=max_body_bytes, body_timeout_s=body_timeout_s, decode_workers=decode_workers)

    @contextlib.asynccontextmanager
    async def lifespan(app):
        await runtime.start()
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
    return _InferFastPath(app, fe)


def uvicorn_config(
    app,
    host: str,
    port: int,
    *,
    header_timeout_s: float = DEFAULT_HEADER_TIMEOUT_S,
    keep_alive_s: float = DEFAULT_KEEP_ALIVE_S,
    shutdown_timeout_s: float = DEFAULT_SHUTDOWN_TIMEOUT_S,
    log_level: str = "warning",
):
    """uvicorn's settings for ``ppipe serve`` (and :class:`BackgroundServer`): no slow client
    holds a connection or the shutdown for long.

    Args:
        header_timeout_s: from the connection (or its last response) to the end of the next
            request's headers; an idle or slowloris connection is closed with a 408.
        keep_alive_s: an idle keep-alive connection is closed after this (uvicorn's ``timeout_keep_alive``).
        shutdown_timeout_s: on SIGTERM, requests in flight get this long to finish; then
            they are cancelled and the server stops (uvicorn's ``timeout_graceful_shutdown``).
    """
    import uvicorn

    return uvicorn.Config(
        app,
        host=host,
        port=port,
        log_level=log_level,
        lifespan="on",
        access_log=False,
        http=timed_http_protocol(header_timeout_s),
        timeout_keep_alive=keep_alive_s,
        timeout_graceful_shutdown=shutdown_timeout_s,
        proxy_headers=False,  # nothing here reads the client's address: no X-Forwarded-* rewriting per request
    )


def timed_http_protocol(header_timeout_s: float, max_header_bytes: int = MAX_HEADER_BYTES):
    """uvicorn's httptools protocol with what it lacks against slow clients: a deadline for
    the request line and headers (from the connection, or from the previous response), and
    a bound on their size. uvicorn arms its keep-alive timer only after a response, so a
    connection that never completes its headers would otherwise stay open for good.

    At the deadline, a connection that has sent part of a request gets a 408 and is closed;
    one that has sent nothing is closed silently (a client's pooled connection must not
    read a 408 as the answer to the request it sends next)."""
    from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

    class TimedHttpToolsProtocol(HttpToolsProtocol):
        _header_timer: asyncio.TimerHandle | None = None
        _header_bytes = 0
        _too_large = False
        _begun = False  # a byte of the next request has come

        def connection_made(self, transport) -> None:
            super().connection_made(transport)
            self._arm_header_timer()

        def _arm_header_timer(self) -> None:
            self._cancel_header_timer()
            self._header_bytes, self._begun = 0, False
            self._header_timer = self.loop.call_later(header_timeout_s, self._header_timeout)

        def _cancel_header_timer(self) -> None:
            if self._header_timer is not None:
                self._header_timer.cancel()
                self._header_timer = None

        def _header_timeout(self) -> None:
            self._header_timer = None
            if self.transport.is_closing():
                return
            if self._begun:  # a slow (slowloris) request: say why
                self._reject(408, f"no complete request line and headers within {header_timeout_s:g} s; the connection is closed")
            else:  # an idle connection: closed silently, as uvicorn closes an idle keep-alive one
                self.transport.close()

        def on_message_begin(self) -> None:
            self._begun = True
            super().on_message_begin()

        def _reject(self, status: int, message: str) -> None:
            body = json.dumps({"error": message}).encode()
            phrase = {400: "Bad Request", 408: "Request Timeout", 431: "Request Header Fields Too Large"}[status]
            self.transport.write(
                f"HTTP/1.1 {status} {phrase}\r\ncontent-type: application/json\r\ncontent-length: {len(body)}\r\n"
                f"connection: close\r\n\r\n".encode() + body
            )
            self.transport.close()

        def _count(self, n: int) -> None:
            self._header_bytes += n
            if self._header_bytes > max_header_bytes:
                self._too_large = True
                raise ValueError("headers too large")  # httptools stops parsing; uvicorn calls send_400_response

        def on_url(self, url: bytes) -> None:
            self._count(len(url))
            super().on_url(url)

        def on_header(self, name: bytes, value: bytes) -> None:
            self._count(len(name) + len(value) + 4)
            super().on_header(name, value)

        def on_headers_complete(self) -> None:
            self._cancel_header_timer()
            super().on_headers_complete()

        def send_400_response(self, msg: str) -> None:
            if self._too_large:
                self._reject(431, f"the request line and headers exceed {max_header_bytes} bytes")
            else:
                self._reject(400, f"{msg.rstrip('.')}: not an HTTP/1.1 request")

        def on_response_complete(self) -> None:
            pipelined = bool(self.pipeline)
            super().on_response_complete()
            if not pipelined and not self.transport.is_closing():
                self._arm_header_timer()  # the next request's headers (uvicorn's keep-alive timer closes an idle one sooner)

        def connection_lost(self, exc) -> None:
            self._cancel_header_timer()
            super().connection_lost(exc)

    return TimedHttpToolsProtocol


class BackgroundServer:
    """Run an ASGI app with uvicorn in a thread (tests, ``scripts/bench_serve.py``).

    Args:
        app: the app (its lifespan runs on the thread's loop).
        host, port: where to bind; port 0 picks a free port (see :attr:`url`).
        timeouts: ``header_timeout_s``, ``keep_alive_s``, ``shutdown_timeout_s`` of :func:`uvicorn_config`.
    """

    def __init__(self, app, host: str = "127.0.0.1", port: int = 0, log_level: str = "warning", sockets=None, **timeouts: float):
        import uvicorn

        self.config = uvicorn_config(app, host, port, log_level=log_level, **timeouts)
        self.server = uvicorn.Server(self.config)
        self.sockets = sockets  # already bound and listening (e.g. a shard's SO_REUSEPORT socket)
        self.thread = None
        self.loop = None
        self.url = ""

    def __enter__(self) -> "BackgroundServer":
        import threading
        import time

        def run() -> None:
            factory = self.config.get_loop_factory()  # uvloop's where installed, as uvicorn.run would
            self.loop = factory() if factory else asyncio.new_event_loop()
            try:
                self.loop.run_until_complete(self.server.serve(sockets=self.sockets))
            finally:
                self.loop.close()

        self.thread = threading.Thread(target=run, name="ppipe-frontend", daemon=True)
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
