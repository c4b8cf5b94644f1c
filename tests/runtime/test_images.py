"""Encoded images as inputs (ppipe.runtime.ingress.images): BYTES tensors on REST and gRPC,
prepared as the model's model.yaml declares, and ``ppipe bench --images``.

The served model is tinynet (3 x 8 x 8 input) with a preprocess; its fake workers answer
y = (x + 1) * 2 of the prepared tensor x, so an answer shows exactly what the ingress made
of the image.
"""

from __future__ import annotations

import asyncio
import base64
import io

import numpy as np
import pytest

pytest.importorskip("cv2", reason="OpenCV is not installed (pip install 'ppipe[images]'; CI's .[test] pulls it)")
import cv2  # noqa: E402
from PIL import Image  # noqa: E402

from ppipe.errors import UserError  # noqa: E402
from ppipe.runtime.client.bench import image_inputs, load_images  # noqa: E402
from ppipe.runtime.ingress.images import prepare_images  # noqa: E402
from ppipe.runtime.ingress.model_io import check_infer_inputs  # noqa: E402
from ppipe.runtime.ingress.protocol import ProtocolError, decode_infer_response, encode_infer_request, parse_infer_request  # noqa: E402
from ppipe.spec.profile import IMAGENET_PREPROCESS, ImagePreprocess, TensorSpec  # noqa: E402

from .tinynet import write_tinynet  # noqa: E402

PRE = ImagePreprocess(color="RGB", layout="NCHW", resize="stretch", scale=1 / 255, mean=[0.5, 0.4, 0.3], std=[0.2, 0.25, 0.5])
SPEC = TensorSpec(name="input", shape=[3, 8, 8])


def _pixels(h: int, w: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, (h, w, 3)).astype(np.uint8)  # RGB


def _encode(rgb: np.ndarray, fmt: str = "PNG") -> bytes:
    buf = io.BytesIO()
    Image.fromarray(rgb).save(buf, fmt)
    return buf.getvalue()


def _expected(rgb: np.ndarray, pre: ImagePreprocess, h: int, w: int) -> np.ndarray:
    """The preprocess written out plainly (float64), for a stretch resize."""
    x = cv2.resize(rgb, (w, h), interpolation=cv2.INTER_LINEAR).astype(np.float64) * pre.scale
    x = (x - np.array(pre.mean)) / np.array(pre.std)
    return x.transpose(2, 0, 1)


# ---- the preparation itself ------------------------------------------------------------------


def test_a_png_is_resized_and_normalized_per_channel_as_declared():
    rgb = _pixels(30, 40)
    got = prepare_images([_encode(rgb)], PRE, SPEC)
    assert got.shape == (1, 3, 8, 8) and got.dtype == np.float32
    np.testing.assert_allclose(got[0], _expected(rgb, PRE, 8, 8), atol=1e-5)


def test_bgr_nhwc_uint8_takes_the_resized_pixels_in_opencvs_order():
    rgb = _pixels(8, 8)  # no resize: exact pixels
    got = prepare_images([_encode(rgb)], ImagePreprocess(color="BGR", layout="NHWC"), TensorSpec(name="x", shape=[8, 8, 3], dtype="uint8"))
    np.testing.assert_array_equal(got[0], rgb[:, :, ::-1])


def test_letterbox_keeps_the_aspect_and_pads_bottom_and_right():
    rgb = _pixels(20, 40)  # into 16 x 16: scale 0.4 -> 8 x 16, rows 8.. padded
    pre = ImagePreprocess(resize="letterbox", pad_value=9)
    got = prepare_images([_encode(rgb)], pre, TensorSpec(name="x", shape=[3, 16, 16], dtype="uint8"))[0]
    assert (got[:, 8:, :] == 9).all()
    np.testing.assert_array_equal(got[:, :8, :], cv2.resize(rgb, (16, 8), interpolation=cv2.INTER_LINEAR).transpose(2, 0, 1))


