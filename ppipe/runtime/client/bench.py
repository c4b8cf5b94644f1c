"""``ppipe bench``: an open-loop load generator against a running ``ppipe serve``.

Requests are sent at the arrival times of a Poisson, bursty (gamma) or trace-driven process
(the simulator's generators, :mod:`ppipe.sim.arrivals`, so a bench and a simulation of the
same seed see the same arrivals), whether or not earlier ones were answered. Latency is
measured from a request's *scheduled* send time, so a client that falls behind shows up
as latency rather than as a lower offered rate. A request attains its SLO when it is
answered 200 within the model's SLO (from its metadata, or ``--slo-ms``).

Requests go out through :class:`ppipe.runtime.client.httpclient.RawHttpClient` (default; see
there why) or httpx (``client="httpx"``), or with ``grpc="HOST:PORT"`` over the KServe v2
gRPC API (``ppipe serve --grpc-port``; :class:`GrpcInferClient`). The model's metadata
(input, SLO) always comes from the REST URL: the v2 gRPC metadata has no SLO.
"""

from __future__ import annotations

import asyncio
import io
import itertools
import json
import math
import threading
import time
from dataclasses import asdict, dataclass, field
from typing import Any, Awaitable, Callable

import numpy as np
from rich.console import Console
from rich.table import Table
from rich.text import Text

from ppipe.errors import UserError
from ppipe.runtime.timerslack import tighten_timer_slack
from ppipe.runtime.ingress.protocol import DATATYPES, encode_infer_request


@dataclass
class BenchResult:
    """Figures of one bench run. Latencies in ms; rates in requests/s."""

    model: str
    arrivals: str
    offered_rps: float
    duration_s: float
    sent: int
    ok: int
    on_time: int
    slo_ms: float
    slo_attainment: float
    goodput_rps: float
    p50_ms: float | None
    p99_ms: float | None
    drops: dict[str, int] = field(default_factory=dict)
    errors: dict[str, int] = field(default_factory=dict)
    client_lag_p99_ms: float | None = None
    server_p50_ms: float | None = None  # the server's own time per 200 (its Server-Timing header), where it says
    server_p99_ms: float | None = None
    server_on_time: int | None = None  # 200s the server held within the SLO (None: it sent no timing)

    def as_dict(self) -> dict[str, Any]:
        return json.loads(json.dumps(asdict(self), default=lambda o: o.item() if hasattr(o, "item") else str(o)))


def _percentile(xs: list[float], q: float) -> float | None:
    return float(np.percentile(xs, q)) if xs else None


def sample_input(meta: dict[str, Any], seed: int = 0) -> dict[str, np.ndarray]:
    """One random sample (with a batch axis of 1) that fits the model's metadata."""
    spec = meta["inputs"][0]
    shape = [d for d in spec["shape"][1:]]
    if any(d < 0 for d in shape) or not shape:
        raise UserError(
            f"model '{meta['name']}' does not declare its input shape (metadata: {spec['shape']})",
            fix="profile the model with an input spec, or give --input-shape",
        )
    dtype = np.dtype(DATATYPES.get(spec["datatype"], "float32"))
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(1, *shape)).astype(dtype) if dtype.kind == "f" else rng.integers(0, 8, size=(1, *shape)).astype(dtype)
    return {spec["name"]: x}


IMAGE_SUFFIXES = (".jpg", ".jpeg", ".png", ".webp", ".bmp", ".tif", ".tiff")


def load_images(directory: str) -> list[bytes]:
    """The image files of ``directory`` (by suffix, in name order), as their bytes.

    Raises:
        UserError: the folder does not exist or holds no image file.
    """
    from pathlib import Path

    folder = Path(directory)
    if not folder.is_dir():
        raise UserError(f"--images {directory}: no such folder", fix="give a folder of JPEG/PNG files")
    files = sorted(f for f in folder.iterdir() if f.is_file() and f.suffix.lower() in IMAGE_SUFFIXES)
    if not files:
        raise UserError(f"--images {directory}: no image file in it", fix=f"put files ending in {', '.join(IMAGE_SUFFIXES)} there")
    return [f.read_bytes() for f in files]


