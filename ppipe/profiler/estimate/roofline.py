"""Roofline estimate of block latencies from the ONNX graph and the GPU spec sheet.

For every kernel k of a block (see :mod:`.onnx_cost` for what is a kernel), on GPU type g
at vGPU level v (a 1/v MPS share) and batch b::

    W_k      = b * flops_k                                      (work)
    u_k      = W_k / (W_k + h * SM_g / v)                     (how full the share gets;
                                                                 conv/matmul only, else 1)
    P_k      = peak_k * eff_g / v**gamma_g                      (compute rate of the share)
    M_k      = (b * act_bytes_k + weight_bytes_k) / (BW_g * eff_mem_g / v**gamma_g)
    t_k      = max(W_k / (P_k * u_k), M_k) + launch_g           (launch only for real kernels)
    latency  = sum_k t_k

``peak_k`` is the conv/matmul peak of the precision TensorRT uses on g (``gpus.yaml``:
TF32 tensor cores on Ampere and newer, fp32 CUDA cores before) for conv/matmul kernels and
the fp32 peak for the rest; ``BW_g`` the DRAM bandwidth. The five per-GPU constants
(``eff_g``, ``eff_mem_g``, ``launch_g`` in us, ``h`` in FLOP per SM -- shared by all types --, ``gamma_g``) are
fitted by :func:`fit_roofline` on the artifact's block timings of the models whose graphs
:mod:`.reference_graphs` rebuilds (all levels and batches), and stored in
``roofline_params.json``. GPU types without timings use the constants of the measured
type named by their ``calibration`` entry in ``gpus.yaml``.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Iterable, Mapping, Sequence

import numpy as np

from ppipe.errors import UserError
from ppipe.profiler.estimate.gpus import GpuSpec, gpu_spec
from ppipe.profiler.estimate.onnx_cost import NodeCost, graph_costs

PARAMS_FILE = Path(__file__).with_name("roofline_params.json")
PARAM_NAMES = ("eff", "eff_mem", "launch_us", "half_sat_flops_per_sm", "gamma")
# Starting point and bounds of the fit: physical ranges, not tuned values. ``eff`` may
# exceed 1 because FLOPs are counted for direct convolution, and cuDNN/TensorRT run 3x3
# convolutions with Winograd on the fp32 path (up to 2.25x fewer multiplies). The launch floor
# (2-10 us: a TensorRT kernel enqueue and tail) matters only where the data cannot see it
# (large blocks, as wide_resnet101_2 at 520x520: the fit drives it to the floor).
_X0 = {"eff": 0.5, "eff_mem": 0.6, "launch_us": 5.0, "half_sat_flops_per_sm": 1e7, "gamma": 1.0}
_BOUNDS = {"eff": (0.02, 2.5), "eff_mem": (0.05, 1.0), "launch_us": (2.0, 10.0), "half_sat_flops_per_sm": (1e4, 1e10), "gamma": (0.5, 1.5)}
MIN_LATENCY_US = 1.0


@dataclass(frozen=True)
class BlockWork:
    """A block's kernels as arrays (per sample, except weight bytes)."""

    flops: np.ndarray
    act_bytes: np.ndarray
    weight_bytes: np.ndarray
    is_matmul: np.ndarray
    is_kernel: np.ndarray

    @staticmethod
    def from_costs(costs: Sequence[NodeCost]) -> "BlockWork":
        live = [c for c in costs if c.kernel or c.act_bytes > 0 or c.flops > 0]
        return BlockWork(
            flops=np.array([c.flops for c in live], dtype=float),
            act_bytes=np.array([c.act_bytes for c in live], dtype=float),
            weight_bytes=np.array([c.weight_bytes for c in live], dtype=float),
            is_matmul=np.array([c.op_class in ("conv", "matmul") for c in live], dtype=bool),
            is_kernel=np.array([c.kernel for c in live], dtype=bool),
        )


def _kernel_times_us(
    flops, act_bytes, weight_bytes, is_matmul, is_kernel, spec: GpuSpec, params: Mapping[str, float], vgpu, batch
) -> np.ndarray:
    """Per-kernel times (the module docstring's t_k); vgpu and batch may be arrays."""
    vgpu = np.asarray(vgpu, dtype=float)
    share = vgpu ** params["gamma"]
    peak = np.where(is_matmul, spec.peak_matmul_tflops, spec.peak_fp32_tflops) * 1e12 * params["eff"] / share
    w = batch * flops
    # only conv/matmul kernels have enough parallel work for occupancy to matter; the
    # rest are memory-bound and their compute term is a lower bound anyway
    util = np.where(is_matmul, w / (w + params["half_sat_flops_per_sm"] * spec.sm_count / vgpu + 1e-30), 1.0)
    compute_s = np.where(w > 0, w / (peak * np.maximum(util, 1e-12)), 0.0)
    bw = spec.memory_bandwidth_gbps * 1e9 * params["eff_mem"] / share
    mem_s = (batch * act_bytes + weight_bytes) / bw
    return np.maximum(compute_s, mem_s) * 1e6 + np.where(is_kernel, params["launch_us"], 0.0)


