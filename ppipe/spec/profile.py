"""Model profiles: ``models/<name>/model.yaml`` and ``profile.csv``.

``model.yaml`` describes the model and its blocks; ``profile.csv`` holds, in long form,
the latency of every block on every GPU type, vGPU level and batch size::

    gpu,vgpu,batch,block,latency_us
    L4,1,1,0,1295.0

``vgpu`` = v means a 1/v share of one GPU (MPS). Blocks are numbered from 0.

**Per-layer timings (optional).** A profile may also carry ``layers.csv``: the batch-1
latency of every ONNX compute node on the device types ``ppipe profile`` measured, one
row per (device type, node), nodes in compute order::

    gpu,node,op_type,latency_us
    L4,/conv1/Conv,Conv,36.263

``op_type`` is the node's ONNX op type (from the graph, not guessed from the name). The
header line is the format's version marker (as for ``profile.csv``). ``model.yaml`` lists
the file and, per device type, how the timings were taken (``layers.gpus.<gpu>.method``):

* ``per-node`` – every node timed as its own kernel, fusion prevented (TensorRT with every
  activation marked as an engine output; the PPipe artifact's per-layer tables are of this
  kind: their sums are 1.8-8.4x the whole-model latency, element-wise nodes carry their
  memory traffic). The cross-GPU estimator uses only these as per-layer features.
* ``fused-split`` – TensorRT's per-layer profile of the engine as deployed; a fused layer's
  time is split over its ONNX nodes (:mod:`ppipe.profiler.layers` states the rule).
* ``ort-optimized`` – onnxruntime's per-node profile with all graph optimizations: a node
  fused into another has 0 and its time counts for the node it was fused into.

Node -> block follows from ``model.yaml``'s blocks: block i is the rows from its
``first_node`` to its ``last_node`` (``num_nodes`` of them). Every listed device type has
the same node list. Profiles without ``layers.csv`` (older ones, or imported ones) load as
before; :attr:`ModelProfile.layers` is then ``None``.

:class:`ModelProfile` is the one latency interface that the planner, the simulator and
the runtime read (none of them imports ONNX): ``block_latency_us`` and
``partition_latency_us`` answer "how long does blocks i..j take on (gpu, v) at batch b".
"""

from __future__ import annotations

import csv
import math
from dataclasses import dataclass, field
from enum import Enum
from pathlib import Path
from typing import Iterable, Literal

from pydantic import Field, NonNegativeInt, model_validator

from ppipe.errors import SpecError
from ppipe.spec.base import SCHEMA_VERSION, StrictModel, dump_yaml, load_yaml_model

PROFILE_COLUMNS = ("gpu", "vgpu", "batch", "block", "latency_us")
LAYER_COLUMNS = ("gpu", "node", "op_type", "latency_us")
MIN_BLOCK_LATENCY_US = 1.0  # docs/planning-model.md, Derived quantities: C = sum of max(L, 1 us)


class TensorSpec(StrictModel):
    name: str = Field(description="Tensor name in the ONNX graph.")
    shape: list[int] = Field(description="Shape of ONE sample (no batch dimension).")
    dtype: str = Field(default="float32", description="Element type, numpy spelling (float32, float16, int64, ...).")

    @property
    def fixed(self) -> bool:
        """Whether every dimension is known (none dynamic, <= 0): a sample of it can be made."""
        return all(d > 0 for d in self.shape)


class SourceSpec(StrictModel):
    kind: Literal["onnx", "builtin", "ppipe-artifact", "synthetic"] = Field(
        description="Where the model came from."
    )
    path: str | None = Field(default=None, description="Source ONNX file or artifact folder, if any.")
    note: str = Field(default="", description="Free text, e.g. how weights were materialized.")
    builtin: str | None = Field(
        default=None, description="For kind 'builtin': the name of the onnx backend-test model (e.g. resnet50)."
    )
    weights_seed: int | None = Field(
        default=None, description="For kind 'builtin': seed of the materialized weights (block sub-models are regenerated from it)."
    )
    sha256: str | None = Field(default=None, description="SHA-256 of the source ONNX file, to detect a changed file on resume.")