def test_gray_and_jpeg():
    rgb = _pixels(64, 64)
    got = prepare_images([_encode(rgb, "JPEG")], ImagePreprocess(color="GRAY"), TensorSpec(name="x", shape=[1, 32, 32]))
    assert got.shape == (1, 1, 32, 32) and 0 <= got.min() and got.max() <= 255


def test_a_large_jpeg_is_decoded_reduced_and_still_resized_to_the_input():
    import ppipe.runtime.ingress.images as images

    rgb = cv2.resize(_pixels(12, 16), (160, 120), interpolation=cv2.INTER_LINEAR)  # smooth: JPEG keeps it
    blob = _encode(rgb, "JPEG")
    seen = []
    real = images._cv2().imdecode
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(images._cv2(), "imdecode", lambda buf, flag: seen.append(flag) or real(buf, flag))
        got = prepare_images([blob], PRE, TensorSpec(name="input", shape=[3, 28, 28]))
    assert seen == [cv2.IMREAD_REDUCED_COLOR_4]  # 120 // 4 = 30 >= 28; 120 // 8 < 28
    # as the mean of each 4 x 4 block of the full decode, then resized: within a few pixel levels (the
    # reduced decode upsamples JPEG's half-resolution chroma its own way)
    full = cv2.cvtColor(cv2.imdecode(np.frombuffer(blob, np.uint8), cv2.IMREAD_COLOR), cv2.COLOR_BGR2RGB)
    quarter = cv2.resize(full, (40, 30), interpolation=cv2.INTER_AREA)
    levels = np.abs(got[0] - _expected(quarter, PRE, 28, 28)) * np.array(PRE.std)[:, None, None] / PRE.scale
    assert levels.mean() <= 2 and levels.max() <= 12, (levels.mean(), levels.max())


@pytest.mark.parametrize("blob,match", [
    (b"", "is empty"),
    (b"GIF89a not really", "is not an image file"),
    (b"\x89PNG\r\n\x1a\n" + b"\0" * 40, "is not an image file"),
    (_encode(np.zeros((8, 8, 3), np.uint8))[:60], "is not an image OpenCV can decode"),
])
def test_what_does_not_decode_is_a_400_naming_the_element(blob, match):
    with pytest.raises(ProtocolError, match=match) as exc:
        prepare_images([_encode(_pixels(8, 8)), blob], PRE, SPEC)
    assert exc.value.status == 400 and "inputs[0].data[1]" in exc.value.message


def test_an_image_of_too_many_pixels_is_refused_before_it_is_decoded():
    big = io.BytesIO()
    Image.new("L", (10_000, 8_000)).save(big, "PNG")  # 80 M pixels in ~80 kB
    with pytest.raises(ProtocolError, match="10000 x 8000 = 80,000,000 pixels; images of at most 50,000,000"):
        prepare_images([big.getvalue()], PRE, SPEC)


def test_the_manifest_refuses_a_preprocess_that_does_not_fit_its_input(tmp_path):
    with pytest.raises(ValueError, match="input 'input' has 1 under layout NCHW"):
        ImagePreprocess(color="RGB").geometry(TensorSpec(name="input", shape=[1, 8, 8]))
    with pytest.raises(ValueError, match="needs 1 or 3 values"):
        ImagePreprocess(mean=[1.0, 2.0])
    with pytest.raises(ValueError, match="3-D input"):
        IMAGENET_PREPROCESS.geometry(TensorSpec(name="x", shape=[150528]))


# ---- BYTES on the wire -----------------------------------------------------------------------


def _bytes_tensor(*blobs: bytes) -> np.ndarray:
    arr = np.empty(len(blobs), dtype=object)
    arr[:] = list(blobs)
    return arr


@pytest.mark.parametrize("binary", [True, False])
def test_bytes_tensors_round_trip_binary_and_json(binary):
    blobs = (b"\xff\xd8first", b"", b"third\x00")
    body, headers = encode_infer_request({"input": _bytes_tensor(*blobs)}, binary=binary)
    req = parse_infer_request(body, headers.get("inference-header-content-length"))
    assert req.inputs[0].array.shape == (3,) and list(req.inputs[0].array) == list(blobs)


