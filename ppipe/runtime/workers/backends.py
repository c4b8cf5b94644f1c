"""Execution backends: how a worker runs blocks ``first..last`` of a model on a batch.

A backend takes and returns a dict of named arrays whose first axis is the batch. Four
are available, by name:

- ``ort``: onnxruntime over the profile's per-block ONNX sub-models (``BlockSpec.onnx``;
  built-in models get them from :func:`ppipe.profiler.ensure_block_models`). CPU by
  default; the CUDA execution provider on GPU types when onnxruntime has it. On the CPU
  a vGPU of level v gets ``max(1, cores // v)`` intra-op threads.
- ``tensorrt``: TensorRT engines built from the same sub-models (at the profile's
  precision, tf32 by default), on the GPU the worker was pinned to. Needs ``tensorrt`` and
  ``cupy`` (``pip install ppipe[gpu]``).
- ``torch``: PyTorch over the same sub-models (:mod:`ppipe.runtime.workers.torch_backend`), on
  CUDA in fp16/tf32 or on the CPU; needs ``pip install ppipe[torch]``.
- ``emulated``: sleeps for the profiled latency of the partition at the batch
  (``ModelProfile.partition_latency_us``) and emits fp16 tensors of the profiled size
  (``out_bytes_per_sample`` of the partition's last block). It rehearses a plan for a
  cluster one does not have (a 100-GPU plan on a laptop) and drives tests. Its latencies
  are the profile's, by construction; it measures the serving system, not a model.
"""

from __future__ import annotations

import asyncio
import os
from bisect import bisect_left
from typing import Protocol

import numpy as np

from ppipe.errors import NotAvailableError, UserError
from ppipe.runtime.workers.stage_clock import WALL_CLOCK, StageClock
from ppipe.spec.profile import ModelProfile

BACKENDS = ("ort", "tensorrt", "torch", "emulated")

Tensors = dict[str, np.ndarray]


class Backend(Protocol):
    """Runs one partition. ``run`` may block (it is called in a thread) or be a coroutine.

    Attributes read by the worker's transport (absent means False):
        gpu_resident: runs on CUDA, so it can take part in NCCL edges.
        accepts_device: ``run`` takes CuPy device arrays as inputs.
        device_outputs: ``run(..., device_out=True)`` returns CuPy device arrays.
        starts_itself: ``run(..., start_us=t)`` begins the batch at wall time ``t`` by
            itself (the worker need not wait for the reserved start first).
    """

    name: str

    async def run(self, inputs: Tensors, batch: int) -> Tensors: ...


def interpolated_latency_us(profile: ModelProfile, gpu: str, vgpu: int, batch: int, first: int, last: int) -> float:
    """Profiled latency of blocks first..last at ``batch``; linear between profiled batches.

    The scheduler may dispatch a batch size the profile lacks (it shrinks batches to meet a
    deadline); between two profiled sizes the latency is interpolated linearly, beyond the
    largest it is extrapolated from the last two (or scaled, with a single point).
    """
    sizes = profile.batches(gpu, vgpu)
    if not sizes:
        raise UserError(
            f"model '{profile.name}' has no timings for gpu={gpu} vgpu={vgpu}",
            fix="profile the model for that GPU type and vGPU level, or plan for a cluster the profile covers",
        )
    if batch in sizes:
        return profile.partition_latency_us(gpu, vgpu, batch, first, last)
    i = bisect_left(sizes, batch)
    if i == 0:
        lo, hi = sizes[0], sizes[min(1, len(sizes) - 1)]
    elif i == len(sizes):
        lo, hi = sizes[max(0, len(sizes) - 2)], sizes[-1]
    else:
        lo, hi = sizes[i - 1], sizes[i]
    l_lo = profile.partition_latency_us(gpu, vgpu, lo, first, last)
    if lo == hi:
        return l_lo * batch / lo
    l_hi = profile.partition_latency_us(gpu, vgpu, hi, first, last)
    return max(0.0, l_lo + (l_hi - l_lo) * (batch - lo) / (hi - lo))


def emulated_tensor_name(block: int) -> str:
    return f"emulated_block{block}"


