"""ONNX graphs of artifact models whose architecture is public, rebuilt for calibration.

The PPipe artifact has timings but no ONNX files. For a model whose architecture is a
published one, the graph can be rebuilt node for node with the names the PyTorch exporter
gives (so the artifact's ``block-mapping/<model>.csv`` assigns every node to its block);
weights are shape-only initializers (no data), which is all the roofline needs.

* ``wide_resnet101_2``: torchvision's Wide ResNet-101-2 (bottleneck width x2, blocks
  3-4-23-3), batch-norm folded into the convolutions as the exporter does in eval mode.
  The input resolution, 520x520, is the one that reproduces the artifact's cut bytes
  exactly (checked by :func:`check_against_artifact`).
* ``repvgg-b3``: RepVGG-B3 (Ding et al. 2021) in deploy form: widths 64-192-384-768-2560,
  depths 1-4-6-16-1, one 3x3 conv + ReLU per layer; 448x448 reproduces the cut bytes.
"""

from __future__ import annotations

from pathlib import Path

from ppipe.errors import UserError


def _tensor(name: str, dims: list[int]):
    from onnx import TensorProto

    t = TensorProto()
    t.name = name
    t.data_type = TensorProto.FLOAT
    t.dims.extend(dims)
    return t


class _Builder:
    def __init__(self) -> None:
        self.nodes = []
        self.inits = []

    def conv(self, name: str, x: str, cin: int, cout: int, k: int, stride: int = 1, pad: int = 0) -> str:
        from onnx import helper

        w, b = f"{name}.weight", f"{name}.bias"
        self.inits += [_tensor(w, [cout, cin, k, k]), _tensor(b, [cout])]
        out = f"{name}_output_0"
        self.nodes.append(
            helper.make_node("Conv", [x, w, b], [out], name=name, kernel_shape=[k, k], strides=[stride, stride], pads=[pad] * 4)
        )
        return out

    def op(self, op_type: str, name: str, inputs: list[str], **attrs) -> str:
        from onnx import helper

        out = f"{name}_output_0"
        self.nodes.append(helper.make_node(op_type, inputs, [out], name=name, **attrs))
        return out

    def model(self, x_shape: list[int], out: str, name: str):
        from onnx import TensorProto, helper

        g = helper.make_graph(
            self.nodes,
            name,
            [helper.make_tensor_value_info("input", TensorProto.FLOAT, ["batch", *x_shape])],
            [helper.make_tensor_value_info(out, TensorProto.FLOAT, None)],
            initializer=self.inits,
        )
        return helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)


def wide_resnet101_2(resolution: int = 520):
    """torchvision ``wide_resnet101_2`` as the PyTorch exporter names its nodes."""
    bld = _Builder()
    x = bld.conv("/conv1/Conv", "input", 3, 64, 7, 2, 3)
    x = bld.op("Relu", "/relu/Relu", [x])
    x = bld.op("MaxPool", "/maxpool/MaxPool", [x], kernel_shape=[3, 3], strides=[2, 2], pads=[1, 1, 1, 1])
    cin = 64
    for li, (planes, blocks, stride) in enumerate(zip((64, 128, 256, 512), (3, 4, 23, 3), (1, 2, 2, 2)), start=1):
        width = planes * 2  # width_per_group = 128
        for bi in range(blocks):
            p = f"/layer{li}/layer{li}.{bi}"
            s = stride if bi == 0 else 1
            y = bld.conv(f"{p}/conv1/Conv", x, cin, width, 1)
            y = bld.op("Relu", f"{p}/relu/Relu", [y])
            y = bld.conv(f"{p}/conv2/Conv", y, width, width, 3, s, 1)
            y = bld.op("Relu", f"{p}/relu_1/Relu", [y])
            y = bld.conv(f"{p}/conv3/Conv", y, width, planes * 4, 1)
            idn = x
            if bi == 0:
                idn = bld.conv(f"{p}/downsample/downsample.0/Conv", x, cin, planes * 4, 1, s)
            y = bld.op("Add", f"{p}/Add", [y, idn])
            x = bld.op("Relu", f"{p}/relu_2/Relu", [y])
            cin = planes * 4
    x = bld.op("GlobalAveragePool", "/avgpool/GlobalAveragePool", [x])
    x = bld.op("Flatten", "/Flatten", [x], axis=1)
    from onnx import helper

    bld.inits += [_tensor("fc.weight", [1000, 2048]), _tensor("fc.bias", [1000])]
    bld.nodes.append(helper.make_node("Gemm", [x, "fc.weight", "fc.bias"], ["logits"], name="/fc/Gemm", transB=1))
    return bld.model([3, resolution, resolution], "logits", "wide_resnet101_2")