class BlockSpec(StrictModel):
    index: NonNegativeInt = Field(description="Block number, 0-based, in execution order.")
    first_node: str | None = Field(default=None, description="Name of the first ONNX node of the block.")
    last_node: str | None = Field(default=None, description="Name of the last ONNX node of the block.")
    num_nodes: NonNegativeInt | None = Field(default=None, description="ONNX nodes in the block.")
    out_bytes_per_sample: NonNegativeInt = Field(
        description="Bytes per sample of the feature map leaving this block, as transmitted "
        "(floating tensors at 2 bytes: fp16). For the last block: the model output."
    )
    out_tensors: list[str] = Field(default_factory=list, description="Names of the tensors that cross the cut after this block.")
    onnx: str | None = Field(default=None, description="Runnable ONNX sub-model of this block, relative to model.yaml.")


class LayerMethod(str, Enum):
    """How a device type's per-layer timings were taken (see the module docstring)."""

    PER_NODE = "per-node"
    FUSED_SPLIT = "fused-split"
    ORT_OPTIMIZED = "ort-optimized"


class LayerTimingSpec(StrictModel):
    method: LayerMethod = Field(description="How the per-node times were taken: per-node, fused-split or ort-optimized.")
    provenance: str = Field(default="", description="Free text: backend, version, device, statistic.")


class LayersSpec(StrictModel):
    csv: str = Field(default="layers.csv", description="Per-layer timing table (gpu,node,op_type,latency_us), relative to model.yaml.")
    gpus: dict[str, LayerTimingSpec] = Field(
        min_length=1, description="Device types with per-layer timings in the table, and how each was taken."
    )


class ImagePreprocess(StrictModel):
    """How an encoded image (JPEG, PNG, WebP, BMP, TIFF) becomes the model's input tensor,
    so that clients may send images (``BYTES`` inputs) instead of tensors.

    The input's shape gives the size and the layout: ``[C, H, W]`` for ``layout: NCHW``,
    ``[H, W, C]`` for ``NHWC``, with C = 3 (``color`` RGB or BGR) or 1 (gray). A decoded
    image of ``h x w`` becomes ``H x W`` by ``resize``: ``stretch`` scales each axis on its
    own (aspect not kept); ``letterbox`` scales both by ``min(H / h, W / w)`` and pads the
    bottom and right with ``pad_value`` (the detectors' "keep ratio" resize). Each channel c
    of pixel p (0-255) then becomes ``(p x scale - mean[c]) / std[c]`` in the input's dtype
    (``uint8`` inputs take the resized pixels as they are).
    """

    color: Literal["RGB", "BGR", "GRAY"] = Field(default="RGB", description="Channel order the model takes (GRAY: one channel).")
    layout: Literal["NCHW", "NHWC"] = Field(default="NCHW", description="Where the channels are in the input's shape.")
    resize: Literal["stretch", "letterbox"] = Field(default="stretch", description="stretch: to H x W; letterbox: aspect kept, padded.")
    interpolation: Literal["linear", "area", "nearest"] = Field(default="linear", description="Resampling filter (OpenCV's).")
    pad_value: int = Field(default=0, ge=0, le=255, description="Pixel value (0-255) of letterbox padding, before normalization.")
    scale: float = Field(default=1.0, gt=0, description="Pixels (0-255) are multiplied by this first, e.g. 0.00392157 for 0-1.")
    mean: list[float] = Field(default_factory=lambda: [0.0], description="Subtracted per channel after scale (one value: all).")
    std: list[float] = Field(default_factory=lambda: [1.0], description="Divided by per channel after the mean (one value: all).")

    @model_validator(mode="after")
    def _per_channel(self) -> "ImagePreprocess":
        channels = 1 if self.color == "GRAY" else 3
        for key in ("mean", "std"):
            if len(getattr(self, key)) not in (1, channels):
                raise ValueError(f"preprocess.{key} needs 1 or {channels} values for color {self.color}, got {len(getattr(self, key))}")
        if any(v == 0 for v in self.std):
            raise ValueError("preprocess.std must not hold 0")
        return self

    def geometry(self, spec: "TensorSpec") -> tuple[int, int, int]:
        """(H, W, C) of the model input ``spec`` under this layout.

        Raises:
            ValueError: the input is not 3-D, or its channels do not match ``color``.
        """
        if len(spec.shape) != 3:
            raise ValueError(f"preprocess needs a 3-D input ([C, H, W] or [H, W, C]), input '{spec.name}' has shape {spec.shape}")
        c, h, w = spec.shape if self.layout == "NCHW" else (spec.shape[2], *spec.shape[:2])
        if c != (1 if self.color == "GRAY" else 3):
            raise ValueError(f"preprocess color {self.color} gives {1 if self.color == 'GRAY' else 3} channel(s); input "
                             f"'{spec.name}' has {c} under layout {self.layout} (shape {spec.shape})")
        return h, w, c


