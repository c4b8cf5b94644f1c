"""Small ONNX graphs built with onnx.helper, for fast profiler tests."""

from __future__ import annotations

import numpy as np
import pytest


def tiny_residual_model(batch_dim="N", spatial=8, with_argmax=True):
    """x[N,3,S,S] -> conv(4) -> relu -> {conv a, conv b} -> add -> relu -> GAP -> flatten -> gemm(5)
    (+ ArgMax, int64). Per sample: conv/relu outputs 4*S*S floats."""
    from onnx import TensorProto, helper, numpy_helper

    rng = np.random.default_rng(0)

    def w(name, *shape):
        return numpy_helper.from_array((rng.standard_normal(shape) * 0.3).astype(np.float32), name)

    nodes = [
        helper.make_node("Conv", ["x", "w0"], ["c0"], name="conv0", pads=[1, 1, 1, 1]),
        helper.make_node("Relu", ["c0"], ["r0"], name="relu0"),
        helper.make_node("Conv", ["r0", "wa"], ["a"], name="conv_a", pads=[1, 1, 1, 1]),
        helper.make_node("Conv", ["r0", "wb"], ["b"], name="conv_b"),
        helper.make_node("Add", ["a", "b"], ["s"], name="add"),
        helper.make_node("Relu", ["s"], ["r1"], name="relu1"),
        helper.make_node("GlobalAveragePool", ["r1"], ["g"], name="gap"),
        helper.make_node("Flatten", ["g"], ["f"], name="flatten"),
        helper.make_node("Gemm", ["f", "wf", "bf"], ["logits"], name="fc", transB=1),
    ]
    outputs = [helper.make_tensor_value_info("logits", TensorProto.FLOAT, [batch_dim, 5])]
    if with_argmax:
        nodes.append(helper.make_node("ArgMax", ["logits"], ["top"], name="argmax", axis=1, keepdims=1))
        outputs.append(helper.make_tensor_value_info("top", TensorProto.INT64, [batch_dim, 1]))
    graph = helper.make_graph(
        nodes,
        "tiny",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [batch_dim, 3, spatial, spatial])],
        outputs,
        initializer=[w("w0", 4, 3, 3, 3), w("wa", 4, 4, 3, 3), w("wb", 4, 4, 1, 1), w("wf", 5, 4), w("bf", 5)],
    )
    m = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)])
    m.ir_version = 8  # what onnxruntime 1.18+ reads
    return m


@pytest.fixture
def tiny_onnx(tmp_path):
    import onnx

    p = tmp_path / "tiny.onnx"
    onnx.save(tiny_residual_model(), str(p))
    return p


@pytest.fixture(autouse=True)
def _private_cache(tmp_path, monkeypatch):
    """Block caches go to a temporary folder, never to ~/.cache."""
    monkeypatch.setenv("PPIPE_CACHE", str(tmp_path / "cache"))


@pytest.fixture
def make_tiny():
    """The graph builder itself, for tests that vary it."""
    return tiny_residual_model
