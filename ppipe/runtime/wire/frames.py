"""The data path's messages: a msgpack header, then the tensors' raw bytes.

On a connection, each message is a 4-byte little-endian length ``n`` and ``n`` bytes::

    n | header length h (4 bytes) | header (h bytes, msgpack map) | tensor 0 | tensor 1 | ...

The header's key ``"t"`` lists the tensors that follow as ``[name, dtype, shape]`` (dtype
as NumPy's ``dtype.str``, e.g. ``"<f2"``), in order; each tensor is its array's
C-contiguous bytes. :func:`pack` returns the pieces to write: the length prefix, header
length and header as one ``bytes``, then each tensor's buffer (a memoryview of its array,
not a copy), so a sender can hand them to the socket without joining them.
:func:`unpack` reads a message without copying its tensors (:func:`numpy.frombuffer`:
views that keep the message alive, read-only where the message is, as the receiver's
are).

Why msgpack and raw bytes rather than pickle: a message carries data, never code, so a
peer that can reach a worker's port can at worst send a batch that fails, and decoding is
a few microseconds for a header of a dozen fields. Malformed messages raise
:class:`WireError`; the receiver logs and drops them.
"""

from __future__ import annotations

import math
from typing import Any

import msgpack
import numpy as np

TENSORS = "t"
MAX_TENSORS = 64
MAX_DIMS = 16


class WireError(ValueError):
    """A message that is not a well-formed data-path message."""


LENGTH = 4  # bytes of each length field
MAX_MESSAGE_BYTES = 2**32 - 1


def pack(header: dict[str, Any], tensors: dict[str, np.ndarray] | None = None) -> list[Any]:
    """The pieces of one message on a connection, in order: ``bytes`` of the length prefix,
    header length and header, then the tensors' buffers (memoryviews of C-contiguous
    arrays; a non-contiguous array is copied first). The views share the arrays' memory:
    an array must not change until its message is sent."""
    specs, bufs, size = [], [], 0
    for name, arr in (tensors or {}).items():
        arr = np.asarray(arr)
        if not arr.flags.c_contiguous:
            arr = arr.copy(order="C")
        specs.append((name, arr.dtype.str, arr.shape))
        if arr.size:
            bufs.append(arr.data.cast("B") if arr.ndim else arr.tobytes())
            size += arr.nbytes
    head = msgpack.packb({**header, TENSORS: specs})
    n = LENGTH + len(head) + size
    if n > MAX_MESSAGE_BYTES:
        raise WireError(f"a message of {n} bytes exceeds the wire's limit of {MAX_MESSAGE_BYTES}")
    return [n.to_bytes(LENGTH, "little") + len(head).to_bytes(LENGTH, "little") + head, *bufs]


def unpack(message: bytes | memoryview) -> tuple[dict[str, Any], dict[str, np.ndarray]]:
    """``(header, tensors)`` of one message (without its length prefix).

    Raises:
        WireError: the header is not a msgpack map with a valid tensor list, or the
            tensors' bytes do not add up to the message's length.
    """
    view = memoryview(message)
    if len(view) < LENGTH:
        raise WireError(f"message of {len(view)} bytes has no header")
    h = int.from_bytes(view[:LENGTH], "little")
    if LENGTH + h > len(view):
        raise WireError(f"header of {h} bytes overruns a message of {len(view)} bytes")
    try:
        header = msgpack.unpackb(view[LENGTH : LENGTH + h], strict_map_key=False)
    except Exception as exc:
        raise WireError(f"header is not msgpack: {exc}") from None
    if not isinstance(header, dict):
        raise WireError("header is not a map")
    specs = header.pop(TENSORS, [])
    if not isinstance(specs, list) or len(specs) > MAX_TENSORS:
        raise WireError(f"header's tensor list is not a list of at most {MAX_TENSORS}")
    tensors, pos = {}, LENGTH + h
    for spec in specs:
        name, arr, pos = _name(spec), *_array(spec, view, pos)
        tensors[name] = arr
    if pos != len(view):
        raise WireError(f"message has {len(view) - pos} bytes after its tensors")
    return header, tensors


def _name(spec: Any) -> str:
    if not (isinstance(spec, list) and len(spec) == 3 and isinstance(spec[0], str)):
        raise WireError(f"tensor spec {spec!r} is not [name, dtype, shape]")
    return spec[0]


def _array(spec: list[Any], view: memoryview, pos: int) -> tuple[np.ndarray, int]:
    name, dtype, shape = spec
    try:
        dt = np.dtype(dtype)
    except TypeError:
        raise WireError(f"tensor '{name}': unknown dtype {dtype!r}") from None
    if dt.hasobject or not isinstance(shape, list) or len(shape) > MAX_DIMS or not all(isinstance(d, int) and 0 <= d < 2**40 for d in shape):
        raise WireError(f"tensor '{name}': bad dtype or shape {dtype!r} {shape!r}")
    n = math.prod(shape) * dt.itemsize
    if pos + n > len(view):
        raise WireError(f"tensor '{name}': {dtype} {shape} needs {n} bytes, the message has {len(view) - pos} left")
    return np.frombuffer(view[pos : pos + n], dtype=dt).reshape(shape), pos + n