IMAGENET_PREPROCESS = ImagePreprocess(color="RGB", layout="NCHW", resize="stretch", scale=1 / 255,
                                      mean=[0.485, 0.456, 0.406], std=[0.229, 0.224, 0.225])
"""torchvision's ImageNet normalization: what the built-in classifiers (3 x 224 x 224) take."""


class ModelManifest(StrictModel):
    version: int = Field(default=SCHEMA_VERSION, description="File format version.")
    name: str = Field(description="Model name (unique within a plan).")
    description: str = Field(default="", description="Free text.")
    source: SourceSpec = Field(description="Provenance of the model.")
    input: TensorSpec | None = Field(default=None, description="Model input (one sample).")
    outputs: list[TensorSpec] = Field(default_factory=list, description="Model outputs (one sample each).")
    blocks: list[BlockSpec] = Field(min_length=1, description="Pre-partitioned blocks, in order.")
    latency_bs1_us: dict[str, float] = Field(
        default_factory=dict, description="Whole-model batch-1 latency per GPU type on a whole GPU, in us."
    )
    provenance: dict[str, str] = Field(
        default_factory=dict,
        description="Per GPU type: how its timings were obtained ('measured: onnxruntime ...', 'estimated: ...').",
    )
    slo_ms: float | None = Field(default=None, gt=0, description="Default SLO of the model in ms (optional).")
    profile_csv: str = Field(default="profile.csv", description="Latency table, relative to model.yaml.")
    layers: LayersSpec | None = Field(
        default=None, description="Optional per-layer (per ONNX node) batch-1 timings of the measured device types."
    )
    preprocess: ImagePreprocess | None = Field(
        default=None, description="How encoded images sent as BYTES inputs become the input tensor; none: tensors only."
    )

    @model_validator(mode="after")
    def _blocks_in_order(self) -> "ModelManifest":
        got = [b.index for b in self.blocks]
        if got != list(range(len(got))):
            raise ValueError(f"blocks: indices must be 0..{len(got) - 1} in order, got {got}")
        return self

    @model_validator(mode="after")
    def _preprocess_fits_input(self) -> "ModelManifest":
        if self.preprocess is None:
            return self
        if self.input is None:
            raise ValueError("preprocess needs the model's input (input: name, shape, dtype)")
        if self.input.dtype not in ("float32", "float16", "uint8"):
            raise ValueError(f"preprocess makes float32, float16 or uint8 inputs; input '{self.input.name}' is {self.input.dtype}")
        self.preprocess.geometry(self.input)
        return self


