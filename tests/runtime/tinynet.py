"""A tiny 3-block CNN built with onnx.helper, its block sub-models and a synthetic profile.

Keeps runtime tests fast and independent of the profiler: blocks are real ONNX models
(conv, residual add, pooling, gemm) so the ``ort`` backend runs real arithmetic, and the
unpartitioned model gives the reference answer.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from ppipe.spec.profile import BlockSpec, ModelManifest, ModelProfile, SourceSpec, TensorSpec

C_IN, H, W, C_MID, N_OUT = 3, 8, 8, 4, 5


def _weights(seed: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {
        "w0": rng.normal(0, 0.3, (C_MID, C_IN, 3, 3)).astype(np.float32),
        "b0": rng.normal(0, 0.1, (C_MID,)).astype(np.float32),
        "w1": rng.normal(0, 0.3, (C_MID, C_MID, 3, 3)).astype(np.float32),
        "b1": rng.normal(0, 0.1, (C_MID,)).astype(np.float32),
        "wf": rng.normal(0, 0.5, (N_OUT, C_MID)).astype(np.float32),
        "bf": rng.normal(0, 0.1, (N_OUT,)).astype(np.float32),
    }


def _block_nodes(block: int):
    if block == 0:
        return [
            helper.make_node("Conv", ["input", "w0", "b0"], ["c0"], pads=[1, 1, 1, 1]),
            helper.make_node("Relu", ["c0"], ["t0"]),
        ], ["w0", "b0"], "input", "t0"
    if block == 1:
        return [
            helper.make_node("Conv", ["t0", "w1", "b1"], ["c1"], pads=[1, 1, 1, 1]),
            helper.make_node("Add", ["c1", "t0"], ["a1"]),
            helper.make_node("Relu", ["a1"], ["t1"]),
        ], ["w1", "b1"], "t0", "t1"
    return [
        helper.make_node("GlobalAveragePool", ["t1"], ["p2"]),
        helper.make_node("Flatten", ["p2"], ["f2"], axis=1),
        helper.make_node("Gemm", ["f2", "wf", "bf"], ["logits"], transB=1),
    ], ["wf", "bf"], "t1", "logits"


SHAPES = {"input": [C_IN, H, W], "t0": [C_MID, H, W], "t1": [C_MID, H, W], "logits": [N_OUT]}


def _model(blocks: list[int], weights) -> onnx.ModelProto:
    nodes, inits = [], []
    for b in blocks:
        n, w, _, _ = _block_nodes(b)
        nodes += n
        inits += [numpy_helper.from_array(weights[k], k) for k in w]
    first_in = _block_nodes(blocks[0])[2]
    last_out = _block_nodes(blocks[-1])[3]
    g = helper.make_graph(
        nodes,
        f"tinynet_{'_'.join(map(str, blocks))}",
        [helper.make_tensor_value_info(first_in, TensorProto.FLOAT, ["N", *SHAPES[first_in]])],
        [helper.make_tensor_value_info(last_out, TensorProto.FLOAT, ["N", *SHAPES[last_out]])],
        inits,
    )
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 13)])
    m.ir_version = 8
    onnx.checker.check_model(m)
    return m


def latency_table(base_us: float = 300.0) -> dict[tuple[str, int, int, int], float]:
    """Synthetic CPU timings: block b at batch n and level v takes base*(b+1)*n^0.8*v^0.7 us."""
    out = {}
    for v in (1, 2):
        for n in (1, 2, 4, 8):
            for b in range(3):
                out[("cpu", v, n, b)] = base_us * (1 + 0.5 * b) * n**0.8 * v**0.7
    return out


def write_tinynet(directory: Path, base_us: float = 300.0, name: str = "tinynet", preprocess=None) -> ModelProfile:
    """Write model.yaml, profile.csv, blocks/*.onnx and full.onnx into ``directory``
    (``preprocess``: the model.yaml's, an ImagePreprocess or None)."""
    d = Path(directory)
    (d / "blocks").mkdir(parents=True, exist_ok=True)
    w = _weights()
    blocks = []
    for b in range(3):
        onnx.save(_model([b], w), d / "blocks" / f"block{b}.onnx")
        out = _block_nodes(b)[3]
        blocks.append(
            BlockSpec(
                index=b,
                out_bytes_per_sample=int(np.prod(SHAPES[out])) * 2,
                out_tensors=[out],
                onnx=f"blocks/block{b}.onnx",
            )
        )
    onnx.save(_model([0, 1, 2], w), d / "full.onnx")
    manifest = ModelManifest(
        name=name,
        source=SourceSpec(kind="synthetic", note="tests/runtime/tinynet.py"),
        input=TensorSpec(name="input", shape=SHAPES["input"]),
        outputs=[TensorSpec(name="logits", shape=SHAPES["logits"])],
        blocks=blocks,
        slo_ms=200.0,
        preprocess=preprocess,
    )
    prof = ModelProfile(manifest=manifest, table=latency_table(base_us), directory=d)
    prof.save(d)
    return prof


def reference(directory: Path, x: np.ndarray) -> np.ndarray:
    """The unpartitioned model's answer."""
    import onnxruntime as ort

    s = ort.InferenceSession(str(Path(directory) / "full.onnx"), providers=["CPUExecutionProvider"])
    return s.run(["logits"], {"input": x.astype(np.float32)})[0]