def repvgg_b3(resolution: int = 448):
    """RepVGG-B3 in its deploy form (one 3x3 conv + ReLU per layer), as exported."""
    from onnx import TensorProto, helper

    bld = _Builder()
    x = bld.conv("/stage0/rbr_reparam/Conv", "input", 3, 64, 3, 2, 1)
    x = bld.op("Relu", "/stage0/nonlinearity/Relu", [x])
    cin = 64
    for si, (cout, depth) in enumerate(zip((192, 384, 768, 2560), (4, 6, 16, 1)), start=1):
        for li in range(depth):
            p = f"/stage{si}/stage{si}.{li}"
            x = bld.conv(f"{p}/rbr_reparam/Conv", x, cin, cout, 3, 2 if li == 0 else 1, 1)
            x = bld.op("Relu", f"{p}/nonlinearity/Relu", [x])
            cin = cout
    x = bld.op("GlobalAveragePool", "/gap/GlobalAveragePool", [x])
    shape = bld.op("Shape", "/Shape", [x])
    bld.inits.append(helper.make_tensor("zero", TensorProto.INT64, [], [0]))
    bld.inits.append(helper.make_tensor("axes0", TensorProto.INT64, [1], [0]))
    bld.inits.append(helper.make_tensor("minus1", TensorProto.INT64, [1], [-1]))
    n = bld.op("Gather", "/Gather", [shape, "zero"], axis=0)
    n = bld.op("Unsqueeze", "/Unsqueeze", [n, "axes0"])
    tgt = bld.op("Concat", "/Concat", [n, "minus1"], axis=0)
    x = bld.op("Reshape", "/Reshape", [x, tgt])
    bld.inits += [_tensor("linear.weight", [1000, 2560]), _tensor("linear.bias", [1000])]
    bld.nodes.append(helper.make_node("Gemm", [x, "linear.weight", "linear.bias"], ["logits"], name="/linear/Gemm", transB=1))
    return bld.model([3, resolution, resolution], "logits", "repvgg-b3")


REFERENCE_GRAPHS = {"wide_resnet101_2": wide_resnet101_2, "repvgg-b3": repvgg_b3}


def reference_graph(name: str):
    try:
        return REFERENCE_GRAPHS[name]()
    except KeyError:
        raise UserError(f"no rebuilt graph for '{name}'", fix=f"use one of: {', '.join(REFERENCE_GRAPHS)}") from None


def block_costs(name: str, artifact_dir: str | Path):
    """Per block of the artifact's mapping: the rebuilt graph's node costs.

    Returns:
        list (one entry per block) of lists of :class:`NodeCost`.
    """
    from ppipe.profiler.estimate.artifact_data import load_model
    from ppipe.profiler.estimate.onnx_cost import graph_costs

    am = load_model(artifact_dir, name)
    costs = {c.name: c for c in graph_costs(reference_graph(name), source=f"<rebuilt {name}>")}
    missing = [n for n in am.nodes if n not in costs]
    if missing:
        raise UserError(
            f"rebuilt graph of {name} lacks {len(missing)} nodes of the artifact's mapping, e.g. {missing[:3]}",
            fix="the rebuilt architecture does not match the artifact's model",
        )
    out: list[list] = [[] for _ in range(am.profile.num_blocks)]
    for n, b in zip(am.nodes, am.node_block):
        out[int(b)].append(costs[n])
    return out


def check_against_artifact(name: str, artifact_dir: str | Path) -> list[tuple[int, int, int]]:
    """(cut, rebuilt bytes, artifact bytes) for every cut: the rebuilt graph's activation
    tensors that cross each cut of the artifact's mapping, counted at 2 bytes (fp16, as the
    artifact counts them)."""
    from ppipe.profiler.estimate.artifact_data import load_model
    from ppipe.profiler.estimate.onnx_cost import _prepare

    am = load_model(artifact_dir, name)
    m = _prepare(reference_graph(name), name)
    shapes = {vi.name: [d.dim_value for d in vi.type.tensor_type.shape.dim] for vi in list(m.graph.value_info) + list(m.graph.input)}
    block_of = dict(zip(am.nodes, am.node_block))
    produced = {}
    for n in m.graph.node:
        for o in n.output:
            produced[o] = block_of.get(n.name, -1)
    produced["input"] = -1
    rows = []
    for cut in range(am.profile.num_blocks - 1):
        crossing = set()
        for n in m.graph.node:
            if block_of.get(n.name, -2) > cut:
                crossing.update(i for i in n.input if i in produced and produced[i] <= cut)
        size = 0
        for t in crossing:
            s = shapes.get(t, [])
            e = 1
            for d in s:
                e *= max(d, 1)
            size += 2 * e
        rows.append((cut, size, am.profile.cut_bytes(cut)))
    return rows
