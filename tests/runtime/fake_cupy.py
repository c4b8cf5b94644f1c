"""A FAKE of the few CuPy calls the backends and the transport make: NOT CuPy, no GPU.

It records, for each array operation that would queue GPU work (a host to device copy, a
cast, a contiguous copy, an allocation, a device to host copy), which stream was current
when it ran. Tests use it to check *ordering logic*: that the copies are queued on the
stream that later reads them. It proves nothing about CUDA itself; the ``gpu`` tests do.
Arrays are NumPy arrays of a subclass, so the arithmetic is NumPy's.
"""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np


class FakeStream:
    """A named stream; ``with stream:`` makes it current, like ``cupy.cuda.Stream``."""

    def __init__(self, xp: "FakeCupy", name: str):
        self.xp, self.name = xp, name
        self.ptr = id(self)

    def __enter__(self) -> "FakeStream":
        self.xp._current.append(self)
        return self

    def __exit__(self, *exc) -> None:
        self.xp._current.pop()

    def synchronize(self) -> None:
        self.xp.log.append(("synchronize", self.name))


class FakeDeviceArray(np.ndarray):
    """A NumPy array standing for a device array; ops that would queue work are logged."""

    _xp: "FakeCupy | None" = None

    @property
    def data(self):  # cupy.ndarray.data.ptr
        return SimpleNamespace(ptr=self.ctypes.data)

    def astype(self, dtype, copy=True, **kw):
        self._xp.record("astype")
        return np.ndarray.astype(self, dtype, copy=copy, **kw)

    def copy(self, order="C"):
        self._xp.record("copy")
        return np.ndarray.copy(self, order)


class FakeCupy:
    """Module-like: ``asarray``, ``ascontiguousarray``, ``empty``, ``asnumpy``, ``cuda.Stream``."""

    uint8, float16, float32 = np.uint8, np.float16, np.float32

    def __init__(self):
        self.log: list[tuple[str, str]] = []
        self.null = FakeStream(self, "null")  # CuPy's default current stream
        self._current = [self.null]
        self._n = 0
        self.cuda = SimpleNamespace(Stream=self._stream)
        FakeDeviceArray._xp = self

    def _stream(self, non_blocking: bool = False) -> FakeStream:
        self._n += 1
        return FakeStream(self, f"stream{self._n}")

    @property
    def current(self) -> str:
        return self._current[-1].name

    def record(self, op: str) -> None:
        self.log.append((op, self.current))

    def streams_of(self, *ops: str) -> set[str]:
        """The streams that the logged ops named ``ops`` ran on."""
        return {s for op, s in self.log if op in ops}

    def asarray(self, a, dtype=None):
        if isinstance(a, FakeDeviceArray) and dtype in (None, a.dtype):
            return a  # already on the device: no copy, no work queued
        self.record("h2d")
        return np.array(a, dtype=dtype).view(FakeDeviceArray)

    def ascontiguousarray(self, a):
        self.record("ascontiguousarray")
        return np.ascontiguousarray(a).view(FakeDeviceArray)

    def empty(self, shape, dtype=np.float32):
        self.record("empty")
        return np.empty(shape, dtype=dtype).view(FakeDeviceArray)

    def asnumpy(self, a, stream=None):
        self.record("d2h")
        return np.array(a).view(np.ndarray)
