"""Open Inference Protocol v2 (KServe v2 REST) encoding: pure functions, no I/O.

Requests carry tensors as JSON (``"data"``: a flat or nested list, row-major) or, with the
binary tensor extension, as raw little-endian bytes after a JSON header whose length is
given by the ``Inference-Header-Content-Length`` HTTP header; a binary input says its
size in ``parameters.binary_data_size``. ``BYTES`` tensors (encoded images, for models that
declare a preprocess: :mod:`ppipe.runtime.ingress.images`) hold one byte string per
element: in binary, each as a 4-byte little-endian length and its bytes (Triton's layout);
in JSON, each as a base64 string. They parse to arrays of ``bytes`` objects. A response is binary when the request asks for
it (``parameters.binary_data_output: true``, or ``parameters.binary_data: true`` on a
requested output) and JSON otherwise.

Every malformed request raises :class:`ProtocolError` with the HTTP status to answer
and a message that says what is wrong and how to fix it; no input makes the parser raise
anything else. Its work is bounded by the body's size: a shape is checked (at most
:data:`MAX_DIMS` dimensions, no more elements than the body has bytes) before anything is
allocated for it, so a small body cannot make it compute or allocate a lot.

JSON is read and written with orjson: a ResNet-50 input (150,528 numbers) decodes about
five times and encodes about twenty times faster than with the standard library's ``json``,
and orjson is strict where the protocol wants it (no ``NaN`` literals, numbers beyond a
double and nesting beyond 1,024 levels are errors, so they become a 400).
"""

from __future__ import annotations

import base64
import binascii
import math
import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import orjson

HEADER_LENGTH = "inference-header-content-length"

# KServe v2 datatype <-> numpy dtype, for tensors of numbers; BYTES (byte strings) is apart
DATATYPES: dict[str, str] = {
    "BOOL": "bool",
    "UINT8": "uint8",
    "UINT16": "uint16",
    "UINT32": "uint32",
    "UINT64": "uint64",
    "INT8": "int8",
    "INT16": "int16",
    "INT32": "int32",
    "INT64": "int64",
    "FP16": "float16",
    "FP32": "float32",
    "FP64": "float64",
}
NUMPY_TO_DATATYPE = {v: k for k, v in DATATYPES.items()}
_WIRE_DTYPES = {k: np.dtype(v).newbyteorder("<") for k, v in DATATYPES.items()}
BYTES = "BYTES"
INPUT_DATATYPES = (*DATATYPES, BYTES)

MAX_DIMS = 32
"""The most dimensions a tensor may have: numpy 1.x's own limit (numpy 2 allows 64); a CNN's
input has 4."""

# what JSON ``data`` of each datatype may hold, as numpy dtype kinds (np.asarray of the list):
# numbers for numbers, booleans for BOOL; never strings ("1.5"), nulls or objects
_DATA_KINDS = {k: ("b" if k == "BOOL" else "iu" if k[0] in "IU" else "iuf") for k in DATATYPES}
_KIND_WORDS = {"b": "true/false values", "iu": "integers", "iuf": "numbers"}


class ProtocolError(Exception):
    """A request the server refuses; ``status`` is the HTTP status code to answer with."""

    def __init__(self, status: int, message: str):
        super().__init__(message)
        self.status = status
        self.message = message

    def __reduce__(self):  # survives pickling (a decode in a worker process raises it there)
        return (type(self), (self.status, self.message))


def brief(value: Any, items: int = 8) -> str:
    """A short repr of a value taken from a request, for an error message: lists cut after
    ``items`` entries, huge integers as their size (an attacker's shape must not make the
    error message itself large or slow)."""
    if isinstance(value, list):
        inner = ", ".join(brief(v, items) for v in value[:items])
        return f"[{inner}{', ...' if len(value) > items else ''}] ({len(value)} entries)" if len(value) > items else f"[{inner}]"
    if isinstance(value, int) and not isinstance(value, bool) and value.bit_length() > 64:
        return f"<{value.bit_length()}-bit integer>"
    r = repr(value) if isinstance(value, (int, float, str, bool, type(None))) else f"<{type(value).__name__}>"
    return r if len(r) <= 80 else r[:77] + "..."