@dataclass(frozen=True)
class ModelProfile:
    """A model manifest plus its latency table. Immutable; cheap lookups.

    Attributes:
        manifest: the parsed model.yaml.
        table: latency in us keyed by (gpu, vgpu, batch, block).
        directory: folder the profile was loaded from (to resolve block ONNX paths).
        layers: the optional per-layer timings (``layers.csv``), or None.
    """

    manifest: ModelManifest
    table: dict[tuple[str, int, int, int], float]
    directory: Path | None = None
    layers: "LayerTimings | None" = None
    _batches: dict[tuple[str, int], tuple[int, ...]] = field(default_factory=dict, repr=False, compare=False)

    def __post_init__(self) -> None:
        batches: dict[tuple[str, int], set[int]] = {}
        for (gpu, v, b, _blk) in self.table:
            batches.setdefault((gpu, v), set()).add(b)
        object.__setattr__(self, "_batches", {k: tuple(sorted(s)) for k, s in batches.items()})

    # ---- identity ---------------------------------------------------------------
    @property
    def name(self) -> str:
        return self.manifest.name

    @property
    def num_blocks(self) -> int:
        return len(self.manifest.blocks)

    # ---- what the table covers ----------------------------------------------------
    def gpus(self) -> list[str]:
        return sorted({g for (g, _v) in self._batches})

    def levels(self, gpu: str) -> list[int]:
        return sorted({v for (g, v) in self._batches if g == gpu})

    def batches(self, gpu: str, vgpu: int) -> tuple[int, ...]:
        """Batch sizes profiled for (gpu, vgpu), ascending; empty if none."""
        return self._batches.get((gpu, vgpu), ())

    # ---- latency -----------------------------------------------------------------
    def block_latency_us(self, gpu: str, vgpu: int, batch: int, block: int) -> float:
        try:
            return self.table[(gpu, vgpu, batch, block)]
        except KeyError:
            raise KeyError(f"{self.name}: no timing for gpu={gpu} vgpu={vgpu} batch={batch} block={block}") from None

    def partition_latency_us(self, gpu: str, vgpu: int, batch: int, first: int, last: int) -> float:
        """Latency of blocks first..last (inclusive) at a batch: sum of max(L, 1 us)."""
        return sum(
            max(self.block_latency_us(gpu, vgpu, batch, i), MIN_BLOCK_LATENCY_US) for i in range(first, last + 1)
        )

    def model_latency_us(self, gpu: str, vgpu: int = 1, batch: int = 1) -> float:
        return self.partition_latency_us(gpu, vgpu, batch, 0, self.num_blocks - 1)

    def cut_bytes(self, block: int) -> int:
        """Bytes per sample crossing the cut after ``block`` (as transmitted)."""
        return self.manifest.blocks[block].out_bytes_per_sample

    def transfer_us_per_sample(self, block: int, bandwidth_gbps: float) -> float:
        """Time to send one sample's feature map after ``block`` at an effective bandwidth."""
        return self.cut_bytes(block) * 8 / (bandwidth_gbps * 1e9) * 1e6

    def block_onnx_path(self, block: int) -> Path | None:
        rel = self.manifest.blocks[block].onnx
        if rel is None:
            return None
        base = self.directory or Path(".")
        return base / rel

    # ---- I/O ----------------------------------------------------------------------
    def save(self, directory: str | Path) -> Path:
        """Write model.yaml and profile.csv (and layers.csv, if the profile has per-layer
        timings) into ``directory``."""
        d = Path(directory)
        d.mkdir(parents=True, exist_ok=True)
        spec = self.manifest.layers
        if (spec is None) != (self.layers is None) or (
            spec is not None and self.layers is not None and set(spec.gpus) != set(self.layers.gpus())
        ):
            raise ValueError("manifest.layers and the layer timings disagree on the device types")
        dump_yaml(self.manifest.model_dump(mode="json", exclude_none=True), d / "model.yaml")
        write_profile_csv(d / self.manifest.profile_csv, self.table)
        if spec is not None and self.layers is not None:
            write_layers_csv(d / spec.csv, self.layers)
        return d