def block_latency_us(work: BlockWork, spec: GpuSpec, params: Mapping[str, float], vgpu: int, batch: int) -> float:
    """Roofline latency of one block (see the module docstring for the formula)."""
    t_us = _kernel_times_us(
        work.flops, work.act_bytes, work.weight_bytes, work.is_matmul, work.is_kernel, spec, params, vgpu, batch
    )
    return float(max(t_us.sum(), MIN_LATENCY_US))


@dataclass(frozen=True)
class _Samples:
    """Many (block, level, batch) samples of one GPU type flattened to kernel rows, so a
    fit evaluates them all in a few array operations."""

    flops: np.ndarray
    act_bytes: np.ndarray
    weight_bytes: np.ndarray
    is_matmul: np.ndarray
    is_kernel: np.ndarray
    vgpu: np.ndarray
    batch: np.ndarray
    sample: np.ndarray
    n: int

    @staticmethod
    def build(rows: Sequence[tuple[BlockWork, int, int, float]]) -> "_Samples":
        cat = lambda f: np.concatenate([getattr(w, f) for w, _v, _b, _l in rows])  # noqa: E731
        sizes = [len(w.flops) for w, _v, _b, _l in rows]
        rep = lambda vals: np.repeat(np.asarray(vals, dtype=float), sizes)  # noqa: E731
        return _Samples(
            flops=cat("flops"), act_bytes=cat("act_bytes"), weight_bytes=cat("weight_bytes"),
            is_matmul=cat("is_matmul"), is_kernel=cat("is_kernel"),
            vgpu=rep([v for _w, v, _b, _l in rows]), batch=rep([b for _w, _v, b, _l in rows]),
            sample=np.repeat(np.arange(len(rows)), sizes), n=len(rows),
        )

    def latency_us(self, spec: GpuSpec, params: Mapping[str, float]) -> np.ndarray:
        t = _kernel_times_us(
            self.flops, self.act_bytes, self.weight_bytes, self.is_matmul, self.is_kernel, spec, params, self.vgpu, self.batch
        )
        return np.maximum(np.bincount(self.sample, weights=t, minlength=self.n), MIN_LATENCY_US)


@lru_cache(maxsize=4)
def _load_params(path: str) -> dict:
    p = Path(path)
    if not p.exists():
        raise UserError(
            "roofline parameters not found",
            fix="run `python -m ppipe.profiler.estimate fit-roofline <artifact folder>` to fit them",
            file=str(p),
        )
    return json.loads(p.read_text())


def roofline_params(gpu: str, path: str | Path = PARAMS_FILE) -> dict[str, float]:
    """The fitted constants a GPU type uses (its own, or its ``calibration`` type's)."""
    spec = gpu_spec(gpu)
    data = _load_params(str(path))
    per_gpu = data["gpus"]
    if spec.calibration not in per_gpu:
        raise UserError(
            f"GPU type {gpu} borrows the calibration of {spec.calibration}, which roofline_params.json lacks "
            f"(it has {', '.join(sorted(per_gpu))})",
            fix="set 'calibration' in gpus.yaml to a fitted type, or refit with fit_roofline()",
            file=str(path),
        )
    return {k: float(per_gpu[spec.calibration][k]) for k in PARAM_NAMES}


def provenance(gpu: str) -> str:
    """One line for a profile's ``provenance`` entry of an estimated GPU type."""
    spec = gpu_spec(gpu)
    borrowed = "" if spec.calibration == gpu else f", efficiencies borrowed from {spec.calibration}"
    measured_on = _load_params(str(PARAMS_FILE))["gpus"].get(spec.calibration, {}).get("measured_on")
    fitted_on = "PPipe-artifact TensorRT timings" if measured_on is None else measured_on["summary"]
    return (
        f"estimated: roofline of the block ONNX graphs on the {gpu} spec sheet ({spec.matmul_precision} conv/matmul "
        f"{spec.peak_matmul_tflops:g} TFLOP/s, {spec.memory_bandwidth_gbps:g} GB/s{borrowed}; "
        f"constants fitted on {fitted_on}), not measured"
    )