def image_inputs(meta: dict[str, Any], images: list[bytes]) -> list[dict[str, np.ndarray]]:
    """One request's inputs per image: a BYTES tensor of shape [1] holding it.

    Raises:
        UserError: the model takes no images (its metadata names no BYTES alternative).
    """
    spec = meta["inputs"][0]
    if "also_accepts" not in (spec.get("parameters") or {}):
        raise UserError(f"model '{meta['name']}' takes {spec['datatype']} tensors, not images: its model.yaml declares no preprocess",
                        fix="leave out --images, or add a preprocess to the model's model.yaml")
    out = []
    for blob in images:
        arr = np.empty(1, dtype=object)
        arr[0] = blob
        out.append({spec["name"]: arr})
    return out


def encode_grpc_request(model: str, inputs: dict[str, np.ndarray], raw: bool = True) -> bytes:
    """A serialized ``ModelInferRequest``: the tensors in raw_input_contents (``raw``) or
    as typed contents (not for FP16, which has no typed field)."""
    from ppipe.runtime.ingress import proto as pb
    from ppipe.runtime.ingress.grpc_server import CONTENTS_FIELD
    from ppipe.runtime.ingress.protocol import datatype_of

    req = pb.ModelInferRequest(model_name=model)
    for name, arr in inputs.items():
        if arr.dtype == object:  # byte strings: 4-byte little-endian lengths and bytes, or bytes_contents
            t = req.inputs.add(name=name, datatype="BYTES", shape=arr.shape)
            blobs = [bytes(b) for b in arr.reshape(-1)]
            if raw:
                req.raw_input_contents.append(b"".join(len(b).to_bytes(4, "little") + b for b in blobs))
            else:
                t.contents.bytes_contents.extend(blobs)
            continue
        dt = datatype_of(arr.dtype)
        t = req.inputs.add(name=name, datatype=dt, shape=arr.shape)
        if raw:
            req.raw_input_contents.append(np.ascontiguousarray(arr, dtype=arr.dtype.newbyteorder("<")).tobytes())
        elif dt in CONTENTS_FIELD:
            getattr(t.contents, CONTENTS_FIELD[dt]).extend(arr.ravel().tolist())
        else:
            raise UserError(f"{dt} input '{name}' has no typed gRPC contents", fix="use --binary (raw_input_contents)")
    return req.SerializeToString()


class GrpcInferClient:
    """ModelInfer calls of one pre-serialized request over one grpc.aio channel (HTTP/2
    multiplexes the calls in flight; the answers are not decoded, as the HTTP clients'
    are not).

    Args:
        address: ``host:port`` of the gRPC frontend.
        token: sent as ``authorization: Bearer <token>`` metadata.
    """

    def __init__(self, address: str, token: str | None = None, timeout_s: float = 60.0):
        import grpc

        from ppipe.runtime.ingress import proto as pb

        self.channel = grpc.aio.insecure_channel(
            address, options=[("grpc.max_send_message_length", -1), ("grpc.max_receive_message_length", -1)]
        )
        self.call = self.channel.unary_unary(pb.METHODS["ModelInfer"][0])  # bytes in, bytes out
        self.metadata = (("authorization", f"Bearer {token}"),) if token else None
        self.timeout_s = timeout_s

    async def infer(self, body: bytes) -> tuple[int | str, dict[str, str]]:
        """One call; returns (200 or the gRPC status name, its trailing metadata)."""
        import grpc

        call = self.call(body, metadata=self.metadata, timeout=self.timeout_s)
        try:
            await call
        except grpc.aio.AioRpcError as exc:
            return exc.code().name, {k: v for k, v in (exc.trailing_metadata() or ()) if isinstance(v, str)}
        return 200, {k: v for k, v in (await call.trailing_metadata() or ()) if isinstance(v, str)}

    async def aclose(self) -> None:
        await self.channel.close()