def write_profile_csv(path: str | Path, table: dict[tuple[str, int, int, int], float]) -> None:
    rows = sorted(table.items())
    with Path(path).open("w", newline="") as fh:
        w = csv.writer(fh)
        w.writerow(PROFILE_COLUMNS)
        for (gpu, v, b, blk), lat in rows:
            w.writerow([gpu, v, b, blk, f"{lat:.3f}"])


def read_profile_csv(path: str | Path, num_blocks: int) -> dict[tuple[str, int, int, int], float]:
    p = Path(path)
    if not p.exists():
        raise SpecError("profile table not found", fix="run `ppipe profile` for this model, or fix 'profile_csv'", file=str(p))
    table: dict[tuple[str, int, int, int], float] = {}
    with p.open(newline="") as fh:
        reader = csv.DictReader(fh)
        if reader.fieldnames is None or tuple(reader.fieldnames) != PROFILE_COLUMNS:
            raise SpecError(
                f"header is {reader.fieldnames}, expected {list(PROFILE_COLUMNS)}",
                fix="write the header line 'gpu,vgpu,batch,block,latency_us'",
                file=str(p),
            )
        for lineno, row in enumerate(reader, start=2):
            try:
                key = (row["gpu"], int(row["vgpu"]), int(row["batch"]), int(row["block"]))
                lat = float(row["latency_us"])
            except (TypeError, ValueError):
                raise SpecError(
                    f"line {lineno}: cannot read {dict(row)}",
                    fix="vgpu, batch and block must be integers and latency_us a number",
                    file=str(p),
                ) from None
            if not math.isfinite(lat) or lat < 0:
                raise SpecError(f"line {lineno}: latency_us {lat} is not a finite non-negative number", fix="re-profile", file=str(p))
            if not (0 <= key[3] < num_blocks):
                raise SpecError(
                    f"line {lineno}: block {key[3]} outside 0..{num_blocks - 1} (model.yaml has {num_blocks} blocks)",
                    fix="profile.csv and model.yaml disagree: re-run `ppipe profile`",
                    file=str(p),
                )
            if key[1] not in (1, 2, 3, 4) or key[2] < 1:
                raise SpecError(f"line {lineno}: vgpu must be 1..4 and batch >= 1", fix="correct the row", file=str(p))
            if key in table:
                raise SpecError(f"line {lineno}: duplicate row for {key}", fix="keep one row per (gpu, vgpu, batch, block)", file=str(p))
            table[key] = lat
    _check_complete(table, num_blocks, str(p))
    return table


def _check_complete(table: dict[tuple[str, int, int, int], float], num_blocks: int, file: str) -> None:
    """Every (gpu, vgpu, batch) that appears must have all blocks."""
    seen: dict[tuple[str, int, int], set[int]] = {}
    for (g, v, b, blk) in table:
        seen.setdefault((g, v, b), set()).add(blk)
    for (g, v, b), blocks in sorted(seen.items()):
        missing = sorted(set(range(num_blocks)) - blocks)
        if missing:
            raise SpecError(
                f"missing timings for gpu={g} vgpu={v} batch={b}: blocks {missing}",
                fix="re-run `ppipe profile` (it resumes) or remove that (gpu, vgpu, batch) entirely",
                file=file,
            )


@dataclass(frozen=True)
class LayerRow:
    """One ONNX compute node: name, op type, batch-1 latency on one device type (us)."""

    node: str
    op_type: str
    latency_us: float