@pytest.mark.parametrize("head,tail,match", [
    ({"shape": [1], "parameters": {"binary_data_size": 6}}, b"\x09\0\0\0ab", "element 0 claims 9 bytes, past the end"),
    ({"shape": [2], "parameters": {"binary_data_size": 6}}, b"\x02\0\0\0ab", "2 BYTES elements need at least 2 x 4 bytes"),
    ({"shape": [1], "parameters": {"binary_data_size": 7}}, b"\x02\0\0\0abc", "1 bytes of binary_data_size follow its 1 elements"),
    ({"shape": [1], "data": ["%%%"]}, b"", r"data\[0\] is not base64"),
    ({"shape": [1], "data": [3]}, b"", "must hold base64 strings for BYTES"),
    ({"shape": [2], "data": ["YQ=="]}, b"", "has 1 elements, shape"),
])
def test_malformed_bytes_tensors_are_400s_naming_the_field(head, tail, match):
    import orjson

    h = orjson.dumps({"inputs": [{"name": "input", "datatype": "BYTES", **head}]})
    with pytest.raises(ProtocolError, match=match) as exc:
        parse_infer_request(h + tail, str(len(h)) if tail else None)
    assert exc.value.status == 400


def test_bytes_are_refused_by_a_model_that_declares_no_preprocess(tmp_path):
    from ppipe.runtime.ingress.protocol import InferInput

    plain = write_tinynet(tmp_path / "plain").manifest
    with pytest.raises(ProtocolError, match="declares no image preprocessing"):
        check_infer_inputs("tinynet", plain, [InferInput("input", _bytes_tensor(b"x"))], [])
    images = write_tinynet(tmp_path / "img", preprocess=PRE).manifest
    two = np.empty((1, 2), dtype=object)
    with pytest.raises(ProtocolError, match=r"shape \[N\] or \[N, 1\], got \[1, 2\]"):
        check_infer_inputs("tinynet", images, [InferInput("input", two)], [])
    name, flat = check_infer_inputs("tinynet", images, [InferInput("input", _bytes_tensor(b"a", b"b").reshape(2, 1))], [])
    assert name == "input" and flat.shape == (2,)


# ---- served: REST and gRPC -------------------------------------------------------------------


@pytest.fixture(scope="module")
def image_net(tmp_path_factory):
    return write_tinynet(tmp_path_factory.mktemp("tinynet-images"), preprocess=PRE)


@pytest.fixture(scope="module")
def served(image_net):
    from ppipe.runtime.ingress.grpc_server import GrpcServer
    from ppipe.runtime.ingress.http_server import create_app
    from ppipe.runtime.ingress.http_transport import BackgroundServer

    from .fakes import close_workers
    from .test_units import _runtime

    rt, workers = _runtime(image_net, max_batch=1)
    g = GrpcServer(rt, host="127.0.0.1", port=0)
    with BackgroundServer(create_app(rt, decode_workers=0, companions=[g], on_shutdown=lambda: close_workers(workers.values()))) as srv:
        yield srv.url, g


@pytest.mark.parametrize("binary", [True, False])
def test_rest_answers_images_as_the_prepared_tensor(served, binary):
    import httpx

    url, _ = served
    rgbs = [_pixels(30, 40, 1), _pixels(8, 8, 2)]
    body, headers = encode_infer_request({"input": _bytes_tensor(*map(_encode, rgbs))}, binary=binary, binary_output=binary)
    r = httpx.post(f"{url}/v2/models/tinynet/infer", content=body, headers=headers, timeout=30)
    assert r.status_code == 200, r.text
    y = decode_infer_response(r.content, r.headers.get("inference-header-content-length"))["y"]
    want = np.stack([(_expected(x, PRE, 8, 8) + 1) * 2 for x in rgbs])
    np.testing.assert_allclose(y, want, atol=1e-4)
    meta = httpx.get(f"{url}/v2/models/tinynet").json()
    assert "BYTES" in meta["inputs"][0]["parameters"]["also_accepts"]


