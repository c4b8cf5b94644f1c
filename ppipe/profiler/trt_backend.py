"""TensorRT timing backend (NVIDIA GPUs): per-layer times and block latencies.

Written against the TensorRT Python API of 10.x, and 11.x at tf32 (``setup.cfg``: ``tensorrt-cu12>=10,<12``;
TensorRT 11 removed weakly typed fp16, see :func:`_set_precision`):
named I/O tensors (``set_input_shape``, ``set_tensor_address``, ``execute_async_v3``),
``build_serialized_network``, an explicit-batch network (the flag 8.6 needs; 10 ignores it).

**Precision.** ``tf32`` by default: TensorRT's default (TF32 tensor cores where the GPU has
them, fp32 elsewhere), fp32 I/O. It is what the PPipe artifact measured ("TensorRT, TF32"),
so it is what the cross-GPU estimator's ratios and the roofline's spec sheet describe; a
profile measured in ``fp16`` (``--precision fp16``) is its own thing, and the cross-GPU
estimator refuses it as a source (:mod:`ppipe.profiler.run`).

**Blocks** (:class:`TensorRTTimer`):

* One engine per block and batch size (an optimization profile fixed at that batch),
  built from the block's ONNX sub-model and cached as
  ``<engine_dir>/<block>_<sha of the ONNX file>_<precision>_b<batch>.plan``.
* Level 1: the engine alone on the GPU; latency = median of CUDA-event times of
  ``execute_async_v3`` over ``reps`` runs after ``warmup`` runs.
* Level v > 1: v processes run the same engine *at the same time* under MPS, each limited
  to ``CUDA_MPS_ACTIVE_THREAD_PERCENTAGE = 100 / v`` of the SMs; each builds its context
  and buffers and warms up before a barrier, then times; the latency of level v is the mean
  of their medians. This needs the MPS control daemon (``nvidia-cuda-mps-control -d``).

**Layers** (:func:`layer_times_us`): the whole prepared model at batch 1 on the whole GPU,
built with ``ProfilingVerbosity.DETAILED`` (layer names and the inspector's ``Metadata``
carry the ONNX node names), run ``reps`` times with an ``IProfiler`` attached after
``warmup`` plain runs; each engine layer's time is its median over the runs, and
:mod:`ppipe.profiler.layers` maps the layers to ONNX nodes (fused layers split by the
rule stated there). Two modes:

* ``per-node`` (default): every floating activation that a compute node produces is marked
  as an engine output, so TensorRT cannot fuse across nodes and each node runs as its own
  kernel(s), reading and writing its tensors in memory. These are the per-node times the
  PPipe artifact's per-layer tables hold (their sums are 1.8-8.4x the whole-model latency,
  element-wise nodes carry their memory traffic), i.e. the features the cross-GPU model
  was fitted on; PPipe also pre-partitioned from such times. The engine keeps every
  activation: its memory is the sum of all activations at batch 1.
* ``fused``: the engine as it is deployed; fused layers are split over their nodes. Closer
  to what a block costs, but not comparable with the artifact's per-layer tables (element-
  wise nodes fused into a convolution get almost nothing): the cross-GPU estimator does not
  use such times as features.

``tensorrt`` and ``cupy`` are imported lazily; without them (or without a GPU) every
entry point raises :class:`~ppipe.errors.NotAvailableError` with the fix.
"""

from __future__ import annotations

import hashlib
import multiprocessing as mp
import os
import queue as queue_mod
import re
import tempfile
from dataclasses import dataclass
from pathlib import Path

from ppipe.errors import NotAvailableError, UserError
from ppipe.spec.local_gpu import mps_available  # defined with the local-gpu cluster, which needs it too

WORKSPACE_BYTES = 1 << 30
PRECISIONS = ("tf32", "fp16")
LAYER_MODES = ("per-node", "fused")
LAYER_REPS = 20
_LOGGER = None


def _import_trt():
    try:
        import tensorrt as trt  # noqa: F401
    except ImportError as exc:
        raise NotAvailableError(
            f"TensorRT is not installed ({exc})",
            fix="pip install 'ppipe[gpu]' on a machine with an NVIDIA GPU, or measure with --measure cpu",
        ) from None
    return trt


def _import_cupy():
    try:
        import cupy as cp
    except ImportError as exc:
        raise NotAvailableError(f"CuPy is not installed ({exc})", fix="pip install 'ppipe[gpu]' (cupy-cuda12x)") from None
    try:
        cp.cuda.runtime.getDeviceCount()
    except Exception as exc:  # cupy raises CUDARuntimeError without a driver/GPU
        raise NotAvailableError(f"no usable CUDA GPU ({exc})", fix="run on a machine with an NVIDIA GPU, or use --measure cpu") from None
    return cp


