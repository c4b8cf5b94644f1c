"""TensorRT backend: an engine per block and batch, level 1 timing, MPS levels, per-layer
timing of the whole model.

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
def test_without_tensorrt_the_backend_says_how_to_get_it(make_tiny):
    from ppipe.profiler.graph import analyze, prepare_model
    from ppipe.profiler.trt_backend import TensorRTTimer, layer_times_us

    with pytest.raises(NotAvailableError, match="TensorRT is not installed"):
        TensorRTTimer()
    with pytest.raises(NotAvailableError, match="TensorRT is not installed"):
        layer_times_us(analyze(prepare_model(make_tiny())), gpu_type="L4")


def test_bad_precision_and_mode_are_user_errors(make_tiny):
    from ppipe.errors import UserError
    from ppipe.profiler.graph import analyze, prepare_model
    from ppipe.profiler.trt_backend import TensorRTTimer, layer_times_us

    with pytest.raises(UserError, match="precision 'int8'"):
        TensorRTTimer(precision="int8")
    with pytest.raises(UserError, match="layer timing mode 'unfused'"):
        layer_times_us(analyze(prepare_model(make_tiny())), mode="unfused")


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
    assert len(list((tmp_path / "engines").glob("block_00_*_tf32_b4.plan"))) == 1
    if mps_available():
        assert timer.latency_us(paths[0], 2, 1) > 0
    assert "TensorRT" in timer.provenance()
    timer.close()
    assert onnx.load(str(paths[0])) is not None


@pytest.mark.gpu
@requires_cuda
@pytest.mark.skipif(not HAS_TRT, reason="tensorrt is not installed")
@pytest.mark.parametrize("mode", ["per-node", "fused"])
def test_tensorrt_times_every_layer_of_the_whole_model(make_tiny, mode):
    from ppipe.profiler.graph import analyze, prepare_model
    from ppipe.profiler.layers import NodeIndex
    from ppipe.profiler.trt_backend import layer_times_us

    info = analyze(prepare_model(make_tiny(with_argmax=False, spatial=64)))
    lt = layer_times_us(info, gpu_type="L4", mode=mode, reps=5)
    names = NodeIndex.from_graph(info).names
    assert len(lt.node_us) == len(names) and lt.mode == mode
    t = dict(zip(names, lt.node_us))
    assert all(x >= 0 for x in lt.node_us)
    assert t["conv0"] > 0 and t["conv_a"] > 0 and t["fc"] > 0
    if mode == "per-node":
        # fusion is prevented: the ReLUs run as kernels of their own
        assert t["relu0"] > 0 and t["relu1"] > 0
    assert "TensorRT" in lt.provenance and 0.0 <= lt.fallback_share <= 1.0