def shape_elements(shape: Any, where: str, max_elements: int) -> int:
    """Check a requested shape and return its element count, in constant time.

    Args:
        shape: the shape as sent (anything JSON can hold).
        where: the field's path for the message (``inputs[0]``).
        max_elements: the most elements the request can carry (its body's size in bytes:
            every element costs at least one byte in either encoding).

    Raises:
        ProtocolError: 400 when the shape is not a list of at most :data:`MAX_DIMS`
            non-negative integers, or holds more than ``max_elements`` elements (or a
            dimension larger than that, which with a 0 elsewhere would still overflow numpy).
    """
    if not isinstance(shape, list):
        raise ProtocolError(400, f"{where}.shape must be a list of non-negative integers, got {brief(shape)}")
    if len(shape) > MAX_DIMS:
        raise ProtocolError(400, f"{where}.shape has {len(shape)} dimensions; at most {MAX_DIMS} are accepted")
    count = 1
    for d in shape:
        if not isinstance(d, int) or isinstance(d, bool) or d < 0:
            raise ProtocolError(400, f"{where}.shape must be a list of non-negative integers, got {brief(shape)}")
        if d > max_elements:
            raise ProtocolError(
                400, f"{where}.shape {brief(shape)} has a dimension of {brief(d)}, more elements than this {max_elements}-byte body can hold"
            )
        count *= d  # at most MAX_DIMS factors each <= max_elements: cheap
    if count > max_elements:
        raise ProtocolError(400, f"{where}.shape {brief(shape)} has {brief(count)} elements, more than this {max_elements}-byte body can hold")
    return count


@dataclass
class InferInput:
    name: str
    array: np.ndarray


@dataclass
class InferRequest:
    """A parsed infer request."""

    id: str | None
    inputs: list[InferInput]
    binary_output: bool = False
    requested_outputs: list[str] = field(default_factory=list)


def datatype_of(dtype: np.dtype | str) -> str:
    """The KServe v2 datatype of a numpy dtype (``ProtocolError`` 500 where it has none)."""
    try:
        return _DATATYPE_OF[dtype]
    except (KeyError, TypeError):  # (TypeError: an unhashable dtype-like)
        pass
    name = np.dtype(dtype).name
    try:
        found = NUMPY_TO_DATATYPE[name]
    except KeyError:
        raise ProtocolError(500, f"no KServe v2 datatype for numpy dtype {name}") from None
    _DATATYPE_OF[dtype] = found  # (a dtype's ``name`` takes microseconds; the dtypes seen are few)
    return found


_DATATYPE_OF: dict[Any, str] = {}


def wire_dtype(datatype: str) -> np.dtype:
    """The little-endian numpy dtype of a KServe v2 datatype of :data:`DATATYPES`."""
    return _WIRE_DTYPES[datatype]


def parse_infer_request(body: bytes, header_length: str | None = None) -> InferRequest:
    """Parse an infer request body (JSON, or JSON header + binary tensors).

    Args:
        body: the raw HTTP body.
        header_length: value of the ``Inference-Header-Content-Length`` header, if any.

    Raises:
        ProtocolError: 400 with a message naming the field at fault, for any malformed body.
    """
    head_bytes, tail = _split_body(body, header_length)
    head = _load_head(head_bytes, header_length)
    inputs = _parse_inputs(head, len(body), tail)
    binary, requested = _parse_outputs(head)
    return InferRequest(id=_request_id(head), inputs=inputs, binary_output=binary, requested_outputs=requested)


def _split_body(body: bytes, header_length: str | None) -> tuple[bytes, memoryview]:
    """(JSON header, binary tail) of a body: the first ``header_length`` bytes and the rest,
    or the whole body and no tail when the request has no such header."""
    if header_length is None:
        return body, memoryview(b"")
    try:
        n = int(header_length) if len(header_length) <= 20 else None
    except ValueError:
        n = None
    if n is None:
        raise ProtocolError(400, f"Inference-Header-Content-Length {brief(header_length)} is not an integer of at most 20 digits")
    if not 0 < n <= len(body):
        raise ProtocolError(
            400, f"Inference-Header-Content-Length {n} is outside the body's {len(body)} bytes"
        )
    return body[:n], memoryview(body)[n:]