def _logger(trt):
    # one logger per process: TensorRT warns when builders and runtimes get different ones
    global _LOGGER
    if _LOGGER is None:
        _LOGGER = trt.Logger(trt.Logger.WARNING)
    return _LOGGER


def _set_precision(trt, config, precision: str) -> None:
    """Builder flags of ``precision`` (TensorRT 10), or a clear refusal on TensorRT 11.

    TensorRT 11 removed weak typing: its networks are strongly typed and have no
    ``BuilderFlag.FP16``; an fp16 engine needs an ONNX model already converted to fp16
    (ModelOpt AutoCast), which ppipe does not do. tf32 is TensorRT's default either way.
    """
    if hasattr(trt.BuilderFlag, "TF32"):
        config.set_flag(trt.BuilderFlag.TF32)  # the default; stated so that the precision is explicit
    if precision != "fp16":
        return
    if not hasattr(trt.BuilderFlag, "FP16"):
        raise NotAvailableError(
            f"TensorRT {trt.__version__} has no weakly typed fp16 (removed in TensorRT 11)",
            fix="profile and serve at --precision tf32, use TensorRT 10 (pip install 'tensorrt-cu12>=10,<11'), "
            "or the torch backend (--backend torch), which runs fp16 itself",
        )
    config.set_flag(trt.BuilderFlag.FP16)


def _check_precision(precision: str) -> None:
    if precision not in PRECISIONS:
        raise UserError(f"precision {precision!r} is not one of {', '.join(PRECISIONS)}", fix="use --precision tf32 (the default) or fp16")


def _build(
    onnx_bytes: bytes,
    batch: int,
    precision: str,
    source: str,
    *,
    detailed: bool = False,
    mark_outputs: tuple[str, ...] = (),
    max_batch: int | None = None,
) -> bytes:
    """Serialized engine of an ONNX model at one batch size (every input's first dimension).

    With ``max_batch`` the engine takes any batch from 1 to ``max_batch`` and its kernels
    are tuned for ``batch`` (the serving runtime's case: the planned batch, or a smaller
    one when the data plane shrinks a batch to meet a deadline).
    """
    _check_precision(precision)
    trt = _import_trt()
    logger = _logger(trt)
    builder = trt.Builder(logger)
    flags = 0
    if hasattr(trt.NetworkDefinitionCreationFlag, "EXPLICIT_BATCH"):  # required by 8.x; deprecated no-op in 10
        flags = 1 << int(trt.NetworkDefinitionCreationFlag.EXPLICIT_BATCH)
    network = builder.create_network(flags)
    parser = trt.OnnxParser(network, logger)
    if not parser.parse(onnx_bytes):
        errors = "; ".join(str(parser.get_error(i)) for i in range(parser.num_errors))
        raise UserError(f"TensorRT cannot parse this model: {errors}", fix="use ops TensorRT supports, or --measure cpu", file=source)
    if mark_outputs:
        wanted = set(mark_outputs)
        for i in range(network.num_layers):
            layer = network.get_layer(i)
            for j in range(layer.num_outputs):
                t = layer.get_output(j)
                if t is not None and t.name in wanted and not t.is_network_output:
                    network.mark_output(t)
    config = builder.create_builder_config()
    config.set_memory_pool_limit(trt.MemoryPoolType.WORKSPACE, WORKSPACE_BYTES)
    _set_precision(trt, config, precision)
    if detailed:
        config.profiling_verbosity = trt.ProfilingVerbosity.DETAILED
    profile = builder.create_optimization_profile()
    for i in range(network.num_inputs):
        t = network.get_input(i)
        rest = [int(d) for d in list(t.shape)[1:]]
        if max_batch is None:
            profile.set_shape(t.name, [batch] + rest, [batch] + rest, [batch] + rest)
        else:
            profile.set_shape(t.name, [1] + rest, [batch] + rest, [max(batch, max_batch)] + rest)
    config.add_optimization_profile(profile)
    plan = builder.build_serialized_network(network, config)
    if plan is None:
        raise UserError("TensorRT failed to build an engine", fix="see the TensorRT log above", file=source)
    return bytes(plan)


