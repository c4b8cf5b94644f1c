"""The gRPC frontend: the KServe v2 (Open Inference Protocol) gRPC API on grpc.aio.

Service ``inference.GRPCInferenceService`` (messages: :mod:`ppipe.runtime.ingress.proto`), beside
the REST frontend (:mod:`ppipe.runtime.ingress.http_server`) and over the same :class:`Runtime`::

    ServerLive       live: true while the process serves
    ServerReady      ready: at least one model is ready (as REST's /v2/health/ready)
    ModelReady       ready of one model (token)                 NOT_FOUND unknown model
    ServerMetadata   name, version, extensions (token)
    ModelMetadata    inputs, outputs (shape [-1, ...])          NOT_FOUND unknown model
    ModelInfer       inference; inputs as raw_input_contents or typed contents, outputs
                     always as raw_output_contents

Status codes of ``ModelInfer`` (REST's status in brackets; both count in
``ppipe_requests_total`` under the REST status):

    OK                  the outputs                                                  [200]
    INVALID_ARGUMENT    wrong tensor name, datatype, shape or size; the message says
                        which field and what it must be                             [400]
    UNAUTHENTICATED     missing or wrong ``authorization: Bearer <token>`` metadata  [401]
    NOT_FOUND           unknown model                                                [404]
    RESOURCE_EXHAUSTED  message larger than the limit (grpc's own check)             [413]
    UNAVAILABLE         dropped by the data plane: "dropped: <reason>: <detail>"     [503]
    INTERNAL            worker-error, or a bug in the server                         [500]
    DEADLINE_EXCEEDED   timeout: no decision within SLO + grace (a bug)              [504]

Every drop (UNAVAILABLE, INTERNAL worker-error, DEADLINE_EXCEEDED timeout) carries the
reason in the trailing metadata ``ppipe-drop-reason``, as REST's header does.

The server runs on the asyncio loop of the Runtime (the scheduler may only be called from
that loop): ``ppipe serve`` passes a :class:`GrpcServer` to
:func:`ppipe.runtime.ingress.http_server.create_app` as a companion, which the app's lifespan starts
after the runtime and stops before it, on uvicorn's loop.
"""

from __future__ import annotations

import logging
import math
import socket
import time

import grpc
import numpy as np

from ppipe.runtime.ingress import proto as pb
from ppipe.runtime.scheduler.host import DroppedError, Runtime
from ppipe.runtime.ingress.protocol import (BYTES, INPUT_DATATYPES, MAX_DIMS, InferInput, ProtocolError, datatype_of, split_bytes,
                                             stacked_outputs, wire_dtype)
from ppipe.runtime.ingress.http_server import DEFAULT_MAX_BODY_BYTES, DROP_STATUS, Frontend
from ppipe.runtime.ingress.model_io import check_infer_inputs

log = logging.getLogger(__name__)

DROP_HEADER = "ppipe-drop-reason"
SERVER_TIMING = "server-timing"  # trailing metadata of an answered ModelInfer: how long the server held it

# REST status -> gRPC status, for the errors both frontends share
STATUS_CODE = {
    400: grpc.StatusCode.INVALID_ARGUMENT,
    401: grpc.StatusCode.UNAUTHENTICATED,
    404: grpc.StatusCode.NOT_FOUND,
    413: grpc.StatusCode.RESOURCE_EXHAUSTED,
    415: grpc.StatusCode.UNIMPLEMENTED,
    500: grpc.StatusCode.INTERNAL,
    503: grpc.StatusCode.UNAVAILABLE,
    504: grpc.StatusCode.DEADLINE_EXCEEDED,
}

# datatype -> the InferTensorContents field that carries it (FP16 has none: raw only)
CONTENTS_FIELD = {
    "BOOL": "bool_contents",
    "INT8": "int_contents",
    "INT16": "int_contents",
    "INT32": "int_contents",
    "INT64": "int64_contents",
    "UINT8": "uint_contents",
    "UINT16": "uint_contents",
    "UINT32": "uint_contents",
    "UINT64": "uint64_contents",
    "FP32": "fp32_contents",
    "FP64": "fp64_contents",
}

_TOKEN_HELP = "missing or wrong bearer token (metadata 'authorization: Bearer <token>')"


