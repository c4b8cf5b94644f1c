"""The built-in profiles shipped in models/: they load, cover the default cluster's GPU
types, record provenance, carry the CPU per-layer timings that cut them, and their block
sub-models regenerate from model.yaml."""

from __future__ import annotations

from pathlib import Path

import pytest

from ppipe.spec import load_cluster, load_profile
from ppipe.spec.cluster import builtin_dirs

SHIPPED = ["resnet50", "inception_v2", "densenet121"]


def _shipped() -> list[str]:
    found = {m.parent.name for d in builtin_dirs("models") for m in d.glob("*/model.yaml")}
    return [n for n in SHIPPED if n in found]


def test_the_promised_models_are_shipped():
    assert _shipped() == SHIPPED


@pytest.mark.parametrize("name", SHIPPED)
def test_shipped_profile_loads_by_name_and_covers_hc2s(name):
    prof = load_profile(name)  # a built-in name, as `ppipe plan` resolves it
    cluster = load_cluster("HC2-S")
    assert prof.num_blocks == 10
    for gpu in cluster.gpu_types:
        for v in gpu.vgpu_levels:
            bs = prof.batches(gpu.name, v)
            assert bs and bs[0] == 1, (gpu.name, v)
            assert all(prof.model_latency_us(gpu.name, v, b) > 0 for b in bs)
        assert prof.manifest.provenance[gpu.name].startswith("estimated")
        assert prof.manifest.latency_bs1_us[gpu.name] == pytest.approx(prof.model_latency_us(gpu.name), rel=1e-3)
    # measured here, on the CPU, at both levels of the local-cpu cluster
    assert prof.batches("cpu", 1) == tuple(range(1, 9)) and prof.batches("cpu", 2) == (1, 2, 3, 4)
    assert prof.manifest.provenance["cpu"].startswith("measured: onnxruntime")
    assert prof.manifest.source.kind == "builtin" and prof.manifest.source.builtin == name
    # the model output is the last cut: 1000 class scores at 2 bytes
    assert prof.cut_bytes(prof.num_blocks - 1) == 2000
    assert all(prof.cut_bytes(i) > 0 for i in range(prof.num_blocks))


def test_shipped_block_models_regenerate(tmp_path):
    from ppipe.profiler import ensure_block_models

    prof = load_profile("inception_v2")
    paths = ensure_block_models(prof, tmp_path)
    assert [Path(p).name for p in paths] == [f"block_{i:02d}.onnx" for i in range(10)]
    # ensure_block_models checked every block's outputs and sizes against model.yaml
    import onnx

    first = onnx.load(str(paths[0]))
    assert [i.name for i in first.graph.input] == [prof.manifest.input.name]
    assert [o.name for o in first.graph.output] == prof.manifest.blocks[0].out_tensors


def test_shipped_estimates_use_only_the_levels_each_gpu_offers():
    from ppipe.profiler.estimate.gpus import gpu_spec
    from ppipe.spec import load_profile

    for name in ("resnet50", "inception_v2", "densenet121"):
        prof = load_profile(name)
        for gpu in prof.gpus():
            if gpu != "cpu":
                assert set(prof.levels(gpu)) <= set(gpu_spec(gpu).mps_levels), (name, gpu, prof.levels(gpu))
        assert prof.levels("P4") == [1]


@pytest.mark.parametrize("name", SHIPPED)
def test_shipped_layer_timings_match_the_graph_and_the_blocks(name):
    from ppipe.profiler.builtin import load_builtin
    from ppipe.profiler.graph import analyze, prepare_model

    prof = load_profile(name)
    assert prof.layers is not None and prof.layers.gpus() == ["cpu"]
    assert prof.manifest.layers.gpus["cpu"].method.value == "ort-optimized"
    model, path = load_builtin(name, prof.manifest.source.weights_seed)
    info = analyze(prepare_model(model, source=str(path)))
    nodes = [info.node(p) for p in range(len(info.compute_nodes))]
    assert prof.layers.nodes() == [n.name for n in nodes]
    assert prof.layers.op_types() == {n.name: n.op_type for n in nodes}  # from the graph, not the names (n0, n1, ...)
    assert [b.num_nodes for b in prof.manifest.blocks] == [
        sum(1 for blk in prof.layers.node_blocks.values() if blk == i) for i in range(prof.num_blocks)
    ]
    lat = prof.layers.latency_us("cpu")
    assert sum(lat.values()) > 0 and all(x >= 0 for x in lat.values())
