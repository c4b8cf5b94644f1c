"""TensorRT timing backend (NVIDIA GPUs), as the PPipe paper measured its profiles.

* One engine per block and batch size (fp16, an optimization profile fixed at that batch),
  built from the block's ONNX sub-model and cached as ``<engine_dir>/<block>_b<batch>.plan``.
* Level 1: the engine alone on the GPU; latency = median of CUDA-event times of
  ``execute_async_v3`` over ``reps`` runs after ``warmup`` runs.
* Level v > 1: v processes run the same engine *at the same time* under MPS, each limited
  to ``CUDA_MPS_ACTIVE_THREAD_PERCENTAGE = 100 / v`` of the SMs; the latency of level v is
  the mean of their medians. This needs the MPS control daemon
  (``nvidia-cuda-mps-control -d``).

``tensorrt`` and ``cupy`` are imported lazily; without them (or without a GPU) every
entry point raises :class:`~ppipe.errors.NotAvailableError` with the fix.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

from ppipe.errors import NotAvailableError, UserError

WORKSPACE_BYTES = 1 << 30


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


def build_engine(onnx_path: str | Path, batch: int, fp16: bool = True) -> bytes:
    """Serialized TensorRT engine of an ONNX block for one batch size."""
    trt = _import_trt()
    logger = trt.Logger(trt.Logger.WARNING)
    builder = trt.Builder(logger)
    flags = 0
    if hasattr(trt.NetworkDefinitionCreationFlag, "EXPLICIT_BATCH"):  # TensorRT 8.x; implicit in 10
        flags = 1 << int(trt.NetworkDefinitionCreationFlag.EXPLICIT_BATCH)
    network = builder.create_network(flags)
    parser = trt.OnnxParser(network, logger)
    if not parser.parse(Path(onnx_path).read_bytes()):
        errors = "; ".join(str(parser.get_error(i)) for i in range(parser.num_errors))
        raise UserError(f"TensorRT cannot parse this block: {errors}", fix="use ops TensorRT supports, or --measure cpu", file=str(onnx_path))
    config = builder.create_builder_config()
    config.set_memory_pool_limit(trt.MemoryPoolType.WORKSPACE, WORKSPACE_BYTES)
    if fp16 and builder.platform_has_fast_fp16:
        config.set_flag(trt.BuilderFlag.FP16)
    profile = builder.create_optimization_profile()
    for i in range(network.num_inputs):
        t = network.get_input(i)
        shape = [batch] + [int(d) for d in list(t.shape)[1:]]
        profile.set_shape(t.name, shape, shape, shape)
    config.add_optimization_profile(profile)
    plan = builder.build_serialized_network(network, config)
    if plan is None:
        raise UserError("TensorRT failed to build an engine for this block", fix="see the TensorRT log above", file=str(onnx_path))
    return bytes(plan)


def _time_engine(plan: bytes, batch: int, reps: int, warmup: int) -> list[float]:
    """CUDA-event times (us) of ``reps`` runs of one engine, in this process."""
    trt = _import_trt()
    cp = _import_cupy()
    logger = trt.Logger(trt.Logger.WARNING)
    engine = trt.Runtime(logger).deserialize_cuda_engine(plan)
    ctx = engine.create_execution_context()
    stream = cp.cuda.Stream(non_blocking=True)
    buffers = []
    for i in range(engine.num_io_tensors):
        name = engine.get_tensor_name(i)
        dtype = trt.nptype(engine.get_tensor_dtype(name))
        if engine.get_tensor_mode(name) == trt.TensorIOMode.INPUT:
            shape = [batch] + [int(d) for d in list(engine.get_tensor_shape(name))[1:]]
            ctx.set_input_shape(name, shape)
            arr = cp.random.standard_normal(shape).astype(dtype) if dtype.kind == "f" else cp.zeros(shape, dtype=dtype)
        else:
            shape = [int(d) for d in ctx.get_tensor_shape(name)]
            arr = cp.empty(shape, dtype=dtype)
        buffers.append(arr)
        ctx.set_tensor_address(name, arr.data.ptr)
    start, end = cp.cuda.Event(), cp.cuda.Event()
    for _ in range(warmup):
        ctx.execute_async_v3(stream.ptr)
    stream.synchronize()
    out = []
    for _ in range(reps):
        start.record(stream)
        ctx.execute_async_v3(stream.ptr)
        end.record(stream)
        end.synchronize()
        out.append(cp.cuda.get_elapsed_time(start, end) * 1000.0)
    return out


def _mps_worker(plan_path: str, batch: int, reps: int, warmup: int, percentage: int, barrier, queue) -> None:
    # must be set before this process touches CUDA
    os.environ["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"] = str(percentage)
    try:
        import numpy as np

        plan = Path(plan_path).read_bytes()
        _time_engine(plan, batch, reps=0, warmup=warmup)  # build context + warm up before the barrier
        barrier.wait(timeout=600)
        times = _time_engine(plan, batch, reps, warmup)
        queue.put(("ok", float(np.median(times))))
    except Exception as exc:  # report to the parent instead of dying silently
        queue.put(("error", f"{type(exc).__name__}: {exc}"))


def mps_available() -> bool:
    """Whether an MPS control daemon is running (``nvidia-cuda-mps-control -d``)."""
    exe = shutil.which("nvidia-cuda-mps-control")
    if exe is None:
        return False
    try:
        r = subprocess.run([exe], input="get_server_list\n", capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.TimeoutExpired):
        return False
    return r.returncode == 0


class TensorRTTimer:
    """Times block sub-models with TensorRT on the local GPU (levels via MPS).

    Args:
        reps: timed runs per measurement (median).
        warmup: untimed runs first.
        engine_dir: where to cache serialized engines (default: a temporary folder).
    """

    def __init__(self, reps: int = 10, warmup: int = 5, engine_dir: str | Path | None = None):
        self.trt = _import_trt()
        self.cp = _import_cupy()
        self.reps = reps
        self.warmup = warmup
        self._tmp = None if engine_dir else tempfile.TemporaryDirectory(prefix="ppipe-trt-")
        self.engine_dir = Path(engine_dir or self._tmp.name)
        self.engine_dir.mkdir(parents=True, exist_ok=True)

    def provenance(self) -> str:
        props = self.cp.cuda.runtime.getDeviceProperties(0)
        name = props["name"].decode() if isinstance(props["name"], bytes) else str(props["name"])
        return (
            f"measured: TensorRT {self.trt.__version__} fp16 on {name}, an engine per block and batch, median of "
            f"{self.reps} runs; level v = v concurrent copies under MPS at {{100/v}}% of the SMs"
        )

    def _plan(self, block_path: str | Path, batch: int) -> Path:
        p = self.engine_dir / f"{Path(block_path).stem}_b{batch}.plan"
        if not p.is_file():
            p.write_bytes(build_engine(block_path, batch))
        return p

    def latency_us(self, block_path: str | Path, level: int, batch: int) -> float:
        """Latency of a block at vGPU level ``level`` and batch ``batch``, in us."""
        import numpy as np

        plan = self._plan(block_path, batch)
        if level == 1:
            return float(np.median(_time_engine(plan.read_bytes(), batch, self.reps, self.warmup)))
        if not mps_available():
            raise NotAvailableError(
                "vGPU levels > 1 are measured under MPS, and no MPS control daemon is running",
                fix="start it with `nvidia-cuda-mps-control -d`, or measure only level 1 with --gpu-levels 1",
            )
        ctx = mp.get_context("spawn")
        barrier = ctx.Barrier(level)
        queue = ctx.Queue()
        procs = [
            ctx.Process(target=_mps_worker, args=(str(plan), batch, self.reps, self.warmup, max(1, 100 // level), barrier, queue))
            for _ in range(level)
        ]
        for p in procs:
            p.start()
        results = [queue.get(timeout=900) for _ in procs]
        for p in procs:
            p.join(timeout=60)
        errors = [msg for status, msg in results if status != "ok"]
        if errors:
            raise NotAvailableError(f"MPS measurement failed: {errors[0]}", fix="check the MPS daemon and the GPU")
        return float(np.mean([val for _s, val in results]))

    def close(self) -> None:
        if self._tmp is not None:
            self._tmp.cleanup()


__all__ = ["TensorRTTimer", "build_engine", "mps_available"]
