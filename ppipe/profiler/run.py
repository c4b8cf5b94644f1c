"""``ppipe profile`` as a Python API: ONNX model -> ``models/<name>/`` (model.yaml + profile.csv).

Steps (each is a function of this package):

1. load the ONNX file (or a built-in model with materialized weights) and prepare it
   (:mod:`ppipe.profiler.graph`);
2. time every layer (ONNX compute node) at batch 1 on the measured device: the CPU with
   onnxruntime's profiler, a GPU with TensorRT's (``per-node`` by default, see
   :mod:`ppipe.profiler.trt_backend`; the CPU when nothing is measured), and cut the model
   into blocks of about equal time, preferring small feature maps at the cuts
   (:mod:`ppipe.profiler.blocks`); write the block sub-models;
3. measure every (level, batch, block) of the grid on the local device: ``cpu``
   (onnxruntime, :mod:`ppipe.profiler.ort_backend`) or an NVIDIA GPU (TensorRT,
   :mod:`ppipe.profiler.trt_backend`);
4. add estimates for GPU types that are not here (:mod:`ppipe.profiler.estimate`): with
   ``--estimate-from GPU``, the cross-GPU model, with per-layer features where
   ``layers.csv`` has ``per-node`` timings of that GPU type, else from block timings alone
   (:func:`ppipe.profiler.layers.cross_gpu_layer_inputs`; the provenance says which);
5. write ``model.yaml`` (blocks, cut sizes, input, provenance per GPU type),
   ``profile.csv`` and ``layers.csv`` (per-node batch-1 timings of the device types timed,
   format in :mod:`ppipe.spec.profile`).

**Grid** (the PPipe paper's, :func:`batch_grid`): batches 1..B at level 1, up to 4 at
level 2 and up to 2 at levels 3 and 4 (B = 8 by default). CPU levels are 1 and 2 (the
``local-cpu`` cluster); GPU types get levels 1..4.

**Resume.** ``model.yaml`` is written with the blocks before anything is measured, and
every measurement is appended to ``profile.partial.csv`` as soon as it is taken. Running
the same command again reuses the cuts of the existing ``model.yaml`` (if it describes the
same source, input and number of blocks) and skips every (gpu, vgpu, batch, block) row it
already has, in ``profile.csv`` or in ``profile.partial.csv``. ``layers.csv`` is written
with the first ``model.yaml``; a resumed run keeps its rows and times the layers only on a
measured device type it lacks.
"""

from __future__ import annotations

import csv
import json
import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Callable, Sequence

from tqdm import tqdm

from ppipe.errors import UserError
from ppipe.profiler.blocks import (
    DEFAULT_BLOCKS,
    DEFAULT_SIZE_WEIGHT,
    Block,
    block_fingerprint,
    blocks_from_last_nodes,
    cache_root,
    partition,
    write_blocks,
)
from ppipe.profiler.graph import GraphInfo, analyze, file_sha256, load_onnx, prepare_model
from ppipe.spec.base import dump_yaml

if TYPE_CHECKING:
    from ppipe.spec.profile import LayersSpec, LayerTimings

log = logging.getLogger(__name__)

PARTIAL_CSV = "profile.partial.csv"
CPU = "cpu"
CPU_LEVELS = (1, 2)
GPU_LEVELS = (1, 2, 3, 4)
MAX_BATCH_AT_LEVEL = {1: None, 2: 4, 3: 2, 4: 2}  # None: no cap beyond the requested batches

Key = tuple[str, int, int, int]


def batch_grid(batches: Sequence[int], levels: Sequence[int]) -> dict[int, list[int]]:
    """The batches profiled at each level: all at level 1, <= 4 at level 2, <= 2 at 3 and 4."""
    out = {}
    for v in levels:
        cap = MAX_BATCH_AT_LEVEL.get(v)
        bs = sorted(b for b in set(batches) if cap is None or b <= cap)
        if bs:
            out[v] = bs
    return out


