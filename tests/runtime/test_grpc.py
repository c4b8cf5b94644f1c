"""The KServe v2 gRPC frontend, driven by ``tritonclient.grpc`` and by a bare grpc channel.

The runtime runs fake workers (no Ray; see test_units.py): each stage adds 1, the last
doubles, so an input x answers (x + 1) * 2 as output 'y'. The REST app and the gRPC
server share the uvicorn thread's loop, as in ``ppipe serve --grpc-port``.
"""

from __future__ import annotations

import json

import grpc
import numpy as np
import pytest

from ppipe.runtime.ingress import proto as pb
from ppipe.runtime.ingress.grpc_server import GrpcServer
from ppipe.runtime.ingress.http_server import create_app
from ppipe.runtime.ingress.http_transport import BackgroundServer

from .fakes import close_workers
from .test_units import _runtime

tg = pytest.importorskip("tritonclient.grpc")
from tritonclient.utils import InferenceServerException  # noqa: E402

TOKEN = "s3cret"
AUTH = {"authorization": f"Bearer {TOKEN}"}


def _serve(tinynet, token=None, max_message_bytes=1 << 20, **sched):
    rt, workers = _runtime(tinynet, **sched)
    g = GrpcServer(rt, host="127.0.0.1", port=0, token=token, max_message_bytes=max_message_bytes)
    srv = BackgroundServer(create_app(rt, token=token, decode_workers=0, companions=[g], on_shutdown=lambda: close_workers(workers.values())))
    return rt, g, srv


@pytest.fixture(scope="module")
def served(tinynet):
    rt, g, srv = _serve(tinynet, token=TOKEN, max_batch=1)
    with srv:
        g.rest_url = srv.url
        yield rt, g
    assert g.server is None  # the app's lifespan stopped the gRPC server with the runtime


@pytest.fixture()
def client(served):
    _, g = served
    c = tg.InferenceServerClient(f"127.0.0.1:{g.port}")
    yield c
    c.close()


def _input(x: np.ndarray, name: str = "input", datatype: str = "FP32"):
    t = tg.InferInput(name, list(x.shape), datatype)
    t.set_data_from_numpy(x)
    return t


def _raw_call(g, rpc: str):
    path, req, resp = pb.METHODS[rpc]
    channel = grpc.insecure_channel(f"127.0.0.1:{g.port}")
    return channel, channel.unary_unary(path, request_serializer=req.SerializeToString, response_deserializer=resp.FromString)


def test_tritonclient_infers_one_sample_and_a_batch(client):
    x = np.arange(192, dtype=np.float32).reshape(1, 3, 8, 8)
    res = client.infer("tinynet", [_input(x)], request_id="r-7", headers=AUTH)
    np.testing.assert_array_equal(res.as_numpy("y"), (x + 1) * 2)
    assert res.get_response().id == "r-7"
    assert res.get_response().model_name == "tinynet"
    xs = np.random.default_rng(0).normal(size=(3, 3, 8, 8)).astype(np.float32)  # 3 samples, 3 scheduler requests
    np.testing.assert_allclose(client.infer("tinynet", [_input(xs)], headers=AUTH).as_numpy("y"), (xs + 1) * 2, rtol=1e-6)


def test_typed_contents_are_accepted_like_raw_ones(served):
    rt, g = served
    x = np.linspace(-1, 1, 192, dtype=np.float32).reshape(1, 3, 8, 8)
    req = pb.ModelInferRequest(model_name="tinynet", id="typed")
    t = req.inputs.add(name="input", datatype="FP32", shape=[1, 3, 8, 8])
    t.contents.fp32_contents.extend(x.ravel().tolist())
    channel, call = _raw_call(g, "ModelInfer")
    with channel:
        resp = call(req, metadata=tuple(AUTH.items()), timeout=30)
    assert [(o.name, o.datatype, list(o.shape)) for o in resp.outputs] == [("y", "FP32", [1, 3, 8, 8])]
    assert not resp.outputs[0].HasField("contents")  # answers are raw
    got = np.frombuffer(resp.raw_output_contents[0], dtype="<f4").reshape(1, 3, 8, 8)
    np.testing.assert_allclose(got, (x + 1) * 2, rtol=1e-6)


def test_health_and_metadata(client):
    assert client.is_server_live() and client.is_server_ready()
    assert client.is_model_ready("tinynet", headers=AUTH)
    meta = client.get_server_metadata(headers=AUTH)
    assert meta.name == "ppipe" and meta.version
    m = client.get_model_metadata("tinynet", headers=AUTH)
    assert [(t.name, t.datatype, list(t.shape)) for t in m.inputs] == [("input", "FP32", [-1, 3, 8, 8])]
    assert m.outputs[0].name == "logits" and m.versions == ["1"] and m.platform == "ppipe"
    with pytest.raises(InferenceServerException, match="unknown model 'nope'; this server has: tinynet") as exc:
        client.get_model_metadata("nope", headers=AUTH)
    assert exc.value.status() == "StatusCode.NOT_FOUND"