def block_work_from_onnx(paths: Iterable[str | Path]) -> list[BlockWork]:
    return [BlockWork.from_costs(graph_costs(p)) for p in paths]


def roofline_table(
    block_onnx_paths: list[Path],
    gpus: list[str],
    levels_by_gpu: dict[str, list[int]],
    batches_by_level: dict[int, list[int]],
) -> dict[tuple[str, int, int, int], float]:
    """Roofline latency of every block on every GPU type, level and batch.

    Args:
        block_onnx_paths: the blocks' ONNX files, in block order (static per-sample shapes;
            the batch dimension symbolic or 1).
        gpus: GPU types (names on the spec sheet, ``gpus.yaml``).
        levels_by_gpu: vGPU levels per GPU type.
        batches_by_level: batch sizes per level.

    Returns:
        {(gpu, vgpu, batch, block): latency_us}.

    Raises:
        UserError: an unknown GPU type (the message lists the known ones), a level without
            batches, or an ONNX file whose shapes cannot be inferred.
    """
    specs = {g: gpu_spec(g) for g in gpus}  # unknown types fail before any ONNX work
    params = {g: roofline_params(g) for g in gpus}
    for g in gpus:
        for v in levels_by_gpu.get(g, [1]):
            if v not in batches_by_level:
                raise UserError(f"no batch sizes given for level {v} (GPU {g})", fix="add the level to batches_by_level")
    works = block_work_from_onnx(block_onnx_paths)
    out: dict[tuple[str, int, int, int], float] = {}
    for g in gpus:
        for v in levels_by_gpu.get(g, [1]):
            for b in batches_by_level[v]:
                for i, w in enumerate(works):
                    out[(g, int(v), int(b), i)] = block_latency_us(w, specs[g], params[g], int(v), int(b))
    return out


# ---------------------------------------------------------------------------------
# calibration
# ---------------------------------------------------------------------------------
def fit_roofline(
    artifact_dir: str | Path, *, models: Sequence[str] | None = None, out: str | Path | None = None
) -> dict:
    """Fit the per-GPU constants on the artifact's block timings of rebuilt graphs.

    Args:
        artifact_dir: the PPipe artifact folder.
        models: artifact models to fit on (default: every model
            :mod:`.reference_graphs` rebuilds).
        out: where to write the JSON (``None``: do not write; the shipped file is
            :data:`PARAMS_FILE`). GPU types the file holds from :func:`fit_measured` and
            the artifact lacks are kept.

    Returns:
        The parameter document: ``{"version", "fitted_on", "gpus": {gpu: {name: value,
        "rms_log_error": ...}}}``.
    """
    from ppipe.profiler.estimate.artifact_data import load_model
    from ppipe.profiler.estimate.reference_graphs import REFERENCE_GRAPHS, block_costs

    names = list(models or REFERENCE_GRAPHS)
    samples: dict[str, list[tuple[BlockWork, int, int, float]]] = {}
    for name in names:
        prof = load_model(artifact_dir, name).profile
        works = [BlockWork.from_costs(c) for c in block_costs(name, artifact_dir)]
        for (g, v, b, blk), lat in prof.table.items():
            samples.setdefault(g, []).append((works[blk], v, b, lat))
    doc = {"version": 1, "fitted_on": names, "gpus": _fit(samples)}
    if out is not None:
        kept = json.loads(Path(out).read_text())["gpus"] if Path(out).exists() else {}
        doc["gpus"] |= {g: p for g, p in kept.items() if "measured_on" in p and g not in doc["gpus"]}
        _write_params(doc, out)
    return doc