def arrival_times_us(kind: str, rate_rps: float, duration_s: float, seed: int, trace: str | None = None, cv: float = 2.0) -> np.ndarray:
    from ppipe.sim.arrivals import make_arrivals, read_trace

    if kind == "trace" and trace is None:
        raise UserError("--arrivals trace needs a trace file", fix="give --trace FILE")
    trace_s = read_trace(trace) if kind == "trace" else None
    return make_arrivals(kind, {"m": rate_rps}, duration_s * 1e6, seed, cv=cv, trace_s=trace_s)["m"]


async def run_bench(
    url: str,
    model: str,
    rate_rps: float,
    duration_s: float,
    arrivals: str = "poisson",
    trace: str | None = None,
    binary: bool = False,
    seed: int = 0,
    slo_ms: float | None = None,
    token: str | None = None,
    cv: float = 2.0,
    input_shape: list[int] | None = None,
    timeout_s: float = 60.0,
    client: str = "raw",
    grpc: str | None = None,
    records: list | None = None,
    images: list[bytes] | None = None,
    start_at: float | None = None,
) -> BenchResult:
    """Drive ``url`` open loop (or, with ``grpc``, that gRPC address); returns the figures
    (see :class:`BenchResult`). ``binary``: REST's binary extension, gRPC's raw_input_contents.
    ``images``: encoded image files, sent in turn as BYTES inputs (instead of one random tensor).
    ``records``: a list that gets one ``(send offset s, outcome, latency ms)`` per request, in
    answer order; the outcome is ``"200"``, the drop reason, or the error. ``start_at``: the
    wall-clock time (``time.time()``) of the first arrival window's start (None: at once),
    so that benches started together send together once each has loaded. The HTTP
    connections that the rate needs are open before the first arrival (:func:`_warm`)."""
    if start_at is not None:
        _check_start(start_at)
    headers = {"authorization": f"Bearer {token}"} if token else {}
    base = url.rstrip("/")
    meta = await _fetch_metadata(url, model, headers, timeout_s)
    if input_shape:
        meta["inputs"][0]["shape"] = [-1, *input_shape]
    slo = slo_ms or (meta.get("parameters") or {}).get("slo_ms")
    if not slo:
        raise UserError(f"model '{model}' does not state its SLO", fix="give --slo-ms")
    requests = image_inputs(meta, images) if images else [sample_input(meta, seed)]
    times_us = arrival_times_us(arrivals, rate_rps, duration_s, seed, trace, cv)
    if grpc:
        sender = _grpc_sender(grpc, token, timeout_s, [encode_grpc_request(model, r, raw=binary) for r in requests])
    else:
        bodies = [encode_infer_request(r, binary=binary, binary_output=binary) for r in requests]
        sender = _http_sender(client, base, headers, timeout_s, f"/v2/models/{model}/infer", bodies)
    tally = _Tally(slo, records)
    try:
        await _warm(sender, rate_rps, slo, start_at)
        await _send_open_loop(times_us, sender, tally)
    finally:
        await sender.close()
    return tally.result(model=model, arrivals=arrivals, offered_rps=rate_rps, duration_s=duration_s, sent=len(times_us))


WARM_AHEAD_S = 0.3  # connections are opened this long before a --start-at (a server closes idle ones after seconds)


async def _warm(sender: "_Sender", rate_rps: float, slo_ms: float, start_at: float | None) -> None:
    """Wait for ``start_at`` (if given), opening ahead of it the connections that about three
    SLOs' worth of arrivals would hold at once (at least two, at most 64).

    Raises:
        UserError: ``start_at`` has passed.
    """
    if start_at is not None:
        _check_start(start_at)
        await asyncio.sleep(max(0.0, start_at - time.time() - WARM_AHEAD_S))
    if sender.warm is not None:
        await sender.warm(min(64, max(2, math.ceil(3 * rate_rps * slo_ms / 1e3))))
    if start_at is not None:
        await asyncio.sleep(max(0.0, start_at - time.time()))


