"""The HTTP frontend against hostile input, slow clients and JSON overload (issue 20).

No Ray: the frontend runs over :class:`StubRuntime`, which answers each sample at once (or
after ``delay_s``) and records the arrival it was given. Timing assertions compare with
margins of several times the effect they check, so a loaded host does not fail them.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import copy
import json
import os
import socket
import time

import httpx
import numpy as np
import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from ppipe.runtime.clock import WallClock
from ppipe.runtime.scheduler.metrics import RuntimeMetrics
from ppipe.runtime.ingress.protocol import decode_job, encode_infer_request
from ppipe.runtime.ingress.bodies import BodyDecoder
from ppipe.runtime.ingress.http_server import create_app
from ppipe.runtime.ingress.http_transport import BackgroundServer
from ppipe.spec.cluster import load_cluster

from .conftest import make_plan

TOKEN = "t0k"
AUTH = {"authorization": f"Bearer {TOKEN}"}


class StubRuntime:
    """What the frontend uses of a :class:`~ppipe.runtime.scheduler.host.Runtime`; infer answers
    ``logits = sum(x)`` after ``delay_s`` and records ``arrival_us``."""

    def __init__(self, profile, slo_ms: float = 200.0, delay_s: float = 0.0):
        self.plan = make_plan(profile, load_cluster("local-cpu"), [(0, 2, "cpu", 1, 1)], slo_ms=slo_ms)
        self.profiles = {profile.name: profile}
        self.metrics = RuntimeMetrics()
        self.clock: WallClock | None = None
        self.delay_s = delay_s
        self.arrivals: list[tuple[float | None, float]] = []  # (arrival given, clock at the call)

    @property
    def started(self) -> bool:
        return self.clock is not None

    async def start(self) -> None:
        self.clock = WallClock()

    async def stop(self) -> None:
        pass

    def model_ready(self, model: str) -> bool:
        return True

    async def infer(self, model, inputs, arrival_us=None):
        self.arrivals.append((arrival_us, self.clock.true_now_us()))
        if self.delay_s:
            await asyncio.sleep(self.delay_s)
        (x,) = inputs.values()
        return {"logits": np.full(5, float(x.sum()), np.float32)}

    async def infer_samples(self, model, samples, arrival_us=None):
        return list(await asyncio.gather(*(self.infer(model, s, arrival_us) for s in samples)))


def counted(rt: StubRuntime, code: str | None = None) -> float:
    """ppipe_requests_total of model tinynet (one code, or all)."""
    total = 0.0
    for metric in rt.metrics.requests.collect():
        for s in metric.samples:
            if s.name == "ppipe_requests_total" and (code is None or s.labels["code"] == code):
                total += s.value
    return total


def drops(rt: StubRuntime, reason: str) -> float:
    return sum(s.value for m in rt.metrics.drops.collect() for s in m.samples
               if s.name == "ppipe_drops_total" and s.labels["reason"] == reason)


class AsgiHarness:
    """The app on a private event loop, driven through httpx's ASGI transport (no sockets)."""

    def __init__(self, rt, **app_kw):
        self.rt = rt
        self.app = create_app(rt, **app_kw)
        self.loop = asyncio.new_event_loop()
        self.loop.run_until_complete(rt.start())  # (the ASGI transport runs no lifespan)
        self.client = httpx.AsyncClient(transport=httpx.ASGITransport(app=self.app), base_url="http://x")

    def run(self, coro):
        return self.loop.run_until_complete(coro)

    def post(self, body: bytes, headers=None, model="tinynet"):
        return self.run(self.client.post(f"/v2/models/{model}/infer", content=body, headers=headers or {}))

    def close(self):
        self.run(self.client.aclose())
        self.app.fe.decoder.stop()
        self.loop.close()


@pytest.fixture
def harness(tinynet):
    h = AsgiHarness(StubRuntime(tinynet), decode_workers=0)
    yield h
    h.close()


