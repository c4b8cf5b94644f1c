"""The data path's messages: one msgpack header frame, then one raw frame per tensor.

A message is a list of ZeroMQ frames::

    [header, tensor_0, tensor_1, ...]

``header`` is a msgpack map; its key ``"t"`` lists the tensors that follow as
``[name, dtype, shape]`` (dtype as NumPy's ``dtype.str``, e.g. ``"<f2"``), in frame order.
Tensor frames are the arrays' C-contiguous bytes, sent without a copy (ZeroMQ takes the
buffer) and read without a copy (:func:`numpy.frombuffer` over the received frame: the
arrays are read-only views that live as long as the frame).

Why msgpack and raw frames rather than pickle: a message carries data, never code, so a
peer that can reach a worker's socket can at worst send a batch that fails, and decoding
is a few microseconds for a header of a dozen fields. Malformed messages raise
:class:`WireError`; the receiver logs and drops them.
"""

from __future__ import annotations

import math
from typing import Any, Sequence

import msgpack
import numpy as np

TENSORS = "t"
MAX_TENSORS = 64
MAX_DIMS = 16


class WireError(ValueError):
    """A message that is not a well-formed data-path message."""


def pack(header: dict[str, Any], tensors: dict[str, np.ndarray] | None = None) -> list[Any]:
    """The frames of a message: ``header`` (with the tensor list added) and the tensors' buffers."""
    specs, bufs = [], []
    for name, arr in (tensors or {}).items():
        arr = np.asarray(arr)
        if not arr.flags.c_contiguous:
            arr = arr.copy(order="C")
        specs.append((name, arr.dtype.str, arr.shape))
        bufs.append(arr.data if arr.size else b"")
    return [msgpack.packb({**header, TENSORS: specs}), *bufs]


def unpack(frames: Sequence[Any]) -> tuple[dict[str, Any], dict[str, np.ndarray]]:
    """``(header, tensors)`` of a received message (frames as bytes or ``zmq.Frame``).

    Raises:
        WireError: the header is not a msgpack map with a valid tensor list, or a tensor
            frame's size does not match its dtype and shape.
    """
    if not frames:
        raise WireError("empty message")
    try:
        header = msgpack.unpackb(_buffer(frames[0]), strict_map_key=False)
    except Exception as exc:
        raise WireError(f"header is not msgpack: {exc}") from None
    if not isinstance(header, dict):
        raise WireError("header is not a map")
    specs = header.pop(TENSORS, [])
    if not isinstance(specs, list) or len(specs) > MAX_TENSORS or len(specs) != len(frames) - 1:
        raise WireError(f"header lists {len(specs) if isinstance(specs, list) else '?'} tensors, message has {len(frames) - 1}")
    tensors = {}
    for spec, frame in zip(specs, frames[1:]):
        tensors[_name(spec)] = _array(spec, _buffer(frame))
    return header, tensors


def _buffer(frame: Any) -> memoryview:
    buf = getattr(frame, "buffer", None)  # zmq.Frame (received with copy=False)
    return memoryview(frame) if buf is None else buf


def _name(spec: Any) -> str:
    if not (isinstance(spec, list) and len(spec) == 3 and isinstance(spec[0], str)):
        raise WireError(f"tensor spec {spec!r} is not [name, dtype, shape]")
    return spec[0]


def _array(spec: list[Any], buf: memoryview) -> np.ndarray:
    name, dtype, shape = spec
    try:
        dt = np.dtype(dtype)
    except TypeError:
        raise WireError(f"tensor '{name}': unknown dtype {dtype!r}") from None
    if dt.hasobject or not isinstance(shape, list) or len(shape) > MAX_DIMS or not all(isinstance(d, int) and 0 <= d < 2**40 for d in shape):
        raise WireError(f"tensor '{name}': bad dtype or shape {dtype!r} {shape!r}")
    n = math.prod(shape)
    if n * dt.itemsize != buf.nbytes:
        raise WireError(f"tensor '{name}': {buf.nbytes} bytes for {dtype} {shape}")
    return np.frombuffer(buf, dtype=dt).reshape(shape)