class _Refused(Exception):
    """An RPC to answer with a non-OK status (``status`` is REST's equivalent)."""

    def __init__(self, status: int, message: str, drop_reason: str | None = None):
        super().__init__(message)
        self.status, self.message, self.drop_reason = status, message, drop_reason


def decode_inputs(request) -> list[InferInput]:
    """The input tensors of a ``ModelInferRequest`` as arrays, raw or typed contents.

    Raises:
        ProtocolError: 400 with a message naming the field at fault.
    """
    raw = request.raw_input_contents
    if raw and len(raw) != len(request.inputs):
        raise ProtocolError(
            400, f"raw_input_contents has {len(raw)} entries for {len(request.inputs)} inputs; send one per input, in order"
        )
    out: list[InferInput] = []
    for i, t in enumerate(request.inputs):
        where = f"inputs[{i}] ('{t.name}')"
        if t.datatype not in INPUT_DATATYPES:
            raise ProtocolError(400, f"{where}.datatype {t.datatype!r} is not supported; use one of {', '.join(INPUT_DATATYPES)}")
        shape = list(t.shape)
        if len(shape) > MAX_DIMS:
            raise ProtocolError(400, f"{where}.shape has {len(shape)} dimensions; at most {MAX_DIMS} are accepted")
        if any(d < 0 for d in shape):
            raise ProtocolError(400, f"{where}.shape must be non-negative integers, got {shape}")
        count = math.prod(shape)  # at most MAX_DIMS int64 factors: cheap; compared with the data before numpy sees it
        if t.datatype == BYTES:
            out.append(InferInput(name=t.name, array=_bytes_input(t, where, shape, count, raw[i] if raw else None)))
            continue
        dtype = wire_dtype(t.datatype)
        if raw:
            if t.HasField("contents"):
                raise ProtocolError(400, f"{where} has typed contents and raw_input_contents; send one or the other")
            data = raw[i]
            if len(data) != count * dtype.itemsize:
                raise ProtocolError(
                    400, f"{where}: raw_input_contents[{i}] has {len(data)} bytes; shape {shape} of {t.datatype} needs "
                    f"{count} x {dtype.itemsize} = {count * dtype.itemsize}"
                )
            try:
                arr = np.frombuffer(data, dtype=dtype).reshape(shape)
            except ValueError as exc:  # e.g. an empty tensor with a dimension numpy cannot hold
                raise ProtocolError(400, f"{where}.shape {shape} cannot be read as {t.datatype}: {exc}") from None
        else:
            field = CONTENTS_FIELD.get(t.datatype)
            if field is None:
                raise ProtocolError(400, f"{where}: {t.datatype} has no typed contents field; send it in raw_input_contents")
            values = getattr(t.contents, field)
            if len(values) != count:
                raise ProtocolError(400, f"{where}.contents.{field} has {len(values)} elements, shape {shape} needs {count}")
            try:
                arr = np.array(values, dtype=dtype).reshape(shape)
            except (OverflowError, ValueError) as exc:
                raise ProtocolError(400, f"{where}.contents.{field} cannot be read as {t.datatype}: {exc}") from None
        out.append(InferInput(name=t.name, array=arr))
    return out


def _bytes_input(t, where: str, shape: list[int], count: int, raw: bytes | None) -> np.ndarray:
    """A ``BYTES`` input as an array of ``bytes``: from its raw contents (each element a
    4-byte little-endian length and its bytes, as Triton sends them) or ``contents.bytes_contents``."""
    if raw is not None:
        if t.HasField("contents"):
            raise ProtocolError(400, f"{where} has typed contents and raw_input_contents; send one or the other")
        return split_bytes(memoryview(raw), count, where).reshape(shape)
    values = t.contents.bytes_contents
    if len(values) != count:
        raise ProtocolError(400, f"{where}.contents.bytes_contents has {len(values)} elements, shape {shape} needs {count}")
    arr = np.empty(count, dtype=object)
    arr[:] = list(values)
    return arr.reshape(shape)


