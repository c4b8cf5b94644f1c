"""`ppipe profile` end to end on small models: output files, resume, estimates plumbing,
bad inputs (exit code 2), and deterministic regeneration of built-in block models."""

from __future__ import annotations


import pytest
from click.testing import CliRunner

from ppipe.cli import main
from ppipe.profiler import ort_backend
from ppipe.profiler.run import ProfileRequest, batch_grid, parse_batches, profile_model
from ppipe.spec import load_profile


_REAL_LATENCY_US = ort_backend.BlockTimer.latency_us


def _count_measurements(monkeypatch, fail_after=None):
    calls = []
    real = _REAL_LATENCY_US

    def counting(self, path, level, batch):
        if fail_after is not None and len(calls) >= fail_after:
            raise KeyboardInterrupt("simulated interruption")
        calls.append((str(path), level, batch))
        return real(self, path, level, batch)

    monkeypatch.setattr(ort_backend.BlockTimer, "latency_us", counting)
    return calls


def test_batch_grid_follows_the_paper():
    assert batch_grid(range(1, 9), [1, 2, 3, 4]) == {1: list(range(1, 9)), 2: [1, 2, 3, 4], 3: [1, 2], 4: [1, 2]}
    assert parse_batches("1-3,8") == [1, 2, 3, 8]


def test_profile_writes_a_loadable_profile(tiny_onnx, tmp_path):
    out = tmp_path / "tiny"
    res = CliRunner().invoke(
        main, ["profile", str(tiny_onnx), "-o", str(out), "--blocks", "3", "--batches", "1-3", "--reps", "2", "--threads", "2", "--no-progress"]
    )
    assert res.exit_code == 0, res.output
    prof = load_profile(out)
    assert prof.num_blocks == 3 and prof.gpus() == ["cpu"]
    assert prof.levels("cpu") == [1, 2]
    assert prof.batches("cpu", 1) == (1, 2, 3) and prof.batches("cpu", 2) == (1, 2, 3)
    assert len(prof.table) == 3 * (3 + 3)
    assert prof.manifest.input.shape == [3, 8, 8]
    assert prof.manifest.latency_bs1_us["cpu"] == pytest.approx(prof.model_latency_us("cpu"), rel=1e-6)
    assert "onnxruntime" in prof.manifest.provenance["cpu"] and "1/v of the intra-op threads" in prof.manifest.provenance["cpu"]
    # a user's model keeps its block files next to model.yaml
    paths = [prof.block_onnx_path(i) for i in range(3)]
    assert all(p.is_file() and p.parent == out / "blocks" for p in paths)
    assert prof.manifest.blocks[-1].out_bytes_per_sample == 5 * 2 + 4
    assert not (out / "profile.partial.csv").exists()
    # the CPU per-layer timings that cut the model are in layers.csv, op types from the graph
    assert prof.layers.gpus() == ["cpu"] and prof.manifest.layers.gpus["cpu"].method.value == "ort-optimized"
    assert prof.layers.op_types()["conv_a"] == "Conv" and prof.layers.op_types()["argmax"] == "ArgMax"
    assert prof.layers.nodes()[0] == "conv0" and len(prof.layers.nodes()) == 10
    assert [prof.layers.node_blocks[b.last_node] for b in prof.manifest.blocks] == [0, 1, 2]
    assert sum(prof.layers.latency_us("cpu").values()) > 0
    assert "layers.csv (cpu)" in res.output


