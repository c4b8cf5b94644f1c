"""Per-layer timings: from a backend's per-layer records to one latency per ONNX node.

``ppipe profile`` times every ONNX compute node at batch 1 on the device it measures: to
cut the model into blocks of about equal time, and to write ``layers.csv`` (the format is
in :mod:`ppipe.spec.profile`), whose per-node times of a GPU type feed the cross-GPU
estimator's per-layer features (:mod:`ppipe.profiler.estimate.crossgpu`).

onnxruntime (CPU) reports per ONNX node already (:func:`ppipe.profiler.ort_backend.layer_times_us`).
TensorRT reports per *engine layer* (:mod:`ppipe.profiler.trt_backend`), and an engine
layer may stand for several ONNX nodes (a fused conv + bias + ReLU, a Myelin
``{ForeignNode[first...last]}``), for a part of one (a ``Gemm`` split into a matrix
multiply and an add), or for none (a format conversion TensorRT inserted). This module
maps the records to nodes, without TensorRT, so that the rules are tested on the CPU:

**Which nodes a layer covers.** From the engine inspector's ``Metadata`` field where the
engine has one (TensorRT 10 with ``ProfilingVerbosity.DETAILED``: ``[ONNX Layer: a]``
entries separated by ``\\x1f`` / ``\\x1e``); else from the layer name, as the ONNX parser
and the builder write it: ``a + b + c`` (fused), ``PWN(a, PWN(b))`` (pointwise fusion),
``{ForeignNode[a...c]}`` (every compute node from ``a`` to ``c`` in compute order),
``Reformatting CopyNode for Input Tensor 0 to X`` (the nodes of ``X``). A name part
resolves to a node by its exact name, or as the name of a tensor the node produces, or
after dropping a TensorRT suffix (``_clone_3``, `` [Shuffle]``, ``_12``).

**Split rule.** A layer's time is split over the nodes it covers in proportion to each
node's *standalone* roofline time on the measured GPU type's spec sheet,
``max(FLOPs / peak, bytes / bandwidth)`` with bytes = its activation inputs and outputs at
their element size plus its weights (:func:`standalone_costs`); where every node of the
layer costs 0 (shape ops), equally. A layer that covers no node (an inserted
reformatting or shuffle layer with a generated name) is charged to the nodes of the
closest *preceding* layer that covers some (in execution order; the first such layer
when it comes before all of them), split the same way. Nodes that no layer covers (folded
into constants, or fused away where the name lists only the survivor) get 0. The share of
time that needed the fallback is returned, so that a profile can say how much was guessed.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Sequence

import numpy as np

# ONNX element types whose tensors can be marked as engine outputs for per-node timing
FLOAT_TYPES = {1, 10, 11, 16}
_ELEM_BYTES = {1: 4, 2: 1, 3: 1, 4: 2, 5: 2, 6: 4, 7: 8, 9: 1, 10: 2, 11: 8, 12: 4, 13: 8, 16: 2}

# Machine balance used where the measured device type is not on the spec sheet.
GENERIC_PEAK_FLOPS = 10e12
GENERIC_BANDWIDTH_BPS = 300e9

_META = re.compile(r"\[ONNX Layer: ([^\]\x1e\x1f]+)\]")
_REFORMAT = re.compile(r"^Reformatting CopyNode for (?:Input|Output) Tensor \d+ to (.+)$")
_FOREIGN = re.compile(r"ForeignNode\[([^\]]*)\]")
_SUFFIXES = (re.compile(r"\s*\[[^\]]*\]$"), re.compile(r"_clone_\d+$"), re.compile(r"_\d+$"), re.compile(r"_output$"))


@dataclass(frozen=True)
class NodeIndex:
    """The compute nodes of a model, in compute order, and how names resolve to them.

    Attributes:
        names: node names in compute order.
        op_types: their ONNX op types.
        by_tensor: output tensor name -> position of the node producing it.
    """

    names: tuple[str, ...]
    op_types: tuple[str, ...]
    by_tensor: dict[str, int] = field(default_factory=dict)
    _pos: dict[str, int] = field(default_factory=dict, repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "_pos", {n: i for i, n in enumerate(self.names)})

    @staticmethod
    def from_graph(info) -> "NodeIndex":
        """From a :class:`ppipe.profiler.graph.GraphInfo`."""
        nodes = [info.node(p) for p in range(len(info.compute_nodes))]
        by_tensor = {o: p for p, n in enumerate(nodes) for o in n.output if o}
        return NodeIndex(tuple(n.name for n in nodes), tuple(n.op_type for n in nodes), by_tensor)

    def __len__(self) -> int:
        return len(self.names)

    def resolve(self, token: str) -> int | None:
        """Position of the node a name part stands for, or None."""
        t = token.strip()
        for _ in range(3):
            if not t:
                return None
            if t in self._pos:
                return self._pos[t]
            if t in self.by_tensor:
                return self.by_tensor[t]
            for pat in _SUFFIXES:
                stripped = pat.sub("", t)
                if stripped != t:
                    t = stripped
                    break
            else:
                return None
        return None


def _balance_parens(tok: str) -> str:
    t = tok.strip()
    while t.startswith("PWN("):
        t = t[4:].strip()
    while t.endswith(")") and t.count(")") > t.count("("):
        t = t[:-1].strip()
    return t


def nodes_from_name(name: str, index: NodeIndex) -> list[int]:
    """Positions of the nodes a TensorRT layer name covers (see the module docstring)."""
    text = name.strip()
    m = _REFORMAT.match(text)
    if m:
        return nodes_from_name(m.group(1), index)
    whole = index.resolve(text)
    if whole is not None:
        return [whole]
    if text.startswith("{") and text.endswith("}"):
        text = text[1:-1]
    out: set[int] = set()
    for fm in _FOREIGN.finditer(text):
        inner = fm.group(1)
        if "..." in inner:
            a, b = inner.split("...", 1)
            pa, pb = index.resolve(a), index.resolve(b)
            if pa is not None and pb is not None:
                lo, hi = min(pa, pb), max(pa, pb)
                out.update(range(lo, hi + 1))
                continue
            parts = [a, b]
        else:
            parts = inner.split(",")
        out.update(p for p in (index.resolve(x) for x in parts) if p is not None)
    rest = _FOREIGN.sub(" + ", text)
    for tok in re.split(r"\s\+\s|,\s*", rest):
        pos = index.resolve(_balance_parens(tok))
        if pos is not None:
            out.add(pos)
    return sorted(out)


def nodes_from_metadata(metadata: str, index: NodeIndex) -> list[int]:
    """Positions of the nodes named in an engine inspector ``Metadata`` field."""
    found = (index.resolve(m) for m in _META.findall(metadata or ""))
    return sorted({p for p in found if p is not None})


def layer_nodes(name: str, metadata: str | None, index: NodeIndex) -> list[int]:
    """Nodes of one engine layer: from its metadata where that names known nodes, else from its name."""
    if metadata:
        got = nodes_from_metadata(metadata, index)
        if got:
            return got
    return nodes_from_name(name, index)


def parse_layer_info(text: str) -> dict[str, str]:
    """Layer name -> ``Metadata`` from the engine inspector's JSON (empty where absent).

    ``get_engine_information(LayerInformationFormat.JSON)`` gives ``{"Layers": [...]}``
    with one object per layer under ``ProfilingVerbosity.DETAILED`` (plain strings, the
    names, under ``LAYER_NAMES_ONLY``).
    """
    try:
        doc = json.loads(text)
    except ValueError:
        return {}
    out: dict[str, str] = {}
    for layer in doc.get("Layers", []) if isinstance(doc, dict) else []:
        if isinstance(layer, dict):
            out[str(layer.get("Name", ""))] = str(layer.get("Metadata", "") or "")
        elif isinstance(layer, str):
            out[layer] = ""
    return out


@dataclass(frozen=True)
class LayerRecord:
    """One engine layer as profiled: its name, time (us, a statistic over runs), metadata."""

    name: str
    time_us: float
    metadata: str = ""


@dataclass(frozen=True)
class Attribution:
    """Per-node times from layer records.

    Attributes:
        node_us: one time per compute node (us), in compute order.
        fallback_us: time of the layers that covered no node (charged to a neighbour).
        total_us: time of all layers.
    """

    node_us: np.ndarray
    fallback_us: float
    total_us: float


def attribute_times(records: Sequence[LayerRecord], index: NodeIndex, weights: Sequence[float]) -> Attribution:
    """Split layer times over ONNX nodes by the rules of the module docstring.

    Args:
        records: the engine's layers in execution order.
        index: the model's compute nodes.
        weights: per node (compute order), its standalone cost; any non-negative scale.
    """
    w = np.asarray(weights, dtype=float)
    if w.shape != (len(index),):
        raise ValueError(f"weights has {w.shape} entries, the model {len(index)} compute nodes")
    out = np.zeros(len(index))
    fallback = 0.0
    pending = 0.0  # unmatched time before the first matched layer
    last: list[int] | None = None

    def charge(nodes: list[int], t: float) -> None:
        ww = w[nodes]
        share = ww / ww.sum() if ww.sum() > 0 else np.full(len(nodes), 1.0 / len(nodes))
        out[nodes] += t * share

    for rec in records:
        t = max(float(rec.time_us), 0.0)
        nodes = layer_nodes(rec.name, rec.metadata, index)
        if nodes:
            charge(nodes, t + pending)
            pending = 0.0
            last = nodes
        else:
            fallback += t
            if last is None:
                pending += t
            else:
                charge(last, t)
    return Attribution(node_us=out, fallback_us=fallback, total_us=float(sum(max(r.time_us, 0.0) for r in records)))


def standalone_costs(info, peak_flops: float = GENERIC_PEAK_FLOPS, bandwidth_bps: float = GENERIC_BANDWIDTH_BPS) -> np.ndarray:
    """Standalone roofline time (s) of every compute node at batch 1: ``max(FLOPs / peak,
    bytes / bandwidth)``, bytes = activation inputs + outputs at their element size +
    weights. The split weights of :func:`attribute_times`."""
    from ppipe.errors import UserError

    g = info.model.graph
    init_bytes = {t.name: float(np.prod(list(t.dims), dtype=float)) * _ELEM_BYTES.get(t.data_type, 4) for t in g.initializer}
    flops: dict[str, float] = {}
    try:
        from ppipe.profiler.estimate.onnx_cost import graph_costs

        flops = {c.name: c.flops for c in graph_costs(info.model)}
    except (UserError, ImportError):
        pass  # bytes alone still rank the nodes

    def act_bytes(name: str) -> float:
        shape = info.shapes.get(name)
        if shape is None:
            return 0.0
        return float(np.prod(shape, dtype=float)) * _ELEM_BYTES.get(info.elem_types.get(name, 1), 4)

    out = np.zeros(len(info.compute_nodes))
    for p in range(len(info.compute_nodes)):
        n = info.node(p)
        moved = sum(act_bytes(x) for x in n.input if x and x not in init_bytes)
        moved += sum(init_bytes.get(x, 0.0) for x in n.input if x)
        moved += sum(act_bytes(o) for o in n.output if o)
        out[p] = max(flops.get(n.name, 0.0) / peak_flops, moved / bandwidth_bps)
    return out


def device_balance(gpu_type: str | None) -> tuple[float, float]:
    """(peak FLOP/s, bandwidth B/s) of a GPU type from the spec sheet, generic if unknown."""
    from ppipe.errors import UserError

    if gpu_type:
        try:
            from ppipe.profiler.estimate.gpus import gpu_spec

            spec = gpu_spec(gpu_type)
            return spec.peak_matmul_tflops * 1e12, spec.memory_bandwidth_gbps * 1e9
        except (UserError, ImportError):  # a type not on the sheet, or no sheet in this build
            pass
    return GENERIC_PEAK_FLOPS, GENERIC_BANDWIDTH_BPS


def activation_outputs(info) -> list[str]:
    """Floating activation tensors produced by compute nodes (not model outputs), in compute
    order: the tensors marked as engine outputs for ``per-node`` TensorRT timing."""
    outputs = set(info.output_names)
    out: list[str] = []
    for p in range(len(info.compute_nodes)):
        for o in info.node(p).output:
            if o and o not in outputs and o in info.shapes and info.elem_types.get(o) in FLOAT_TYPES:
                out.append(o)
    return out


def cross_gpu_layer_inputs(profile, gpu: str) -> tuple[dict, str]:
    """The per-layer inputs of the cross-GPU estimator for a profile's source GPU type.

    The estimator's per-layer features were fitted on the PPipe artifact's per-layer
    tables, which are per-node timings; only ``per-node`` timings in the profile's
    ``layers.csv`` are given to it (other methods distribute time over the nodes
    differently, and would feed it features unlike any it was fitted on).

    Returns:
        ``(kwargs, how)``: keyword arguments for
        :func:`ppipe.profiler.estimate.crossgpu.cross_gpu_table` (``layer_latency_us``,
        ``node_blocks``, ``node_op_types``; empty: the blocks-only model), and a phrase
        saying which model that selects and why, for the provenance.
    """
    from ppipe.spec.profile import LayerMethod

    lt = profile.layers
    if lt is None or gpu not in lt.rows:
        return {}, f"blocks-only model (the profile has no per-layer timings of {gpu} in layers.csv)"
    method = lt.methods[gpu]
    if method != LayerMethod.PER_NODE:
        return {}, (
            f"blocks-only model (the per-layer timings of {gpu} are '{method.value}', not 'per-node' like the "
            "artifact tables the per-layer features were fitted on)"
        )
    kwargs = dict(layer_latency_us=lt.latency_us(gpu), node_blocks=dict(lt.node_blocks), node_op_types=lt.op_types())
    return kwargs, f"per-layer model (the per-node timings of {gpu} in layers.csv as features)"


__all__ = [
    "Attribution",
    "LayerRecord",
    "NodeIndex",
    "activation_outputs",
    "attribute_times",
    "cross_gpu_layer_inputs",
    "device_balance",
    "layer_nodes",
    "nodes_from_metadata",
    "nodes_from_name",
    "parse_layer_info",
    "standalone_costs",
]