@dataclass(frozen=True)
class LayerTimings:
    """Per-layer timings of a profile (``layers.csv``), checked against its blocks.

    Attributes:
        rows: per device type, one row per compute node, in compute order (the same
            nodes for every device type).
        node_blocks: node name -> block index (from model.yaml's blocks).
        methods: per device type, how the timings were taken.
    """

    rows: dict[str, tuple[LayerRow, ...]]
    node_blocks: dict[str, int]
    methods: dict[str, LayerMethod]

    def gpus(self) -> list[str]:
        return sorted(self.rows)

    def latency_us(self, gpu: str) -> dict[str, float]:
        """node -> batch-1 latency on ``gpu`` (us)."""
        return {r.node: r.latency_us for r in self.rows[gpu]}

    def op_types(self) -> dict[str, str]:
        """node -> ONNX op type."""
        first = self.rows[self.gpus()[0]]
        return {r.node: r.op_type for r in first}

    def nodes(self) -> list[str]:
        return [r.node for r in self.rows[self.gpus()[0]]]

    def with_gpu(self, gpu: str, rows: Iterable[LayerRow], method: LayerMethod) -> "LayerTimings":
        """A copy with ``gpu``'s rows set (same nodes, same order as the others)."""
        new = tuple(rows)
        if self.rows and [r.node for r in new] != self.nodes():
            raise ValueError(f"per-layer rows of {gpu} list other nodes than the table's")
        return LayerTimings(rows={**self.rows, gpu: new}, node_blocks=self.node_blocks, methods={**self.methods, gpu: method})

    def without(self, gpus: Iterable[str]) -> "LayerTimings | None":
        drop = set(gpus)
        keep = {g: r for g, r in self.rows.items() if g not in drop}
        if not keep:
            return None
        return LayerTimings(rows=keep, node_blocks=self.node_blocks, methods={g: m for g, m in self.methods.items() if g in keep})


def layer_node_blocks(manifest: ModelManifest, nodes: list[str], file: str) -> dict[str, int]:
    """Map nodes (in compute order) to blocks by model.yaml's first/last node and count.

    Raises:
        SpecError: the blocks do not name their nodes, or the node list does not match them.
    """
    fix = "re-run `ppipe profile` for this model (it re-times the layers), or delete the per-layer file and the 'layers' entry of model.yaml"
    if any(b.first_node is None or b.last_node is None for b in manifest.blocks):
        raise SpecError(
            "model.yaml's blocks do not name their first_node/last_node, so the per-layer nodes cannot be mapped to blocks",
            fix=fix,
            file=file,
        )
    index = {n: i for i, n in enumerate(nodes)}
    out: dict[str, int] = {}
    start = 0
    for b in manifest.blocks:
        if start >= len(nodes) or nodes[start] != b.first_node:
            got = nodes[start] if start < len(nodes) else "(end of the table)"
            raise SpecError(
                f"node list does not match model.yaml's blocks: block {b.index} starts at node {b.first_node!r} "
                f"(first_node), the table has {got!r} there",
                fix=fix,
                file=file,
            )
        end = index.get(b.last_node)  # type: ignore[arg-type]
        if end is None or end < start:
            raise SpecError(
                f"node list does not match model.yaml's blocks: block {b.index}'s last_node {b.last_node!r} is not "
                "in the table after its first node",
                fix=fix,
                file=file,
            )
        if b.num_nodes is not None and end - start + 1 != b.num_nodes:
            raise SpecError(
                f"node list does not match model.yaml's blocks: block {b.index} has {end - start + 1} nodes in the "
                f"table, model.yaml says num_nodes {b.num_nodes}",
                fix=fix,
                file=file,
            )
        for n in nodes[start : end + 1]:
            out[n] = b.index
        start = end + 1
    if start != len(nodes):
        raise SpecError(
            f"node list does not match model.yaml's blocks: {len(nodes) - start} node(s) after the last block's "
            f"last_node ({nodes[start]!r} ...)",
            fix=fix,
            file=file,
        )
    return out


