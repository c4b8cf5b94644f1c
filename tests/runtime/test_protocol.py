"""KServe v2 encoding: JSON and binary tensors, and the errors of malformed requests."""

import json
import pickle
import time

import numpy as np
import pytest

from ppipe.runtime.ingress.protocol import (
    MAX_DIMS,
    ProtocolError,
    decode_infer_response,
    encode_infer_request,
    encode_infer_response,
    parse_infer_request,
)


@pytest.mark.parametrize("binary", [False, True])
def test_request_round_trip(binary):
    x = np.arange(24, dtype=np.float32).reshape(1, 2, 3, 4) / 7
    body, headers = encode_infer_request({"input": x}, binary=binary, request_id="r1")
    req = parse_infer_request(body, headers.get("inference-header-content-length"))
    assert req.id == "r1"
    assert req.inputs[0].name == "input"
    np.testing.assert_array_equal(req.inputs[0].array, x)


@pytest.mark.parametrize("binary", [False, True])
def test_response_round_trip(binary):
    out = {"logits": np.array([[1.5, -2.0, 3.25]], dtype=np.float32), "idx": np.array([[2]], dtype=np.int64)}
    body, headers = encode_infer_response("m", out, "7", binary)
    got = decode_infer_response(body, headers.get("inference-header-content-length"))
    for k in out:
        np.testing.assert_array_equal(got[k], out[k])
    assert got["idx"].dtype == np.int64


def test_binary_output_requested_by_parameter():
    body = json.dumps({"inputs": [{"name": "a", "shape": [1], "datatype": "FP32", "data": [1]}], "parameters": {"binary_data_output": True}})
    assert parse_infer_request(body.encode()).binary_output


@pytest.mark.parametrize(
    "body,match",
    [
        (b"{not json", "not valid JSON"),
        (b"[]", "JSON object"),
        (b'{"inputs": []}', "non-empty list"),
        (b'{"inputs": [{"name": "a", "shape": [2], "datatype": "FP32", "data": [1]}]}', "has 1 elements"),
        (b'{"inputs": [{"name": "a", "shape": [1], "datatype": "STRING", "data": [1]}]}', "not supported"),
        (b'{"inputs": [{"name": "a", "shape": [-1], "datatype": "FP32", "data": [1]}]}', "non-negative integers"),
        (b'{"inputs": [{"name": "a", "shape": [1], "datatype": "FP32"}]}', "no 'data'"),
        (b'{"inputs": [{"name": "a", "shape": [1], "datatype": "INT32", "data": ["x"]}]}', "must hold integers for INT32, got strings"),
    ],
)
def test_malformed_requests_are_400(body, match):
    with pytest.raises(ProtocolError, match=match) as exc:
        parse_infer_request(body)
    assert exc.value.status == 400


def test_binary_size_must_match_shape():
    head = json.dumps({"inputs": [{"name": "a", "shape": [2], "datatype": "FP32", "parameters": {"binary_data_size": 4}}]}).encode()
    with pytest.raises(ProtocolError, match="binary_data_size 4"):
        parse_infer_request(head + b"\0" * 4, str(len(head)))


def test_binary_header_length_out_of_range():
    with pytest.raises(ProtocolError, match="outside the body"):
        parse_infer_request(b"{}", "99")


def test_trailing_binary_bytes_are_refused():
    x = np.zeros((1, 2), np.float32)
    body, headers = encode_infer_request({"a": x}, binary=True)
    with pytest.raises(ProtocolError, match="not claimed"):
        parse_infer_request(body + b"xx", headers["inference-header-content-length"])


def _one(**tensor) -> bytes:
    t = {"name": "a", "shape": [1], "datatype": "FP32", "data": [1.0], **tensor}
    return json.dumps({"inputs": [t]}).encode()


