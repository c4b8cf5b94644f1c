"""The data path's framing: a typed message, then the tensors' raw bytes.

On a connection, each message is a 4-byte little-endian length ``n`` and ``n`` bytes::

    n | header length h (4 bytes) | header (h bytes) | tensor 0 | tensor 1 | ...

The header is the MessagePack array ``[message, tensors]``: the message, a
:mod:`msgspec` struct of :mod:`ppipe.runtime.wire.messages` (or another module's, for
other boundaries), and the tensors that follow as ``[name, dtype, shape]`` (dtype as
NumPy's ``dtype.str``, e.g. ``"<f2"``), in order; each tensor is its array's C-contiguous
bytes. :func:`pack` returns the pieces to write: the length prefix, header length and
header as one ``bytes``, then each tensor's buffer (a memoryview of its array, not a copy),
so a sender can hand them to the socket without joining them. :func:`unpack` decodes the
header into the one message type its caller expects and reads the tensors without copying
them (:func:`numpy.frombuffer`: views that keep the message alive, read-only where the
message is, as the receiver's are).

Why MessagePack and raw bytes rather than pickle: a message carries data, never code, so a
peer that can reach a worker's port can at worst send a batch that fails, and decoding a
header of a dozen fields takes a few microseconds. Malformed messages (not MessagePack, a
missing or mistyped field, tensors that do not add up) raise :class:`WireError`; the
receiver logs and drops them.
"""

from __future__ import annotations

import math
from typing import Annotated, Any, TypeVar

import msgspec
import numpy as np

MAX_TENSORS = 64
MAX_DIMS = 16

M = TypeVar("M", bound=msgspec.Struct)
Dim = Annotated[int, msgspec.Meta(ge=0, lt=2**40)]
TensorSpec = tuple[str, str, Annotated[tuple[Dim, ...], msgspec.Meta(max_length=MAX_DIMS)]]
TensorSpecs = Annotated[list[TensorSpec], msgspec.Meta(max_length=MAX_TENSORS)]


class WireError(ValueError):
    """A message that is not a well-formed data-path message."""


LENGTH = 4  # bytes of each length field
MAX_MESSAGE_BYTES = 2**32 - 1

_encoder = msgspec.msgpack.Encoder()
_decoders: dict[type, msgspec.msgpack.Decoder] = {}


def pack(message: msgspec.Struct, tensors: dict[str, np.ndarray] | None = None) -> list[Any]:
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
    head = _encoder.encode((message, specs))
    n = LENGTH + len(head) + size
    if n > MAX_MESSAGE_BYTES:
        raise WireError(f"a message of {n} bytes exceeds the wire's limit of {MAX_MESSAGE_BYTES}")
    return [n.to_bytes(LENGTH, "little") + len(head).to_bytes(LENGTH, "little") + head, *bufs]


def unpack(message: bytes | memoryview, kind: type[M]) -> tuple[M, dict[str, np.ndarray]]:
    """``(message, tensors)`` of one message (without its length prefix), its header decoded as ``kind``.

    Raises:
        WireError: the header is not MessagePack, not a ``kind`` with a valid tensor list,
            or the tensors' bytes do not add up to the message's length.
    """
    view = memoryview(message)
    if len(view) < LENGTH:
        raise WireError(f"message of {len(view)} bytes has no header")
    h = int.from_bytes(view[:LENGTH], "little")
    if LENGTH + h > len(view):
        raise WireError(f"header of {h} bytes overruns a message of {len(view)} bytes")
    decoder = _decoders.get(kind)
    if decoder is None:
        decoder = _decoders[kind] = msgspec.msgpack.Decoder(tuple[kind, TensorSpecs])
    try:
        header, specs = decoder.decode(view[LENGTH : LENGTH + h])
    except msgspec.DecodeError as exc:  # ValidationError is one
        raise WireError(f"header is not a {getattr(kind, '__name__', kind)}: {exc}") from None
    tensors, pos = {}, LENGTH + h
    for spec in specs:
        arr, pos = _array(spec, view, pos)
        tensors[spec[0]] = arr
    if pos != len(view):
        raise WireError(f"message has {len(view) - pos} bytes after its tensors")
    return header, tensors


def _array(spec: TensorSpec, view: memoryview, pos: int) -> tuple[np.ndarray, int]:
    name, dtype, shape = spec
    try:
        dt = np.dtype(dtype)
    except TypeError:
        raise WireError(f"tensor '{name}': unknown dtype {dtype!r}") from None
    if dt.hasobject:
        raise WireError(f"tensor '{name}': dtype {dtype!r} holds objects")
    n = math.prod(shape) * dt.itemsize
    if pos + n > len(view):
        raise WireError(f"tensor '{name}': {dtype} {shape} needs {n} bytes, the message has {len(view) - pos} left")
    return np.frombuffer(view[pos : pos + n], dtype=dt).reshape(shape), pos + n
