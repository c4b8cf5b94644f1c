"""Read the PPipe artifact's timing tables into arrays for fitting and evaluation.

The artifact (README in its folder) holds, per model and GPU type:
``block-timing/<model>-<GPU>-<v>.csv`` (rows = blocks, column c = batch c+1, us),
``layer-latency/<model>-<GPU>.csv`` (``node,latency``: per ONNX node, batch 1, whole GPU, us)
and ``block-mapping/<model>.csv`` (``layer_name,block_index``). This module only reads;
it never copies the artifact anywhere.
"""

from __future__ import annotations

import csv
import re
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from ppipe.errors import SpecError
from ppipe.spec.artifact import artifact_models, load_artifact_model
from ppipe.spec.profile import ModelProfile

_SUFFIX = re.compile(r"_\d+$")


def op_type_of(node_name: str) -> str:
    """ONNX op type from a node name as exporters write it.

    ``/layer1/layer1.0/conv1/Conv`` -> ``Conv``; ``Relu_12`` -> ``Relu``;
    ``/features/ReduceMean_1`` -> ``ReduceMean``. TensorRT plugin prefixes (``TRT``) are
    dropped so that ``TRTInstanceNormalization`` and ``InstanceNormalization`` meet.
    """
    last = node_name.rstrip("/").rsplit("/", 1)[-1]
    last = _SUFFIX.sub("", last)
    if last.startswith("TRT") and len(last) > 3:
        last = last[3:]
    return last or "Unknown"


@dataclass
class ArtifactModel:
    """One model of the artifact, as arrays.

    Attributes:
        name: model name.
        profile: the block timings as a :class:`ModelProfile`.
        nodes: ONNX node names in block-mapping order.
        node_block: block index of each node.
        layer_us: per GPU type, the batch-1 latency of each node (aligned with ``nodes``;
            NaN where the GPU's table lacks the node).
    """

    name: str
    profile: ModelProfile
    nodes: list[str]
    node_block: np.ndarray
    layer_us: dict[str, np.ndarray] = field(default_factory=dict)

    @property
    def op_types(self) -> list[str]:
        return [op_type_of(n) for n in self.nodes]


def _rows(path: Path) -> list[list[str]]:
    with path.open(newline="") as fh:
        return [r for r in csv.reader(fh) if r and any(c.strip() for c in r)]


def read_layer_latency(path: Path) -> dict[str, float]:
    """``node,latency`` -> {node: us}; the header line is optional."""
    out: dict[str, float] = {}
    for row in _rows(path):
        name, val = ",".join(row[:-1]), row[-1]
        try:
            out[name] = float(val)
        except ValueError:
            continue  # header line
    return out


def load_model(artifact_dir: str | Path, name: str) -> ArtifactModel:
    """Read one artifact model with its block mapping and per-layer latencies."""
    root = Path(artifact_dir)
    prof = load_artifact_model(root, name)
    mapping = root / "block-mapping" / f"{name}.csv"
    if not mapping.exists():
        raise SpecError("block mapping missing", fix="the artifact needs block-mapping/<model>.csv", file=str(mapping))
    nodes: list[str] = []
    blocks: list[int] = []
    for row in _rows(mapping):
        if not row[-1].strip().isdigit():
            continue
        nodes.append(",".join(row[:-1]))
        blocks.append(int(row[-1]))
    am = ArtifactModel(name=name, profile=prof, nodes=nodes, node_block=np.asarray(blocks, dtype=int))
    for f in sorted((root / "layer-latency").glob(f"{name}-*.csv")):
        gpu = f.name[len(name) + 1 : -len(".csv")]
        if "-" in gpu:  # another model whose name starts with this one
            continue
        lat = read_layer_latency(f)
        am.layer_us[gpu] = np.array([lat.get(n, np.nan) for n in nodes], dtype=float)
    return am


def load_all(artifact_dir: str | Path, names: list[str] | None = None) -> dict[str, ArtifactModel]:
    """Every model of the artifact (or ``names``), keyed by name."""
    names = names or artifact_models(artifact_dir)
    return {n: load_model(artifact_dir, n) for n in names}