def make_layer_timings(
    manifest: ModelManifest, rows: dict[str, Iterable[LayerRow]], methods: dict[str, LayerMethod], file: str = "layers.csv"
) -> LayerTimings:
    """Layer timings for a manifest, checked like :func:`read_layers_csv` checks the file."""
    got = {g: tuple(rs) for g, rs in rows.items()}
    if not got or set(got) != set(methods):
        raise ValueError("rows and methods must name the same, non-empty set of device types")
    nodes = [r.node for r in got[sorted(got)[0]]]
    for g, rs in got.items():
        if [r.node for r in rs] != nodes:
            raise ValueError(f"per-layer rows of {g} list other nodes than those of {sorted(got)[0]}")
    return LayerTimings(rows=got, node_blocks=layer_node_blocks(manifest, nodes, file), methods=dict(methods))


def write_layers_csv(path: str | Path, layers: LayerTimings) -> None:
    with Path(path).open("w", newline="") as fh:
        w = csv.writer(fh)
        w.writerow(LAYER_COLUMNS)
        for gpu in layers.gpus():
            for r in layers.rows[gpu]:
                w.writerow([gpu, r.node, r.op_type, f"{r.latency_us:.3f}"])


def read_layers_csv(path: str | Path, manifest: ModelManifest) -> LayerTimings:
    """Read and check ``layers.csv`` against model.yaml (its ``layers`` entry and blocks)."""
    p = Path(path)
    spec = manifest.layers
    if spec is None:
        raise ValueError("manifest has no 'layers' entry")
    if not p.exists():
        raise SpecError(
            "per-layer timing table not found (model.yaml's 'layers.csv' names it)",
            fix="copy layers.csv with the profile, or delete the 'layers' entry of model.yaml",
            file=str(p),
        )
    rows: dict[str, list[LayerRow]] = {}
    with p.open(newline="") as fh:
        reader = csv.DictReader(fh)
        if reader.fieldnames is None or tuple(reader.fieldnames) != LAYER_COLUMNS:
            raise SpecError(
                f"header is {reader.fieldnames}, expected {list(LAYER_COLUMNS)}",
                fix="write the header line 'gpu,node,op_type,latency_us' (format version 1)",
                file=str(p),
            )
        for lineno, row in enumerate(reader, start=2):
            gpu, node, op = (row.get("gpu") or "").strip(), (row.get("node") or ""), (row.get("op_type") or "").strip()
            try:
                lat = float(row["latency_us"])
            except (TypeError, ValueError):
                raise SpecError(
                    f"line {lineno}: latency_us {row.get('latency_us')!r} is not a number",
                    fix="latency_us must be a number of microseconds",
                    file=str(p),
                ) from None
            if not gpu or not node or not op:
                raise SpecError(f"line {lineno}: gpu, node and op_type must not be empty", fix="correct the row", file=str(p))
            if not math.isfinite(lat) or lat < 0:
                raise SpecError(f"line {lineno}: latency_us {lat} is not a finite non-negative number", fix="re-profile", file=str(p))
            if gpu not in spec.gpus:
                raise SpecError(
                    f"line {lineno}: device type {gpu!r} is not listed in model.yaml's layers.gpus ({', '.join(sorted(spec.gpus))})",
                    fix="add it to layers.gpus with its method, or remove its rows",
                    file=str(p),
                )
            rows.setdefault(gpu, []).append(LayerRow(node, op, lat))
    missing = sorted(set(spec.gpus) - set(rows))
    if missing:
        raise SpecError(
            f"model.yaml's layers.gpus lists {missing}, which have no rows",
            fix="re-run `ppipe profile`, or drop them from layers.gpus",
            file=str(p),
        )
    ref_gpu = sorted(rows)[0]
    nodes = [r.node for r in rows[ref_gpu]]
    if len(set(nodes)) != len(nodes):
        dup = sorted({n for n in nodes if nodes.count(n) > 1})[:3]
        raise SpecError(f"node(s) {dup} listed more than once for {ref_gpu}", fix="keep one row per (gpu, node)", file=str(p))
    ops = [r.op_type for r in rows[ref_gpu]]
    for g, rs in rows.items():
        if [r.node for r in rs] != nodes:
            raise SpecError(
                f"device types {ref_gpu} and {g} list different nodes (or in another order)",
                fix="every device type needs one row per compute node, in compute order: re-run `ppipe profile`",
                file=str(p),
            )
        if [r.op_type for r in rs] != ops:
            raise SpecError(f"device types {ref_gpu} and {g} disagree on op types", fix="re-run `ppipe profile`", file=str(p))
    node_blocks = layer_node_blocks(manifest, nodes, str(p))
    return LayerTimings(
        rows={g: tuple(rs) for g, rs in rows.items()},
        node_blocks=node_blocks,
        methods={g: s.method for g, s in spec.gpus.items()},
    )