def parse_batches(text: str) -> list[int]:
    """``1-8`` or ``1,2,4,8`` (or a mix) -> sorted batch sizes."""
    out: set[int] = set()
    try:
        for part in text.replace(" ", "").split(","):
            if not part:
                continue
            if "-" in part:
                lo, hi = (int(x) for x in part.split("-", 1))
                out.update(range(lo, hi + 1))
            else:
                out.add(int(part))
    except ValueError:
        out = set()
    if not out or min(out) < 1:
        raise UserError(f"--batches {text!r} is not a list of batch sizes", fix="give e.g. 1-8 or 1,2,4,8 (batch sizes >= 1)")
    return sorted(out)


@dataclass
class ProfileRequest:
    """What to profile and how (the CLI's flags).

    Attributes:
        onnx_path: the user's ONNX file (or None with ``builtin``).
        builtin: name of a built-in model (see :data:`ppipe.profiler.builtin.BUILTIN_MODELS`).
        out_dir: output folder; default ``models/<name>``.
        name: model name; default the built-in name or the file's stem.
        num_blocks: blocks to cut the model into.
        batches: batch sizes at level 1 (see :func:`batch_grid` for the others).
        measure: the local device type to measure on: ``cpu`` (onnxruntime) or a GPU type
            name (TensorRT on the local NVIDIA GPU, e.g. ``L4``); None: measure nothing.
        estimate: GPU types to add roofline estimates for (``ppipe.profiler.estimate``).
        cpu_levels: vGPU levels measured on a CPU.
        gpu_levels: vGPU levels measured or estimated on GPU types.
        input_shape: per-sample input shape for models with dynamic dimensions.
        threads: intra-op threads of the whole CPU (level 1).
        reps: timed runs per measurement.
        seed: weights seed of built-in models.
        size_weight: weight of cut sizes against balance when cutting.
        statistic: ``median`` or ``min`` of the timed runs (``min`` damps a busy machine).
        refresh_estimates: recompute estimates even where rows exist.
        estimate_from: a GPU type measured in this profile (e.g. by ``measure``) to carry
            over to the ``estimate`` types with the cross-GPU model (learned from real
            TensorRT timings) instead of the roofline model.
        trt_layers: TensorRT per-layer timing mode, ``per-node`` or ``fused``
            (:mod:`ppipe.profiler.trt_backend`).
        precision: TensorRT precision, ``tf32`` (as the PPipe artifact) or ``fp16``.
    """

    onnx_path: Path | None = None
    builtin: str | None = None
    out_dir: Path | None = None
    name: str | None = None
    num_blocks: int = DEFAULT_BLOCKS
    batches: list[int] = field(default_factory=lambda: list(range(1, 9)))
    measure: str | None = CPU
    estimate: list[str] = field(default_factory=list)
    cpu_levels: tuple[int, ...] = CPU_LEVELS
    gpu_levels: tuple[int, ...] = GPU_LEVELS
    input_shape: list[int] | None = None
    threads: int | None = None
    reps: int = 10
    seed: int = 0
    size_weight: float = DEFAULT_SIZE_WEIGHT
    statistic: str = "median"
    refresh_estimates: bool = False
    estimate_from: str | None = None
    trt_layers: str = "per-node"
    precision: str = "tf32"
    backend: str = "auto"  # auto: onnxruntime on the CPU, TensorRT on a GPU; torch: ppipe.profiler.torch_backend


def _load(req: ProfileRequest):
    """(model, source spec dict, default name, source file) for the request."""
    from ppipe.profiler.builtin import DEFAULT_SEED, WEIGHTS_NOTE, load_builtin

    if (req.onnx_path is None) == (req.builtin is None):
        raise UserError("give either an ONNX file or --builtin NAME (not both)", fix="e.g. `ppipe profile --builtin resnet50`")
    if req.builtin is not None:
        seed = DEFAULT_SEED if req.seed is None else req.seed
        model, path = load_builtin(req.builtin, seed)
        src = {
            "kind": "builtin",
            "path": f"onnx/backend/test/data/light/{path.name}",
            "builtin": req.builtin,
            "weights_seed": seed,
            "sha256": file_sha256(path),
            "note": WEIGHTS_NOTE.format(name=req.builtin, seed=seed),
        }
        return model, src, req.builtin, path
    path = Path(req.onnx_path)
    model = load_onnx(path)
    src = {"kind": "onnx", "path": str(path.resolve()), "sha256": file_sha256(path)}
    return model, src, path.stem, path