@pytest.mark.parametrize(
    "x,name,datatype,match",
    [
        (np.zeros((1, 3, 8, 7), np.float32), "input", "FP32", r"input 'input' must have shape \[N, 3, 8, 8\], got \[1, 3, 8, 7\]"),
        (np.zeros((3, 8, 8), np.float32), "input", "FP32", r"must have shape \[N, 3, 8, 8\], got \[3, 8, 8\]"),
        (np.zeros((1, 3, 8, 8), np.float32), "x", "FP32", "model 'tinynet' has input 'input', not 'x'"),
        (np.zeros((1, 3, 8, 8), np.int32), "input", "INT32", "input 'input' must have datatype FP32, got INT32"),
    ],
)
def test_a_wrong_request_is_refused_with_invalid_argument(client, x, name, datatype, match):
    with pytest.raises(InferenceServerException, match=match) as exc:
        client.infer("tinynet", [_input(x, name, datatype)], headers=AUTH)
    assert exc.value.status() == "StatusCode.INVALID_ARGUMENT"
    assert client.is_server_ready()


def _bad(**fields):
    req = pb.ModelInferRequest(model_name="tinynet")
    t = req.inputs.add(name="input", datatype=fields.pop("datatype", "FP32"), shape=fields.pop("shape", [1, 3, 8, 8]))
    if "raw" in fields:
        req.raw_input_contents.extend(fields.pop("raw"))
    if "fp32" in fields:
        t.contents.fp32_contents.extend(fields.pop("fp32"))
    if "int" in fields:
        t.contents.int_contents.extend(fields.pop("int"))
    assert not fields
    return req


@pytest.mark.parametrize(
    "req,match",
    [
        (_bad(raw=[b"\0" * 100]), r"raw_input_contents\[0\] has 100 bytes; shape \[1, 3, 8, 8\] of FP32 needs 192 x 4 = 768"),
        (_bad(raw=[b"\0" * 768, b"\0" * 768]), "raw_input_contents has 2 entries for 1 inputs"),
        (_bad(raw=[b"\0" * 768], fp32=[0.0]), "has typed contents and raw_input_contents"),
        (_bad(fp32=[0.0] * 10), r"contents.fp32_contents has 10 elements, shape \[1, 3, 8, 8\] needs 192"),
        (_bad(datatype="FP16", shape=[1]), "FP16 has no typed contents field; send it in raw_input_contents"),
        (_bad(datatype="BYTES"), r"contents.bytes_contents has 0 elements, shape \[1, 3, 8, 8\] needs 192"),
        (_bad(datatype="BYTES", shape=[1], raw=[b"\5\0\0\0ab"]), "element 0 claims 5 bytes, past the end"),
        (_bad(datatype="STRING"), "datatype 'STRING' is not supported"),
        (_bad(shape=[1] * 40, raw=[b"\0" * 4]), "shape has 40 dimensions; at most 32"),
        (_bad(datatype="INT8", shape=[1], int=[300]), "cannot be read as INT8"),
        (_bad(shape=[0, 2**62], raw=[b""]), r"shape \[0, 4611686018427387904\] cannot be read as FP32"),
    ],
)
def test_malformed_tensors_name_the_field(served, req, match):
    _, g = served
    channel, call = _raw_call(g, "ModelInfer")
    with channel, pytest.raises(grpc.RpcError) as exc:
        call(req, metadata=tuple(AUTH.items()), timeout=30)
    assert exc.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert __import__("re").search(match, exc.value.details()), exc.value.details()


def test_the_token_is_required_on_every_call_but_server_health_as_on_rest(client):
    x = np.zeros((1, 3, 8, 8), np.float32)
    for call in (lambda: client.infer("tinynet", [_input(x)]), lambda: client.get_model_metadata("tinynet"),
                 lambda: client.infer("tinynet", [_input(x)], headers={"authorization": "Bearer wrong"}),
                 lambda: client.get_server_metadata(), lambda: client.is_model_ready("tinynet")):
        with pytest.raises(InferenceServerException, match="missing or wrong bearer token") as exc:
            call()
        assert exc.value.status() == "StatusCode.UNAUTHENTICATED"
    assert client.is_server_live() and client.is_server_ready()  # health needs no token, as on REST
    assert client.is_model_ready("tinynet", headers=AUTH)


def test_grpc_requests_count_in_the_metrics(served, client):
    rt, _ = served
    before = rt.metrics.requests.labels("tinynet", "200")._value.get()
    client.infer("tinynet", [_input(np.zeros((1, 3, 8, 8), np.float32))], headers=AUTH)
    assert rt.metrics.requests.labels("tinynet", "200")._value.get() == before + 1