def _load_head(head_bytes: bytes, header_length: str | None) -> dict[str, Any]:
    """The JSON header as an object, each way it can be malformed a 400 that says which."""
    try:
        head = orjson.loads(head_bytes)
    except orjson.JSONDecodeError as exc:  # not JSON, not UTF-8, a number beyond a double, nested too deeply
        if "depth limit" in str(exc):
            raise ProtocolError(400, "request body is nested too deeply to decode; a tensor's data is a flat or shape-nested list") from None
        if "infinity" in str(exc):
            raise ProtocolError(400, f"request body holds a number beyond a double's range (|x| > 1.8e308): {brief(str(exc))}; "
                                     "integers must fit in 64 bits") from None
        hint = " (binary tensors need the Inference-Header-Content-Length header)" if header_length is None else ""
        raise ProtocolError(400, f"request body is not valid JSON: {brief(str(exc))}{hint}") from None
    if not isinstance(head, dict):
        raise ProtocolError(400, "request body must be a JSON object with an 'inputs' list")
    return head


def _parse_inputs(head: dict[str, Any], body_bytes: int, tail: memoryview) -> list[InferInput]:
    """The header's ``inputs``, their binary data taken from ``tail`` in order; every byte
    of the tail must belong to an input. ``body_bytes`` bounds each input's shape."""
    raw_inputs = head.get("inputs")
    if not isinstance(raw_inputs, list) or not raw_inputs:
        raise ProtocolError(400, "'inputs' must be a non-empty list of tensors")
    inputs: list[InferInput] = []
    offset = 0
    for i, t in enumerate(raw_inputs):
        arr, offset = _parse_input(t, f"inputs[{i}]", body_bytes, tail, offset)
        inputs.append(InferInput(name=t["name"], array=arr))
    if offset != len(tail):
        raise ProtocolError(400, f"{len(tail) - offset} bytes after the last binary tensor are not claimed by any input")
    return inputs


def _parse_input(t: Any, where: str, body_bytes: int, tail: memoryview, offset: int) -> tuple[np.ndarray, int]:
    """One input tensor ``t`` (at ``where``) as an array, and the tail's offset after it:
    its binary data at ``offset`` of the tail, or its JSON ``data``."""
    if not isinstance(t, dict):
        raise ProtocolError(400, f"{where} must be an object with name, shape, datatype and data")
    name, shape, datatype = t.get("name"), t.get("shape"), t.get("datatype")
    if not isinstance(name, str):
        raise ProtocolError(400, f"{where}.name must be a string")
    count = shape_elements(shape, where, body_bytes)
    if not isinstance(datatype, str) or datatype not in INPUT_DATATYPES:
        raise ProtocolError(400, f"{where}.datatype {brief(datatype)} is not supported; use one of {', '.join(INPUT_DATATYPES)}")
    params = t.get("parameters") or {}
    if not isinstance(params, dict):
        raise ProtocolError(400, f"{where}.parameters must be an object")
    if datatype == BYTES:
        return _bytes_input(t, where, shape, count, params, tail, offset)
    dtype = wire_dtype(datatype)
    if "binary_data_size" in params:
        size = _binary_size(params, where)
        if size != count * dtype.itemsize:
            raise ProtocolError(
                400, f"{where}: binary_data_size {size} != {count} elements x {dtype.itemsize} bytes of {datatype}"
            )
        if offset + size > len(tail):
            raise ProtocolError(400, f"{where}: binary data runs past the end of the body")
        return np.frombuffer(tail[offset : offset + size], dtype=dtype).reshape(shape), offset + size
    if "data" not in t:
        raise ProtocolError(400, f"{where} has no 'data' (and no parameters.binary_data_size)")
    arr = _json_data(t["data"], where, datatype, dtype)
    if arr.size != count:
        raise ProtocolError(400, f"{where}.data has {arr.size} elements, shape {brief(shape)} needs {count}")
    return arr.reshape(shape), offset


