"""CUDA graph replays of block sub-models (issue 23): the switch and keys on the CPU; captures with -m gpu."""

from __future__ import annotations

import numpy as np
import pytest

from ppipe.profiler.cuda_graph import ENV_SWITCH, graphs_enabled, shape_key

try:
    import torch
except ImportError:  # the switch and the keys need no torch; the captures below do
    torch = None
needs_gpu = pytest.mark.skipif(torch is None or not torch.cuda.is_available(), reason="needs a CUDA build of torch and a GPU")


def test_graphs_are_on_for_cuda_devices_only_and_switched_off_by_the_environment(monkeypatch):
    monkeypatch.delenv(ENV_SWITCH, raising=False)
    assert graphs_enabled("cuda") and graphs_enabled("cuda:1") and not graphs_enabled("cpu")
    if torch is not None:
        assert graphs_enabled(torch.device("cuda", 0)) and not graphs_enabled(torch.device("cpu"))
    for off in ("0", "false", "off"):
        monkeypatch.setenv(ENV_SWITCH, off)
        assert not graphs_enabled("cuda")
    monkeypatch.setenv(ENV_SWITCH, "1")
    assert graphs_enabled("cuda")


def test_a_capture_key_tells_batch_sizes_and_dtypes_apart_whatever_the_array_type():
    a = {"x": np.zeros((4, 3, 8, 8), np.float32)}
    assert shape_key(a) == shape_key({"x": np.ones((4, 3, 8, 8), np.float32)})
    assert shape_key(a) != shape_key({"x": np.zeros((2, 3, 8, 8), np.float32)})
    assert shape_key(a) != shape_key({"x": np.zeros((4, 3, 8, 8), np.float16)})
    assert shape_key({"x": a["x"], "y": a["x"]}) == shape_key({"y": a["x"], "x": a["x"]})


@pytest.mark.gpu
@needs_gpu
def test_on_a_gpu_a_replay_computes_on_the_new_inputs_and_matches_an_eager_run(tmp_path, make_tiny):
    import onnx

    from ppipe.profiler.cuda_graph import GraphedRun
    from ppipe.profiler.torch_backend import load_block

    path = tmp_path / "tiny.onnx"
    onnx.save(make_tiny(with_argmax=False, spatial=16), str(path))
    module = load_block(path, "cuda", "fp32")
    (name, shape, _dtype), = module.input_specs
    rng = np.random.default_rng(0)
    xs = [torch.as_tensor(rng.standard_normal((4, *shape)).astype(np.float32), device="cuda") for _ in range(3)]
    run = GraphedRun(torch, module, {name: xs[0]})
    for x in xs[1:] + xs[:1]:
        got = {k: v.clone() for k, v in run({name: x}).items()}
        want = module({name: x})
        for k in want:
            torch.testing.assert_close(got[k], want[k], rtol=1e-4, atol=1e-4)