def _reusable_cuts(manifest_path: Path, src: dict, input_shape: list[int], num_blocks: int) -> list[str] | None:
    """Cuts of an existing model.yaml that describes the same model, else None."""
    from ppipe.spec.base import load_yaml_model
    from ppipe.spec.profile import ModelManifest

    if not manifest_path.is_file():
        return None
    try:
        old = load_yaml_model(ModelManifest, manifest_path)
    except UserError:
        return None
    same = (
        old.source.kind == src["kind"]
        and old.source.sha256 == src.get("sha256")
        and old.source.builtin == src.get("builtin")
        and old.source.weights_seed == src.get("weights_seed")
        and old.input is not None
        and list(old.input.shape) == list(input_shape)
        and len(old.blocks) == num_blocks
        and all(b.last_node for b in old.blocks)
    )
    return [b.last_node for b in old.blocks] if same else None


def _read_rows(path: Path) -> dict[Key, float]:
    rows: dict[Key, float] = {}
    if not path.is_file():
        return rows
    with path.open(newline="") as fh:
        for row in csv.DictReader(fh):
            try:
                rows[(row["gpu"], int(row["vgpu"]), int(row["batch"]), int(row["block"]))] = float(row["latency_us"])
            except (KeyError, TypeError, ValueError):
                continue  # a line cut short by an interrupted run: measure it again
    return rows


class _PartialWriter:
    def __init__(self, path: Path):
        new = not path.is_file() or path.stat().st_size == 0
        self._fh = path.open("a", newline="")
        self._w = csv.writer(self._fh)
        if new:
            self._w.writerow(["gpu", "vgpu", "batch", "block", "latency_us"])
            self._fh.flush()

    def add(self, key: Key, lat: float) -> None:
        self._w.writerow([*key, f"{lat:.3f}"])
        self._fh.flush()

    def close(self) -> None:
        self._fh.close()


def _manifest(name, src, info: GraphInfo, blocks: Sequence[Block], onnx_rel: list[str] | None, latency_bs1, provenance, layers=None,
              preprocess=None):
    """The model.yaml of a profile. ``preprocess``: the one the folder's model.yaml declared
    (kept across re-profiling: it describes the model's input, not its cuts); the built-in
    models take torchvision's ImageNet preprocess; others none."""
    from ppipe.spec.profile import IMAGENET_PREPROCESS, BlockSpec, ModelManifest, SourceSpec, TensorSpec

    def node_name(pos):
        return info.node(pos).name

    return ModelManifest(
        name=name,
        description=f"{len(info.compute_nodes)} compute nodes cut into {len(blocks)} blocks by `ppipe profile`",
        source=SourceSpec(**src),
        input=TensorSpec(name=info.input_name, shape=list(info.input_shape), dtype=info.input_dtype),
        outputs=[
            TensorSpec(name=o, shape=list(info.shapes.get(o, [])), dtype=_dtype(info, o)) for o in info.output_names
        ],
        blocks=[
            BlockSpec(
                index=b.index,
                first_node=node_name(b.first),
                last_node=node_name(b.last),
                num_nodes=b.last - b.first + 1,
                out_bytes_per_sample=b.out_bytes_per_sample,
                out_tensors=list(b.out_tensors),
                onnx=None if onnx_rel is None else onnx_rel[b.index],
            )
            for b in blocks
        ],
        latency_bs1_us=latency_bs1,
        provenance=provenance,
        layers=layers,
        preprocess=preprocess or (IMAGENET_PREPROCESS if src.get("kind") == "builtin" else None),
    )


