"""The torch backend (issue 23): ONNX blocks run by PyTorch, timed per level; CPU tier.

Skipped where torch is not installed: CI installs ``.[test]``, which does not pull torch
(``pip install '.[torch]'`` adds it). The GPU behaviour (fp16, CUDA events, MPS or
time-sliced levels) is exercised by ``scripts/gpu_check.sh`` and the ``gpu`` tests.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from ppipe.errors import NotAvailableError
from tests.profiler.conftest import tiny_residual_model

torch = pytest.importorskip("torch", reason="torch is not installed (pip install '.[torch]'); CI's .[test] does not pull it")


def _ort(model, feeds):
    import onnxruntime as ort

    sess = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    return sess.run(None, feeds)


def test_a_graph_runs_like_onnxruntime():
    from ppipe.profiler.onnx_torch import OnnxTorchModule

    model = tiny_residual_model(with_argmax=False)
    x = np.random.default_rng(1).standard_normal((3, 3, 8, 8)).astype(np.float32)
    want = _ort(model, {"x": x})[0]
    got = OnnxTorchModule(model)({"x": x})["logits"].numpy()
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


def test_an_operator_it_lacks_is_refused_at_load_by_name():
    from ppipe.profiler.onnx_torch import OnnxTorchModule

    with pytest.raises(NotAvailableError, match="ArgMax"):
        OnnxTorchModule(tiny_residual_model(with_argmax=True))


def test_builtin_resnet50_blocks_chained_in_torch_answer_like_the_whole_model():
    from ppipe.profiler import ensure_block_models, ensure_reference_model
    from ppipe.profiler.onnx_torch import OnnxTorchModule
    from ppipe.spec.profile import load_profile

    repo = Path(__file__).resolve().parents[2]
    profile = load_profile(repo / "models" / "resnet50")
    x = np.random.default_rng(0).standard_normal((2, 3, 224, 224)).astype(np.float32)
    import onnx

    ref = onnx.load(str(ensure_reference_model(profile)))
    want = _ort(ref, {ref.graph.input[0].name: x})[0]
    env = {ref.graph.input[0].name: x}
    for path in ensure_block_models(profile):
        env.update(OnnxTorchModule(path)(env))
    got = env[ref.graph.output[0].name].numpy()
    assert (got.argmax(1) == want.argmax(1)).all()
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5)


def test_timer_levels_run_v_processes_and_say_how_they_share(tmp_path):
    import onnx

    from ppipe.profiler.torch_backend import TorchTimer

    path = tmp_path / "tiny.onnx"
    onnx.save(tiny_residual_model(with_argmax=False), str(path))
    timer = TorchTimer(device="cpu", reps=3, warmup=1)
    try:
        assert timer.latency_us(path, 1, 2) > 0
        assert timer.latency_us(path, 2, 1) > 0  # two spawned processes, released by one barrier
        assert len(timer._pools[2].procs) == 2
    finally:
        timer.close()
    assert "cores/v" in timer.provenance() and "MPS" not in timer.provenance()
    with pytest.raises(Exception, match="fp16 runs on CUDA only"):
        TorchTimer(device="cpu", precision="fp16")


def test_layer_times_cover_every_named_node():
    from ppipe.profiler.torch_backend import layer_times_us

    names = ["conv0", "relu0", "conv_a", "conv_b", "add", "relu1", "gap", "flatten", "fc", "absent"]
    times, prov = layer_times_us(tiny_residual_model(with_argmax=False), names, device="cpu", runs=2)
    assert len(times) == len(names) and times[-1] == 0.0
    assert all(t > 0 for t in times[:-1]) and "no fusion" in prov


def test_ppipe_profile_backend_torch_measures_blocks_and_layers_and_says_so(tmp_path):
    import onnx
    from click.testing import CliRunner

    from ppipe.cli import main
    from ppipe.spec.profile import load_profile

    src = tmp_path / "tiny.onnx"
    onnx.save(tiny_residual_model(with_argmax=False), str(src))
    out = tmp_path / "prof"
    args = ["profile", str(src), "-o", str(out), "--backend", "torch", "--blocks", "2", "--batches", "1,2", "--cpu-levels", "1", "--reps", "2", "--no-progress"]
    res = CliRunner().invoke(main, args)
    assert res.exit_code == 0, res.output
    prof = load_profile(out)
    assert len(prof.table) == 2 * 2 and prof.manifest.provenance["cpu"].startswith("measured: PyTorch")
    assert "no fusion" in prof.manifest.layers.gpus["cpu"].provenance


def test_ppipe_profile_backend_torch_names_an_operator_it_lacks(tmp_path):
    import onnx
    from click.testing import CliRunner

    from ppipe.cli import main

    src = tmp_path / "tiny.onnx"
    onnx.save(tiny_residual_model(with_argmax=True), str(src))
    res = CliRunner().invoke(main, ["profile", str(src), "-o", str(tmp_path / "o"), "--backend", "torch", "--no-progress"])
    assert res.exit_code != 0 and "ArgMax" in res.output and "--backend ort" in res.output


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA build of torch and a GPU")
def test_on_a_gpu_levels_are_timed_with_cuda_events_and_called_what_they_are(tmp_path):
    import onnx

    from ppipe.profiler.torch_backend import MPS, TorchTimer, sharing_mode

    path = tmp_path / "tiny.onnx"
    onnx.save(tiny_residual_model(with_argmax=False, spatial=64), str(path))
    timer = TorchTimer(reps=5, warmup=2, precision="fp16")  # one CUDA graph replay per run
    try:
        one, two = timer.latency_us(path, 1, 4), timer.latency_us(path, 2, 4)
    finally:
        timer.close()
    assert one > 0 and two > 0
    if sharing_mode("cuda") != MPS:
        # time-sliced, two processes take turns on the whole GPU: a level-2 run takes about twice as long
        # (under MPS a block this small fits in half the SMs, and no such bound holds)
        assert two > 1.5 * one
    prov = timer.provenance()
    assert "CUDA events" in prov and "fp16" in prov
    assert ("under MPS" in prov) == (sharing_mode("cuda") == MPS) and ("time-sliced" in prov) == (sharing_mode("cuda") != MPS)