def resolve_model_dir(ref: str | Path) -> Path:
    """A model folder, a model.yaml path, or the name of a built-in model."""
    from ppipe.spec.cluster import builtin_dirs

    p = Path(ref)
    if p.is_file() and p.name.endswith((".yaml", ".yml")):
        return p.parent
    if (p / "model.yaml").exists():
        return p
    for d in builtin_dirs("models"):
        if (d / str(ref) / "model.yaml").exists():
            return d / str(ref)
    known = sorted({m.parent.name for d in builtin_dirs("models") for m in d.glob("*/model.yaml")})
    raise SpecError(
        "no model.yaml here and no built-in model of that name",
        fix="give a folder made by `ppipe profile` or `ppipe import-ppipe`"
        + (f", or a built-in model: {', '.join(known)}" if known else ""),
        file=str(ref),
    )


def load_profile(ref: str | Path) -> ModelProfile:
    """Load a model profile from a folder (or built-in name)."""
    d = resolve_model_dir(ref)
    manifest = load_yaml_model(ModelManifest, d / "model.yaml")
    table = read_profile_csv(d / manifest.profile_csv, len(manifest.blocks))
    layers = read_layers_csv(d / manifest.layers.csv, manifest) if manifest.layers is not None else None
    return ModelProfile(manifest=manifest, table=table, directory=d, layers=layers)


def profile_ref(profile: ModelProfile) -> str:
    """What plan.yaml records to reload a profile: its folder, or the artifact it came from.

    In-memory imports of the PPipe artifact are recorded as ``ppipe-artifact:<dir>#<model>``;
    a profile built in memory and never saved as ``memory:<name>`` (not reloadable).
    """
    if profile.directory is not None:
        return str(Path(profile.directory).resolve())
    src = profile.manifest.source
    if src.kind == "ppipe-artifact" and src.path:
        return f"ppipe-artifact:{Path(src.path).resolve()}#{profile.name}"
    return f"memory:{profile.name}"


def load_profile_ref(ref: str, base: str | Path | None = None) -> ModelProfile:
    """Reload a profile named by plan.yaml's ``profile`` field (see :func:`profile_ref`).

    A relative folder is looked up against ``base`` (the plan's folder) first, then as
    given (the current folder, or a built-in model name).
    """
    if ref.startswith("ppipe-artifact:"):
        from ppipe.spec.artifact import load_artifact_model  # artifact.py imports this module

        root, _, name = ref[len("ppipe-artifact:") :].rpartition("#")
        return load_artifact_model(root, name)
    if ref.startswith("memory:"):
        raise SpecError(
            f"profile '{ref}' was built in memory and cannot be reloaded",
            fix="save it with ModelProfile.save(dir) and plan again",
        )
    p = Path(ref)
    if base is not None and not p.is_absolute() and (Path(base) / p).exists():
        p = Path(base) / p
    return load_profile(p)


def load_profiles(refs: Iterable[str | Path]) -> list[ModelProfile]:
    profiles = [load_profile(r) for r in refs]
    names = [p.name for p in profiles]
    dup = sorted({n for n in names if names.count(n) > 1})
    if dup:
        raise SpecError(f"model name(s) {dup} given more than once", fix="give each model once")
    return profiles