def build_engine(onnx_path: str | Path, batch: int, precision: str = "tf32") -> bytes:
    """Serialized TensorRT engine of an ONNX block for one batch size."""
    return _build(Path(onnx_path).read_bytes(), batch, precision, str(onnx_path))


def precision_of(provenance: str) -> str:
    """The TensorRT precision a profile's timings were measured in, from their provenance
    (``ppipe profile`` writes it there); ``tf32`` (the default, as the PPipe artifact) unless it says fp16."""
    return "fp16" if re.search(r"\bfp16\b", provenance or "") else "tf32"


def serving_engine(onnx_path: str | Path, opt_batch: int, max_batch: int, precision: str, engine_dir: str | Path | None = None) -> bytes:
    """A serialized engine for serving one block: batches 1..``max_batch``, tuned for ``opt_batch``.

    Cached on disk (``$PPIPE_CACHE/trt`` by default), keyed by the ONNX file's content, the
    precision, the batch range, the TensorRT version and the GPU, so that a worker restart
    does not rebuild every block.
    """
    from ppipe.profiler.blocks import cache_root

    trt = _import_trt()
    _check_precision(precision)
    cp = _import_cupy()
    data = Path(onnx_path).read_bytes()
    device = re.sub(r"[^A-Za-z0-9]+", "-", _device_name(cp)).strip("-")
    key = hashlib.sha256(data).hexdigest()[:16]
    folder = Path(engine_dir) if engine_dir is not None else cache_root() / "trt"
    path = folder / f"{Path(onnx_path).stem}_{key}_{precision}_b{opt_batch}-{max_batch}_trt{trt.__version__}_{device}.plan"
    if path.exists():
        return path.read_bytes()
    plan = _build(data, opt_batch, precision, str(onnx_path), max_batch=max_batch)
    folder.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(f".{os.getpid()}.tmp")
    tmp.write_bytes(plan)
    tmp.replace(path)  # atomic: workers of one host may build the same block at once
    return plan


def runtime_logger():
    """The process's one TensorRT logger (builders and runtimes should share it)."""
    return _logger(_import_trt())


class _EngineRunner:
    """An engine with its context, stream and device buffers (random inputs), ready to run."""

    def __init__(self, plan: bytes, batch: int):
        trt = self.trt = _import_trt()
        cp = self.cp = _import_cupy()
        self.engine = trt.Runtime(_logger(trt)).deserialize_cuda_engine(plan)
        if self.engine is None:
            raise NotAvailableError("TensorRT could not load the engine it built", fix="check the TensorRT log above (GPU, driver, versions)")
        self.ctx = self.engine.create_execution_context()
        self.stream = cp.cuda.Stream(non_blocking=True)
        names = [self.engine.get_tensor_name(i) for i in range(self.engine.num_io_tensors)]
        inputs = [n for n in names if self.engine.get_tensor_mode(n) == trt.TensorIOMode.INPUT]
        # the random inputs are made on this stream, ahead of the runs that read them (CuPy
        # queues them on the current stream, which the non-blocking one would not wait for)
        with self.stream:
            self._make_buffers(names, inputs, batch)
        self.stream.synchronize()
        for name, arr in self.buffers.items():
            self.ctx.set_tensor_address(name, arr.data.ptr)

    def _make_buffers(self, names: list[str], inputs: list[str], batch: int) -> None:
        """Device buffers of every I/O tensor, inputs filled with random values (current stream)."""
        import numpy as np

        trt, cp = self.trt, self.cp
        self.buffers = {}
        # every input shape first: output shapes are known only once all inputs have theirs
        for name in inputs:
            shape = [batch] + [int(d) for d in list(self.engine.get_tensor_shape(name))[1:]]
            if not self.ctx.set_input_shape(name, shape):
                raise NotAvailableError(f"TensorRT rejected input shape {shape} for {name!r}", fix="check the TensorRT log above")
            dtype = np.dtype(trt.nptype(self.engine.get_tensor_dtype(name)))
            if dtype.kind == "f":
                arr = cp.random.standard_normal(shape).astype(dtype)
            else:
                arr = cp.zeros(shape, dtype=dtype)
            self.buffers[name] = arr
        for name in names:
            if name in self.buffers:
                continue
            dtype = np.dtype(trt.nptype(self.engine.get_tensor_dtype(name)))
            shape = [int(d) for d in self.ctx.get_tensor_shape(name)]
            self.buffers[name] = cp.empty(shape, dtype=dtype)

    def run(self, n: int) -> None:
        for _ in range(n):
            if not self.ctx.execute_async_v3(self.stream.ptr):
                raise NotAvailableError("TensorRT execute_async_v3 failed", fix="check the TensorRT log above")
        self.stream.synchronize()

    def time_us(self, reps: int) -> list[float]:
        """CUDA-event times (us) of ``reps`` runs."""
        cp = self.cp
        start, end = cp.cuda.Event(), cp.cuda.Event()
        out = []
        for _ in range(reps):
            start.record(self.stream)
            if not self.ctx.execute_async_v3(self.stream.ptr):
                raise NotAvailableError("TensorRT execute_async_v3 failed", fix="check the TensorRT log above")
            end.record(self.stream)
            end.synchronize()
            out.append(cp.cuda.get_elapsed_time(start, end) * 1000.0)
        return out


