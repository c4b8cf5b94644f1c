"""Import profiles in the PPipe artifact's format into ppipe model profiles.

The artifact (``../shared/data/ppipe-artifact``, README there) holds, per model:
``block-timing/<model>-<GPU>-<v>.csv`` (one row per block; column c = batch c+1; us),
``cut-bytes/<model>.csv`` (one row per cut, bytes per sample as transmitted),
``block-mapping/<model>.csv`` (``layer_name,block_index``) and ``model-latency-bs1.csv``.
"""

from __future__ import annotations

import csv
import re
from pathlib import Path

from ppipe.errors import SpecError
from ppipe.spec.profile import BlockSpec, ModelManifest, ModelProfile, SourceSpec

_TIMING = re.compile(r"^(?P<model>.+)-(?P<gpu>[A-Za-z0-9]+)-(?P<v>[1-4])\.csv$")


def artifact_models(artifact_dir: str | Path) -> list[str]:
    """Names of the models that have block timings in the artifact folder."""
    d = Path(artifact_dir) / "block-timing"
    if not d.is_dir():
        raise SpecError(
            "no block-timing/ folder here", fix="point at the artifact's root folder (it holds block-timing/, cut-bytes/)", file=str(artifact_dir)
        )
    names = set()
    for f in d.glob("*.csv"):
        m = _TIMING.match(f.name)
        if m:
            names.add(m.group("model"))
    return sorted(names)


def _read_rows(path: Path) -> list[list[str]]:
    with path.open(newline="") as fh:
        return [row for row in csv.reader(fh) if row and any(c.strip() for c in row)]


def load_artifact_model(artifact_dir: str | Path, model: str) -> ModelProfile:
    """Read one model of the artifact as a :class:`ModelProfile` (in memory)."""
    root = Path(artifact_dir)
    timing_files = sorted((root / "block-timing").glob(f"{model}-*.csv"))
    timing_files = [f for f in timing_files if (m := _TIMING.match(f.name)) and m.group("model") == model]
    if not timing_files:
        known = artifact_models(root)
        raise SpecError(
            f"no block timings for model '{model}'",
            fix=f"use one of: {', '.join(known)}",
            file=str(root / "block-timing"),
        )
    table: dict[tuple[str, int, int, int], float] = {}
    num_blocks = None
    for f in timing_files:
        m = _TIMING.match(f.name)
        assert m is not None  # filtered above
        gpu, v = m.group("gpu"), int(m.group("v"))
        rows = _read_rows(f)
        if num_blocks is None:
            num_blocks = len(rows)
        elif len(rows) != num_blocks:
            raise SpecError(f"{len(rows)} blocks, but other files of this model have {num_blocks}", fix="check the artifact", file=str(f))
        for blk, row in enumerate(rows):
            for c, val in enumerate(row):
                try:
                    table[(gpu, v, c + 1, blk)] = float(val)
                except ValueError:
                    raise SpecError(f"row {blk + 1}, column {c + 1}: '{val}' is not a number", fix="check the artifact", file=str(f)) from None
    assert num_blocks is not None
    cut_file = root / "cut-bytes" / f"{model}.csv"
    if not cut_file.exists():
        raise SpecError("cut bytes missing", fix="the artifact needs cut-bytes/<model>.csv", file=str(cut_file))
    cuts = [int(float(r[0])) for r in _read_rows(cut_file)]
    if len(cuts) != num_blocks - 1:
        raise SpecError(
            f"{len(cuts)} cuts for {num_blocks} blocks (expected {num_blocks - 1})", fix="check the artifact", file=str(cut_file)
        )
    mapping = root / "block-mapping" / f"{model}.csv"
    first: dict[int, str] = {}
    last: dict[int, str] = {}
    counts: dict[int, int] = {}
    if mapping.exists():
        for row in _read_rows(mapping):  # layer_name,block_index (no header)
            if len(row) < 2 or not row[-1].strip().isdigit():
                continue  # a header line, if a copy has one
            name, b = ",".join(row[:-1]), int(row[-1])
            first.setdefault(b, name)
            last[b] = name
            counts[b] = counts.get(b, 0) + 1
    bs1: dict[str, float] = {}
    bs1_file = root / "model-latency-bs1.csv"
    if bs1_file.exists():
        with bs1_file.open(newline="") as fh:
            for row in csv.DictReader(fh):
                if row["model"] == model:
                    bs1[row["gpu"]] = float(row["latency_us"])
    blocks = [
        BlockSpec(
            index=i,
            first_node=first.get(i),
            last_node=last.get(i),
            num_nodes=counts.get(i),
            out_bytes_per_sample=cuts[i] if i < num_blocks - 1 else 0,
        )
        for i in range(num_blocks)
    ]
    gpus = sorted({k[0] for k in table})
    manifest = ModelManifest(
        name=model,
        description="Imported from the PPipe artifact (TensorRT, TF32).",
        source=SourceSpec(kind="ppipe-artifact", path=str(root), note="output bytes of the last block are not in the artifact (recorded as 0)"),
        blocks=blocks,
        latency_bs1_us=bs1,
        provenance={g: "measured: TensorRT by the PPipe authors (artifact)" for g in gpus},
    )
    return ModelProfile(manifest=manifest, table=table)


def import_artifact(artifact_dir: str | Path, out_dir: str | Path, models: list[str] | None = None) -> list[Path]:
    """Write ``out_dir/<model>/`` (model.yaml + profile.csv) for each model; returns the folders."""
    names = models or artifact_models(artifact_dir)
    return [load_artifact_model(artifact_dir, n).save(Path(out_dir) / n) for n in names]