def _dtype(info: GraphInfo, name: str) -> str:
    from ppipe.profiler.graph import np_dtype_name

    return np_dtype_name(info.elem_types.get(name, 1))


def _offered_levels(gpu: str, levels: Sequence[int]) -> list[int]:
    """The levels of ``levels`` that the spec sheet offers for ``gpu``."""
    from ppipe.profiler.estimate import gpu_spec

    return [v for v in levels if v in gpu_spec(gpu).mps_levels]


def _estimate(block_paths: list[Path], gpus: list[str], levels: Sequence[int], batches: Sequence[int]) -> dict[Key, float]:
    """Roofline estimates of ``gpus`` from the block ONNX graphs."""
    from ppipe.profiler.estimate import roofline_table

    # only the MPS levels the GPU type offers (a P4 has no thread-percentage limits)
    levels_by_gpu = {g: _offered_levels(g, levels) for g in gpus}
    grid = batch_grid(batches, levels)
    table = roofline_table([str(p) for p in block_paths], gpus, levels_by_gpu, grid)
    return {(g, int(v), int(b), int(blk)): float(lat) for (g, v, b, blk), lat in table.items()}


def _estimate_cross(profile, source: str, gpu: str, levels: Sequence[int], batches: Sequence[int]) -> tuple[dict[Key, float], str]:
    """Cross-GPU estimates of ``gpu`` from ``source``, and which model made them (per-layer
    features where ``layers.csv`` has per-node timings of the source, else blocks-only)."""
    from ppipe.profiler.estimate import cross_gpu_table
    from ppipe.profiler.layers import cross_gpu_layer_inputs

    levels = _offered_levels(gpu, levels)  # a P4 has no MPS levels, as for the roofline
    kwargs, how = cross_gpu_layer_inputs(profile, source)
    table = cross_gpu_table(profile, source, gpu, levels=list(levels), batches_by_level=batch_grid(batches, levels), **kwargs)
    return {(g, int(v), int(b), int(blk)): float(lat) for (g, v, b, blk), lat in table.items()}, how


def _time_layers(req: "ProfileRequest", info: GraphInfo, device: str, threads: int, say) -> tuple[list[float], str, str]:
    """Batch-1 time of every compute node on ``device``: (times, method, provenance)."""
    from ppipe.spec.profile import LayerMethod

    if req.backend == "torch":
        from ppipe.profiler.torch_backend import profile_layers

        say(f"timing layers on {device} (PyTorch)")
        return profile_layers(req, info, device)
    names = [info.node(p).name for p in range(len(info.compute_nodes))]
    if device == CPU:
        import onnxruntime as ort

        from ppipe.profiler.ort_backend import layer_times_us

        say(f"timing {len(names)} layers (onnxruntime, {threads} threads)")
        times = layer_times_us(info.model, names, threads)
        prov = (
            f"measured: onnxruntime {ort.__version__} CPUExecutionProvider, all graph optimizations, {threads} intra-op "
            "threads, batch 1, minimum of 10 runs per node; a node fused into another has 0"
        )
        return times, LayerMethod.ORT_OPTIMIZED.value, prov
    from ppipe.profiler.trt_backend import layer_times_us as trt_layer_times_us

    say(f"timing {len(names)} layers on {device} (TensorRT, {req.trt_layers}, {req.precision})")
    lt = trt_layer_times_us(info, gpu_type=device, mode=req.trt_layers, precision=req.precision)
    method = LayerMethod.PER_NODE if lt.mode == "per-node" else LayerMethod.FUSED_SPLIT
    return lt.node_us, method.value, lt.provenance