def test_a_drop_is_unavailable_with_its_reason_and_a_big_message_resource_exhausted(tinynet):
    rt, g, srv = _serve(tinynet, drop_all=True, max_message_bytes=4096)
    with srv:
        big = np.zeros((8, 3, 8, 8), np.float32)  # 6 KiB of tensor: over the limit, refused before the scheduler
        c = tg.InferenceServerClient(f"127.0.0.1:{g.port}")
        with pytest.raises(InferenceServerException, match="larger than max") as too_big:
            c.infer("tinynet", [_input(big)])
        assert too_big.value.status() == "StatusCode.RESOURCE_EXHAUSTED"
        channel, call = _raw_call(g, "ModelInfer")
        req = pb.ModelInferRequest(model_name="tinynet")
        req.inputs.add(name="input", datatype="FP32", shape=[1, 3, 8, 8])
        req.raw_input_contents.append(np.zeros(192, "<f4").tobytes())
        with channel, pytest.raises(grpc.RpcError) as exc:
            call(req, timeout=30)
        with pytest.raises(InferenceServerException, match="dropped: deadline-unreachable: test scheduler drops everything"):
            c.infer("tinynet", [_input(np.zeros((1, 3, 8, 8), np.float32))])
        c.close()
    assert exc.value.code() == grpc.StatusCode.UNAVAILABLE
    assert exc.value.details() == "dropped: deadline-unreachable: test scheduler drops everything"
    assert dict(exc.value.trailing_metadata())["ppipe-drop-reason"] == "deadline-unreachable"
    assert rt.metrics.requests.labels("tinynet", "503")._value.get() == 2


def test_bench_drives_the_grpc_frontend(served):
    import asyncio

    from ppipe.runtime.client.bench import run_bench

    rt, g = served
    for binary in (True, False):  # raw_input_contents, typed contents
        res = asyncio.run(run_bench(g.rest_url, "tinynet", rate_rps=50, duration_s=0.4, token=TOKEN, grpc=f"127.0.0.1:{g.port}",
                                    slo_ms=10_000, binary=binary))
        assert res.sent > 5 and res.ok == res.sent and not res.errors and not res.drops
        # the server's own time, from the answers' trailing metadata (as REST's Server-Timing header)
        assert res.server_on_time == res.ok and 0 < res.server_p50_ms <= res.p50_ms
    res = asyncio.run(run_bench(g.rest_url, "tinynet", rate_rps=50, duration_s=0.2, token=TOKEN, grpc=f"127.0.0.1:{g.port}",
                                slo_ms=10_000, binary=True, input_shape=[3, 8, 7]))
    assert res.ok == 0 and res.errors == {"gRPC INVALID_ARGUMENT": res.sent}


def test_the_shipped_descriptor_matches_the_proto():
    pytest.importorskip("grpc_tools")
    from ppipe.runtime.ingress.proto import _regen
    from ppipe.runtime.ingress.proto.grpc_predict_v2_desc import FILE_DESCRIPTOR

    assert _regen.serialized_descriptor() == FILE_DESCRIPTOR, "run: python -m ppipe.runtime.ingress.proto._regen"


def test_bench_cli_with_grpc(served):
    from click.testing import CliRunner

    from ppipe.cli import main

    _, g = served
    r = CliRunner().invoke(main, ["bench", g.rest_url, "--model", "tinynet", "--rate", "40", "--duration-s", "0.3", "--binary",
                                  "--token", TOKEN, "--grpc", f"127.0.0.1:{g.port}"])
    assert r.exit_code == 0, r.output
    res = json.loads(r.output[r.output.index("{"):])
    assert res["sent"] > 3 and res["ok"] == res["sent"]


def test_serve_refuses_a_busy_grpc_port_before_starting_ray(tmp_path, tinynet):
    import socket

    from click.testing import CliRunner

    from ppipe.cli import main
    from ppipe.spec.cluster import load_cluster

    from .conftest import make_plan

    plan = make_plan(tinynet, load_cluster("local-cpu"), [(0, 2, "cpu", 1, 1)])
    plan.save(tmp_path / "plan.yaml")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        busy = s.getsockname()[1]
        r = CliRunner().invoke(main, ["serve", str(tmp_path / "plan.yaml"), "--grpc-port", str(busy)])
    assert r.exit_code == 2
    assert f"cannot bind the gRPC frontend to 127.0.0.1:{busy}" in r.output and "choose another --grpc-port" in r.output
    r = CliRunner().invoke(main, ["serve", str(tmp_path / "plan.yaml"), "--port", "8123", "--grpc-port", "8123"])
    assert r.exit_code == 2 and "other than --port 8123" in r.output