def fit_measured(gpu: str, profile_dirs: Sequence[str | Path], *, out: str | Path | None = None, params_file: str | Path = PARAMS_FILE) -> dict:
    """Fit one GPU type's constants on its measured rows in ppipe profiles (``ppipe profile --measure``).

    The occupancy constant h stays the one the artifact fit shares (``params_file``): a few
    models on one GPU barely constrain it. ``eff``, ``eff_mem``, ``launch_us`` and ``gamma``
    (1 without levels) are fitted on every measured (level, batch, block) of ``gpu``, the
    blocks' work read from the profiles' block ONNX files. The entry records what it was
    fitted on (``measured_on``: models, points, the first profile's provenance).

    Returns:
        The parameter document of ``params_file`` with ``gpu``'s entry replaced; written to
        ``out`` when given (then a type whose ``calibration`` in ``gpus.yaml`` is ``gpu``
        uses it).
    """
    from ppipe.profiler.blocks import ensure_block_models
    from ppipe.spec.profile import load_profile

    gpu_spec(gpu)  # an unknown type fails first, listing the known ones
    rows: list[tuple[BlockWork, int, int, float]] = []
    models, provenances = [], []
    for d in sorted(profile_dirs, key=lambda d: Path(d).resolve()):  # the fit does not depend on the order given
        prof = load_profile(d)
        measured = {k: lat for k, lat in prof.table.items() if k[0] == gpu}
        if not measured or not prof.manifest.provenance.get(gpu, "").startswith("measured"):
            raise UserError(f"profile {d} has no measured rows for {gpu}", fix=f"profile it with --measure {gpu} on that GPU", file=str(d))
        works = block_work_from_onnx(ensure_block_models(prof))
        rows += [(works[blk], v, b, lat) for (_g, v, b, blk), lat in sorted(measured.items())]
        models.append(prof.name)
        provenances.append(prof.manifest.provenance[gpu])
    doc = json.loads(Path(params_file).read_text())
    shared_h = next(iter(doc["gpus"].values()))["half_sat_flops_per_sm"]
    doc["gpus"][gpu] = _fit({gpu: rows}, shared_h=shared_h)[gpu] | {
        "measured_on": {
            "models": models,
            "points": len(rows),
            "provenance": provenances[0],
            "summary": f"{len(rows)} block timings of {', '.join(models)} measured on {gpu} by {_measured_by(provenances[0])}",
        }
    }
    if out is not None:
        _write_params(doc, out)
    return doc


def _measured_by(provenance: str) -> str:
    """What took a measurement, from its provenance (``measured: PyTorch 2.11 (tf32, ...) on NVIDIA ...``)."""
    return provenance.removeprefix("measured: ").split(" on ")[0]


def _write_params(doc: dict, out: str | Path) -> None:
    Path(out).write_text(json.dumps(doc, indent=2) + "\n")
    _load_params.cache_clear()


def _fit(samples: dict[str, list[tuple[BlockWork, int, int, float]]], shared_h: float | None = None) -> dict[str, dict]:
    """Least squares in log latency over all GPU types' samples at once.

    The occupancy constant h (FLOP per SM for half occupancy) is shared by all GPU types,
    because large calibration blocks barely constrain it and a per-GPU value then drifts to
    whatever the bounds allow, which ruins small blocks; ``shared_h`` fixes it instead of
    fitting it. Each GPU type has its own eff, eff_mem, launch_us and gamma (gamma fixed at
    1 without MPS data).
    """
    from scipy.optimize import least_squares

    per_gpu = [k for k in PARAM_NAMES if k != "half_sat_flops_per_sm"]
    gpus = sorted(samples)
    has_levels = {g: len({v for _w, v, _b, _l in samples[g]}) > 1 for g in gpus}
    y = np.concatenate([np.log([lat for *_r, lat in samples[g]]) for g in gpus])
    specs = {g: gpu_spec(g) for g in gpus}
    flat = {g: _Samples.build(samples[g]) for g in gpus}
    names = [k for _g in gpus for k in per_gpu] + ([] if shared_h else ["half_sat_flops_per_sm"])

    def unpack(theta: np.ndarray) -> dict[str, dict[str, float]]:
        vals = np.exp(theta)
        out_p = {}
        for i, g in enumerate(gpus):
            p = dict(zip(per_gpu, vals[i * len(per_gpu) : (i + 1) * len(per_gpu)]))
            p["half_sat_flops_per_sm"] = shared_h or vals[-1]
            if not has_levels[g]:
                p["gamma"] = 1.0  # no MPS data: a 1/v share assumed to scale linearly
            out_p[g] = p
        return out_p

    def resid(theta: np.ndarray) -> np.ndarray:
        ps = unpack(theta)
        return np.log(np.concatenate([flat[g].latency_us(specs[g], ps[g]) for g in gpus])) - y

    res = least_squares(
        resid,
        np.log([_X0[k] for k in names]),
        bounds=(np.log([_BOUNDS[k][0] for k in names]), np.log([_BOUNDS[k][1] for k in names])),
    )
    fitted = unpack(res.x)
    out: dict[str, dict] = {}
    start = 0
    for g in gpus:
        n = len(samples[g])
        r = res.fun[start : start + n]
        start += n
        out[g] = {k: float(v) for k, v in fitted[g].items()} | {"rms_log_error": float(np.sqrt(np.mean(r**2))), "n_samples": n}
    return out