def _old_layers(out: Path):
    """The layer timings of the model.yaml/layers.csv in ``out`` (whose cuts are reused), or None."""
    from ppipe.errors import SpecError
    from ppipe.spec.base import load_yaml_model
    from ppipe.spec.profile import ModelManifest, read_layers_csv

    manifest = load_yaml_model(ModelManifest, out / "model.yaml")
    if manifest.layers is None or not (out / manifest.layers.csv).is_file():
        return None  # nothing (left) to keep: the layers are timed again
    try:
        return read_layers_csv(out / manifest.layers.csv, manifest)
    except SpecError as exc:
        raise UserError(
            f"the per-layer timings of the profile being resumed are unusable: {exc.message}",
            fix=f"delete {out / manifest.layers.csv} and run the same command again (the layers are timed again)",
            file=exc.file,
        ) from None


def _check_estimate_source(source: str, provenance: str) -> None:
    from ppipe.profiler.trt_backend import precision_of

    if precision_of(provenance) == "fp16":
        raise UserError(
            f"--estimate-from {source}: the {source} timings were measured in fp16 ({provenance[:120]}...), and the "
            "cross-GPU model learned its ratios from TF32 timings (the PPipe artifact); fp16 ratios between GPU types differ",
            fix=f"measure {source} with --precision tf32 (the default), or estimate with the roofline (drop --estimate-from)",
        )


def profile_model(req: ProfileRequest, progress: bool = True, echo: Callable[[str], None] | None = None):
    """Run the whole profiler for one model and write its folder.

    Args:
        req: what to profile.
        progress: show a progress bar over the measurement grid.
        echo: where to print progress lines (default: nowhere).

    Returns:
        The written :class:`ppipe.spec.profile.ModelProfile`.

    Raises:
        UserError: bad input file, shapes, flags; NotAvailableError: a backend is missing.
    """
    from ppipe.profiler.ort_backend import default_threads

    say = echo or (lambda _m: None)
    _check_request(req)
    model, src, default_name, src_path = _load(req)
    name = req.name or default_name
    out = Path(req.out_dir) if req.out_dir is not None else Path("models") / name
    info = analyze(prepare_model(model, input_shape=req.input_shape, source=str(src_path)))
    threads = req.threads or default_threads()
    out.mkdir(parents=True, exist_ok=True)
    run = _cut(req, name, src, info, out, threads, say)  # 1. cuts and per-layer timings
    _write_blocks_and_manifest(run)  # 2. block files, then model.yaml and layers.csv
    if req.measure is not None:  # 3. measure on the local device
        _measure(req, run, threads, progress, say)
    if req.estimate:  # 4. estimates for the GPU types that are not here
        _add_estimates(req, run, say)
    return _write_profile(run)  # 5. model.yaml with the table's figures, profile.csv


@dataclass
class _Run:
    """The state of one :func:`profile_model` run, filled in step by step.

    Attributes:
        name, src, info, out: the model's name, source spec, analysed graph and folder.
        blocks: the cuts (reused from an existing model.yaml, or made afresh).
        resumed: whether the cuts were reused.
        layer_times: per device type, (per-node times in compute order, method, provenance).
        table: latency rows, starting with those of a resumed run.
        provenance: per GPU type, how its rows were obtained in this run.
        old_provenance: per GPU type, the provenance of the resumed model.yaml.
    """

    name: str
    src: dict
    info: GraphInfo
    out: Path
    blocks: list[Block]
    resumed: bool
    layer_times: dict[str, tuple[list[float], str, str]]
    table: dict[Key, float]
    provenance: dict[str, str] = field(default_factory=dict)
    old_provenance: dict[str, str] = field(default_factory=dict)
    block_paths: list[Path] = field(default_factory=list)
    onnx_rel: list[str] | None = None
    layers_spec: LayersSpec | None = None
    layer_timings: LayerTimings | None = None

    def manifest(self, latency_bs1: dict[str, float], provenance: dict[str, str]):
        return _manifest(self.name, self.src, self.info, self.blocks, self.onnx_rel, latency_bs1, provenance, self.layers_spec,
                         _old_preprocess(self.out))