def test_profile_resumes_after_an_interruption(tiny_onnx, tmp_path, monkeypatch):
    out = tmp_path / "tiny"
    req = ProfileRequest(onnx_path=tiny_onnx, out_dir=out, num_blocks=2, batches=[1, 2], reps=1, threads=2)
    total = 2 * (2 + 2)  # blocks x (batches at level 1 + at level 2)
    calls = _count_measurements(monkeypatch, fail_after=3)
    with pytest.raises(KeyboardInterrupt):
        profile_model(req, progress=False)
    assert len(calls) == 3
    assert (out / "profile.partial.csv").is_file() and (out / "model.yaml").is_file()
    layers_before = (out / "layers.csv").read_text()
    calls = _count_measurements(monkeypatch)
    retimed = []
    monkeypatch.setattr(ort_backend, "layer_times_us", lambda *a, **k: retimed.append(1) or [])
    prof = profile_model(req, progress=False)
    assert len(calls) == total - 3  # only what was missing
    assert len(prof.table) == total
    assert not retimed and (out / "layers.csv").read_text() == layers_before  # the layers are not timed again
    # a run that measures nothing keeps the record of the run that measured the rows
    before = prof.manifest.provenance["cpu"]
    monkeypatch.setattr(ort_backend, "provenance", lambda *a, **k: "measured: by another onnxruntime")
    assert profile_model(req, progress=False).manifest.provenance["cpu"] == before
    # a third run, with batch 3 added, measures only batch 3 (at levels 1 and 2)
    calls = _count_measurements(monkeypatch)
    prof = profile_model(ProfileRequest(onnx_path=tiny_onnx, out_dir=out, num_blocks=2, batches=[1, 2, 3], reps=1, threads=2), progress=False)
    assert sorted(c[1:] for c in calls) == [(1, 3), (1, 3), (2, 3), (2, 3)]
    assert len(load_profile(out).table) == total + 4
    assert prof.manifest.provenance["cpu"] == "measured: by another onnxruntime"  # it measured


def test_estimates_are_added_for_absent_gpu_types(tiny_onnx, tmp_path, monkeypatch):
    seen = {}

    def roofline_table(block_onnx_paths, gpus, levels_by_gpu, batches_by_level):
        seen.update(paths=block_onnx_paths, gpus=gpus, levels=levels_by_gpu, batches=batches_by_level)
        return {
            (g, v, b, blk): 10.0 * (blk + 1) * b / (1 if g == "L4" else 2) * v
            for g in gpus for v in levels_by_gpu[g] for b in batches_by_level[v] for blk in range(len(block_onnx_paths))
        }

    monkeypatch.setattr("ppipe.profiler.estimate.roofline_table", roofline_table)
    out = tmp_path / "tiny"
    req = ProfileRequest(onnx_path=tiny_onnx, out_dir=out, num_blocks=2, batches=list(range(1, 9)), measure=None, estimate=["L4", "T4"], threads=2)
    prof = profile_model(req, progress=False)
    assert seen["gpus"] == ["L4", "T4"] and seen["levels"] == {"L4": [1, 2, 3, 4], "T4": [1, 2, 3, 4]}
    assert seen["batches"] == {1: list(range(1, 9)), 2: [1, 2, 3, 4], 3: [1, 2], 4: [1, 2]}
    assert all(str(p).endswith(".onnx") for p in seen["paths"]) and len(seen["paths"]) == 2
    assert prof.gpus() == ["L4", "T4"]
    assert prof.block_latency_us("T4", 2, 4, 1) == pytest.approx(10.0 * 2 * 4 / 2 * 2)
    assert prof.manifest.provenance["L4"].startswith("estimated")
    # measuring the CPU afterwards keeps the estimates and their provenance
    prof = profile_model(ProfileRequest(onnx_path=tiny_onnx, out_dir=out, num_blocks=2, batches=[1], reps=1, threads=2), progress=False)
    assert prof.gpus() == ["L4", "T4", "cpu"] and prof.manifest.provenance["T4"].startswith("estimated")


def test_not_onnx_exits_2(tmp_path):
    bad = tmp_path / "model.onnx"
    bad.write_text("this is not a protobuf")
    res = CliRunner().invoke(main, ["profile", str(bad), "-o", str(tmp_path / "o")])
    assert res.exit_code == 2
    assert "not a readable ONNX model" in res.output and "Traceback" not in res.output