def _binary_size(params: dict[str, Any], where: str) -> int:
    size = params["binary_data_size"]
    if not isinstance(size, int) or isinstance(size, bool) or size < 0:
        raise ProtocolError(400, f"{where}.parameters.binary_data_size must be a non-negative integer")
    return size


def _bytes_input(t: dict[str, Any], where: str, shape: list[int], count: int, params: dict[str, Any],
                 tail: memoryview, offset: int) -> tuple[np.ndarray, int]:
    """A ``BYTES`` tensor as an array of ``bytes`` of ``shape``, and the tail's offset after it:
    binary (``count`` elements of a 4-byte little-endian length and the bytes, filling
    ``binary_data_size`` exactly) or JSON (``data``: ``count`` base64 strings, flat or nested)."""
    if "binary_data_size" in params:
        size = _binary_size(params, where)
        if offset + size > len(tail):
            raise ProtocolError(400, f"{where}: binary data runs past the end of the body")
        return split_bytes(tail[offset : offset + size], count, where).reshape(shape), offset + size
    if "data" not in t:
        raise ProtocolError(400, f"{where} has no 'data' (and no parameters.binary_data_size)")
    flat = _flat_strings(t["data"], where)
    if len(flat) != count:
        raise ProtocolError(400, f"{where}.data has {len(flat)} elements, shape {brief(shape)} needs {count}")
    out = np.empty(count, dtype=object)
    for i, text in enumerate(flat):
        try:
            out[i] = base64.b64decode(text, validate=True)
        except (binascii.Error, ValueError):
            raise ProtocolError(400, f"{where}.data[{i}] is not base64; BYTES elements in JSON are base64 strings "
                                     "(or send the binary tensor extension)") from None
    return out.reshape(shape), offset


def split_bytes(region: memoryview, count: int, where: str) -> np.ndarray:
    """``count`` length-prefixed byte strings that fill ``region`` exactly, as an array of bytes."""
    if count * 4 > len(region):  # before anything is allocated for them
        raise ProtocolError(400, f"{where}: {count} BYTES elements need at least {count} x 4 bytes, the tensor has {len(region)}")
    out, pos = np.empty(count, dtype=object), 0
    for i in range(count):
        if pos + 4 > len(region):
            raise ProtocolError(400, f"{where}: element {i} of {count} has no 4-byte length prefix within binary_data_size")
        n = int.from_bytes(region[pos : pos + 4], "little")
        if pos + 4 + n > len(region):
            raise ProtocolError(400, f"{where}: element {i} claims {n} bytes, past the end of its binary_data_size")
        out[i] = bytes(region[pos + 4 : pos + 4 + n])
        pos += 4 + n
    if pos != len(region):
        raise ProtocolError(400, f"{where}: {len(region) - pos} bytes of binary_data_size follow its {count} elements")
    return out


def _flat_strings(data: Any, where: str) -> list[str]:
    """The strings of a flat or nested JSON list, in row-major order (at most :data:`MAX_DIMS` deep)."""
    flat: list[str] = []
    stack = [(data, 0)]
    while stack:
        item, depth = stack.pop()
        if isinstance(item, str):
            flat.append(item)
        elif isinstance(item, list) and depth < MAX_DIMS:
            stack.extend((x, depth + 1) for x in reversed(item))
        else:
            raise ProtocolError(400, f"{where}.data must hold base64 strings for BYTES, got {brief(item)}")
    return flat


def _parse_outputs(head: dict[str, Any]) -> tuple[bool, list[str]]:
    """(whether the answer is binary, the outputs requested by name) from the header's
    ``parameters.binary_data_output`` and ``outputs``."""
    params = head.get("parameters") or {}
    if not isinstance(params, dict):
        raise ProtocolError(400, "'parameters' must be an object")
    binary = bool(params.get("binary_data_output", False))
    requested: list[str] = []
    outs = head.get("outputs") or []
    if not isinstance(outs, list):
        raise ProtocolError(400, "'outputs' must be a list")
    for j, o in enumerate(outs):
        if not isinstance(o, dict) or not isinstance(o.get("name"), str):
            raise ProtocolError(400, f"outputs[{j}] must be an object with a 'name'")
        requested.append(o["name"])
        oparams = o.get("parameters") or {}
        if not isinstance(oparams, dict):
            raise ProtocolError(400, f"outputs[{j}].parameters must be an object, e.g. {{\"binary_data\": true}}")
        if oparams.get("binary_data"):
            binary = True
    return binary, requested