# ---- malformed input: always a 4xx with {"error": ...}, always counted ---------------------------
_LEAF = st.one_of(
    st.none(), st.booleans(), st.integers(min_value=-(2**70), max_value=2**70), st.floats(allow_nan=True),
    st.text(max_size=8), st.sampled_from([10**30, 2**62, -1, 0, 4300 * "9", ()]),
)
_ANY = st.recursive(_LEAF, lambda kids: st.one_of(st.lists(kids, max_size=4), st.dictionaries(st.text(max_size=6), kids, max_size=3)), max_leaves=12)
_SHAPE = st.one_of(
    st.lists(st.integers(min_value=-2, max_value=9), max_size=6),
    st.lists(st.sampled_from([0, 1, 3, 8, 10**30, 2**62, 10**300]), max_size=70),
    st.just([1, 3, 8, 8]),
    st.sampled_from([[0, 10**30], [10**3000, 10**3000], [1] * 33, [1, 3, 8, 8] + [1] * 61, [2**62] * 40, [0] * 70, [0, 2**62, 2**62]]),
    _ANY,
)
_ANY = st.one_of(_ANY, st.sampled_from(["FP32", "INT8", "UINT64", "BOOL", "BYTES", "input", "logits", "1.5"]))


_PATHS = [
    ("id",), ("inputs",), ("inputs", 0), ("inputs", 0, "name"), ("inputs", 0, "shape"), ("inputs", 0, "shape", 0),
    ("inputs", 0, "datatype"), ("inputs", 0, "data"), ("inputs", 0, "data", 0), ("inputs", 0, "parameters"),
    ("inputs", 0, "parameters", "binary_data_size"), ("outputs",), ("outputs", 0), ("outputs", 0, "name"),
    ("outputs", 0, "parameters"), ("outputs", 0, "parameters", "binary_data"), ("parameters",), ("parameters", "binary_data_output"),
]
_DELETE = object()


def _valid_request(binary: bool) -> tuple[dict, bytes]:
    """A request tinynet serves: (its JSON head as a dict, the binary tail)."""
    x = np.full((1, 3, 8, 8), 0.5, np.float32)
    tensor = {"name": "input", "shape": [1, 3, 8, 8], "datatype": "FP32"}
    if binary:
        tensor["parameters"] = {"binary_data_size": x.nbytes}
    else:
        tensor["data"] = x.ravel().tolist()
    head = {"id": "r1", "inputs": [tensor], "outputs": [{"name": "logits", "parameters": {"binary_data": False}}],
            "parameters": {"binary_data_output": False}}
    return head, (x.tobytes() if binary else b"")


def _set(obj, path, value) -> None:
    """Replace (or delete) the value at ``path``, creating containers on the way."""
    for key in path[:-1]:
        if isinstance(obj, list):
            if not obj:
                obj.append({})
            key = min(key, len(obj) - 1) if isinstance(key, int) else 0
        elif not isinstance(obj, dict):
            return
        elif key not in obj or not isinstance(obj[key], (dict, list)):
            obj[key] = [] if isinstance(key, int) else {}
        obj = obj[key]
    last = path[-1]
    if isinstance(obj, dict):
        if value is _DELETE:
            obj.pop(last, None)
        else:
            obj[last] = value
    elif isinstance(obj, list) and obj and isinstance(last, int):
        if value is _DELETE:
            del obj[min(last, len(obj) - 1)]
        else:
            obj[min(last, len(obj) - 1)] = value


