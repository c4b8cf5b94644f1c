"""TensorRT backend: an engine per block and batch, level 1 timing, MPS levels.

Skipped without CUDA; without tensorrt installed the backend must say so (NotAvailableError)."""

from __future__ import annotations

import importlib.util

import pytest

from ppipe.errors import NotAvailableError



def _has_cuda() -> bool:  # same probe as tests/conftest.py's requires_cuda
    try:
        import ctypes

        ctypes.CDLL("libcuda.so.1")
        return True
    except OSError:
        return False


requires_cuda = pytest.mark.skipif(not _has_cuda(), reason="needs an NVIDIA GPU with CUDA (none on this machine)")

HAS_TRT = importlib.util.find_spec("tensorrt") is not None


@pytest.mark.skipif(HAS_TRT, reason="tensorrt is installed here")
def test_without_tensorrt_the_backend_says_how_to_get_it():
    from ppipe.profiler.trt_backend import TensorRTTimer

    with pytest.raises(NotAvailableError, match="TensorRT is not installed"):
        TensorRTTimer()


@pytest.mark.gpu
@requires_cuda
@pytest.mark.skipif(not HAS_TRT, reason="tensorrt is not installed")
def test_tensorrt_times_a_block_at_two_batches(tmp_path, make_tiny):
    import onnx

    from ppipe.profiler.blocks import partition, write_blocks
    from ppipe.profiler.graph import analyze, prepare_model
    from ppipe.profiler.trt_backend import TensorRTTimer, mps_available

    info = analyze(prepare_model(make_tiny(with_argmax=False)))
    paths = write_blocks(info, partition(info, None, 2), tmp_path, "tiny")
    timer = TensorRTTimer(reps=5, engine_dir=tmp_path / "engines")
    t1 = timer.latency_us(paths[0], 1, 1)
    t4 = timer.latency_us(paths[0], 1, 4)
    assert 0 < t1 < 1e6 and 0 < t4 < 1e6
    assert (tmp_path / "engines" / "block_00_b4.plan").is_file()
    if mps_available():
        assert timer.latency_us(paths[0], 2, 1) > 0
    assert "TensorRT" in timer.provenance()
    timer.close()
    assert onnx.load(str(paths[0])) is not None