def _check_request(req: ProfileRequest) -> None:
    from ppipe.profiler.trt_backend import LAYER_MODES, PRECISIONS

    if req.measure is None and not req.estimate:
        raise UserError("nothing to do: no --measure and no --estimate", fix="give --measure cpu and/or --estimate L4,T4")
    if req.trt_layers not in LAYER_MODES:
        raise UserError(f"--trt-layers {req.trt_layers!r} is not one of {', '.join(LAYER_MODES)}", fix="use --trt-layers per-node (default) or fused")
    if req.backend not in ("auto", "torch"):
        raise UserError(f"--backend {req.backend!r} is not auto or torch", fix="use --backend auto (default) or torch")
    if req.precision not in PRECISIONS:
        raise UserError(f"--precision {req.precision!r} is not one of {', '.join(PRECISIONS)}", fix="use --precision tf32 (default) or fp16")


def _cut(req: ProfileRequest, name: str, src: dict, info: GraphInfo, out: Path, threads: int, say) -> _Run:
    """Step 1: reuse the cuts (and rows, and per-layer timings) of an existing model.yaml
    for the same model, else time the layers and cut afresh."""
    last_nodes = _reusable_cuts(out / "model.yaml", src, info.input_shape, req.num_blocks)
    layer_times: dict[str, tuple[list[float], str, str]] = {}
    if last_nodes is None:
        device = req.measure or CPU
        layer_times[device] = _time_layers(req, info, device, threads, say)
        say(f"cutting {req.num_blocks} blocks by the {device} layer times")
        blocks = partition(info, layer_times[device][0], req.num_blocks, req.size_weight)
        for stale in (out / PARTIAL_CSV, out / "profile.csv", out / "layers.csv"):
            stale.unlink(missing_ok=True)  # rows of other cuts are meaningless now
        return _Run(name, src, info, out, list(blocks), resumed=False, layer_times=layer_times, table={})
    blocks = blocks_from_last_nodes(info, last_nodes)
    say(f"resuming: reusing the {len(blocks)} blocks of {out / 'model.yaml'}")
    existing = _read_rows(out / "profile.csv")
    existing.update(_read_rows(out / PARTIAL_CSV))
    layer_times.update(_kept_layer_times(info, out, say))
    if req.measure is not None and req.measure not in layer_times:
        layer_times[req.measure] = _time_layers(req, info, req.measure, threads, say)  # recorded, not cut on
    return _Run(
        name, src, info, out, list(blocks), resumed=True, layer_times=layer_times, table=existing,
        old_provenance=_old_provenance(out),
    )


def _kept_layer_times(info: GraphInfo, out: Path, say) -> dict[str, tuple[list[float], str, str]]:
    """The per-layer timings of the profile being resumed, where it lists this model's nodes."""
    old = _old_layers(out)
    if old is None:
        return {}
    names_now = [info.node(p).name for p in range(len(info.compute_nodes))]
    if old.nodes() != names_now:
        say("the existing layers.csv lists other nodes than this model has: its rows are dropped")
        return {}
    old_spec = _old_layer_spec(out)
    kept = {}
    for g in old.gpus():
        lat = old.latency_us(g)
        kept[g] = ([lat[n] for n in names_now], old.methods[g].value, old_spec.get(g, ""))
    return kept