def _mps_worker(plan_path: str, batch: int, reps: int, warmup: int, percentage: int, barrier, queue) -> None:
    # must be set before this process touches CUDA
    os.environ["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"] = str(percentage)
    try:
        import numpy as np

        runner = _EngineRunner(Path(plan_path).read_bytes(), batch)
        runner.run(warmup)  # context, buffers and warm-up before the barrier: the timed loops start together
        barrier.wait(timeout=600)
        times = runner.time_us(reps)
        queue.put(("ok", float(np.median(times))))
    except Exception as exc:  # report to the parent instead of dying silently
        queue.put(("error", f"{type(exc).__name__}: {exc}"))


def _device_name(cp) -> str:
    props = cp.cuda.runtime.getDeviceProperties(cp.cuda.Device().id)
    return props["name"].decode() if isinstance(props["name"], bytes) else str(props["name"])


class TensorRTTimer:
    """Times block sub-models with TensorRT on the local GPU (levels via MPS).

    Args:
        reps: timed runs per measurement (median).
        warmup: untimed runs first.
        engine_dir: where to cache serialized engines (default: a temporary folder).
        precision: ``tf32`` (default, as the PPipe artifact) or ``fp16``.
    """

    def __init__(self, reps: int = 10, warmup: int = 5, engine_dir: str | Path | None = None, precision: str = "tf32"):
        _check_precision(precision)
        self.trt = _import_trt()
        self.cp = _import_cupy()
        self.reps = reps
        self.warmup = warmup
        self.precision = precision
        self._tmp = None if engine_dir else tempfile.TemporaryDirectory(prefix="ppipe-trt-")
        self.engine_dir = Path(engine_dir or self._tmp.name)
        self.engine_dir.mkdir(parents=True, exist_ok=True)

    def provenance(self) -> str:
        return (
            f"measured: TensorRT {self.trt.__version__} {self.precision} on {_device_name(self.cp)}, an engine per block and "
            f"batch, median of {self.reps} runs; level v = v concurrent copies under MPS at {{100/v}}% of the SMs"
        )

    def _plan(self, block_path: str | Path, batch: int) -> Path:
        data = Path(block_path).read_bytes()
        key = hashlib.sha256(data).hexdigest()[:12]
        p = self.engine_dir / f"{Path(block_path).stem}_{key}_{self.precision}_b{batch}.plan"
        if not p.is_file():
            p.write_bytes(_build(data, batch, self.precision, str(block_path)))
        return p

    def latency_us(self, block_path: str | Path, level: int, batch: int) -> float:
        """Latency of a block at vGPU level ``level`` and batch ``batch``, in us."""
        import numpy as np

        plan = self._plan(block_path, batch)
        if level == 1:
            runner = _EngineRunner(plan.read_bytes(), batch)
            runner.run(self.warmup)
            return float(np.median(runner.time_us(self.reps)))
        if not mps_available():
            raise NotAvailableError(
                "vGPU levels > 1 are measured under MPS, and no MPS control daemon is running",
                fix="start it with `nvidia-cuda-mps-control -d`, or measure only level 1 with --gpu-levels 1",
            )
        ctx = mp.get_context("spawn")
        barrier = ctx.Barrier(level)
        results_q = ctx.Queue()
        procs = [
            ctx.Process(target=_mps_worker, args=(str(plan), batch, self.reps, self.warmup, max(1, 100 // level), barrier, results_q))
            for _ in range(level)
        ]
        for p in procs:
            p.start()
        try:
            results = [results_q.get(timeout=900) for _ in procs]
        except queue_mod.Empty:
            results = [("error", "a worker process reported nothing within 15 minutes")]
        finally:
            for p in procs:
                p.join(timeout=60)
                if p.is_alive():
                    p.terminate()
        errors = [msg for status, msg in results if status != "ok"]
        if errors:
            raise NotAvailableError(f"MPS measurement failed: {errors[0]}", fix="check the MPS daemon and the GPU")
        return float(np.mean([val for _s, val in results]))

    def close(self) -> None:
        if self._tmp is not None:
            self._tmp.cleanup()


# ----------------------------------------------------------------------------------------
# per-layer timing
# ----------------------------------------------------------------------------------------
@dataclass(frozen=True)
class LayerTiming:
    """Per-node times of a whole model on the local GPU.

    Attributes:
        node_us: one batch-1 time per compute node (us), in compute order.
        mode: ``per-node`` or ``fused``.
        provenance: how they were taken (for model.yaml).
        fallback_share: share of the time spent in engine layers that named no ONNX node.
    """

    node_us: list[float]
    mode: str
    provenance: str
    fallback_share: float


def _profiler_class(trt):
    class _MedianProfiler(trt.IProfiler):
        """Collects every layer's time of every profiled run, in execution order."""

        def __init__(self):
            trt.IProfiler.__init__(self)  # the binding needs the base initialized explicitly
            self.times: dict[str, list[float]] = {}

        def report_layer_time(self, layer_name, ms):
            self.times.setdefault(layer_name, []).append(float(ms))

    return _MedianProfiler


def layer_times_us(
    info,
    *,
    gpu_type: str | None = None,
    mode: str = "per-node",
    precision: str = "tf32",
    reps: int = LAYER_REPS,
    warmup: int = 5,
) -> LayerTiming:
    """Batch-1 time of every compute node of a prepared model on the local GPU.

    Args:
        info: the analyzed model (:class:`ppipe.profiler.graph.GraphInfo`).
        gpu_type: the GPU type name (e.g. ``L4``): its spec sheet weights the split of
            fused layers (:func:`ppipe.profiler.layers.standalone_costs`).
        mode: ``per-node`` or ``fused`` (module docstring).
        precision: ``tf32`` or ``fp16``.
        reps: profiled runs (each layer's median is kept).
        warmup: plain runs before the profiler is attached.

    Raises:
        UserError: TensorRT cannot parse or build the model; NotAvailableError: no TensorRT/GPU.
    """
    import numpy as np

    from ppipe.profiler.layers import (
        LayerRecord,
        NodeIndex,
        activation_outputs,
        attribute_times,
        device_balance,
        parse_layer_info,
        standalone_costs,
    )

    if mode not in LAYER_MODES:
        raise UserError(f"layer timing mode {mode!r} is not one of {', '.join(LAYER_MODES)}", fix="use --trt-layers per-node or fused")
    trt = _import_trt()
    cp = _import_cupy()
    marks = tuple(activation_outputs(info)) if mode == "per-node" else ()
    plan = _build(info.model.SerializeToString(), 1, precision, "the whole model", detailed=True, mark_outputs=marks)
    runner = _EngineRunner(plan, 1)
    runner.run(warmup)
    profiler = _profiler_class(trt)()
    runner.ctx.profiler = profiler  # enqueue_emits_profile is True by default: every run reports
    runner.run(reps)
    inspector = runner.engine.create_engine_inspector()
    inspector.execution_context = runner.ctx
    metadata = parse_layer_info(inspector.get_engine_information(trt.LayerInformationFormat.JSON))
    records = [
        LayerRecord(name, float(np.median(ms)) * 1000.0, metadata.get(name, "")) for name, ms in profiler.times.items() if ms
    ]
    index = NodeIndex.from_graph(info)
    peak, bw = device_balance(gpu_type)
    att = attribute_times(records, index, standalone_costs(info, peak, bw))
    share = att.fallback_us / att.total_us if att.total_us > 0 else 0.0
    how = "every activation marked as an engine output (no fusion across nodes)" if mode == "per-node" else "the deployed (fused) engine, fused layers split by standalone roofline cost"
    prov = (
        f"measured: TensorRT {trt.__version__} {precision} on {_device_name(cp)}, batch 1, whole GPU, {how}; "
        f"median of {reps} profiled runs per engine layer (IProfiler); {100 * share:.1f} % of the time in layers "
        "naming no ONNX node, charged to the preceding layer's nodes"
    )
    return LayerTiming(node_us=[float(x) for x in att.node_us], mode=mode, provenance=prov, fallback_share=share)


__all__ = ["LAYER_MODES", "PRECISIONS", "LayerTiming", "TensorRTTimer", "build_engine", "layer_times_us", "mps_available"]
