"""The data path's framing: a typed message, then the tensors' raw bytes.

On a connection, each message is a 4-byte little-endian length ``n`` and ``n`` bytes::

    n | header length h (4 bytes) | header (h bytes) | tensor 0 | tensor 1 | ...

The header is the MessagePack array ``[message, tensors]``: the message, a
:mod:`msgspec` struct of :mod:`ppipe.runtime.wire.messages` (or another module's, for
other boundaries), and the tensors as ``[name, dtype, shape, shared]`` (dtype as NumPy's
``dtype.str``, e.g. ``"<f2"``), in order. A tensor with ``shared`` empty follows the
header as its array's C-contiguous bytes (:class:`ForwardedRows`: rows that a sender
forwards without holding them, by ref or their bytes joined); one in shared memory on this machine
(:mod:`ppipe.runtime.wire.shared_inputs`) has no bytes on the wire: ``shared`` names
where its rows lie, one :class:`~ppipe.runtime.wire.shared_inputs.SharedRef` for the whole
tensor or one per row of its first axis. :func:`pack` returns the pieces to write: the
length prefix, header length and header as one ``bytes``, then each inline tensor's buffer
(a memoryview of its array, not a copy), so a sender can hand them to the socket without
joining them. :func:`unpack` decodes the header into the one message type its caller
expects and reads the tensors without copying them (:func:`numpy.frombuffer`: views that
keep the message alive, read-only where the message is, as the receiver's are; shared
tensors are views of the mapped segment, and a tensor of several shared rows is stacked).

Why MessagePack and raw bytes rather than pickle: a message carries data, never code, so a
peer that can reach a worker's port can at worst send a batch that fails, and decoding a
header of a dozen fields takes a few microseconds. Malformed messages (not MessagePack, a
missing or mistyped field, tensors that do not add up) raise :class:`WireError`; the
receiver logs and drops them.
"""

from __future__ import annotations

import math
from typing import Annotated, Any, NamedTuple, TypeVar

import msgspec
import numpy as np

from ppipe.runtime.wire.shared_inputs import InputArena, SharedInputError, SharedMaps, SharedRef, process_maps

MAX_TENSORS = 64
MAX_DIMS = 16
MAX_SHARED_ROWS = 4096

M = TypeVar("M", bound=msgspec.Struct)
Dim = Annotated[int, msgspec.Meta(ge=0, lt=2**40)]
Ref = tuple[int, int, int, int]  # SharedRef: pid, fd, serial, offset
TensorSpec = tuple[str, str, Annotated[tuple[Dim, ...], msgspec.Meta(max_length=MAX_DIMS)],
                   Annotated[list[Ref], msgspec.Meta(max_length=MAX_SHARED_ROWS)]]
TensorSpecs = Annotated[list[TensorSpec], msgspec.Meta(max_length=MAX_TENSORS)]


class WireError(ValueError):
    """A message that is not a well-formed data-path message."""


class SharedTensorError(WireError):
    """A well-formed message whose shared tensors this process cannot map: ``header`` is its
    decoded message, so that the receiver can answer for it (fail its batch) rather than drop it."""

    def __init__(self, header: msgspec.Struct, why: str):
        super().__init__(why)
        self.header = header


class Rows(list):
    """A batch's inputs as its rows (arrays of one shape and dtype), stacked on the wire:
    :func:`pack` names where they lie when every row is in its arena, else stacks them."""


class ForwardedRows(NamedTuple):
    """A batch's rows of one input that the sender does not hold (the scheduler forwarding
    what ingresses hold): every row's :class:`~ppipe.runtime.wire.shared_inputs.SharedRef`
    (``refs``), or, where ``refs`` is empty, every row's bytes (``data``, C order).
    :func:`pack` names the refs, or sends the rows' bytes joined; the sender has checked
    that each row holds ``row_shape`` of ``dtype``."""

    dtype: str
    row_shape: tuple[int, ...]
    refs: list[Ref]
    data: list[bytes]


LENGTH = 4  # bytes of each length field
MAX_MESSAGE_BYTES = 2**32 - 1

_encoder = msgspec.msgpack.Encoder()
_decoders: dict[type, msgspec.msgpack.Decoder] = {}