def test_dynamic_shapes_without_input_shape_exit_2(make_tiny, tmp_path):
    import onnx
    from onnx import TensorProto, helper

    m = make_tiny()
    m.graph.input[0].CopyFrom(helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 3, "H", "W"]))
    p = tmp_path / "dyn.onnx"
    onnx.save(m, str(p))
    res = CliRunner().invoke(main, ["profile", str(p), "-o", str(tmp_path / "o")])
    assert res.exit_code == 2 and "--input-shape" in res.output
    res = CliRunner().invoke(
        main, ["profile", str(p), "-o", str(tmp_path / "o"), "--input-shape", "3,8,8", "--blocks", "2", "--batches", "1", "--reps", "1", "--no-progress"]
    )
    assert res.exit_code == 0, res.output


def test_an_op_the_backend_cannot_run_exits_2(make_tiny, tmp_path):
    import onnx
    from onnx import helper

    m = make_tiny(with_argmax=False)
    relu = next(n for n in m.graph.node if n.name == "relu1")
    relu.op_type, relu.domain = "FancyRelu", "com.example"
    m.opset_import.append(helper.make_opsetid("com.example", 1))
    p = tmp_path / "custom.onnx"
    onnx.save(m, str(p))
    res = CliRunner().invoke(main, ["profile", str(p), "-o", str(tmp_path / "o"), "--blocks", "2"])
    assert res.exit_code == 2, res.output
    assert "error:" in res.output and "Traceback" not in res.output


def test_bad_flags_exit_2(tmp_path):
    runner = CliRunner()
    assert runner.invoke(main, ["profile"]).exit_code == 2
    assert runner.invoke(main, ["profile", "--builtin", "resnet5"]).exit_code == 2
    assert "did you mean 'resnet50'" in runner.invoke(main, ["profile", "--builtin", "resnet5"]).output
    assert runner.invoke(main, ["profile", "--builtin", "squeezenet", "--batches", "0-3"]).exit_code == 2
    assert runner.invoke(main, ["profile", "--builtin", "squeezenet", "--gpu-levels", "5"]).exit_code == 2


def test_builtin_blocks_regenerate_deterministically(tmp_path):
    from ppipe.profiler import ensure_block_models
    from ppipe.profiler.blocks import ensure_reference_model, input_spec, make_input, run_blocks

    out = tmp_path / "sq"
    prof = profile_model(
        ProfileRequest(builtin="squeezenet", out_dir=out, num_blocks=4, batches=[1], reps=1, threads=2, cpu_levels=(1,)), progress=False
    )
    assert prof.manifest.source.kind == "builtin" and prof.manifest.source.weights_seed == 0
    assert all(b.onnx is None for b in prof.manifest.blocks)  # not written next to model.yaml
    loaded = load_profile(out)
    a = ensure_block_models(loaded, tmp_path / "a")
    b = ensure_block_models(loaded, tmp_path / "b")
    assert len(a) == 4 and [p.read_bytes() for p in a] == [p.read_bytes() for p in b]
    # the default cache ($PPIPE_CACHE/<name>) was filled by the profiler itself and is reused
    c = ensure_block_models(loaded)
    assert c[0].parent.name == "squeezenet"
    assert [p.read_bytes() for p in c] == [p.read_bytes() for p in a]
    # and the regenerated blocks reproduce the reference model
    import numpy as np

    from ppipe.profiler.ort_backend import make_session as _session

    spec = input_spec(loaded)
    x = make_input(spec.shape, 2, seed=5)
    ref_sess = _session(ensure_reference_model(loaded, tmp_path / "a"), 1)
    ref = ref_sess.run(None, {spec.name: x})[0]
    got = run_blocks(a, {spec.name: x})[loaded.manifest.outputs[0].name]
    assert np.abs(got - ref).max() <= 1e-4 * np.abs(ref).max()