HOSTILE = [
    # the bodies that got a 500 with a traceback (issue 20)
    ("datatype a list", _one(datatype=["FP32"]), r"datatype \['FP32'\] is not supported"),
    ("datatype an object", _one(datatype={"a": 1}), "datatype <dict> is not supported"),
    ("outputs[].parameters a list", json.dumps({"inputs": [json.loads(_one())["inputs"][0]], "outputs": [{"name": "y", "parameters": [1]}]}).encode(),
     r"outputs\[0\]\.parameters must be an object"),
    ("nested 100,000 deep", b"[" * 100_000 + b"]" * 100_000, "nested too deeply"),
    ("id of 5,000 digits", b'{"id": ' + b"7" * 5000 + b', "inputs": []}', "beyond a double's range"),
    ("shape dim of 5,000 digits", b'{"inputs": [{"name": "a", "datatype": "FP32", "data": [], "shape": [' + b"7" * 5000 + b"]}]}", "beyond a double's range"),
    ("65 dims", _one(shape=[1] * 65), f"65 dimensions; at most {MAX_DIMS}"),
    ("shape [0, 10**30]", _one(shape=[0, 10**30], data=[]), "shape must be a list of non-negative integers"),  # (read as the double 1e30)
    ("shape [10**3000, 10**3000]", _one(shape=[10**3000, 10**3000], data=[]), "beyond a double's range"),
    ("60,000 dims of 2**62", _one(shape=[2**62] * 60_000, data=[]), "60000 dimensions"),
    ("more elements than bytes", _one(shape=[64, 64], data=[]), "has 4096 elements, more than this"),
    ("binary of 65 dims", None, "65 dimensions"),
    # values numpy would silently convert or wrap
    ("a string as FP32", _one(data=["1.5"]), "must hold numbers for FP32, got strings"),
    ("null as FP32", _one(data=[None]), "must hold numbers for FP32, got nulls"),
    ("300 as INT8", _one(datatype="INT8", data=[300]), r"outside INT8's range \[-128, 127\]"),
    ("1.5 as INT32", _one(datatype="INT32", data=[1.5]), "must hold integers for INT32, got fractional"),
    ("1e300 as FP32 (an infinity)", _one(data=[1e300]), "finite values beyond FP32's range"),
    ("70000 as FP16 (an infinity)", _one(datatype="FP16", data=[70000.0]), "finite values beyond FP16's range"),
    ("an id that is a list", json.dumps({"id": [1], "inputs": json.loads(_one())["inputs"]}).encode(), "'id' must be a string"),
    ("a bool binary_data_size", _one(parameters={"binary_data_size": True}), "binary_data_size must be a non-negative integer"),
]


@pytest.mark.parametrize("label,body,match", HOSTILE, ids=[h[0] for h in HOSTILE])
def test_hostile_bodies_are_400_fast_and_short(label, body, match):
    header = None
    if body is None:  # the binary extension: a JSON header, then the raw bytes
        head = json.dumps({"inputs": [{"name": "a", "shape": [1] * 65, "datatype": "FP32", "parameters": {"binary_data_size": 4}}]}).encode()
        body, header = head + b"\0" * 4, str(len(head))
    t = time.perf_counter()
    with pytest.raises(ProtocolError, match=match) as exc:
        parse_infer_request(body, header)
    assert time.perf_counter() - t < 1.0  # the 60,000-dim shape took 11 s when the product came first
    assert exc.value.status == 400
    assert len(exc.value.message) < 400  # no echo of a 1 MB shape


def test_protocol_error_survives_pickling():
    err = pickle.loads(pickle.dumps(ProtocolError(413, "too big")))
    assert (err.status, err.message) == (413, "too big")


@pytest.mark.parametrize("header", ["x", "1" * 25, "\u00b2"])
def test_header_length_must_be_a_short_integer(header):
    with pytest.raises(ProtocolError, match="not an integer of at most 20 digits"):
        parse_infer_request(b"{}", header)


def test_data_of_the_right_kind_still_converts():
    body = json.dumps({"inputs": [
        {"name": "f", "shape": [2, 2], "datatype": "FP16", "data": [[1, 2.5], [3, 4]]},  # ints are numbers too
        {"name": "b", "shape": [2], "datatype": "BOOL", "data": [True, False]},
        {"name": "u", "shape": [1], "datatype": "UINT64", "data": [2**64 - 1]},
        {"name": "e", "shape": [0, 3], "datatype": "INT8", "data": []},
    ]}).encode()
    req = parse_infer_request(body)
    got = {t.name: t.array for t in req.inputs}
    assert got["f"].dtype == np.float16 and got["f"].tolist() == [[1, 2.5], [3, 4]]
    assert got["b"].tolist() == [True, False]
    assert int(got["u"][0]) == 2**64 - 1
    assert got["e"].shape == (0, 3)


def test_non_finite_outputs_are_valid_json_and_read_back():
    out = {"y": np.array([[1.5, np.nan, np.inf, -np.inf]], dtype=np.float32)}
    body, headers = encode_infer_response("m", out, None, binary=False)

    def refuse(name):
        raise ValueError(f"bare {name} is not JSON")

    head = json.loads(body, parse_constant=refuse)  # strict JSON: no bare NaN / Infinity
    assert head["outputs"][0]["data"] == [1.5, "NaN", "Infinity", "-Infinity"]
    got = decode_infer_response(body)["y"]
    assert got.dtype == np.float32 and got[0, 0] == 1.5 and np.isnan(got[0, 1]) and got[0, 2] == np.inf and got[0, 3] == -np.inf