@st.composite
def _bodies(draw):
    """(body, extra headers): a valid request (JSON or binary) with one to three fields
    replaced by hostile values or deleted (so that most get past the first checks), a
    wrong binary tail or header length, JSON nested deep, or raw bytes."""
    kind = draw(st.sampled_from(["json", "json", "json", "binary", "binary", "nested", "bytes"]))
    if kind == "bytes":
        return draw(st.binary(max_size=300)), {}
    if kind == "nested":
        depth = draw(st.sampled_from([10, 1000, 100_000]))
        return b'{"inputs": [{"name": "input", "shape": [1], "datatype": "FP32", "data": ' + b"[" * depth + b"]" * depth + b"}]}", {}
    head, tail = _valid_request(binary=kind == "binary")
    for _ in range(draw(st.integers(0, 3))):
        path = draw(st.sampled_from(_PATHS))
        value = draw(st.one_of(_ANY, _SHAPE, st.just(_DELETE)) if path[-1] != "shape" else st.one_of(_SHAPE, st.just(_DELETE)))
        _set(head, path, value if value is _DELETE else copy.deepcopy(value))  # (sampled values are shared objects)
    raw = json.dumps(head, allow_nan=True).encode()
    if kind == "json":
        return raw, {}
    tail = draw(st.one_of(st.just(tail), st.binary(max_size=1024), st.just(tail + b"x")))
    text = st.text(alphabet=st.characters(min_codepoint=32, max_codepoint=255), max_size=30)
    length = draw(st.one_of(st.just(str(len(raw))), st.just(str(len(raw))), st.integers(-5, len(raw) + 2000).map(str), text))
    return raw + tail, {"inference-header-content-length": length.encode("latin-1")}


def _examples(cases):
    def decorate(fn):
        for case in reversed(cases):
            fn = example(case=case)(fn)
        return fn

    return decorate


def _edited(binary: bool = False, **edits) -> tuple[bytes, dict]:
    """A valid request with fields set (``inputs__0__shape=[...]`` sets inputs[0].shape)."""
    head, tail = _valid_request(binary)
    for key, value in edits.items():
        _set(head, tuple(int(k) if k.isdigit() else k for k in key.split("__")), value)
    raw = json.dumps(head).encode()
    return raw + tail, ({"inference-header-content-length": str(len(raw))} if binary else {})


# the bodies that got a 500: always tried, whatever the generator draws
_KNOWN = [
    _edited(inputs__0__datatype=["FP32"]),
    _edited(inputs__0__datatype={"a": 1}),
    _edited(outputs__0__parameters=[1]),
    (b"[" * 100_000 + b"]" * 100_000, {}),
    (b'{"id": ' + b"7" * 5000 + b', "inputs": []}', {}),
    (b'{"inputs": [{"name": "input", "datatype": "FP32", "data": [], "shape": [' + b"7" * 5000 + b"]}]}", {}),
    _edited(inputs__0__shape=[1, 3, 8, 8] + [1] * 61),
    _edited(binary=True, inputs__0__shape=[1, 3, 8, 8] + [1] * 61),
    _edited(inputs__0__shape=[0, 10**30], inputs__0__data=[]),
    _edited(inputs__0__shape=[10**3000, 10**3000], inputs__0__data=[]),
    _edited(inputs__0__shape=[2**62] * 60_000, inputs__0__data=[]),
]