def test_estimate_from_a_measured_type_uses_the_cross_gpu_model(tiny_onnx, tmp_path, monkeypatch):
    calls = []

    def cross_gpu_table(profile, source_gpu, target_gpu, *, levels=None, batches_by_level=None, **_kw):
        calls.append((source_gpu, target_gpu, list(levels), dict(batches_by_level)))
        # e.g. "the target is 3x faster than the source", block by block
        return {
            (target_gpu, v, b, blk): profile.block_latency_us(source_gpu, 1, b, blk) / 3.0
            for v in levels for b in batches_by_level[v] for blk in range(profile.num_blocks)
        }

    monkeypatch.setattr("ppipe.profiler.estimate.cross_gpu_table", cross_gpu_table)
    out = tmp_path / "tiny"
    req = ProfileRequest(
        onnx_path=tiny_onnx, out_dir=out, num_blocks=2, batches=[1, 2], reps=1, threads=2, cpu_levels=(1,),
        estimate=["L4"], estimate_from="cpu", gpu_levels=(1, 2),
    )
    prof = profile_model(req, progress=False)
    assert calls == [("cpu", "L4", [1, 2], {1: [1, 2], 2: [1, 2]})]
    assert prof.block_latency_us("L4", 2, 2, 1) == pytest.approx(prof.block_latency_us("cpu", 1, 2, 1) / 3.0, rel=1e-3)
    assert "cross-GPU" in prof.manifest.provenance["L4"]


def test_roofline_estimates_with_the_real_estimator(tiny_onnx, tmp_path):
    res = CliRunner().invoke(
        main,
        ["profile", str(tiny_onnx), "-o", str(tmp_path / "t"), "--blocks", "2", "--measure", "none", "--estimate", "L4,T4", "--no-progress"],
    )
    assert res.exit_code == 0, res.output
    prof = load_profile(tmp_path / "t")
    assert prof.gpus() == ["L4", "T4"] and prof.levels("T4") == [1, 2, 3, 4]
    assert prof.batches("L4", 1) == tuple(range(1, 9)) and prof.batches("L4", 3) == (1, 2)
    assert prof.manifest.provenance["T4"].startswith("estimated")
    res = CliRunner().invoke(main, ["profile", str(tiny_onnx), "-o", str(tmp_path / "u"), "--measure", "none", "--estimate", "Q9000"])
    assert res.exit_code == 2  # an unknown GPU type is the user's mistake


def test_resuming_over_a_broken_layers_file_says_what_to_delete(tiny_onnx, tmp_path):
    out = tmp_path / "tiny"
    args = ["profile", str(tiny_onnx), "-o", str(out), "--blocks", "2", "--batches", "1", "--reps", "1", "--threads", "2", "--no-progress"]
    assert CliRunner().invoke(main, args).exit_code == 0
    text = (out / "layers.csv").read_text().splitlines()
    (out / "layers.csv").write_text("\n".join(text[:3] + ["cpu,relu0,Relu,soon"] + text[4:]) + "\n")
    res = CliRunner().invoke(main, args)
    assert res.exit_code == 2 and "Traceback" not in res.output
    assert "latency_us 'soon' is not a number" in res.output and f"delete {out / 'layers.csv'}" in res.output
    (out / "layers.csv").unlink()  # as the message says: the layers are timed again
    res = CliRunner().invoke(main, args)
    assert res.exit_code == 0 and load_profile(out).layers.gpus() == ["cpu"]


def test_a_declared_preprocess_survives_profiling_again(tiny_onnx, tmp_path):
    """The user adds a preprocess to model.yaml by hand; profiling the model again keeps it."""
    import yaml

    out = tmp_path / "tiny"
    args = ["profile", str(tiny_onnx), "-o", str(out), "--blocks", "2", "--batches", "1", "--reps", "1", "--threads", "2", "--no-progress"]
    assert CliRunner().invoke(main, args).exit_code == 0
    assert load_profile(out).manifest.preprocess is None  # a user's ONNX declares none by itself
    doc = yaml.safe_load((out / "model.yaml").read_text())
    doc["preprocess"] = {"color": "BGR", "mean": [1.0, 2.0, 3.0], "std": [4.0, 5.0, 6.0]}
    (out / "model.yaml").write_text(yaml.safe_dump(doc))
    res = CliRunner().invoke(main, [*args[:5], "3", *args[6:]])  # other cuts: a fresh profile into the folder
    assert res.exit_code == 0, res.output
    pre = load_profile(out).manifest.preprocess
    assert pre.color == "BGR" and pre.mean == [1.0, 2.0, 3.0]