def _write_blocks_and_manifest(run: _Run) -> None:
    """Step 2: block files (next to model.yaml for a user's file, in the cache for
    built-ins), then model.yaml without a table (an interrupted run resumes from its cuts)
    and layers.csv."""
    from ppipe.spec.profile import LayerMethod, LayerRow, LayerTimingSpec, LayersSpec, make_layer_timings, write_layers_csv

    if run.src["kind"] == "builtin":
        block_dir = cache_root() / run.name
    else:
        block_dir = run.out / "blocks"
        run.onnx_rel = [f"blocks/block_{b.index:02d}.onnx" for b in run.blocks]
    run.block_paths = write_blocks(run.info, run.blocks, block_dir, run.name)
    if run.layer_times:
        run.layers_spec = LayersSpec(
            gpus={g: LayerTimingSpec(method=LayerMethod(m), provenance=prov) for g, (_t, m, prov) in sorted(run.layer_times.items())}
        )
    manifest = run.manifest({}, run.old_provenance)
    if run.layers_spec is not None:
        info = run.info
        node_ops = [(info.node(p).name, info.node(p).op_type) for p in range(len(info.compute_nodes))]
        run.layer_timings = make_layer_timings(
            manifest,
            {g: [LayerRow(n, op, round(float(t), 3)) for (n, op), t in zip(node_ops, times)] for g, (times, _m, _p) in run.layer_times.items()},
            {g: LayerMethod(m) for g, (_t, m, _p) in run.layer_times.items()},
        )
    dump_yaml(manifest.model_dump(mode="json", exclude_none=True), run.out / "model.yaml")
    if run.layer_timings is not None:
        write_layers_csv(run.out / run.layers_spec.csv, run.layer_timings)
    if run.src["kind"] == "builtin":
        (block_dir / "blocks.stamp.json").write_text(json.dumps({"fingerprint": block_fingerprint(manifest), "model": run.name}))


def _measure(req: ProfileRequest, run: _Run, threads: int, progress: bool, say) -> None:
    """Step 3: time every missing (level, block, batch) of the grid on ``req.measure``,
    appending each row to the partial CSV as it is taken."""
    if req.backend == "torch":
        from ppipe.profiler.torch_backend import profile_timer

        levels, timer = profile_timer(req)
        run.provenance[req.measure] = timer.provenance()
    elif req.measure == CPU:
        from ppipe.profiler.ort_backend import BlockTimer, provenance as ort_provenance

        levels = [v for v in req.cpu_levels if v <= threads]
        if len(levels) < len(req.cpu_levels):
            say(f"skipping CPU levels {sorted(set(req.cpu_levels) - set(levels))}: only {threads} thread(s)")
        timer = BlockTimer(threads, reps=req.reps, statistic=req.statistic)
        run.provenance[CPU] = ort_provenance(threads, req.reps, req.statistic)
    else:
        from ppipe.profiler.trt_backend import TensorRTTimer

        levels = list(req.gpu_levels)
        timer = TensorRTTimer(reps=req.reps, precision=req.precision)
        run.provenance[req.measure] = timer.provenance()
    grid = batch_grid(req.batches, levels)
    todo = [
        (v, blk, b)
        for v, bs in grid.items()
        for blk in range(len(run.blocks))
        for b in bs
        if (req.measure, v, b, blk) not in run.table
    ]
    done = sum(len(bs) for bs in grid.values()) * len(run.blocks) - len(todo)
    say(f"measuring {len(todo)} (level, block, batch) points on {req.measure}" + (f" ({done} already done)" if done else ""))
    if not todo and req.measure in run.old_provenance:
        run.provenance[req.measure] = run.old_provenance[req.measure]  # nothing measured now: the rows keep their record
    writer = _PartialWriter(run.out / PARTIAL_CSV)
    try:
        with _progress(len(todo), f"{run.name} on {req.measure}", progress) as bar:
            for v, blk, b in todo:
                lat = round(timer.latency_us(run.block_paths[blk], v, b), 3)  # as profile.csv stores it
                key = (req.measure, v, b, blk)
                run.table[key] = lat
                writer.add(key, lat)
                bar.update(1)
    finally:
        writer.close()
    if hasattr(timer, "close"):
        timer.close()