@settings(max_examples=int(os.environ.get("PPIPE_FUZZ_EXAMPLES", 300)), deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(case=_bodies())
@_examples(_KNOWN)
def test_fuzzed_infer_requests_never_get_a_500(harness, case):
    body, headers = case
    before = counted(harness.rt)
    t = time.perf_counter()
    r = harness.post(body, headers)
    assert time.perf_counter() - t < 5.0
    assert r.status_code in (200, 400), (r.status_code, r.text[:300], body[:300])
    assert counted(harness.rt) == before + 1  # every answer is counted in ppipe_requests_total
    if r.status_code != 200:
        assert r.headers["content-type"] == "application/json"
        assert isinstance(r.json()["error"], str) and len(r.json()["error"]) < 1000


def test_the_server_still_answers_correctly_after_the_fuzz(harness):
    body, headers = encode_infer_request({"input": np.ones((2, 3, 8, 8), np.float32)})
    for bad in (b"[" * 100_000, json.dumps({"inputs": [{"name": "input", "shape": [10**3000], "datatype": "FP32", "data": []}]}).encode()):
        assert harness.post(bad).status_code == 400
    r = harness.post(body, headers)
    assert r.status_code == 200 and r.json()["outputs"][0]["data"] == [192.0] * 10


def test_a_bug_is_a_counted_500_with_a_json_body_not_a_traceback(harness):
    async def broken(*a, **kw):
        raise KeyError("oops")

    harness.rt.infer = broken
    body, headers = encode_infer_request({"input": np.ones((1, 3, 8, 8), np.float32)})
    r = harness.post(body, headers)
    assert r.status_code == 500 and "internal error" in r.json()["error"] and "oops" not in r.text
    assert counted(harness.rt, "500") == 1


# ---- JSON off the event loop, arrival stamped before decoding, overload as fast 503s --------------
def _slow_job(seconds: float):
    """A decode job that takes ``seconds`` (a thread sleeping: known duration, no GIL held)."""

    def job(body, header_length):
        time.sleep(seconds)
        out, _ = decode_job(body, header_length)
        return out, seconds

    return job


def _thread_decoder(workers: int, decode_s: float, body_bytes: int, **kw) -> BodyDecoder:
    dec = BodyDecoder(workers, inline_bytes=100, executor=concurrent.futures.ThreadPoolExecutor, job=_slow_job(decode_s), **kw)
    dec.s_per_byte = decode_s / body_bytes  # as if measured
    return dec


def _tinynet_json(n: int = 1) -> bytes:
    return encode_infer_request({"input": np.ones((n, 3, 8, 8), np.float32)})[0]


def test_arrival_is_stamped_before_the_body_is_decoded(tinynet):
    h = AsgiHarness(StubRuntime(tinynet, slo_ms=2000.0))
    body = _tinynet_json()
    h.app.fe.decoder = _thread_decoder(1, 0.2, len(body))
    try:
        r = h.post(body)
        assert r.status_code == 200
        (arrival, called), = h.rt.arrivals
        assert arrival is not None and called - arrival >= 0.19e6  # the decode's 0.2 s count against the SLO
        hist = {s.name: s.value for m in h.rt.metrics.latency.collect() for s in m.samples}
        assert hist["ppipe_request_latency_seconds_sum"] >= 0.19  # the latency metric too
    finally:
        h.close()


def test_json_overload_gets_fast_503s_not_a_queue(tinynet):
    """60 JSON requests at once, one decode worker, 0.1 s per decode, SLO 0.5 s: a few are
    served, the rest are dropped at once with a reason; none waits for the queue."""
    slo_s, decode_s, n = 0.5, 0.1, 60
    h = AsgiHarness(StubRuntime(tinynet, slo_ms=slo_s * 1e3))
    body = _tinynet_json()
    h.app.fe.decoder = _thread_decoder(1, decode_s, len(body))

    async def one():
        t = time.perf_counter()
        r = await h.client.post("/v2/models/tinynet/infer", content=body)
        return r, time.perf_counter() - t

    async def burst():
        return await asyncio.gather(*(one() for _ in range(n)))

    try:
        out = h.run(burst())
    finally:
        h.close()
    codes = [r.status_code for r, _ in out]
    served = codes.count(200)
    assert set(codes) <= {200, 503} and 2 <= served <= slo_s / decode_s + 1
    for r, took in out:
        if r.status_code == 503:
            assert r.headers["ppipe-drop-reason"] == "deadline-unreachable" and "JSON body" in r.json()["error"]
            assert took < slo_s  # dropped at once, not after waiting its turn
        assert took < slo_s + 1.0
    assert counted(h.rt) == n and counted(h.rt, "503") == n - served == drops(h.rt, "deadline-unreachable")


def test_a_decode_that_ends_too_late_is_dropped_not_served(tinynet):
    h = AsgiHarness(StubRuntime(tinynet, slo_ms=100.0))
    body = _tinynet_json()
    h.app.fe.decoder = _thread_decoder(1, 0.3, len(body))
    h.app.fe.decoder.s_per_byte = 1e-9  # the estimate is wrong: the decode takes 0.3 s
    wrong = encode_infer_request({"input": np.ones((1, 3, 8, 7), np.float32)})[0]
    try:
        r = h.post(body)
        h.app.fe.decoder.s_per_byte = 1e-9  # (the first decode taught it; forget that)
        r_wrong = h.post(wrong)
    finally:
        h.close()
    assert r.status_code == 503 and "ended" in r.json()["error"] and not h.rt.arrivals
    assert r_wrong.status_code == 400 and "shape [N, 3, 8, 8]" in r_wrong.json()["error"]  # malformed: a 400 whatever the time


def test_too_many_queued_decodes_is_queue_full(tinynet):
    h = AsgiHarness(StubRuntime(tinynet, slo_ms=5000.0))
    body = _tinynet_json()
    h.app.fe.decoder = _thread_decoder(1, 0.05, len(body), max_queued=3)

    async def burst():
        return await asyncio.gather(*(h.client.post("/v2/models/tinynet/infer", content=body) for _ in range(6)))

    try:
        codes = sorted(r.status_code for r in h.run(burst()))
    finally:
        h.close()
    assert codes == [200] * 3 + [503] * 3 and drops(h.rt, "queue-full") == 3


def test_large_json_is_decoded_in_another_process_while_the_loop_runs(tinynet):
    """A ~12 MB JSON body: its decode takes a large fraction of a second of CPU, which
    the event loop must not spend (a ticker measures the loop's longest stall)."""
    h = AsgiHarness(StubRuntime(tinynet, slo_ms=60_000.0), decode_workers=1, max_body_bytes=64 << 20)
    x = np.random.default_rng(0).normal(size=(1_000_000,))
    body = json.dumps({"inputs": [{"name": "input", "shape": [1, 1_000_000], "datatype": "FP32", "data": x.tolist()}]}).encode()

    async def main():
        await h.app.fe.decoder.start()  # spawn the process first: its start-up is not the decode
        stalls, done = [0.0], asyncio.Event()

        async def ticker():
            last = time.perf_counter()
            while not done.is_set():
                await asyncio.sleep(0.005)
                now = time.perf_counter()
                stalls[0], last = max(stalls[0], now - last), now

        tick = asyncio.ensure_future(ticker())
        await asyncio.sleep(0.05)  # the ticker is running
        t = time.perf_counter()
        r = await h.client.post("/v2/models/tinynet/infer", content=body)
        took = time.perf_counter() - t
        done.set()
        await tick
        return r, took, stalls[0]

    try:
        r, took, stall = h.run(main())
    finally:
        h.close()
    assert r.status_code == 400 and "shape [N, 3, 8, 8]" in r.json()["error"]  # decoded, then checked against the model
    assert stall < 0.5 * took, f"the loop stalled {stall:.3f} s of the request's {took:.3f} s"


# ---- slow clients: idle connections, partial headers and bodies, shutdown ---------------------------
def _raw(url: str, payload: bytes, wait_s: float) -> tuple[bytes, float]:
    """Send ``payload`` and read until the server closes (or ``wait_s``): (answer, seconds)."""
    host, port = url[len("http://"):].rsplit(":", 1)
    with socket.create_connection((host, int(port))) as s:
        s.sendall(payload)
        s.settimeout(wait_s)
        t, data = time.perf_counter(), b""
        try:
            while chunk := s.recv(65536):
                data += chunk
        except socket.timeout:
            return data, float("inf")
        return data, time.perf_counter() - t


@pytest.fixture
def slow_server(tinynet):
    rt = StubRuntime(tinynet)
    with BackgroundServer(create_app(rt, body_timeout_s=0.4, decode_workers=0), header_timeout_s=0.4, keep_alive_s=0.4,
                          shutdown_timeout_s=0.5) as srv:
        yield srv, rt


@pytest.mark.parametrize(
    "label,payload,status",
    [
        ("partial headers", b"POST /v2/models/tinynet/infer HTTP/1.1\r\nhost: x\r\n", b"408"),
        ("partial body", b"POST /v2/models/tinynet/infer HTTP/1.1\r\nhost: x\r\ncontent-length: 1000\r\n\r\n0123456789", b"408"),
        ("huge headers", b"GET /v2 HTTP/1.1\r\n" + b"x-pad: " + b"a" * 70_000 + b"\r\n\r\n", b"431"),
        ("garbage", b"\x16\x03\x01 not http\r\n\r\n", b"400"),
    ],
)
def test_slow_or_broken_connections_are_closed_with_a_json_answer(slow_server, label, payload, status):
    srv, rt = slow_server
    data, took = _raw(srv.url, payload, wait_s=5.0)
    assert took < 3.0, f"{label}: still open after 5 s"
    assert data.startswith(b"HTTP/1.1 " + status), data[:200]
    assert json.loads(data.split(b"\r\n\r\n", 1)[1])["error"]
    if label == "partial body":
        assert counted(rt, "408") == 1


def test_idle_connections_are_closed_silently(slow_server):
    srv, _ = slow_server
    data, took = _raw(srv.url, b"", wait_s=5.0)  # never sends a byte
    assert data == b"" and took < 3.0  # closed without an answer to a request it never sent
    data, took = _raw(srv.url, b"GET /v2/health/live HTTP/1.1\r\nhost: x\r\n\r\n", wait_s=5.0)  # then idles
    assert data.startswith(b"HTTP/1.1 200") and b"408" not in data and took < 3.0


def test_shutdown_is_not_held_up_by_a_slow_client(tinynet):
    rt = StubRuntime(tinynet)
    srv = BackgroundServer(create_app(rt, body_timeout_s=30.0, decode_workers=0), shutdown_timeout_s=0.5).__enter__()
    host, port = srv.url[len("http://"):].rsplit(":", 1)
    with socket.create_connection((host, int(port))) as s:
        s.sendall(b"POST /v2/models/tinynet/infer HTTP/1.1\r\nhost: x\r\ncontent-length: 1000\r\n\r\n0123")
        time.sleep(0.2)  # its request is in flight, waiting for the body
        t = time.perf_counter()
        srv.server.should_exit = True
        srv.thread.join(timeout=10)
        assert not srv.thread.is_alive() and time.perf_counter() - t < 3.0
        s.settimeout(2.0)
        answer = s.recv(65536)
    assert answer.startswith(b"HTTP/1.1 503") and b"shut down before this request was answered" in answer  # told, not cut silently
    assert counted(rt, "503") == 1


# ---- the token guards everything but health -------------------------------------------------------------
def test_token_guards_every_endpoint_but_health(tinynet):
    h = AsgiHarness(StubRuntime(tinynet), token=TOKEN, decode_workers=0)

    async def main():
        c = h.client
        out = {}
        for path in ("/v2", "/v2/models/tinynet", "/v2/models/tinynet/ready", "/v2/models/nope/ready", "/v2/models/nope", "/metrics"):
            out[path] = (await c.get(path), await c.get(path, headers=AUTH))
        out["infer"] = (await c.post("/v2/models/nope/infer", content=b"{}"), await c.post("/v2/models/nope/infer", content=b"{}", headers=AUTH))
        out["live"] = (await c.get("/v2/health/live"),)
        out["ready"] = (await c.get("/v2/health/ready"),)
        out["no route"] = (await c.get("/v2/nothing/here"),)
        return out

    try:
        out = h.run(main())
    finally:
        h.close()
    for path in ("/v2", "/v2/models/tinynet", "/v2/models/tinynet/ready", "/v2/models/nope/ready", "/v2/models/nope", "/metrics", "infer"):
        anon, authed = out[path]
        assert anon.status_code == 401 and "tinynet" not in anon.text, path
        assert authed.status_code in (200, 404), path
    assert "this server has: tinynet" in out["/v2/models/nope/ready"][1].json()["error"]  # only with the token
    assert out["live"][0].status_code == 200 and out["ready"][0].status_code == 200
    miss = out["no route"][0]
    assert miss.status_code == 404 and "tinynet" not in miss.text and miss.json()["error"].startswith("Not Found")


# ---- `ppipe serve`: what --help promises, its defaults, and where its Ray listens -------------------------
def test_serve_help_says_what_the_token_guards_and_the_timeouts():
    from click.testing import CliRunner

    from ppipe.cli import main

    text = " ".join(CliRunner().invoke(main, ["serve", "--help"], terminal_width=200).output.split())
    assert "required on every HTTP endpoint except GET /v2/health/live and /v2/health/ready" in text
    assert "/v2, /v2/models/NAME, /v2/models/NAME/ready and /metrics" in text
    for flag in ("--header-timeout-s", "--body-timeout-s", "--shutdown-timeout-s", "--decode-workers"):
        assert flag in text


def test_serve_defaults_are_the_servers():
    from ppipe.runtime import cli
    from ppipe.runtime.ingress import http_server, http_transport

    for name, server in (("DEFAULT_HEADER_TIMEOUT_S", http_transport), ("DEFAULT_BODY_TIMEOUT_S", http_server),
                         ("DEFAULT_SHUTDOWN_TIMEOUT_S", http_transport)):
        assert getattr(cli, name) == getattr(server, name), name


def test_serve_refuses_a_zero_timeout_before_loading_anything(tmp_path):
    from click.testing import CliRunner

    from ppipe.cli import main

    r = CliRunner().invoke(main, ["serve", str(tmp_path / "plan.yaml"), "--body-timeout-s", "0"])
    assert r.exit_code != 0 and "--body-timeout-s must be > 0" in r.output


@pytest.mark.parametrize("address,loopback,single_host", [(None, True, True), (None, False, False), ("auto", True, False)])
def test_a_loopback_server_starts_its_ray_on_loopback(monkeypatch, address, loopback, single_host):
    """Ray picks the node's IP (and so where its GCS and raylet listen: 127.0.0.1 or all
    interfaces) from its single-host switch; this checks the switch as ray.init sees it.
    (Measured with `ss -ltnp`: with it, every Ray process listens on 127.0.0.1 only.)"""
    ray = pytest.importorskip("ray")
    from ray._private import ray_constants

    from ppipe.runtime.cli import init_ray

    monkeypatch.setattr(ray_constants, "ENABLE_RAY_CLUSTER", True)
    seen = {}
    monkeypatch.setattr(ray, "init", lambda **kw: seen.update(kw, single_host=not ray_constants.ENABLE_RAY_CLUSTER))
    init_ray(address, 2, loopback_only=loopback)
    assert seen["single_host"] == single_host
    # no --ray-address: a new local instance ("local"), never a Ray that already runs here
    assert seen.get("address") == (address or "local") and seen["include_dashboard"] is False


def test_decode_processes_leave_ctrl_c_to_the_server():
    """A terminal's Ctrl-C reaches every process of the group: a decode process must not die
    of it with a traceback while the server shuts down in order."""
    import os
    import signal

    from ppipe.runtime.ingress.bodies import _process_pool

    pool = _process_pool(1)
    try:
        pid = pool.submit(os.getpid).result(timeout=60)
        os.kill(pid, signal.SIGINT)
        assert pool.submit(os.getpid).result(timeout=60) == pid  # the same process, still serving
    finally:
        pool.shutdown()


_POOL_OWNER = """
import os, sys, time
from ppipe.runtime.ingress.bodies import _process_pool
if __name__ == "__main__":
    pool = _process_pool(1)
    print(pool.submit(os.getpid).result(timeout=60), flush=True)
    time.sleep(600)
"""


@pytest.mark.skipif(not os.sys.platform.startswith("linux"), reason="the parent-death signal is Linux's")
def test_decode_processes_end_with_a_server_killed_by_sigkill(tmp_path):
    """A server killed with SIGKILL shuts nothing down: its decode processes end by themselves."""
    import signal
    import subprocess
    import sys

    psutil = pytest.importorskip("psutil")
    script = tmp_path / "owner.py"
    script.write_text(_POOL_OWNER)
    owner = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, text=True)
    try:
        child = int(owner.stdout.readline())
        assert psutil.pid_exists(child)
        owner.send_signal(signal.SIGKILL)
        owner.wait(timeout=30)
        gone, alive = psutil.wait_procs([psutil.Process(child)], timeout=30)
        assert not alive
    finally:
        owner.kill()