def encode_outputs(response, outputs: dict[str, np.ndarray]) -> None:
    """Append ``outputs`` to a ``ModelInferResponse`` as tensors with raw_output_contents."""
    for name, arr in outputs.items():
        arr = np.ascontiguousarray(arr, dtype=arr.dtype.newbyteorder("<"))
        t = response.outputs.add()
        t.name, t.datatype = name, datatype_of(arr.dtype)
        t.shape.extend(arr.shape)
        response.raw_output_contents.append(arr.tobytes())


class GrpcFrontend:
    """The RPC handlers around a :class:`Runtime`; same checks and answers as the REST
    :class:`~ppipe.runtime.ingress.http_server.Frontend` (whose metadata and token check it reuses)."""

    def __init__(self, runtime: Runtime, token: str | None = None, router=None):
        self.runtime = runtime
        self.rest = Frontend(runtime, token=token)
        self.models = self.rest.models
        self.router = router  # a ShardRouter: RPCs of other shards' models go to their owner
        if router is not None:
            router.grpc = self

    # ---- helpers ----------------------------------------------------------------------
    def _check_token(self, context) -> None:
        if not self.rest.token:
            return
        auth = None
        for key, value in context.invocation_metadata() or ():
            if key == "authorization":
                auth = value
                break
        if not self.rest._token_ok(auth):
            raise _Refused(401, _TOKEN_HELP)

    def _model(self, name: str) -> str:
        if name not in self.models:
            raise _Refused(404, f"unknown model '{name}'; this server has: {', '.join(self.models)}")
        return name

    @staticmethod
    async def _abort(context, exc: _Refused):
        meta = ((DROP_HEADER, exc.drop_reason),) if exc.drop_reason else ()
        await context.abort(STATUS_CODE.get(exc.status, grpc.StatusCode.INTERNAL), exc.message, trailing_metadata=meta)

    def _owner(self, name: str, deal: bool = True) -> int | None:
        """The shard that serves model ``name``, where it is another shard of this server. A
        model on several shards: with ``deal`` (an infer), the next turn of the router's deal;
        without (metadata, readiness), this shard where it serves the model, else the first."""
        r = self.router
        if r is None:
            return None
        if not deal:
            shards = r.owner.shards_of(name)
            return None if not shards or r.index in shards else shards[0]
        k = r.owner.get(name, r.index)
        return None if k == r.index else k

    async def _pass(self, shard: int, rpc: str, request, context):
        """The answer of shard ``shard``'s gRPC frontend to ``request`` (ShardRouter.ask_grpc)."""
        code, message, trailing, body = await self.router.ask_grpc(shard, rpc, request.SerializeToString(),
                                                                    list(context.invocation_metadata() or ()))
        if code is not None:
            await context.abort(grpc.StatusCode[code], message, trailing_metadata=tuple(tuple(t) for t in trailing))
        if trailing:
            context.set_trailing_metadata(tuple(tuple(t) for t in trailing))
        return pb.METHODS[rpc][2].FromString(body)

    async def serve_passed(self, rpc: str, body: bytes, metadata: list) -> tuple[str | None, str, list, bytes]:
        """Answer an RPC another shard passed here: ``(code, message, trailing, response)``
        with ``code`` None for OK (its name otherwise)."""
        ctx = _PassedContext(metadata)
        try:
            response = await self._rpc(rpc)(pb.METHODS[rpc][1].FromString(body), ctx)
        except _Aborted as exc:
            return exc.code.name, exc.message, list(exc.trailing), b""
        return None, "", list(ctx.trailing), response.SerializeToString()

    def _rpc(self, rpc: str):
        return {"ServerLive": self.server_live, "ServerReady": self.server_ready, "ModelReady": self.model_ready,
                "ServerMetadata": self.server_metadata, "ModelMetadata": self.model_metadata, "ModelInfer": self.model_infer}[rpc]

    # ---- RPCs ---------------------------------------------------------------------------
    async def server_live(self, request, context):
        return pb.ServerLiveResponse(live=True)

    async def server_ready(self, request, context):
        if self.router is not None and len(set(self.router.owner.values())) > 1:
            return pb.ServerReadyResponse(ready=await self.router.ready())  # every shard's, as REST's readiness
        ok = self.runtime.started and any(self.runtime.model_ready(m) for m in self.models)
        return pb.ServerReadyResponse(ready=ok)

    async def model_ready(self, request, context):
        if (shard := self._owner(request.name, deal=False)) is not None:
            return await self._pass(shard, "ModelReady", request, context)
        try:
            self._check_token(context)
            name = self._model(request.name)
        except _Refused as exc:
            await self._abort(context, exc)
        return pb.ModelReadyResponse(ready=self.runtime.started and self.runtime.model_ready(name))

    async def server_metadata(self, request, context):
        from ppipe import __version__

        try:
            self._check_token(context)
        except _Refused as exc:
            await self._abort(context, exc)
        return pb.ServerMetadataResponse(name="ppipe", version=__version__)

    async def model_metadata(self, request, context):
        if (shard := self._owner(request.name, deal=False)) is not None:
            return await self._pass(shard, "ModelMetadata", request, context)
        try:
            self._check_token(context)
            meta = self.rest._metadata(self._model(request.name))
        except _Refused as exc:
            await self._abort(context, exc)
        resp = pb.ModelMetadataResponse(name=meta["name"], versions=meta["versions"], platform=meta["platform"])
        for key in ("inputs", "outputs"):
            for t in meta[key]:
                getattr(resp, key).add(name=t["name"], datatype=t["datatype"], shape=t["shape"])
        return resp

    async def model_infer(self, request, context):
        m = self.runtime.metrics
        name = request.model_name
        if (shard := self._owner(name)) is not None:
            return await self._pass(shard, "ModelInfer", request, context)
        try:
            self._check_token(context)
            self._model(name)
        except _Refused as exc:
            await self._abort(context, exc)
        t0 = time.perf_counter()  # (not the loop's clock: uvloop's counts whole milliseconds)
        arrival_us = self.runtime.clock.true_now_us()
        try:
            try:
                inputs = decode_inputs(request)
                requested = [o.name for o in request.outputs]
                in_name, arr = check_infer_inputs(name, self.runtime.profiles[name].manifest, inputs, requested)
            except ProtocolError as exc:
                raise _Refused(exc.status, exc.message) from None
            try:
                arr = await self.rest.images_to_tensor(name, arr, arrival_us)
            except ProtocolError as exc:
                raise _Refused(exc.status, exc.message) from None
            except DroppedError as exc:
                raise _Refused(DROP_STATUS.get(exc.reason, 503), str(exc), drop_reason=exc.reason) from None
            try:
                if arr.shape[0] == 1:
                    results = [await self.runtime.infer(name, {in_name: arr[0]}, arrival_us=arrival_us)]
                else:
                    results = await self.runtime.infer_samples(name, [{in_name: s} for s in arr], arrival_us=arrival_us)
            except DroppedError as exc:
                raise _Refused(DROP_STATUS.get(exc.reason, 503), str(exc), drop_reason=exc.reason) from None
            outputs = stacked_outputs(results)
            if requested:
                outputs = {k: v for k, v in outputs.items() if k in requested}
            resp = pb.ModelInferResponse(model_name=name, model_version="1", id=request.id)
            encode_outputs(resp, outputs)
        except _Refused as exc:
            m.requests.labels(name, str(exc.status)).inc()
            await self._abort(context, exc)
        except Exception:  # never a traceback to the client; the log has it
            log.exception("gRPC ModelInfer of model '%s' failed", name)
            m.requests.labels(name, "500").inc()
            await context.abort(grpc.StatusCode.INTERNAL, "internal error in the server (its log has the details)")
        m.bound(m.requests, name, "200").inc()
        held_s = time.perf_counter() - t0
        m.bound(m.latency, name).observe(held_s)
        context.set_trailing_metadata(((SERVER_TIMING, f"ppipe;dur={held_s * 1e3:.3f}"),))  # as REST's Server-Timing
        return resp

    def handler(self) -> grpc.GenericRpcHandler:
        """The service's handler for ``grpc.aio.Server.add_generic_rpc_handlers``."""
        return grpc.method_handlers_generic_handler(
            pb.SERVICE,
            {
                rpc: grpc.unary_unary_rpc_method_handler(
                    self._rpc(rpc), request_deserializer=req.FromString, response_serializer=resp.SerializeToString
                )
                for rpc, (_, req, resp) in pb.METHODS.items()
            },
        )