def pack(message: msgspec.Struct, tensors: dict[str, np.ndarray | Rows] | None = None, arena: InputArena | None = None) -> list[Any]:
    """The pieces of one message on a connection, in order: ``bytes`` of the length prefix,
    header length and header, then the inline tensors' buffers (memoryviews of C-contiguous
    arrays; a non-contiguous array is copied first). The views share the arrays' memory:
    an array must not change until its message is sent.

    With ``arena`` (the receiver is on this machine), a tensor that lies in it, or
    :class:`Rows` that all do, is named by where it lies instead of sent."""
    specs, bufs, size = [], [], 0
    for name, arr in (tensors or {}).items():
        if isinstance(arr, ForwardedRows):
            size += _forwarded(name, arr, specs, bufs)
            continue
        shared = _shared_refs(arr, arena)
        if shared:
            first = arr[0] if isinstance(arr, Rows) else arr
            shape = (len(arr), *first.shape) if isinstance(arr, Rows) else arr.shape
            specs.append((name, first.dtype.str, shape, shared))
            continue
        if isinstance(arr, Rows):
            arr = np.expand_dims(arr[0], 0) if len(arr) == 1 else np.stack(arr)  # (a batch of one: a view)
        arr = np.asarray(arr)
        if not arr.flags.c_contiguous:
            arr = arr.copy(order="C")
        specs.append((name, arr.dtype.str, arr.shape, []))
        if arr.size:
            bufs.append(arr.data.cast("B") if arr.ndim else arr.tobytes())
            size += arr.nbytes
    head = _encoder.encode((message, specs))
    n = LENGTH + len(head) + size
    if n > MAX_MESSAGE_BYTES:
        raise WireError(f"a message of {n} bytes exceeds the wire's limit of {MAX_MESSAGE_BYTES}")
    return [n.to_bytes(LENGTH, "little") + len(head).to_bytes(LENGTH, "little") + head, *bufs]


def _forwarded(name: str, rows: ForwardedRows, specs: list, bufs: list) -> int:
    """Add the spec (and the joined bytes) of forwarded rows; the bytes added."""
    shape = (len(rows.refs or rows.data), *rows.row_shape)
    if rows.refs:
        specs.append((name, rows.dtype, shape, rows.refs))
        return 0
    joined = b"".join(rows.data)
    specs.append((name, rows.dtype, shape, []))
    if joined:
        bufs.append(joined)
    return len(joined)


def _shared_refs(arr: np.ndarray | Rows, arena: InputArena | None) -> list[SharedRef]:
    """Where ``arr``'s rows lie in ``arena`` (one ref for an array, one per row of :class:`Rows`),
    or [] where any of them does not."""
    rows = arr if isinstance(arr, Rows) else [arr]
    if arena is None or not all(isinstance(r, np.ndarray) and r.shape == rows[0].shape and r.dtype == rows[0].dtype for r in rows):
        return []
    refs = [arena.locate(r) for r in rows]
    return [] if None in refs else refs


def unpack(message: bytes | memoryview, kind: type[M], maps: SharedMaps | None = None) -> tuple[M, dict[str, np.ndarray]]:
    """``(message, tensors)`` of one message (without its length prefix), its header decoded as
    ``kind``; shared tensors are read from ``maps`` (default: this process's).

    Raises:
        WireError: the header is not MessagePack, not a ``kind`` with a valid tensor list,
            or the tensors' bytes do not add up to the message's length.
        SharedTensorError: a shared tensor cannot be mapped (its ``header`` is the message).
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
        if spec[3]:
            tensors[spec[0]] = _shared_array(header, spec, maps or process_maps())
        else:
            tensors[spec[0]], pos = _array(spec, view, pos)
    if pos != len(view):
        raise WireError(f"message has {len(view) - pos} bytes after its tensors")
    return header, tensors


def _dtype(name: str, dtype: str) -> np.dtype:
    try:
        dt = np.dtype(dtype)
    except TypeError:
        raise WireError(f"tensor '{name}': unknown dtype {dtype!r}") from None
    if dt.hasobject:
        raise WireError(f"tensor '{name}': dtype {dtype!r} holds objects")
    return dt


def _shared_array(header: msgspec.Struct, spec: TensorSpec, maps: SharedMaps) -> np.ndarray:
    """A shared tensor: a view of its one ref, or its rows (one ref each) stacked."""
    name, dtype, shape, refs = spec
    dt = _dtype(name, dtype)
    whole = len(refs) == 1
    if not whole and (not shape or shape[0] != len(refs)):
        raise WireError(f"tensor '{name}': {len(refs)} shared rows for shape {tuple(shape)}")
    row_shape = shape if whole else shape[1:]
    n = math.prod(row_shape) * dt.itemsize
    try:
        rows = [maps.array(SharedRef(*r), n).view(dt).reshape(row_shape) for r in refs]
    except SharedInputError as exc:
        raise SharedTensorError(header, f"tensor '{name}': {exc}") from None
    return rows[0] if whole else np.stack(rows)


def _array(spec: TensorSpec, view: memoryview, pos: int) -> tuple[np.ndarray, int]:
    name, dtype, shape, _ = spec
    dt = _dtype(name, dtype)
    n = math.prod(shape) * dt.itemsize
    if pos + n > len(view):
        raise WireError(f"tensor '{name}': {dtype} {shape} needs {n} bytes, the message has {len(view) - pos} left")
    return np.frombuffer(view[pos : pos + n], dtype=dt).reshape(shape), pos + n