def _check_start(start_at: float) -> None:
    """Refuse a start time that has passed (UserError)."""
    ahead = start_at - time.time()
    if ahead < 0:
        raise UserError(f"--start-at is {-ahead:.1f} s in the past", fix="give a time a few seconds ahead, e.g. $(($(date +%s) + 5))")


async def _fetch_metadata(url: str, model: str, headers: dict[str, str], timeout_s: float) -> dict[str, Any]:
    """GET ``url``'s v2 metadata of ``model``; a UserError when the server cannot be reached or refuses."""
    import httpx

    async with httpx.AsyncClient(base_url=url.rstrip("/"), headers=headers, timeout=timeout_s) as meta_client:
        try:
            r = await meta_client.get(f"/v2/models/{model}")
        except httpx.HTTPError as exc:
            raise UserError(f"cannot reach {url}: {exc}", fix="start `ppipe serve` first, or fix the URL") from None
    if r.status_code != 200:
        raise UserError(f"{url}/v2/models/{model}: HTTP {r.status_code}: {r.text[:200]}", fix="check --model and --token")
    return r.json()


@dataclass
class _Sender:
    """How a bench sends its one request: ``post()`` -> (status, headers), 200 or the HTTP
    status or the gRPC status name; ``close()`` ends the client; ``errors``: the exceptions
    of a request that got no answer, counted by their class name."""

    post: Callable[[], Awaitable[tuple[int | str, Any]]]
    close: Callable[[], Awaitable[None]]
    errors: tuple[type[BaseException], ...]
    warm: Callable[[int], Awaitable[None]] | None = None  # open this many connections now (where the client keeps a pool)


def _grpc_sender(address: str, token: str | None, timeout_s: float, grpc_bodies: list[bytes]) -> _Sender:
    gc = GrpcInferClient(address, token=token, timeout_s=timeout_s)
    turn = itertools.cycle(grpc_bodies)

    async def post() -> tuple[int | str, dict[str, str]]:
        return await gc.infer(next(turn))

    return _Sender(post, gc.aclose, ())


def _http_sender(client: str, base: str, headers: dict[str, str], timeout_s: float, path: str,
                 bodies: list[tuple[bytes, dict[str, str]]]) -> _Sender:
    """POST the ``(body, headers)`` of ``bodies`` in turn to ``path`` with ``client``: "raw"
    (:class:`RawHttpClient`) or "httpx"."""
    import httpx

    from ppipe.runtime.client.httpclient import HttpError, RawHttpClient

    turn = itertools.cycle(bodies)

    if client == "httpx":
        limits = httpx.Limits(max_connections=None, max_keepalive_connections=512)
        hx = httpx.AsyncClient(base_url=base, headers=headers, timeout=timeout_s, limits=limits)

        async def post_httpx() -> tuple[int, Any]:
            body, req_headers = next(turn)
            resp = await hx.post(path, content=body, headers=req_headers)
            return resp.status_code, resp.headers

        return _Sender(post_httpx, hx.aclose, (httpx.HTTPError,))
    if client == "raw":
        raw = RawHttpClient(base, headers=headers, timeout_s=timeout_s)

        async def post_raw() -> tuple[int, dict[str, str]]:
            body, req_headers = next(turn)
            status, hdrs, _ = await raw.request("POST", path, body, req_headers)
            return status, hdrs

        return _Sender(post_raw, raw.aclose, (HttpError, OSError, asyncio.TimeoutError), raw.warm)
    raise UserError(f"unknown client '{client}'", fix="use raw or httpx")


