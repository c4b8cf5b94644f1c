"""KServe v2 encoding: JSON and binary tensors, and the errors of malformed requests."""

import json

import numpy as np
import pytest

from ppipe.runtime.protocol import (
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
        (b'{"inputs": [{"name": "a", "shape": [1], "datatype": "INT32", "data": ["x"]}]}', "cannot be read"),
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
