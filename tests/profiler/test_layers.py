"""Per-layer timing logic without TensorRT: engine-layer names and inspector metadata ->
ONNX nodes, the split of fused layers, and the per-node inputs of the cross-GPU model."""

from __future__ import annotations

import json

import numpy as np
import pytest

from ppipe.profiler.layers import (
    LayerRecord,
    NodeIndex,
    activation_outputs,
    attribute_times,
    layer_nodes,
    nodes_from_metadata,
    nodes_from_name,
    parse_layer_info,
    standalone_costs,
)

# node names as the PyTorch exporter writes them, plus old-style ones
NAMES = ("/conv1/Conv", "/relu/Relu", "/layer1/conv/Conv", "/layer1/Add", "/layer1/relu/Relu", "Flatten_7", "Gemm_8")
OPS = ("Conv", "Relu", "Conv", "Add", "Relu", "Flatten", "Gemm")


@pytest.fixture
def index():
    return NodeIndex(NAMES, OPS, {f"{n}_output_0": i for i, n in enumerate(NAMES)})


def test_names_of_fused_and_generated_layers_resolve_to_nodes(index):
    assert nodes_from_name("/conv1/Conv + /relu/Relu", index) == [0, 1]
    assert nodes_from_name("PWN(PWN(/layer1/Add), /layer1/relu/Relu)", index) == [3, 4]
    # a Myelin foreign node names its first and last node: everything between is in it
    assert nodes_from_name("{ForeignNode[/relu/Relu.../layer1/relu/Relu]}", index) == [1, 2, 3, 4]
    assert nodes_from_name("Reformatting CopyNode for Input Tensor 0 to /conv1/Conv + /relu/Relu", index) == [0, 1]
    # names TensorRT derives from tensors or suffixes
    assert nodes_from_name("/layer1/conv/Conv_output_0", index) == [2]
    assert nodes_from_name("Gemm_8_clone_1", index) == [6]
    assert nodes_from_name("Flatten_7 [Shuffle]", index) == [5]
    # layers TensorRT inserted with generated names cover no node
    assert nodes_from_name("(Unnamed Layer* 12) [Shuffle]", index) == []
    assert nodes_from_name("shuffle_between_x_and_y", index) == []


def test_metadata_wins_over_the_name_and_splits_on_separators(index):
    meta = "[ONNX Layer: /layer1/conv/Conv]\x1f[ONNX Layer: /layer1/Add]\x1e[ONNX Layer: /layer1/relu/Relu]"
    assert nodes_from_metadata(meta, index) == [2, 3, 4]
    assert layer_nodes("__myl_ConvAddRelu_0", meta, index) == [2, 3, 4]
    # metadata naming nothing known: fall back on the name
    assert layer_nodes("/conv1/Conv", "[ONNX Layer: something_else]", index) == [0]


def test_inspector_json_with_and_without_detailed_verbosity():
    detailed = json.dumps({
        "Layers": [
            {"Name": "/conv1/Conv + /relu/Relu", "LayerType": "CaskConvolution", "Metadata": "[ONNX Layer: /conv1/Conv]\x1f[ONNX Layer: /relu/Relu]"},
            {"Name": "Reformatting CopyNode for Output Tensor 0 to Gemm_8", "LayerType": "Reformat"},
        ],
        "Bindings": ["x", "logits"],
    })
    assert parse_layer_info(detailed) == {
        "/conv1/Conv + /relu/Relu": "[ONNX Layer: /conv1/Conv]\x1f[ONNX Layer: /relu/Relu]",
        "Reformatting CopyNode for Output Tensor 0 to Gemm_8": "",
    }
    assert parse_layer_info(json.dumps({"Layers": ["a + b", "c"]})) == {"a + b": "", "c": ""}
    assert parse_layer_info("not json") == {}