class _Tally:
    """The bench's counts as answers come: latencies of 200s, client lag, drops by reason,
    other outcomes, and (where ``records`` is a list) every request's record."""

    def __init__(self, slo_ms: float, records: list | None):
        self.slo_ms, self.records = slo_ms, records
        self.lat_ms: list[float] = []
        self.server_ms: list[float] = []  # what the 200s' Server-Timing headers say
        self.lag_ms: list[float] = []
        self.codes: dict[str, int] = {}
        self.drops: dict[str, int] = {}
        self.on_time = self.ok = 0
        self.t0 = 0.0  # perf_counter of the arrivals' time 0

    def error(self, t_sched: float, exc: BaseException) -> None:
        """A request that got no answer: counted by the exception's class name."""
        key = type(exc).__name__
        self.codes[key] = self.codes.get(key, 0) + 1
        if self.records is not None:
            self.records.append((t_sched - self.t0, key, (time.perf_counter() - t_sched) * 1e3))

    def answer(self, t_sched: float, status: int | str, hdrs) -> None:
        """An answer, timed from its scheduled send ``t_sched``: a 200 (on time or late), a drop (by reason) or another status."""
        dt_ms = (time.perf_counter() - t_sched) * 1e3
        if status == 200:
            self.ok += 1
            self.lat_ms.append(dt_ms)
            self.on_time += int(dt_ms <= self.slo_ms)
            held = server_timing_ms(hdrs.get("server-timing"))
            if held is not None:
                self.server_ms.append(held)
            key = "200"
        elif hdrs.get("ppipe-drop-reason"):
            key = hdrs["ppipe-drop-reason"]
            self.drops[key] = self.drops.get(key, 0) + 1
        else:
            key = f"HTTP {status}" if isinstance(status, int) else f"gRPC {status}"
            self.codes[key] = self.codes.get(key, 0) + 1
        if self.records is not None:
            self.records.append((t_sched - self.t0, key, dt_ms))

    def result(self, model: str, arrivals: str, offered_rps: float, duration_s: float, sent: int) -> BenchResult:
        return BenchResult(
            model=model,
            arrivals=arrivals,
            offered_rps=offered_rps,
            duration_s=duration_s,
            sent=sent,
            ok=self.ok,
            on_time=self.on_time,
            slo_ms=float(self.slo_ms),
            slo_attainment=self.on_time / sent if sent else 0.0,
            goodput_rps=self.on_time / duration_s,
            p50_ms=_percentile(self.lat_ms, 50),
            p99_ms=_percentile(self.lat_ms, 99),
            drops=self.drops,
            errors=self.codes,
            client_lag_p99_ms=_percentile(self.lag_ms, 99),
            server_p50_ms=_percentile(self.server_ms, 50),
            server_p99_ms=_percentile(self.server_ms, 99),
            server_on_time=sum(x <= self.slo_ms for x in self.server_ms) if self.server_ms else None,
        )


def server_timing_ms(value: str | None) -> float | None:
    """The ``dur`` of the ``ppipe`` metric of a ``Server-Timing`` header (ms), or None."""
    for metric in (value or "").split(","):
        name, _, params = metric.strip().partition(";")
        if name.strip() != "ppipe":
            continue
        for param in params.split(";"):
            key, _, x = param.strip().partition("=")
            if key.strip() == "dur":
                try:
                    return float(x)
                except ValueError:
                    return None
    return None