class EmulatedBackend:
    """Sleeps for the profiled latency; returns fp16 zeros of the profiled feature-map size.

    Args:
        profile: the model profile.
        gpu, vgpu: the pool's GPU type and vGPU level (the latency row to use).
        first, last: block range of the partition.
        time_scale: multiply every sleep (1.0 = the profiled latency).
        max_bytes_per_sample: cap on the size of the emitted feature maps (None: the
            profiled size). The detection models of the paper cut 2-13 MB feature maps per
            sample; a rehearsal of a 400 req/s plan on one small host cannot move GB/s
            through its sockets, so it caps them; the NIC time of a transfer is still
            the planned one (the worker waits it out), only the bytes shrink.
        clock: what the sleeps wait on (the worker's; default the wall clock).
        warm_batch: make this batch's outputs at once (the planned batch's: their pages
            written now, not by the first batch's send).
    """

    name = "emulated"
    starts_itself = True

    def __init__(
        self, profile: ModelProfile, gpu: str, vgpu: int, first: int, last: int, time_scale: float = 1.0,
        max_bytes_per_sample: int | None = None, clock: StageClock | None = None, warm_batch: int | None = None,
    ):
        self.profile, self.gpu, self.vgpu, self.first, self.last = profile, gpu, vgpu, first, last
        self.clock = clock or WALL_CLOCK
        self.time_scale = time_scale
        self.max_bytes_per_sample = max_bytes_per_sample
        self.is_last = last == profile.num_blocks - 1
        self._latency_us: dict[int, float] = {}
        self._outputs: dict[int, Tensors] = {}
        interpolated_latency_us(profile, gpu, vgpu, 1, first, last)  # fail at start, not per batch
        if warm_batch:
            self.outputs(warm_batch)  # the planned batch's outputs made now, not on the first batch's path

    def latency_us(self, batch: int) -> float:
        t = self._latency_us.get(batch)
        if t is None:
            t = self._latency_us[batch] = interpolated_latency_us(self.profile, self.gpu, self.vgpu, batch, self.first, self.last) * self.time_scale
        return t

    async def run(self, inputs: Tensors, batch: int, start_us: float | None = None) -> Tensors:
        """The outputs, once the partition's latency has passed from ``start_us`` (the
        stage's start; None or past: now). One wait covers the wait for the start and the
        inference: each timed wait is a wake-up or two of the worker, the largest part of an
        emulated stage's CPU."""
        now = self.clock.now_us()
        begin = now if start_us is None else max(now, start_us)
        # the wall clock's sleep_until is the loop's timer, then a kernel sleep for the last
        # millisecond: as punctual as a spin, without the spinning that would delay dozens
        # of emulated vGPUs
        await self.clock.sleep_until(begin + self.latency_us(batch))
        return self.outputs(batch)

    def outputs(self, batch: int) -> Tensors:
        """Zero tensors of the partition's output size (read-only, shared by the batches of one size)."""
        out = self._outputs.get(batch)
        if out is None:
            out = self._outputs[batch] = self._zeros(batch)
            for a in out.values():
                a.flags.writeable = False
        return out

    def _zeros(self, batch: int) -> Tensors:
        m = self.profile.manifest
        if self.is_last and m.outputs:
            return {o.name: np.full((batch, *o.shape), 0, dtype=o.dtype) for o in m.outputs}
        size = self.profile.cut_bytes(self.last)
        if self.max_bytes_per_sample is not None:
            size = min(size, self.max_bytes_per_sample)
        n = max(1, size // 2)
        name = "output" if self.is_last else emulated_tensor_name(self.last)
        return {name: np.full((batch, n), 0, dtype=np.float16)}  # (full, not zeros: its pages written, not mapped at first read)


def _cpu_threads(vgpu: int) -> int:
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return max(1, cores // vgpu)


def block_model_paths(profile: ModelProfile, first: int, last: int) -> list[str]:
    """Runnable ONNX files of blocks first..last, generating them for built-in models."""
    paths = [profile.block_onnx_path(b) for b in range(first, last + 1)]
    if any(p is None or not p.exists() for p in paths):
        from ppipe.profiler import ensure_block_models  # regenerates a built-in model's blocks deterministically

        generated = list(ensure_block_models(profile))
        paths = [generated[b] for b in range(first, last + 1)]
    missing = [first + i for i, p in enumerate(paths) if p is None or not os.path.exists(p)]
    if missing:
        raise NotAvailableError(
            f"model '{profile.name}': no runnable ONNX sub-model for block(s) {missing}"
            + (f" (profile folder {profile.directory})" if profile.directory else ""),
            fix="profile the model from its ONNX file with `ppipe profile` (it writes block sub-models), "
            "or serve with --backend emulated to rehearse the plan with profiled latencies",
        )
    return [str(p) for p in paths]


_ORT_TYPES = {
    "tensor(float)": np.float32,
    "tensor(float16)": np.float16,
    "tensor(double)": np.float64,
    "tensor(int64)": np.int64,
    "tensor(int32)": np.int32,
    "tensor(uint8)": np.uint8,
    "tensor(int8)": np.int8,
    "tensor(bool)": np.bool_,
}


def keep_after(profile: ModelProfile, last: int) -> list[str] | None:
    """Names of the tensors that leave block ``last`` (None: every output of the block)."""
    m = profile.manifest
    if last == profile.num_blocks - 1 and m.outputs:
        return [o.name for o in m.outputs]
    return list(m.blocks[last].out_tensors) or None


class OrtBackend:
    """onnxruntime over the partition's block sub-models, run one after another.

    Tensors that arrive in another float type than a sub-model declares (fp16 feature maps
    from the previous worker) are cast to the declared type.
    """

    name = "ort"

    def __init__(self, profile: ModelProfile, gpu: str, vgpu: int, first: int, last: int):
        import onnxruntime as ort

        self.paths = block_model_paths(profile, first, last)
        opts = ort.SessionOptions()
        opts.intra_op_num_threads = _cpu_threads(vgpu) if gpu == "cpu" else 1
        opts.inter_op_num_threads = 1
        providers = ["CPUExecutionProvider"]
        if gpu != "cpu" and "CUDAExecutionProvider" in ort.get_available_providers():
            providers.insert(0, "CUDAExecutionProvider")
        self.sessions = [ort.InferenceSession(p, sess_options=opts, providers=providers) for p in self.paths]
        self.keep = keep_after(profile, last)
        # NCCL needs the partition on CUDA; host arrays cross the session boundary either way
        self.gpu_resident = all(s.get_providers()[0] == "CUDAExecutionProvider" for s in self.sessions)

    def run_sync(self, inputs: Tensors) -> Tensors:
        env = dict(inputs)
        last_outs: list[str] = []
        for sess in self.sessions:
            feed = {}
            for i in sess.get_inputs():
                if i.name not in env:
                    raise RuntimeError(f"sub-model {sess} needs tensor '{i.name}', have {sorted(env)}")
                want = _ORT_TYPES.get(i.type)
                arr = env[i.name]
                feed[i.name] = arr.astype(want, copy=False) if want is not None and arr.dtype != want else arr
            names = [o.name for o in sess.get_outputs()]
            env.update(zip(names, sess.run(names, feed)))
            last_outs = names
        return {k: env[k] for k in (self.keep or last_outs)}

    async def run(self, inputs: Tensors, batch: int) -> Tensors:
        # onnxruntime releases the GIL: a thread keeps the actor's loop answering pings.
        return await asyncio.get_running_loop().run_in_executor(None, self.run_sync, inputs)


class TensorRTBackend:
    """TensorRT engines built from the block sub-models, on this worker's GPU.

    Written against the TensorRT Python API of 8.6 and 10.x (explicit-batch networks, named
    I/O tensors, ``execute_async_v3``) with CuPy device buffers. Engines come from
    :func:`ppipe.profiler.trt_backend.serving_engine` (shared with ``ppipe profile``, cached
    on disk): batches 1..``max_batch``, kernels tuned for ``opt_batch`` (the pipeline's
    planned batch; the data plane only ever shrinks it), at the precision the profile was
    measured in (``tf32`` unless its provenance for this GPU type says ``fp16``), so that
    served latencies are the profiled ones.

    Args:
        opt_batch: the planned batch of the partition's pipeline.
        max_batch: the largest batch accepted (default ``opt_batch``).
        precision: ``tf32`` or ``fp16`` (default: the profile's, see above).
    """

    name = "tensorrt"
    gpu_resident = True
    accepts_device = True  # CuPy inputs are used in place (cp.asarray does not copy them)
    device_outputs = True

    def __init__(
        self, profile: ModelProfile, gpu: str, vgpu: int, first: int, last: int, opt_batch: int = 1,
        max_batch: int | None = None, precision: str | None = None,
    ):
        try:
            import tensorrt as trt  # noqa: F401
            import cupy  # noqa: F401
        except ImportError as exc:
            raise NotAvailableError(
                f"the tensorrt backend needs TensorRT and CuPy ({exc.name} is not installed)",
                fix="pip install 'ppipe[gpu]' on the GPU servers, or use --backend ort / emulated",
            ) from None
        import cupy as cp
        import tensorrt as trt

        from ppipe.profiler.trt_backend import precision_of, runtime_logger, serving_engine

        self.cp, self.trt = cp, trt
        self.keep = keep_after(profile, last)
        self.opt_batch = max(1, int(opt_batch))
        self.max_batch = max(self.opt_batch, int(max_batch or self.opt_batch))
        self.precision = precision or precision_of(profile.manifest.provenance.get(gpu, ""))
        self.runtime = trt.Runtime(runtime_logger())
        self.engines = []
        for path in block_model_paths(profile, first, last):
            blob = serving_engine(path, self.opt_batch, self.max_batch, self.precision)
            engine = self.runtime.deserialize_cuda_engine(blob)
            if engine is None:
                raise RuntimeError(f"TensorRT could not load the engine of {path} (a stale cache file? delete $PPIPE_CACHE/trt)")
            self.engines.append(engine)
        self.contexts = [e.create_execution_context() for e in self.engines]
        self.stream = cp.cuda.Stream(non_blocking=True)
        self._buffers: dict[tuple[int, str, tuple], object] = {}  # output buffers per (engine, tensor, shape)

    def _output(self, i: int, name: str, shape: tuple, dtype) -> object:
        key = (i, name, shape)
        buf = self._buffers.get(key)
        if buf is None:
            buf = self._buffers[key] = self.cp.empty(shape, dtype=dtype)
        return buf

    def run_sync(self, inputs: Tensors, device_out: bool = False) -> Tensors:
        """Run the engines; outputs as NumPy, or as CuPy device arrays with ``device_out``
        (for an NCCL send: the feature map never visits the host).

        Device inputs come from an NCCL receive, which synchronizes its own stream before
        it returns them, so this stream may use them at once. Every copy made here (host
        inputs to the device, casts, the outputs) is queued on this backend's stream: with
        CuPy >= 13 ``cp.asarray(numpy_array)`` is asynchronous on the *current* stream, and
        this non-blocking stream would not wait for the default one.
        """
        cp = self.cp
        with self.stream:
            env = {k: cp.asarray(v) for k, v in inputs.items()}
            last_outs = self._execute(env)
            keep = self.keep or last_outs
            if device_out:
                # copies: the cached buffers are overwritten by the next batch, the NCCL send may still be reading
                out = {k: env[k].copy() for k in keep}
            else:
                out = {k: cp.asnumpy(env[k]) for k in keep}  # blocking copies on this stream
            self.stream.synchronize()
        return out

    def _execute(self, env: dict) -> list[str]:
        """Queue every engine on ``self.stream`` (the current stream); returns the last outputs' names."""
        cp, trt = self.cp, self.trt
        last_outs: list[str] = []
        for i, (engine, ctx) in enumerate(zip(self.engines, self.contexts)):
            outs = []
            for j in range(engine.num_io_tensors):
                name = engine.get_tensor_name(j)
                dtype = np.dtype(trt.nptype(engine.get_tensor_dtype(name)))
                if engine.get_tensor_mode(name) == trt.TensorIOMode.INPUT:
                    arr = cp.ascontiguousarray(env[name].astype(dtype, copy=False))
                    env[name] = arr
                    if arr.shape[0] > self.max_batch or not ctx.set_input_shape(name, arr.shape):
                        raise UserError(
                            f"TensorRT engine input {name!r}: batch {arr.shape[0]} (shape {arr.shape}) is outside "
                            f"the engine's range 1..{self.max_batch}",
                            fix="serve with a larger backend option max_batch (the plan's batch is the default)",
                        )
                    ctx.set_tensor_address(name, arr.data.ptr)
                else:
                    outs.append((name, dtype))
            for name, dtype in outs:
                # reused between calls: a later stage's copy to the host or the NCCL send
                # finishes before this stream runs the next batch (run_sync is serialised)
                arr = self._output(i, name, tuple(ctx.get_tensor_shape(name)), dtype)
                env[name] = arr
                ctx.set_tensor_address(name, arr.data.ptr)
            if not ctx.execute_async_v3(self.stream.ptr):
                raise RuntimeError("TensorRT execute_async_v3 failed")
            last_outs = [n for n, _ in outs]
        return last_outs

    async def run(self, inputs: Tensors, batch: int, device_out: bool = False) -> Tensors:
        return await asyncio.get_running_loop().run_in_executor(None, self.run_sync, inputs, device_out)


def make_backend(name: str, profile: ModelProfile, gpu: str, vgpu: int, first: int, last: int, *,
                 clock: StageClock | None = None, **options) -> Backend:
    """Build a backend by name (``ort``, ``tensorrt``, ``torch``, ``emulated``); ``clock``: the
    worker's, which the emulated backend sleeps on (the others run for real)."""
    if name == "emulated":
        return EmulatedBackend(
            profile, gpu, vgpu, first, last, time_scale=options.get("time_scale", 1.0),
            max_bytes_per_sample=options.get("max_bytes_per_sample"), clock=clock, warm_batch=options.get("opt_batch"),
        )
    if name == "ort":
        return OrtBackend(profile, gpu, vgpu, first, last)
    if name == "tensorrt":
        return TensorRTBackend(
            profile, gpu, vgpu, first, last, opt_batch=options.get("opt_batch", 1), max_batch=options.get("max_batch"),
            precision=options.get("precision"),
        )
    if name == "torch":
        from ppipe.runtime.workers.torch_backend import TorchBackend

        return TorchBackend(profile, gpu, vgpu, first, last, precision=options.get("precision"), warm_batch=options.get("opt_batch", 0))
    raise UserError(f"unknown backend '{name}'", fix=f"use one of {', '.join(BACKENDS)}")