def _add_estimates(req: ProfileRequest, run: _Run, say) -> None:
    """Step 4: rows for the ``req.estimate`` GPU types that have none: the cross-GPU model
    from ``req.estimate_from``, else the roofline."""
    from ppipe.profiler.estimate import provenance as roofline_provenance
    from ppipe.spec.profile import ModelProfile

    gpus = [g for g in req.estimate if g != req.measure]
    if req.refresh_estimates:
        run.table = {k: lat for k, lat in run.table.items() if k[0] not in gpus}
    missing_gpus = [g for g in gpus if not any(k[0] == g for k in run.table)]
    if not missing_gpus:
        return
    if not req.estimate_from:
        say(f"estimating {', '.join(missing_gpus)}")
        est = _estimate(run.block_paths, missing_gpus, req.gpu_levels, req.batches)
        for k, lat in est.items():
            run.table.setdefault(k, lat)
        for g in missing_gpus:
            run.provenance[g] = roofline_provenance(g)
        return
    src_gpu = req.estimate_from
    _check_estimate_source(src_gpu, run.provenance.get(src_gpu) or run.old_provenance.get(src_gpu, ""))
    partial = ModelProfile(manifest=run.manifest({}, {}), table=run.table, directory=run.out, layers=run.layer_timings)
    for g in missing_gpus:
        est, how = _estimate_cross(partial, src_gpu, g, req.gpu_levels, req.batches)
        say(f"estimating {g} from the {src_gpu} timings: cross-GPU {how}")
        for k, lat in est.items():
            run.table.setdefault(k, lat)
        run.provenance[g] = (
            f"estimated: cross-GPU model (ppipe.profiler.estimate.cross_gpu_table) from the {src_gpu} "
            f"timings of this profile, {how}; not measured"
        )


def _write_profile(run: _Run):
    """Step 5: model.yaml with each GPU type's batch-1 latency and provenance (kept from
    earlier runs for types not touched now), profile.csv; the partial CSV goes."""
    from ppipe.spec.profile import ModelProfile

    table, nb = run.table, len(run.blocks)
    provenance = dict(run.provenance)
    for g in {k[0] for k in table}:
        provenance.setdefault(g, run.old_provenance.get(g, "unknown (rows kept from an earlier run)"))
    latency_bs1 = {}
    for g in sorted({k[0] for k in table}):
        if all((g, 1, 1, blk) in table for blk in range(nb)):
            latency_bs1[g] = round(sum(max(table[(g, 1, 1, blk)], 1.0) for blk in range(nb)), 3)
    manifest = run.manifest(latency_bs1, dict(sorted(provenance.items())))
    profile = ModelProfile(manifest=manifest, table=table, directory=run.out, layers=run.layer_timings)
    profile.save(run.out)
    (run.out / PARTIAL_CSV).unlink(missing_ok=True)
    return profile


def _old_layer_spec(out: Path) -> dict[str, str]:
    """Per device type, the per-layer provenance text of the existing model.yaml."""
    from ppipe.spec.base import load_yaml_model
    from ppipe.spec.profile import ModelManifest

    try:
        m = load_yaml_model(ModelManifest, out / "model.yaml")
    except UserError:
        return {}
    return {g: s.provenance for g, s in (m.layers.gpus.items() if m.layers else [])}


def _old_provenance(out: Path) -> dict[str, str]:
    import yaml

    p = out / "model.yaml"
    if not p.is_file():
        return {}
    try:
        return {str(k): str(v) for k, v in ((yaml.safe_load(p.read_text()) or {}).get("provenance") or {}).items()}
    except (OSError, yaml.YAMLError, AttributeError):
        return {}


def _old_preprocess(out: Path):
    """The preprocess the folder's model.yaml declares, or None (no file, none, or unreadable)."""
    import yaml

    from ppipe.spec.profile import ImagePreprocess

    try:
        raw = (yaml.safe_load((out / "model.yaml").read_text()) or {}).get("preprocess")
        return ImagePreprocess(**raw) if isinstance(raw, dict) else None
    except (OSError, yaml.YAMLError, TypeError, ValueError):
        return None


def _progress(total: int, desc: str, enabled: bool) -> tqdm:
    return tqdm(total=total, desc=desc, unit="pt", disable=not enabled or total == 0)


__all__ = ["ProfileRequest", "batch_grid", "parse_batches", "profile_model"]
