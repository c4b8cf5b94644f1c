"""Model profiles: ``models/<name>/model.yaml`` and ``profile.csv``.

``model.yaml`` describes the model and its blocks; ``profile.csv`` holds, in long form,
the latency of every block on every GPU type, vGPU level and batch size::

    gpu,vgpu,batch,block,latency_us
    L4,1,1,0,1295.0

``vgpu`` = v means a 1/v share of one GPU (MPS). Blocks are numbered from 0.

:class:`ModelProfile` is the one latency interface that the planner, the simulator and
the runtime read (none of them imports ONNX): ``block_latency_us`` and
``partition_latency_us`` answer "how long does blocks i..j take on (gpu, v) at batch b".
"""

from __future__ import annotations

import csv
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterable, Literal

from pydantic import Field, NonNegativeInt, PositiveInt, model_validator

from ppipe.errors import SpecError
from ppipe.spec.base import SCHEMA_VERSION, StrictModel, dump_yaml, load_yaml_model

PROFILE_COLUMNS = ("gpu", "vgpu", "batch", "block", "latency_us")
MIN_BLOCK_LATENCY_US = 1.0  # PLANNING_MODEL.md: C = sum of max(L, 1 us)


class TensorSpec(StrictModel):
    name: str = Field(description="Tensor name in the ONNX graph.")
    shape: list[int] = Field(description="Shape of ONE sample (no batch dimension).")
    dtype: str = Field(default="float32", description="Element type, numpy spelling (float32, float16, int64, ...).")


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

    @model_validator(mode="after")
    def _blocks_in_order(self) -> "ModelManifest":
        got = [b.index for b in self.blocks]
        if got != list(range(len(got))):
            raise ValueError(f"blocks: indices must be 0..{len(got) - 1} in order, got {got}")
        return self


@dataclass(frozen=True)
class ModelProfile:
    """A model manifest plus its latency table. Immutable; cheap lookups.

    Attributes:
        manifest: the parsed model.yaml.
        table: latency in us keyed by (gpu, vgpu, batch, block).
        directory: folder the profile was loaded from (to resolve block ONNX paths).
    """

    manifest: ModelManifest
    table: dict[tuple[str, int, int, int], float]
    directory: Path | None = None
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
        """Write model.yaml and profile.csv into ``directory``."""
        d = Path(directory)
        d.mkdir(parents=True, exist_ok=True)
        dump_yaml(self.manifest.model_dump(mode="json", exclude_none=True), d / "model.yaml")
        write_profile_csv(d / self.manifest.profile_csv, self.table)
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
    return ModelProfile(manifest=manifest, table=table, directory=d)


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