def _request_id(head: dict[str, Any]) -> str | None:
    """The request's ``id`` as a string (a number is accepted and written as one), or None."""
    rid = head.get("id")
    if rid is not None and (not isinstance(rid, (str, int, float)) or isinstance(rid, bool)):
        raise ProtocolError(400, f"'id' must be a string, got {brief(rid)}")
    return None if rid is None else str(rid)


def decode_job(body: bytes, header_length: str | None) -> tuple["InferRequest | ProtocolError", float]:
    """:func:`parse_infer_request` as a job for a worker process (the frontend's decode
    pool): returns the request or its :class:`ProtocolError`, and the seconds it took."""
    t = time.perf_counter()
    try:
        out: InferRequest | ProtocolError = parse_infer_request(body, header_length)
    except ProtocolError as exc:
        out = exc
    return out, time.perf_counter() - t


def _json_data(data: Any, where: str, datatype: str, dtype: np.dtype) -> np.ndarray:
    """A tensor's JSON ``data`` as an array of ``dtype``: numbers only (no strings, nulls or
    objects, which numpy would otherwise convert or wrap), integers within the datatype's range,
    finite numbers within the float datatype's range (not turned into infinities)."""
    try:
        raw = np.asarray(data)
    except (TypeError, ValueError, OverflowError, RecursionError) as exc:
        raise ProtocolError(400, f"{where}.data cannot be read as {datatype}: {brief(str(exc))}") from None
    kinds = _DATA_KINDS[datatype]
    if raw.size and raw.dtype.kind not in kinds:
        got = {"U": "strings", "S": "strings", "O": "nulls, objects or integers beyond 64 bits", "f": "fractional numbers", "b": "true/false values"}
        raise ProtocolError(
            400, f"{where}.data must hold {_KIND_WORDS[kinds]} for {datatype}, got {got.get(raw.dtype.kind, raw.dtype.name)}"
        )
    if dtype.kind in "iu" and raw.size:
        info = np.iinfo(dtype)
        lo, hi = raw.min(), raw.max()
        if lo < info.min or hi > info.max:
            raise ProtocolError(400, f"{where}.data has values outside {datatype}'s range [{info.min}, {info.max}]")
    if dtype.kind == "f" and raw.size and raw.dtype.itemsize > dtype.itemsize:
        big = np.finfo(dtype).max
        finite = np.isfinite(raw)
        if (np.abs(raw[finite]) > big).any():  # would become inf: not the number the client sent
            raise ProtocolError(400, f"{where}.data has finite values beyond {datatype}'s range (|x| <= {big:.4g})")
    return raw.astype(dtype, copy=False)


def _encode_body(head: dict[str, Any], key: str, tensors: dict[str, np.ndarray], binary: bool) -> tuple[bytes, dict[str, str]]:
    """Append ``tensors`` to ``head[key]`` as KServe v2 tensor entries and encode the body:
    JSON data inline, or (``binary``) the binary tensor extension, raw little-endian blobs
    after the JSON header. Returns (body, extra HTTP headers)."""
    blobs: list[bytes] = []
    entries = head.setdefault(key, [])
    for name, arr in tensors.items():
        arr = np.ascontiguousarray(arr)
        if arr.dtype == object:  # byte strings (encoded images)
            entry, blob = _bytes_entry(name, arr, binary)
            entries.append(entry)
            blobs.extend([blob] if binary else [])
            continue
        entry: dict[str, Any] = {"name": name, "shape": list(arr.shape), "datatype": datatype_of(arr.dtype)}
        if binary:
            data = arr.astype(arr.dtype.newbyteorder("<"), copy=False).tobytes()
            entry["parameters"] = {"binary_data_size": len(data)}
            blobs.append(data)
        else:
            entry["data"] = _json_numbers(arr)
        entries.append(entry)
    head_bytes = orjson.dumps(head, option=orjson.OPT_SERIALIZE_NUMPY)
    if not binary:
        return head_bytes, {"content-type": "application/json"}
    return head_bytes + b"".join(blobs), {
        "content-type": "application/octet-stream",
        "inference-header-content-length": str(len(head_bytes)),
    }