async def _send_open_loop(times_us: np.ndarray, sender: _Sender, tally: _Tally) -> None:
    """Send one request at each arrival time (µs from a start just after now), whether or
    not earlier ones were answered, and wait for every answer.

    The arrivals are timed on a thread of their own (:func:`_tick_arrivals`), which hands
    each one to this loop: the loop itself never blocks, so no answer or send of an earlier
    request waits behind the wait for the next arrival (a loop's own timers fire up to 1 ms
    late, and a precise wait on the loop's thread would hold the loop; either counts as
    latency, since latency runs from the scheduled send)."""
    loop = asyncio.get_running_loop()
    tasks: list[asyncio.Task] = []
    all_sent = loop.create_future()

    async def one(t_sched: float) -> None:
        tally.lag_ms.append((time.perf_counter() - t_sched) * 1e3)
        try:
            status, hdrs = await sender.post()
        except sender.errors as exc:
            tally.error(t_sched, exc)
            return
        tally.answer(t_sched, status, hdrs)

    def start(t_sched: float | None) -> None:
        if t_sched is None:
            if not all_sent.done():
                all_sent.set_result(None)
        else:
            tasks.append(loop.create_task(one(t_sched)))

    tally.t0 = time.perf_counter() + 0.05
    stop = threading.Event()
    ticker = threading.Thread(target=_tick_arrivals, args=(times_us, tally.t0, lambda t: loop.call_soon_threadsafe(start, t), stop),
                              name="ppipe-bench-arrivals", daemon=True)
    ticker.start()
    try:
        await all_sent
    finally:
        stop.set()
        ticker.join()
    await asyncio.gather(*tasks)


def _tick_arrivals(times_us: np.ndarray, t0: float, fire: Callable[[float | None], None], stop: threading.Event) -> None:
    """Call ``fire(t)`` at each arrival ``t = t0 + times_us / 1e6`` (``perf_counter`` seconds),
    then ``fire(None)``; return early once ``stop`` is set. The waits are kernel timed waits
    on a serving thread's timer slack (:mod:`ppipe.runtime.timerslack`), so each ends a few
    tens of µs after its time."""
    tighten_timer_slack()
    for t in times_us:
        t_sched = t0 + t / 1e6
        wait_s = t_sched - time.perf_counter()
        if (wait_s > 0 and stop.wait(wait_s)) or stop.is_set():
            return
        fire(t_sched)
    fire(None)


def format_table(res: BenchResult) -> str:
    """The figures as a two-column text table (rich, plain text)."""

    def f(x, unit=""):
        return "-" if x is None else (f"{x:.2f}{unit}" if isinstance(x, float) else f"{x}{unit}")

    rows = [
        ("model", res.model),
        ("arrivals", f"{res.arrivals} at {res.offered_rps:g} req/s for {res.duration_s:g} s"),
        ("sent / ok / on time", f"{res.sent} / {res.ok} / {res.on_time}"),
        ("SLO attainment", f"{100 * res.slo_attainment:.2f} % (SLO {res.slo_ms:g} ms)"),
        ("goodput", f(res.goodput_rps, " req/s")),
        ("latency p50 / p99", f"{f(res.p50_ms)} / {f(res.p99_ms)} ms"),
        ("drops", ", ".join(f"{k}: {v}" for k, v in sorted(res.drops.items())) or "0"),
        ("other errors", ", ".join(f"{k}: {v}" for k, v in sorted(res.errors.items())) or "0"),
        ("client lag p99", f"{f(res.client_lag_p99_ms)} ms"),
    ]
    if res.server_on_time is not None:
        share = 100 * res.server_on_time / res.sent if res.sent else 0.0
        rows.append(("at the server", f"{share:.2f} % held within the SLO; p50 / p99 {f(res.server_p50_ms)} / "
                                      f"{f(res.server_p99_ms)} ms (its Server-Timing: arrival to answer)"))
    table = Table(show_header=False, box=None, pad_edge=False, padding=(0, 2, 0, 0))
    table.add_column(no_wrap=True)
    table.add_column()
    for k, v in rows:
        table.add_row(Text(k), Text(v))
    console = Console(file=io.StringIO(), width=200, color_system=None, highlight=False)
    console.print(table)
    return "\n".join(line.rstrip() for line in console.file.getvalue().splitlines())


def to_json(res: BenchResult) -> str:
    return json.dumps(res.as_dict(), indent=2, sort_keys=True)
