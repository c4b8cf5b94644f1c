"""Stream ordering of the CUDA paths (issue 23): copies are queued on the stream that reads them.

With CuPy >= 13 ``cupy.asarray(numpy_array)`` copies asynchronously on the *current*
stream; a stream made with ``non_blocking=True`` does not wait for the default stream. The
CPU tests run the real code over :mod:`tests.runtime.fake_cupy` (a FAKE that records which
stream each op ran on: it checks the ordering logic, not CUDA). The ``gpu`` tests run the
same paths on a real device with the default stream kept busy, where a copy queued on the
wrong stream would land after the send or the kernel that reads it.
"""

from __future__ import annotations

import asyncio
import ctypes

import numpy as np
import pytest

from ppipe.runtime.workers.transport import EdgeChannel
from tests.runtime.fake_cupy import FakeCupy

STAGING = ("h2d", "astype", "ascontiguousarray", "empty", "copy", "d2h")


class LoopbackLink:
    """Both ends of an edge in one object over any array module: sends are kept, receives pop them."""

    def __init__(self, xp, stream):
        self.xp, self.stream = xp, stream
        self.sent: list = []

    def send(self, buf) -> None:
        if hasattr(self.xp, "record"):
            self.xp.record("send")
        with self.stream:  # like NcclLink: the send runs on the link's stream
            self.sent.append(buf.copy())

    def recv(self, buf) -> None:
        buf[...] = self.sent.pop(0)

    def synchronize(self) -> None:
        self.stream.synchronize()

    def abort(self) -> None:
        pass


def test_channel_stages_header_and_fp16_cast_on_the_link_stream():
    xp = FakeCupy()
    link = LoopbackLink(xp, xp.cuda.Stream(non_blocking=True))
    x = np.arange(24, dtype=np.float32).reshape(2, 3, 4)
    asyncio.run(EdgeChannel(link, "peer", "send").send(0, 7, {"fmap": x}, 0.0))
    assert xp.streams_of(*STAGING, "send") == {link.stream.name}
    assert ("h2d", link.stream.name) in xp.log and ("astype", link.stream.name) in xp.log


def test_channel_receives_into_buffers_taken_on_the_link_stream():
    xp = FakeCupy()
    link = LoopbackLink(xp, xp.cuda.Stream(non_blocking=True))
    x = np.arange(24, dtype=np.float32).reshape(2, 3, 4)
    asyncio.run(EdgeChannel(link, "peer", "send").send(0, 7, {"fmap": x}, 0.0))
    xp.log.clear()
    out, head = asyncio.run(EdgeChannel(link, "peer", "recv").recv(0, 7))
    assert xp.streams_of("empty") == {link.stream.name}
    np.testing.assert_array_equal(np.asarray(out["fmap"]), x.astype(np.float16))


# ---- the TensorRT backend's run_sync over a fake engine -------------------------------------------------
class _FakeTrt:
    class TensorIOMode:
        INPUT, OUTPUT = "input", "output"

    @staticmethod
    def nptype(dtype):
        return dtype


class _DoublingEngine:
    """One input ``x`` (fp32), one output ``y = 2 x``: enough of ICudaEngine for run_sync."""

    num_io_tensors = 2
    _io = {"x": "input", "y": "output"}

    def get_tensor_name(self, j):
        return ("x", "y")[j]

    def get_tensor_dtype(self, name):
        return np.float32

    def get_tensor_mode(self, name):
        return self._io[name]


class _DoublingContext:
    def __init__(self, xp, stream):
        self.xp, self.stream, self.shape, self.ptr = xp, stream, None, {}

    def set_input_shape(self, name, shape):
        self.shape = tuple(shape)
        return True

    def get_tensor_shape(self, name):
        return self.shape

    def set_tensor_address(self, name, ptr):
        self.ptr[name] = ptr

    def execute_async_v3(self, stream_ptr):
        self.xp.record("execute")
        assert stream_ptr == self.stream.ptr
        n = int(np.prod(self.shape))
        view = lambda p: np.ctypeslib.as_array(ctypes.cast(p, ctypes.POINTER(ctypes.c_float)), (n,))  # noqa: E731
        view(self.ptr["y"])[:] = 2 * view(self.ptr["x"])
        return True


def _fake_trt_backend(xp):
    from ppipe.runtime.workers.backends import TensorRTBackend

    be = object.__new__(TensorRTBackend)  # skips the engine build: the run path is what is tested
    be.cp, be.trt, be.keep, be.max_batch, be._buffers = xp, _FakeTrt, None, 8, {}
    be.stream = xp.cuda.Stream(non_blocking=True)
    be.engines, be.contexts = [_DoublingEngine()], [_DoublingContext(xp, be.stream)]
    return be


@pytest.mark.parametrize("device_out", [False, True])
def test_tensorrt_backend_copies_inputs_and_outputs_on_its_own_stream(device_out):
    xp = FakeCupy()
    be = _fake_trt_backend(xp)
    x = np.arange(6, dtype=np.float64).reshape(2, 3)  # fp64: run_sync must cast to the engine's fp32
    out = be.run_sync({"x": x}, device_out=device_out)
    assert xp.streams_of(*STAGING, "execute") == {be.stream.name}
    assert ("h2d", be.stream.name) in xp.log and ("synchronize", be.stream.name) == xp.log[-1]
    np.testing.assert_array_equal(np.asarray(out["y"]), 2 * x)


# ---- on a GPU: the default stream is kept busy while the link's stream sends -------------------------------
def _cupy_device() -> bool:
    try:
        import cupy

        return cupy.cuda.runtime.getDeviceCount() > 0
    except Exception:
        return False


def _busy_default_stream(cp, rounds: int = 40) -> None:
    """Queue ~100 ms of matrix products on CuPy's default stream (not waited for)."""
    a = cp.ones((4096, 4096), dtype=cp.float32)
    with cp.cuda.Stream.null:
        for _ in range(rounds):
            a = a @ a * (1.0 / 4096)


@pytest.mark.gpu
@pytest.mark.skipif(not _cupy_device(), reason="needs CuPy and a CUDA device")
def test_on_a_gpu_a_send_carries_the_bytes_while_the_default_stream_is_busy():
    import cupy as cp

    link = LoopbackLink(cp, cp.cuda.Stream(non_blocking=True))
    rng = np.random.default_rng(0)
    xs = [rng.standard_normal((8, 64, 56, 56), dtype=np.float32) for _ in range(3)]

    async def round_trip():
        send, recv = EdgeChannel(link, "peer", "send"), EdgeChannel(link, "peer", "recv")
        for seq, x in enumerate(xs):
            _busy_default_stream(cp)  # a host copy queued on the default stream would land late
            await send.send(seq, 100 + seq, {"fmap": x}, 0.0)
        return [await recv.recv(seq, 100 + seq) for seq in range(len(xs))]

    for (out, head), x in zip(asyncio.run(round_trip()), xs):
        np.testing.assert_array_equal(cp.asnumpy(out["fmap"]), x.astype(np.float16))
    cp.cuda.Device().synchronize()