def test_fused_time_is_split_by_standalone_cost_and_nothing_is_lost(index):
    w = np.array([9.0, 1.0, 4.0, 0.0, 0.0, 0.0, 2.0])
    records = [
        LayerRecord("(Unnamed Layer* 0) [Shuffle]", 5.0),  # before any named layer: to the first one
        LayerRecord("/conv1/Conv + /relu/Relu", 100.0),
        LayerRecord("/layer1/conv/Conv", 40.0),
        LayerRecord("Reformatting CopyNode for Input Tensor 0 to Flatten_7", 3.0),
        LayerRecord("PWN(/layer1/Add, /layer1/relu/Relu)", 10.0),  # both cost 0: split equally
        LayerRecord("(Unnamed Layer* 9) [Shuffle]", 6.0),  # after a named layer: to that layer's nodes
        LayerRecord("Gemm_8", 20.0),
    ]
    att = attribute_times(records, index, w)
    np.testing.assert_allclose(att.node_us, [94.5, 10.5, 40.0, 8.0, 8.0, 3.0, 20.0])
    assert att.node_us.sum() == pytest.approx(att.total_us) and att.total_us == pytest.approx(184.0)
    assert att.fallback_us == pytest.approx(11.0)
    with pytest.raises(ValueError, match="compute nodes"):
        attribute_times(records, index, w[:3])


def test_standalone_costs_and_marked_outputs_of_a_real_graph(make_tiny):
    from ppipe.profiler.graph import analyze, prepare_model

    info = analyze(prepare_model(make_tiny()))
    cost = dict(zip(NodeIndex.from_graph(info).names, standalone_costs(info, peak_flops=1e12, bandwidth_bps=1e11)))
    # relu0 moves 2 x 4*8*8 fp32 = 2048 B and computes 256 FLOP: memory-bound
    assert cost["relu0"] == pytest.approx(2048 / 1e11)
    # conv_a (3x3, 4->4 channels on 8x8) computes 2*256*36 FLOP and moves in + out + weights
    assert cost["conv_a"] == pytest.approx(max(2 * 256 * 36 / 1e12, (1024 + 1024 + 4 * 4 * 9 * 4) / 1e11))
    assert cost["flatten"] > 0 and all(c >= 0 for c in cost.values())
    marks = activation_outputs(info)
    assert "c0" in marks and "r1" in marks
    assert "logits" not in marks and "top" not in marks  # model outputs already are engine outputs


def test_cross_gpu_layer_inputs_use_per_node_timings_only(tmp_path):
    from ppipe.profiler.layers import cross_gpu_layer_inputs
    from ppipe.spec.profile import BlockSpec, LayerMethod, LayerRow, ModelManifest, ModelProfile, SourceSpec, make_layer_timings

    manifest = ModelManifest(
        name="m", source=SourceSpec(kind="synthetic"),
        blocks=[BlockSpec(index=0, first_node="a", last_node="b", num_nodes=2, out_bytes_per_sample=4),
                BlockSpec(index=1, first_node="c", last_node="c", num_nodes=1, out_bytes_per_sample=4)],
    )
    rows = [LayerRow("a", "Conv", 3.0), LayerRow("b", "Relu", 1.0), LayerRow("c", "Gemm", 2.0)]
    lt = make_layer_timings(manifest, {"L4": rows, "T4": rows}, {"L4": LayerMethod.PER_NODE, "T4": LayerMethod.FUSED_SPLIT})
    prof = ModelProfile(manifest=manifest, table={}, layers=lt)
    kwargs, how = cross_gpu_layer_inputs(prof, "L4")
    assert kwargs == {"layer_latency_us": {"a": 3.0, "b": 1.0, "c": 2.0}, "node_blocks": {"a": 0, "b": 0, "c": 1},
                      "node_op_types": {"a": "Conv", "b": "Relu", "c": "Gemm"}}
    assert how.startswith("per-layer model")
    kwargs, how = cross_gpu_layer_inputs(prof, "T4")
    assert kwargs == {} and "blocks-only" in how and "fused-split" in how
    kwargs, how = cross_gpu_layer_inputs(prof, "V100")
    assert kwargs == {} and "no per-layer timings of V100" in how