class _Aborted(Exception):
    def __init__(self, code: grpc.StatusCode, message: str, trailing: tuple):
        super().__init__(message)
        self.code, self.message, self.trailing = code, message, trailing


class _PassedContext:
    """The part of ``grpc.aio.ServicerContext`` the RPCs use, for an RPC another shard passed:
    its caller's metadata, ``abort`` as an exception the owner sends back, and the trailing
    metadata of an answer."""

    def __init__(self, metadata: list):
        self._metadata = tuple((k, v) for k, v in metadata)
        self.trailing: tuple = ()

    def set_trailing_metadata(self, trailing) -> None:
        self.trailing = tuple(tuple(t) for t in trailing)

    def invocation_metadata(self):
        return self._metadata

    async def abort(self, code, details="", trailing_metadata=()):
        raise _Aborted(code, details, tuple(trailing_metadata))


def grpc_address(host: str, port: int) -> str:
    """``host:port`` as grpc takes it (IPv6 literals in brackets)."""
    return f"[{host}]:{port}" if ":" in host and not host.startswith("[") else f"{host}:{port}"


def check_port_free(host: str, port: int) -> str | None:
    """Why ``host:port`` cannot be bound now, or None. A check before the slow start-up
    (Ray workers), so that a busy port is a clear error, not a failed app start-up."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host.strip("[]"), port))
        except OSError as exc:
            return exc.strerror or str(exc)
    return None


class GrpcServer:
    """A grpc.aio server of :class:`GrpcFrontend`, started on the running loop.

    Args:
        runtime: the runtime to serve (already started, on this loop, when :meth:`start` runs).
        host, port: where to bind; port 0 picks a free port (see :attr:`port` after start).
        token: bearer token required on ModelMetadata and ModelInfer, as on REST.
        router: the shard's :class:`~ppipe.runtime.ingress.shard_router.ShardRouter` on a server of several
            shards: every shard serves the port, and passes RPCs of other shards' models to
            their owner (the answer, error or not, comes back as the owner gave it).
        max_message_bytes: largest request accepted (RESOURCE_EXHAUSTED above), REST's body limit.
        grace_s: on stop, how long in-flight RPCs may still finish.
        shared_port: other processes of this server bind the port too (``SO_REUSEPORT``);
            default: where there is a ``router`` (shards), and the ingress processes set it.
    """

    def __init__(self, runtime: Runtime, host: str = "127.0.0.1", port: int = 0, token: str | None = None,
                 max_message_bytes: int = DEFAULT_MAX_BODY_BYTES, grace_s: float = 5.0, router=None, shared_port: bool | None = None):
        self.frontend = GrpcFrontend(runtime, token=token, router=router)
        self.shared_port = router is not None if shared_port is None else shared_port
        self.host, self.port = host, port
        self.max_message_bytes, self.grace_s = max_message_bytes, grace_s
        self.server: grpc.aio.Server | None = None

    @property
    def address(self) -> str:
        return grpc_address(self.host, self.port)

    async def start(self) -> None:
        """Bind and serve. Raises RuntimeError, naming the address, when it cannot bind."""
        server = grpc.aio.server(
            options=[
                ("grpc.max_receive_message_length", self.max_message_bytes),
                ("grpc.max_send_message_length", -1),
                # one server's shards share the port; a second `ppipe serve` fails instead of sharing it
                # (ppipe serve checks the port is free before it starts the shards)
                ("grpc.so_reuseport", 1 if self.shared_port else 0),
            ]
        )
        server.add_generic_rpc_handlers((self.frontend.handler(),))
        try:
            bound = server.add_insecure_port(grpc_address(self.host, self.port))
        except RuntimeError as exc:
            raise RuntimeError(f"gRPC frontend cannot bind {self.address}: {exc}; choose another --grpc-port") from None
        if bound == 0:
            raise RuntimeError(f"gRPC frontend cannot bind {self.address}; choose another --grpc-port")
        self.port = bound
        await server.start()
        self.server = server

    async def stop(self) -> None:
        """Stop taking RPCs; those in flight get ``grace_s`` to finish."""
        if self.server is not None:
            await self.server.stop(self.grace_s)
            self.server = None
        self.frontend.rest.images.stop()
