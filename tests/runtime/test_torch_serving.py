"""The torch serving backend (issue 23) on the CPU: same answers as onnxruntime; GPU tier below.

Skipped where torch is not installed (CI's ``.[test]`` does not pull it).
"""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="torch is not installed (pip install '.[torch]'); CI's .[test] does not pull it")


def _x(n=3):
    return np.random.default_rng(2).standard_normal((n, 3, 8, 8)).astype(np.float32)


def test_torch_partitions_answer_like_ort_partitions(tinynet):
    from ppipe.runtime.workers.backends import OrtBackend, make_backend

    x = _x()
    want = OrtBackend(tinynet, "cpu", 1, 0, 2).run_sync({"input": x})["logits"]
    up = make_backend("torch", tinynet, "cpu", 1, 0, 0)
    down = make_backend("torch", tinynet, "cpu", 1, 1, 2)
    mid = up.run_sync({"input": x})
    assert not up.gpu_resident and all(v.dtype == np.float32 for v in mid.values())
    fp16 = {k: v.astype(np.float16) for k, v in mid.items()}  # what crosses partitions
    got = down.run_sync(fp16)["logits"]
    assert got.dtype == np.float32
    np.testing.assert_allclose(got, want, rtol=2e-2, atol=2e-2)


def test_a_partition_knows_the_inputs_it_is_sent_and_runs_on_zeros_of_them(tinynet):
    from ppipe.runtime.workers.backends import keep_after, make_backend
    from ppipe.runtime.workers.torch_backend import TorchBackend

    first = TorchBackend(tinynet, "cpu", 1, 0, 0)
    assert first.inputs == {"input": ((3, 8, 8), np.dtype(np.float32))}
    for cut in range(tinynet.num_blocks - 1):
        down = TorchBackend(tinynet, "cpu", 1, cut + 1, tinynet.num_blocks - 1)
        sent = make_backend("torch", tinynet, "cpu", 1, 0, cut).run_sync({"input": _x(2)})
        assert set(down.inputs) == set(keep_after(tinynet, cut)) == set(sent)
        for name, (shape, dtype) in down.inputs.items():
            assert shape == sent[name].shape[1:] and dtype == np.float16  # feature maps cross in fp16
        zeros = {n: np.zeros((2, *shape), dtype) for n, (shape, dtype) in down.inputs.items()}
        assert down.run_sync(zeros)["logits"].shape == (2, *tinynet.manifest.outputs[0].shape)


def test_a_gpu_pool_without_cuda_is_refused_naming_the_fix(tinynet, monkeypatch):
    from ppipe.errors import NotAvailableError
    from ppipe.runtime.workers.torch_backend import TorchBackend

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(NotAvailableError, match="torch sees no CUDA device"):
        TorchBackend(tinynet, "L4", 1, 0, 2)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA build of torch and a GPU")
def test_on_a_gpu_fp16_partitions_answer_like_the_cpu(tinynet):
    from ppipe.runtime.workers.backends import OrtBackend
    from ppipe.runtime.workers.torch_backend import TorchBackend

    x = _x(8)
    want = OrtBackend(tinynet, "cpu", 1, 0, 2).run_sync({"input": x})["logits"]
    up, down = TorchBackend(tinynet, "L4", 1, 0, 0, precision="fp16"), TorchBackend(tinynet, "L4", 1, 1, 2, precision="fp16")
    assert up.gpu_resident and up.modules[0].dtype == torch.float16
    got = down.run_sync(up.run_sync({"input": x}))["logits"]
    np.testing.assert_allclose(got, want, rtol=5e-2, atol=5e-2)
    assert (got.argmax(1) == want.argmax(1)).mean() >= 0.75


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA build of torch and a GPU")
def test_on_a_gpu_device_outputs_and_inputs_go_through_cupy_unchanged(tinynet):
    cp = pytest.importorskip("cupy", reason="device outputs for NCCL need CuPy")
    from ppipe.runtime.workers.torch_backend import TorchBackend

    x = _x(4)
    up, down = TorchBackend(tinynet, "L4", 1, 0, 0, precision="fp16"), TorchBackend(tinynet, "L4", 1, 1, 2, precision="fp16")
    assert up.device_outputs and down.accepts_device
    host = up.run_sync({"input": x})
    dev = up.run_sync({"input": x}, device_out=True)
    assert all(isinstance(v, cp.ndarray) for v in dev.values())
    for k in host:
        np.testing.assert_array_equal(cp.asnumpy(dev[k]), host[k])
    np.testing.assert_array_equal(down.run_sync(dev)["logits"], down.run_sync(host)["logits"])


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA build of torch and a GPU")
def test_on_a_gpu_graph_replays_answer_like_eager_runs_at_every_batch_size_in_any_order(tinynet, monkeypatch):
    cp = pytest.importorskip("cupy", reason="device outputs for NCCL need CuPy")
    from ppipe.profiler.cuda_graph import ENV_SWITCH
    from ppipe.runtime.workers.torch_backend import TorchBackend

    graphed = TorchBackend(tinynet, "L4", 1, 0, 0, precision="fp32")
    monkeypatch.setenv(ENV_SWITCH, "0")
    eager = TorchBackend(tinynet, "L4", 1, 0, 0, precision="fp32")
    assert graphed.graphs is not None and eager.graphs is None
    xs = [_x(n) for n in (4, 2, 4, 8, 2)]  # a shape seen before is replayed, not captured again
    for x in xs:
        got, want = graphed.run_sync({"input": x}), eager.run_sync({"input": x})
        for k in want:
            np.testing.assert_allclose(got[k], want[k], rtol=1e-4, atol=1e-4)
    assert len(graphed.graphs) == 3
    a, b = graphed.run_sync({"input": xs[0]}, device_out=True), graphed.run_sync({"input": xs[2] * 2}, device_out=True)
    host_a = graphed.run_sync({"input": xs[0]})
    for k in a:  # a device output keeps its values after the next replay
        np.testing.assert_array_equal(cp.asnumpy(a[k]), host_a[k])
        assert not np.array_equal(cp.asnumpy(b[k]), host_a[k])


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA build of torch and a GPU")
def test_on_a_gpu_a_warmed_partition_has_every_batch_captured_before_the_first_request(tinynet):
    from ppipe.runtime.workers.backends import make_backend

    down = make_backend("torch", tinynet, "L4", 1, 1, 2, opt_batch=4, precision="fp16")
    assert len(down.graphs) == 4
    up = make_backend("torch", tinynet, "L4", 1, 0, 0, opt_batch=4, precision="fp16")
    for n in (3, 1, 4):
        down.run_sync({k: v.astype(np.float16) for k, v in up.run_sync({"input": _x(n)}).items()})
    assert len(down.graphs) == 4 and len(up.graphs) == 4  # the requests found their graphs captured