def test_rest_answers_a_broken_image_with_400_and_tensors_still_work(served):
    import httpx

    url, _ = served
    body, headers = encode_infer_request({"input": _bytes_tensor(b"not an image")}, binary=True)
    r = httpx.post(f"{url}/v2/models/tinynet/infer", content=body, headers=headers, timeout=30)
    assert r.status_code == 400 and "is not an image file" in r.json()["error"]
    body, headers = encode_infer_request({"input": np.zeros((1, 3, 8, 8), np.float32)}, binary=True)
    assert httpx.post(f"{url}/v2/models/tinynet/infer", content=body, headers=headers, timeout=30).status_code == 200


@pytest.mark.parametrize("raw", [True, False])
def test_grpc_answers_images_raw_and_typed(served, raw):
    import grpc

    from ppipe.runtime.client.bench import encode_grpc_request
    from ppipe.runtime.ingress import proto as pb

    _, g = served
    rgb = _pixels(16, 12, 3)
    body = encode_grpc_request("tinynet", {"input": _bytes_tensor(_encode(rgb, "PNG"))}, raw=raw)
    with grpc.insecure_channel(f"127.0.0.1:{g.port}") as ch:
        resp = ch.unary_unary(f"/{pb.SERVICE}/ModelInfer")(body, timeout=30)
        bad = encode_grpc_request("tinynet", {"input": _bytes_tensor(b"junk")}, raw=raw)
        with pytest.raises(grpc.RpcError) as exc:
            ch.unary_unary(f"/{pb.SERVICE}/ModelInfer")(bad, timeout=30)
    out = pb.ModelInferResponse.FromString(resp)
    y = np.frombuffer(out.raw_output_contents[0], np.float32).reshape(1, 3, 8, 8)
    np.testing.assert_allclose(y[0], (_expected(rgb, PRE, 8, 8) + 1) * 2, atol=1e-4)
    assert exc.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "not an image file" in exc.value.details()


def test_bench_sends_a_folder_of_images(served, tmp_path):
    from ppipe.runtime.client.bench import run_bench

    url, _ = served
    for i in range(3):
        (tmp_path / f"f{i}.jpg").write_bytes(_encode(_pixels(24, 32, i), "JPEG"))
    (tmp_path / "notes.txt").write_text("not an image: skipped")
    images = load_images(str(tmp_path))
    assert len(images) == 3
    res = asyncio.run(run_bench(url, "tinynet", 40.0, 1.0, binary=True, images=images))
    assert res.sent > 0 and res.ok == res.sent and not res.errors


def test_bench_images_errors_name_the_fix(tmp_path):
    with pytest.raises(UserError, match="no such folder"):
        load_images(str(tmp_path / "missing"))
    with pytest.raises(UserError, match="no image file"):
        load_images(str(tmp_path))
    meta = {"name": "m", "inputs": [{"name": "x", "datatype": "FP32", "shape": [-1, 3]}]}
    with pytest.raises(UserError, match="declares no preprocess"):
        image_inputs(meta, [b"x"])


def test_base64_in_json_is_what_the_encoder_writes():
    body, _ = encode_infer_request({"input": _bytes_tensor(b"\x00\xff")}, binary=False)
    assert base64.b64encode(b"\x00\xff").decode() in body.decode()


def test_bench_cli_images_flag(served, tmp_path):
    import json

    from click.testing import CliRunner

    from ppipe.cli import main

    url, _ = served
    (tmp_path / "a.png").write_bytes(_encode(_pixels(8, 8)))
    out = tmp_path / "r.json"
    r = CliRunner().invoke(main, ["bench", url, "--model", "tinynet", "--rate", "20", "--duration-s", "0.5", "--binary",
                                  "--images", str(tmp_path), "--json-out", str(out)])
    assert r.exit_code == 0, r.output
    got = json.loads(out.read_text())
    assert got["sent"] > 0 and got["ok"] == got["sent"]
    r = CliRunner().invoke(main, ["bench", url, "--model", "tinynet", "--rate", "20", "--images", str(tmp_path / "nope")])
    assert r.exit_code == 2 and "no such folder" in r.output
