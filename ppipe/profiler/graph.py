"""ONNX graph preparation and cut points.

A CNN exported to ONNX is a list of nodes in topological order. ppipe cuts it only
between *compute* nodes (nodes that depend on the model input); nodes that depend on
parameters alone (``Constant``, ``ConstantOfShape`` of a constant shape, ``Unsqueeze`` of a
weight, ...) are *constant* nodes: every block that needs one gets its own copy, so they
never cross a cut.

A **cut point** after compute node ``k`` is valid when every activation tensor that
crosses it (produced at or before ``k``, consumed after ``k`` or a model output) has a
known per-sample shape. Its size is counted as transmitted: floating tensors at 2 bytes
per element (fp16), int64 at 4 bytes (as the PPipe artifact counts it), other types at
their own size.

:func:`prepare_model` turns a user's (or a built-in) ONNX file into the form every other
profiler step uses: IR version >= 7 with initializers out of the graph inputs, every node
named, one input whose first dimension is a symbolic batch ``batch``, shapes inferred.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from ppipe.errors import UserError

BATCH_DIM = "batch"
MIN_IR_VERSION = 7

# bytes per element *as transmitted* (see module docstring)
_FLOAT_TYPES = {1, 10, 11, 16}  # FLOAT, FLOAT16, DOUBLE, BFLOAT16
_WIRE_BYTES = {7: 4, 6: 4, 5: 2, 4: 2, 3: 1, 2: 1, 9: 1, 12: 4, 13: 8}  # INT64 at 4 like the artifact


def wire_bytes_per_element(elem_type: int) -> int:
    """Bytes one element of an ONNX tensor type takes on the wire between partitions."""
    if elem_type in _FLOAT_TYPES:
        return 2
    return _WIRE_BYTES.get(elem_type, 4)


def _onnx():
    import onnx

    return onnx


def load_onnx(path: str | Path):
    """Load an ONNX file, raising :class:`UserError` if it is missing or not ONNX."""
    onnx = _onnx()
    p = Path(path)
    if not p.is_file():
        raise UserError("no such file", fix="give the path of an .onnx model file", file=str(p))
    try:
        model = onnx.load(str(p))
    except Exception as exc:  # protobuf DecodeError and friends
        raise UserError(f"not a readable ONNX model ({type(exc).__name__}: {exc})", fix="give an ONNX model file (.onnx)", file=str(p)) from None
    if len(model.graph.node) == 0:
        raise UserError("the ONNX graph has no nodes (not an ONNX model?)", fix="give an ONNX model file (.onnx)", file=str(p))
    return model


def file_sha256(path: str | Path) -> str:
    h = hashlib.sha256()
    with Path(path).open("rb") as fh:
        for chunk in iter(lambda: fh.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def parse_shape(text: str) -> list[int]:
    """Parse a per-sample shape such as ``3,224,224`` or ``3x224x224``."""
    parts = [p for p in text.replace("x", ",").replace(" ", "").split(",") if p]
    try:
        dims = [int(p) for p in parts]
    except ValueError:
        dims = []
    if not dims or any(d <= 0 for d in dims):
        raise UserError(f"--input-shape {text!r} is not a shape", fix="give positive integers per sample, without the batch, e.g. 3,224,224")
    return dims


# ----------------------------------------------------------------------------------------
# preparation
# ----------------------------------------------------------------------------------------
def prepare_model(model, *, input_shape: list[int] | None = None, source: str = "model"):
    """Normalize an ONNX model for profiling (in place) and return it with shapes inferred.

    Args:
        model: an ``onnx.ModelProto``.
        input_shape: per-sample input shape (no batch), required when the file's input
            has symbolic dimensions other than the batch.
        source: file name used in error messages.

    Returns:
        The model, with IR version >= 7, initializers removed from the graph inputs, every
        node named, the input's first dimension the symbolic ``batch``, constant ``Reshape``
        targets that hard-code batch 1 rewritten to copy the batch (``0``), and
        ``value_info`` filled by ONNX shape inference.

    Raises:
        UserError: several inputs, an input without a static per-sample shape, or a graph
            whose shapes cannot be inferred.
    """
    onnx = _onnx()
    g = model.graph
    inits = {i.name for i in g.initializer}
    # 1. initializers out of the inputs (old IR listed them there), IR >= 7
    data_inputs = [i for i in g.input if i.name not in inits]
    if len(data_inputs) != 1:
        raise UserError(
            f"the model has {len(data_inputs)} data inputs ({[i.name for i in data_inputs]}); ppipe profiles single-input CNNs",
            fix="export the model with one input tensor (images)",
            file=source,
        )
    del g.input[:]
    g.input.extend(data_inputs)
    if model.ir_version < MIN_IR_VERSION:
        model.ir_version = MIN_IR_VERSION
    # 2. every node named, uniquely (ORT's profiler and block manifests refer to names)
    seen: set[str] = set()
    for i, n in enumerate(g.node):
        name = n.name or f"{n.op_type}_{i}"
        while name in seen:
            name = f"{name}_{i}"
        n.name = name
        seen.add(name)
    # 3. the input: symbolic batch + static per-sample shape
    inp = g.input[0]  # the copy that extend() put into the graph
    if not inp.type.HasField("tensor_type"):
        raise UserError(f"input {inp.name!r} is not a tensor", fix="export the model with a tensor input", file=source)
    dims = inp.type.tensor_type.shape.dim
    file_dims = [d.dim_value if d.HasField("dim_value") else (d.dim_param or "?") for d in dims]
    static_batch = len(dims) > 0 and dims[0].HasField("dim_value") and dims[0].dim_value == 1
    if input_shape is not None:
        if len(dims) and len(input_shape) != len(dims) - 1:
            raise UserError(
                f"--input-shape has {len(input_shape)} dimensions, the input {inp.name!r} has {len(dims) - 1} per sample (file: {file_dims})",
                fix="give the shape of one sample without the batch, e.g. 3,224,224",
                file=source,
            )
        per_sample = list(input_shape)
    else:
        rest = dims[1:]
        if len(dims) == 0 or any(not d.HasField("dim_value") or d.dim_value <= 0 for d in rest):
            raise UserError(
                f"input {inp.name!r} has dynamic or unknown dimensions {file_dims}",
                fix="give the shape of one sample with --input-shape, e.g. --input-shape 3,224,224",
                file=source,
            )
        if dims[0].HasField("dim_value") and dims[0].dim_value not in (0, 1):
            raise UserError(
                f"input {inp.name!r} has a fixed batch of {dims[0].dim_value}; ppipe needs batch 1 or a dynamic batch",
                fix="export with a dynamic (or 1) first dimension",
                file=source,
            )
        per_sample = [d.dim_value for d in rest]
    inp.type.tensor_type.shape.ClearField("dim")
    new = inp.type.tensor_type.shape.dim.add()
    new.dim_param = BATCH_DIM
    for d in per_sample:
        inp.type.tensor_type.shape.dim.add().dim_value = d
    # 4. Reshape targets that hard-code batch 1 (old exports do) -> 0 = "copy the batch"
    if static_batch or input_shape is not None:
        _dynamic_batch_reshapes(model)
    # 5. outputs: drop their static shapes (batch is symbolic now); inference refills them
    for o in g.output:
        if o.type.HasField("tensor_type"):
            o.type.tensor_type.ClearField("shape")
    del g.value_info[:]
    try:
        inferred = onnx.shape_inference.infer_shapes(model, data_prop=True)
    except Exception as exc:
        raise UserError(f"ONNX shape inference failed: {exc}", fix="check the model with onnx.checker; give --input-shape", file=source) from None
    return inferred


def _dynamic_batch_reshapes(model) -> None:
    from onnx import numpy_helper

    g = model.graph
    inits = {i.name: i for i in g.initializer}
    consumers: dict[str, int] = {}
    for n in g.node:
        for x in n.input:
            consumers[x] = consumers.get(x, 0) + 1
    for n in g.node:
        if n.op_type != "Reshape" or len(n.input) < 2 or n.input[1] not in inits:
            continue
        t = inits[n.input[1]]
        arr = numpy_helper.to_array(t)
        if arr.ndim == 1 and arr.size >= 1 and arr[0] == 1:
            arr = arr.copy()
            arr[0] = 0
            if consumers.get(n.input[1], 0) > 1:
                # shared shape constant: give this Reshape its own copy
                new_name = f"{n.input[1]}__{n.name}"
                g.initializer.append(numpy_helper.from_array(arr, new_name))
                n.input[1] = new_name
            else:
                t.CopyFrom(numpy_helper.from_array(arr, t.name))


# ----------------------------------------------------------------------------------------
# analysis: compute order and cut points
# ----------------------------------------------------------------------------------------
@dataclass(frozen=True)
class CutPoint:
    """A valid place to cut: after compute node ``position``.

    Attributes:
        position: index into :attr:`GraphInfo.compute_nodes` of the last node before the cut.
        last_node: that node's name.
        tensors: activation tensors crossing the cut, sorted by name.
        bytes_per_sample: their size per sample as transmitted (fp16 for floats).
        live_until: the last compute position that reads one of ``tensors`` (the number
            of compute nodes for model outputs). A later cut at ``c < live_until`` would
            need a tensor to pass through the block between them.
    """

    position: int
    last_node: str
    tensors: tuple[str, ...]
    bytes_per_sample: int
    live_until: int


@dataclass
class GraphInfo:
    """What the profiler needs to know about a prepared model.

    Attributes:
        model: the prepared ``onnx.ModelProto`` (shapes inferred).
        input_name: the one data input.
        input_shape: its per-sample shape.
        input_dtype: numpy spelling of its element type.
        compute_nodes: indices (into ``model.graph.node``) of nodes that depend on the input.
        const_nodes: indices of nodes that depend on parameters only.
        shapes: per-sample shape of every activation tensor whose shape is known.
        elem_types: ONNX element type of every typed tensor.
        cuts: valid cut points in compute order; the last one is the model output.
        input_live_until: the last compute position that reads the model input.
    """

    model: object
    input_name: str
    input_shape: list[int]
    input_dtype: str
    compute_nodes: list[int]
    const_nodes: list[int]
    shapes: dict[str, list[int]]
    elem_types: dict[str, int]
    cuts: list[CutPoint] = field(default_factory=list)
    input_live_until: int = 0

    @property
    def output_names(self) -> list[str]:
        return [o.name for o in self.model.graph.output]

    def node(self, compute_pos: int):
        return self.model.graph.node[self.compute_nodes[compute_pos]]

    def cut_at(self, position: int) -> CutPoint | None:
        return self._by_pos.get(position)

    def position_of(self, node_name: str) -> int:
        try:
            return self._pos_by_name[node_name]
        except KeyError:
            raise UserError(f"node {node_name!r} is not a compute node of this model", fix="re-run `ppipe profile` to re-cut the model") from None

    def __post_init__(self) -> None:
        self._by_pos = {c.position: c for c in self.cuts}
        self._pos_by_name = {self.node(i).name: i for i in range(len(self.compute_nodes))}

    def tensor_bytes(self, name: str) -> int | None:
        shape = self.shapes.get(name)
        if shape is None or name not in self.elem_types:
            return None
        return int(np.prod(shape, dtype=np.int64)) * wire_bytes_per_element(self.elem_types[name])


def np_dtype_name(elem_type: int) -> str:
    from onnx import helper

    return str(np.dtype(helper.tensor_dtype_to_np_dtype(elem_type)))


def analyze(model) -> GraphInfo:
    """Classify nodes, collect per-sample shapes and list the valid cut points."""
    g = model.graph
    inp = g.input[0]
    input_name = inp.name
    shapes: dict[str, list[int]] = {}
    elem_types: dict[str, int] = {}
    for vi in list(g.input) + list(g.value_info) + list(g.output):
        tt = vi.type.tensor_type
        if not vi.type.HasField("tensor_type"):
            continue
        elem_types[vi.name] = tt.elem_type
        if not tt.HasField("shape"):
            continue
        dims = tt.shape.dim
        if len(dims) >= 1 and dims[0].dim_param == BATCH_DIM and all(d.HasField("dim_value") for d in dims[1:]):
            shapes[vi.name] = [d.dim_value for d in dims[1:]]
    dynamic = {input_name}
    compute, const = [], []
    for i, n in enumerate(g.node):
        if any(x in dynamic for x in n.input if x):
            compute.append(i)
            dynamic.update(o for o in n.output if o)
        else:
            const.append(i)
    # last compute position that reads each dynamic tensor
    last_use: dict[str, int] = {}
    for pos, idx in enumerate(compute):
        for x in g.node[idx].input:
            if x in dynamic:
                last_use[x] = pos
    outputs = [o.name for o in g.output]
    for o in outputs:
        last_use[o] = len(compute)  # outputs live to the end
    info = GraphInfo(
        model=model,
        input_name=input_name,
        input_shape=shapes.get(input_name, []),
        input_dtype=np_dtype_name(elem_types.get(input_name, 1)),
        compute_nodes=compute,
        const_nodes=const,
        shapes=shapes,
        elem_types=elem_types,
    )
    live: set[str] = {input_name} if last_use.get(input_name, -1) >= 0 else set()
    cuts = []
    for pos, idx in enumerate(compute):
        n = g.node[idx]
        live.update(o for o in n.output if o and last_use.get(o, -1) > pos)
        live = {t for t in live if last_use.get(t, -1) > pos}
        crossing = tuple(sorted(live)) if pos < len(compute) - 1 else tuple(outputs)
        sizes = [info.tensor_bytes(t) for t in crossing]
        if crossing and all(s is not None for s in sizes):
            until = max(last_use.get(t, len(compute)) for t in crossing)
            cuts.append(CutPoint(pos, n.name, crossing, int(sum(sizes)), until))
    info.cuts = cuts
    info.input_live_until = last_use.get(input_name, len(compute))
    info.__post_init__()
    if not cuts or cuts[-1].position != len(compute) - 1:
        raise UserError(
            "the model outputs have no static per-sample shape after shape inference",
            fix="export the model with static shapes (or give --input-shape)",
        )
    return info


__all__ = [
    "BATCH_DIM",
    "CutPoint",
    "GraphInfo",
    "analyze",
    "file_sha256",
    "load_onnx",
    "parse_shape",
    "prepare_model",
    "wire_bytes_per_element",
]