def _bytes_entry(name: str, arr: np.ndarray, binary: bool) -> tuple[dict[str, Any], bytes]:
    """A BYTES tensor entry of the byte strings ``arr``, and its binary blob (length-prefixed
    elements; empty in JSON, where the entry holds them as base64)."""
    entry: dict[str, Any] = {"name": name, "shape": list(arr.shape), "datatype": BYTES}
    flat = [bytes(b) for b in arr.reshape(-1)]
    if not binary:
        entry["data"] = [base64.b64encode(b).decode("ascii") for b in flat]
        return entry, b""
    blob = b"".join(len(b).to_bytes(4, "little") + b for b in flat)
    entry["parameters"] = {"binary_data_size": len(blob)}
    return entry, blob


def _json_numbers(arr: np.ndarray) -> np.ndarray | list:
    """A tensor's values as a flat JSON list: the array itself (orjson writes a C-contiguous
    array in native byte order as a list of numbers), or, where it holds non-finite floats,
    a list in which they are the strings "NaN", "Infinity" and "-Infinity". JSON has no NaN
    or infinity (orjson would write ``null``, the standard library a bare ``NaN`` that strict
    parsers refuse); ``float()`` and numpy read those strings back."""
    flat = arr.reshape(-1)
    if arr.dtype.kind == "f" and not np.isfinite(flat).all():
        return [v if math.isfinite(v) else ("NaN" if v != v else "Infinity" if v > 0 else "-Infinity") for v in flat.tolist()]
    return flat if flat.dtype.isnative else flat.astype(flat.dtype.newbyteorder("="))


def stacked_outputs(results: list[dict[str, np.ndarray]]) -> dict[str, np.ndarray]:
    """The outputs of one request's samples (each without the batch axis) with the batch axis:
    a view of the one sample's arrays, or each output's samples stacked."""
    if len(results) == 1:
        return {k: v[np.newaxis] for k, v in results[0].items()}
    return {k: np.stack([r[k] for r in results]) for k in results[0]}


def encode_infer_response(
    model: str, outputs: dict[str, np.ndarray], request_id: str | None, binary: bool
) -> tuple[bytes, dict[str, str]]:
    """Encode outputs as a KServe v2 response body; returns (body, extra HTTP headers).
    In JSON, non-finite floats are the strings "NaN", "Infinity", "-Infinity"."""
    head: dict[str, Any] = {"model_name": model, "model_version": "1", "outputs": []}
    if request_id is not None:
        head["id"] = request_id
    return _encode_body(head, "outputs", outputs, binary)


def encode_infer_request(
    inputs: dict[str, np.ndarray], binary: bool = False, request_id: str | None = None, binary_output: bool = False
) -> tuple[bytes, dict[str, str]]:
    """Client side (``ppipe bench``, tests): encode an infer request; returns (body, headers)."""
    head: dict[str, Any] = {"inputs": []}
    if request_id is not None:
        head["id"] = request_id
    if binary_output:
        head["parameters"] = {"binary_data_output": True}
    return _encode_body(head, "inputs", inputs, binary)


def decode_infer_response(body: bytes, header_length: str | None = None) -> dict[str, np.ndarray]:
    """Client side: decode a response body into {output name: array}."""
    n = int(header_length) if header_length is not None else len(body)
    head = orjson.loads(body[:n])
    tail = memoryview(body)[n:]
    out: dict[str, np.ndarray] = {}
    offset = 0
    for t in head["outputs"]:
        dtype = wire_dtype(t["datatype"])
        size = (t.get("parameters") or {}).get("binary_data_size")
        if size is not None:
            out[t["name"]] = np.frombuffer(tail[offset : offset + size], dtype=dtype).reshape(t["shape"])
            offset += size
        else:
            out[t["name"]] = np.asarray(t["data"], dtype=dtype).reshape(t["shape"])
    return out
