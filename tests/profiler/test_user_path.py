"""The GPU path of `ppipe profile` with a recorded TensorRT backend (no GPU here): layer
times cut the model and go to layers.csv, `--estimate-from` picks the per-layer or the
blocks-only cross-GPU model and says which; and a PPipe-artifact model profiled through
this path gets exactly the benchmark's predictions.

The TensorRT timer and per-layer timer are replaced by doubles that replay numbers (the
artifact's, or fixed ones); the code under test is everything around them."""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import pytest

from ppipe.errors import UserError
from ppipe.profiler import run as run_mod
from ppipe.profiler import trt_backend
from ppipe.profiler.run import ProfileRequest, profile_model
from ppipe.spec import load_profile


class _ReplayTimer:
    """Stands in for TensorRTTimer: block latencies from a table keyed by (level, batch, block)."""

    table: dict = {}
    precision_seen: list = []

    def __init__(self, reps=10, warmup=5, engine_dir=None, precision="tf32"):
        type(self).precision_seen.append(precision)
        self.precision = precision

    def provenance(self):
        return f"measured: TensorRT (replayed) {self.precision} on a test double"

    def latency_us(self, block_path, level, batch):
        blk = int(re.search(r"block_(\d+)", Path(block_path).stem).group(1))
        return self.table[(level, batch, blk)]

    def close(self):
        pass


def _replay_layers(node_us):
    calls = []

    def layer_times_us(info, *, gpu_type=None, mode="per-node", precision="tf32", reps=20, warmup=5):
        calls.append((gpu_type, mode, precision))
        return trt_backend.LayerTiming(node_us=list(node_us(info)), mode=mode, provenance=f"replayed {mode}", fallback_share=0.0)

    return layer_times_us, calls


def _synthetic_table(num_blocks):
    # a block scales sub-linearly with batch and with the MPS share, like a GPU block
    return {(v, b, i): (200.0 + 50 * i) * b**0.8 * v**0.7 for v in (1, 2, 3, 4) for b in range(1, 9) for i in range(num_blocks)}


@pytest.mark.parametrize("mode,expect", [("per-node", "per-layer model"), ("fused", "blocks-only model")])
def test_gpu_layers_cut_the_model_and_choose_the_estimator(tiny_onnx, tmp_path, monkeypatch, mode, expect):
    fake, calls = _replay_layers(lambda info: [10.0 * (p + 1) for p in range(len(info.compute_nodes))])
    monkeypatch.setattr(trt_backend, "layer_times_us", fake)
    monkeypatch.setattr(trt_backend, "TensorRTTimer", _ReplayTimer)
    _ReplayTimer.table = _synthetic_table(3)
    cut_on = []
    real_partition = run_mod.partition
    monkeypatch.setattr(run_mod, "partition", lambda info, times, n, sw: cut_on.append(list(times)) or real_partition(info, times, n, sw))
    out = tmp_path / "tiny"
    req = ProfileRequest(
        onnx_path=tiny_onnx, out_dir=out, num_blocks=3, batches=list(range(1, 9)), measure="L4", trt_layers=mode,
        estimate=["T4", "P4"], estimate_from="L4",
    )
    prof = profile_model(req, progress=False)
    assert calls == [("L4", mode, "tf32")] and _ReplayTimer.precision_seen[-1] == "tf32"
    assert cut_on == [[10.0 * (p + 1) for p in range(10)]]  # the GPU layer times cut the model
    assert prof.layers.gpus() == ["L4"]
    assert prof.manifest.layers.gpus["L4"].method.value == ("per-node" if mode == "per-node" else "fused-split")
    for g in ("T4", "P4"):
        assert expect in prof.manifest.provenance[g] and "cross-GPU" in prof.manifest.provenance[g]
    assert prof.levels("P4") == [1] and prof.levels("T4") == [1, 2, 3, 4]  # a P4 has no MPS levels
    again = load_profile(out)
    assert again.layers == prof.layers and again.table == pytest.approx(prof.table, abs=6e-4)
    # the Python API reads the same per-layer timings from the saved profile and agrees
    from ppipe.profiler.estimate import estimate_profile

    est = estimate_profile(again, ["T4"], source_gpu="L4", batches_by_level={1: [1, 4, 8], 2: [1, 4]})
    assert expect in est.manifest.provenance["T4"]
    for k in ((("T4", 1, 4, 2)), ("T4", 2, 1, 0)):
        assert est.table[k] == pytest.approx(again.table[k], rel=1e-5)


