"""Per-node work of an ONNX graph: FLOPs and bytes moved per sample, and weight bytes.

Shapes come from ONNX shape inference with the batch dimension set to 1, so every
figure is *per sample* except weights, which a batch shares. Only shapes are needed:
weights may be initializers, graph inputs (old IR) or ``ConstantOfShape`` outputs.

How TensorRT executes the graph is approximated by fusion rules, because the kernel count
and the memory traffic depend on them:

* shape-only nodes (``Shape``, ``Reshape``, ``Unsqueeze``, ``Constant`` ...) and nodes
  that compute on weights alone are free (TensorRT folds them at build time);
* an element-wise node whose first input comes from a convolution, matmul or another
  fused element-wise node is fused into that kernel (TensorRT's conv+bias+add+activation
  and pointwise fusions): no launch, and it moves only its *other* activation inputs
  (e.g. the residual of an ``Add``).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ppipe.errors import UserError

from ppipe.profiler.estimate.crossgpu import op_class

_SHAPE_OPS = {
    "Shape", "Reshape", "Flatten", "Squeeze", "Unsqueeze", "Constant", "ConstantOfShape", "Identity", "Dropout",
    "Size", "Range",
}
_ELEM_BYTES = {1: 4, 2: 1, 3: 1, 4: 2, 5: 2, 6: 4, 7: 8, 9: 1, 10: 2, 11: 8, 12: 4, 13: 8, 16: 2}


@dataclass(frozen=True)
class NodeCost:
    """Work of one node (one kernel, or fused into the previous one).

    Attributes:
        name: node name.
        op_type: ONNX op type.
        op_class: class from :func:`ppipe.profiler.estimate.crossgpu.op_class`.
        flops: floating-point operations per sample (a multiply-add counts 2).
        act_bytes: activation bytes read and written per sample, at the element size of
            the graph (fp32: 4 bytes).
        weight_bytes: bytes of weights read once per batch.
        kernel: whether this node launches its own kernel (False: free or fused).
    """

    name: str
    op_type: str
    op_class: str
    flops: float
    act_bytes: float
    weight_bytes: float
    kernel: bool


def _onnx():
    """The onnx package (a dependency of ppipe; imported on first use: it is slow to load)."""
    import onnx

    return onnx


def _dims(vi) -> list[int] | None:
    t = vi.type.tensor_type
    if not t.HasField("shape"):
        return None
    out = []
    for d in t.shape.dim:
        if not d.HasField("dim_value"):
            return None
        out.append(int(d.dim_value))
    return out


def _prepare(model, source: str):
    """Initializers out of the inputs, IR >= 7, batch 1, shapes inferred."""
    onnx = _onnx()
    g = model.graph
    inits = {i.name for i in g.initializer}
    data_inputs = [i for i in g.input if i.name not in inits]
    del g.input[:]
    g.input.extend(data_inputs)
    if model.ir_version < 7:
        model.ir_version = 7
    for inp in g.input:
        dims = inp.type.tensor_type.shape.dim
        if len(dims) and not dims[0].HasField("dim_value"):
            dims[0].ClearField("dim_param")
            dims[0].dim_value = 1  # per-sample figures
        elif len(dims) and dims[0].dim_value > 1:
            raise UserError(
                f"input {inp.name!r} has a fixed batch of {dims[0].dim_value}; the estimate needs batch 1 or a symbolic batch",
                fix="export the block with a dynamic (or 1) first dimension",
                file=source,
            )
        for d in list(dims)[1:]:
            if not d.HasField("dim_value"):
                raise UserError(
                    f"input {inp.name!r} has a symbolic per-sample dimension",
                    fix="prepare the model with ppipe.profiler.graph.prepare_model (static per-sample shapes)",
                    file=source,
                )
    for o in g.output:
        if o.type.HasField("tensor_type"):
            o.type.tensor_type.ClearField("shape")
    del g.value_info[:]
    try:
        return onnx.shape_inference.infer_shapes(model, data_prop=True)
    except Exception as exc:
        raise UserError(f"ONNX shape inference failed: {exc}", fix="check the model with onnx.checker", file=source) from None


def graph_costs(model_or_path, *, source: str | None = None) -> list[NodeCost]:
    """Costs of every node of an ONNX model (a ``ModelProto`` or a file path), in order.

    Raises:
        UserError: the file cannot be read, or a compute node's shapes stay unknown.
    """
    onnx = _onnx()
    if isinstance(model_or_path, (str, Path)):
        source = source or str(model_or_path)
        try:
            model = onnx.load(str(model_or_path), load_external_data=False)
        except Exception as exc:
            raise UserError(f"cannot read ONNX file: {exc}", fix="give a valid .onnx file", file=source) from None
    else:
        model = onnx.ModelProto()
        model.CopyFrom(model_or_path)  # shape preparation edits the model
        source = source or "model"
    model = _prepare(model, source)
    g = model.graph
    shapes: dict[str, list[int] | None] = {}
    elem: dict[str, int] = {}
    for vi in list(g.input) + list(g.value_info) + list(g.output):
        shapes[vi.name] = _dims(vi)
        elem[vi.name] = vi.type.tensor_type.elem_type
    for init in g.initializer:
        shapes[init.name] = [int(d) for d in init.dims]
        elem[init.name] = init.data_type
    # tensors that depend on the data input (activations); the rest are weights/constants
    active = {i.name for i in g.input}
    for n in g.node:
        if any(i in active for i in n.input if i):
            active.update(o for o in n.output if o)

    def nbytes(name: str) -> float:
        s = shapes.get(name)
        if s is None:
            return 0.0
        return float(np.prod(s, dtype=float)) * _ELEM_BYTES.get(elem.get(name, 1), 4)

    def numel(name: str) -> float:
        s = shapes.get(name)
        return float(np.prod(s, dtype=float)) if s is not None else 0.0

    fused_producers: set[str] = set()  # tensors produced by a conv/matmul/fused eltwise kernel
    costs: list[NodeCost] = []
    for n in g.node:
        name = n.name or f"{n.op_type}_{len(costs)}"
        cls = op_class(n.op_type)
        acts_in = [i for i in n.input if i and i in active]
        if not acts_in or n.op_type in _SHAPE_OPS or (cls == "shape" and n.op_type not in ("Gather", "Cast")):
            costs.append(NodeCost(name, n.op_type, cls, 0.0, 0.0, 0.0, False))
            continue
        outs = [o for o in n.output if o]
        if any(shapes.get(o) is None for o in outs[:1]):
            raise UserError(
                f"node {name!r} ({n.op_type}): output shape unknown after shape inference",
                fix="export the model with static per-sample shapes (or prepare it with ppipe.profiler.graph.prepare_model)",
                file=source,
            )
        weights = [i for i in n.input if i and i not in active]
        w_bytes = sum(nbytes(i) for i in weights)
        out_bytes = sum(nbytes(o) for o in outs)
        in_bytes = sum(nbytes(i) for i in acts_in)
        flops = _flops(n, shapes, numel, acts_in, outs)
        kernel = True
        if cls == "eltwise" and acts_in[0] in fused_producers:
            # fused into the producer's kernel: reads only its other activation inputs
            kernel = False
            in_bytes = sum(nbytes(i) for i in acts_in[1:])
            out_bytes = 0.0
        if cls in ("conv", "matmul") or (cls == "eltwise"):
            fused_producers.update(outs)
        costs.append(NodeCost(name, n.op_type, cls, flops, in_bytes + out_bytes, w_bytes, kernel))
    return costs


def _attr(node, name: str, default=None):
    for a in node.attribute:
        if a.name == name:
            if a.ints:
                return list(a.ints)
            return a.i if a.type == 2 else (a.f if a.type == 1 else default)
    return default


def _flops(n, shapes, numel, acts_in, outs) -> float:
    op = n.op_type
    if op in ("Conv", "ConvTranspose"):
        w = shapes.get(n.input[1]) or []
        if len(w) < 3:
            return 2.0 * numel(outs[0])
        k = float(np.prod(w[2:], dtype=float))
        if op == "Conv":  # w: (Cout, Cin/group, k...)
            return 2.0 * numel(outs[0]) * w[1] * k
        x = shapes.get(n.input[0]) or []  # ConvTranspose w: (Cin, Cout/group, k...)
        return 2.0 * float(np.prod(x, dtype=float)) * w[1] * k if x else 2.0 * numel(outs[0]) * k
    if op in ("MatMul", "Gemm"):
        a = shapes.get(n.input[0]) or []
        if not a:
            return 2.0 * numel(outs[0])
        kdim = a[-1] if not (op == "Gemm" and _attr(n, "transA", 0)) else a[0]
        return 2.0 * numel(outs[0]) * kdim
    if op in ("MaxPool", "AveragePool", "LpPool"):
        k = _attr(n, "kernel_shape", [1]) or [1]
        return numel(outs[0]) * float(np.prod(k, dtype=float))
    if op_class(op) == "reduce":
        return sum(numel(i) for i in acts_in) * (5.0 if "Normalization" in op or op.endswith("Softmax") else 1.0)
    if op in ("Sigmoid", "Tanh", "Erf", "Exp", "Log", "Pow", "Sqrt", "Div", "Gelu", "Softplus", "Mish", "HardSwish"):
        return 4.0 * numel(outs[0])  # transcendental / division: several instructions
    return float(numel(outs[0]))