def test_an_fp16_source_is_refused_by_the_cross_gpu_model(tiny_onnx, tmp_path, monkeypatch):
    fake, _calls = _replay_layers(lambda info: [1.0] * len(info.compute_nodes))
    monkeypatch.setattr(trt_backend, "layer_times_us", fake)
    monkeypatch.setattr(trt_backend, "TensorRTTimer", _ReplayTimer)
    _ReplayTimer.table = _synthetic_table(2)
    req = ProfileRequest(
        onnx_path=tiny_onnx, out_dir=tmp_path / "t", num_blocks=2, batches=list(range(1, 9)), measure="L4", precision="fp16",
        gpu_levels=(1,), estimate=["T4"], estimate_from="L4",
    )
    with pytest.raises(UserError, match="measured in fp16.*TF32"):
        profile_model(req, progress=False)
    with pytest.raises(UserError, match="--precision 'int8'"):
        profile_model(ProfileRequest(onnx_path=tiny_onnx, out_dir=tmp_path / "u", precision="int8"), progress=False)


@pytest.mark.artifact
def test_an_artifact_model_through_the_user_path_gets_the_benchmark_predictions(artifact_dir, tmp_path, monkeypatch):
    """wide_resnet101_2 rebuilt node for node (reference_graphs), profiled by `ppipe profile
    --measure L4 --estimate-from L4` with the artifact's L4 timings replayed (its per-node
    table, its block cuts, its block latencies): the estimates in the written profile are
    those scripts/bench_estimator.py computes from the artifact (same op types, same
    node -> block mapping, same features), up to profile.csv's rounding."""
    import onnx

    from ppipe.profiler.blocks import blocks_from_last_nodes
    from ppipe.profiler.estimate.artifact_data import load_model
    from ppipe.profiler.estimate.crossgpu import artifact_layer_inputs, cross_gpu_table
    from ppipe.profiler.estimate.reference_graphs import wide_resnet101_2
    from ppipe.spec.profile import ModelProfile

    name = "wide_resnet101_2"
    am = load_model(artifact_dir, name)
    path = tmp_path / f"{name}.onnx"
    onnx.save(wide_resnet101_2(), str(path))
    l4_layers = dict(zip(am.nodes, am.layer_us["L4"]))
    fake, _calls = _replay_layers(lambda info: [l4_layers[info.node(p).name] for p in range(len(info.compute_nodes))])
    monkeypatch.setattr(trt_backend, "layer_times_us", fake)
    monkeypatch.setattr(trt_backend, "TensorRTTimer", _ReplayTimer)
    _ReplayTimer.table = {(v, b, i): lat for (g, v, b, i), lat in am.profile.table.items() if g == "L4"}
    last_nodes = [am.nodes[int(np.flatnonzero(am.node_block == i)[-1])] for i in range(am.profile.num_blocks)]
    monkeypatch.setattr(run_mod, "partition", lambda info, times, n, sw: blocks_from_last_nodes(info, last_nodes))
    out = tmp_path / "wrn"
    req = ProfileRequest(
        onnx_path=path, out_dir=out, name=name, num_blocks=am.profile.num_blocks, batches=list(range(1, 9)), measure="L4",
        estimate=["P4", "T4", "V100"], estimate_from="L4",
    )
    profile_model(req, progress=False)
    user = load_profile(out)
    # the user path recorded the graph's op types and the artifact's node -> block mapping
    assert user.layers.nodes() == am.nodes
    assert user.layers.op_types() == dict(zip(am.nodes, am.op_types))
    assert user.layers.node_blocks == {n: int(b) for n, b in zip(am.nodes, am.node_block)}
    for g in ("P4", "T4", "V100"):
        assert "per-layer model" in user.manifest.provenance[g]
    # the benchmark's path: the artifact profile, names -> op types, the block-mapping file
    src = ModelProfile(manifest=am.profile.manifest, table={k: v for k, v in am.profile.table.items() if k[0] == "L4"})
    layer, nodes = artifact_layer_inputs(am, "L4")
    n = 0
    for t in ("P4", "T4", "V100"):
        grid = {v: list(am.profile.batches(t, v)) for v in am.profile.levels(t)}
        bench = cross_gpu_table(src, "L4", t, levels=list(grid), batches_by_level=grid, layer_latency_us=layer, node_blocks=nodes)
        for k, lat in bench.items():
            assert user.table[k] == pytest.approx(lat, rel=2e-5), k
            n += 1
    assert n == sum(1 for k in am.profile.table if k[0] != "L4")
    # and they differ from what the blocks-only model predicts (the per-layer features matter)
    blocks_only = cross_gpu_table(src, "L4", "P4", levels=[1], batches_by_level={1: [1]})
    assert max(abs(user.table[k] / v - 1) for k, v in blocks_only.items()) > 1e-3
