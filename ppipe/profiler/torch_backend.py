"""PyTorch timing backend (``ppipe profile --backend torch``): block latencies and per-layer times.

The block sub-models are the ones onnxruntime and TensorRT run, executed by
:class:`~ppipe.profiler.onnx_torch.OnnxTorchModule`. Why a torch backend next to TensorRT:
a GPU machine with a CUDA build of torch needs nothing else (no TensorRT wheels, no
engine builds), so a profile and a serving run can be had anywhere torch runs.

**Precision.** On CUDA ``fp16`` by default (weights and activations in half precision, as
a TensorRT fp16 engine runs; fp32 images are cast at the block's input), or ``tf32``
(fp32 tensors, TF32 tensor cores allowed for convolutions and matrix products, like
TensorRT's default). On the CPU ``fp32``.

**Timing.** Inputs are made on the device first (no host copy is timed); ``warmup`` untimed
runs, then ``reps`` timed runs, each between two CUDA events (``torch.cuda.Event``,
``elapsed_time``) on the GPU, or ``time.perf_counter`` on the CPU; the median (or minimum)
is kept. On the GPU a run is one replay of the block captured as a CUDA graph
(:mod:`ppipe.profiler.cuda_graph`): eager runs there measure how fast Python launches
kernels, not the GPU.

**vGPU levels.** Level v > 1 runs v processes (spawned once per level and kept), each with
its own copy of the block, released together by a barrier after their warm-up; the latency
of level v is the mean of their medians. On a GPU each of their samples is the wall time
per run of a burst of back-to-back runs that all v start together (:func:`_burst_us`):
timed one by one, runs of a few hundred microseconds do not overlap and a level would look
as fast as a whole GPU. When an MPS control daemon runs
(``nvidia-cuda-mps-control -d``), each process is an MPS client limited to
``CUDA_MPS_ACTIVE_THREAD_PERCENTAGE = 100 / v`` of the SMs: that is the PPipe paper's vGPU.
Without the daemon the v processes share the GPU by **time slicing**; the profile's
provenance then says so and never calls it MPS (:func:`sharing_mode`). On the CPU the v
processes split the cores (``cores // v`` threads each).
"""

from __future__ import annotations

import math
import multiprocessing as mp
import os
import queue as queue_mod
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Callable

import numpy as np

from ppipe.errors import NotAvailableError, UserError
from ppipe.profiler.cuda_graph import GraphedRun, graphs_enabled
from ppipe.profiler.onnx_torch import OnnxTorchModule, import_torch

PRECISIONS = ("fp16", "tf32", "fp32")
MPS, TIME_SLICED, CPU_SPLIT = "mps", "time-sliced", "cpu-split"
LEVEL_TIMEOUT_S = 600.0
BURST_S = 0.02  # the length of one sample at a level v > 1 on a GPU (_burst_us)


def default_device() -> str:
    """``cuda`` where torch sees a CUDA device, else ``cpu``."""
    torch = import_torch()
    return "cuda" if torch.cuda.is_available() else "cpu"


def default_precision(device: str) -> str:
    return "fp16" if device.startswith("cuda") else "fp32"


def check_precision(precision: str, device: str) -> None:
    if precision not in PRECISIONS:
        raise UserError(f"precision {precision!r} is not one of {', '.join(PRECISIONS)}", fix="use fp16 (default on CUDA), tf32 or fp32")
    if precision == "fp16" and not device.startswith("cuda"):
        raise UserError("fp16 runs on CUDA only in the torch backend", fix="use fp32 on the CPU")


def run_dtype(precision: str, device: str):
    """The torch dtype of activations and weights; sets the TF32 switches for ``tf32``."""
    torch = import_torch()
    check_precision(precision, device)
    if device.startswith("cuda"):
        allow = precision == "tf32"
        torch.backends.cuda.matmul.allow_tf32 = allow
        torch.backends.cudnn.allow_tf32 = allow
    return torch.float16 if precision == "fp16" else torch.float32


def load_block(path: str | Path, device: str, precision: str) -> OnnxTorchModule:
    """A block sub-model ready to run on ``device`` at ``precision``."""
    return OnnxTorchModule(path, device=device, dtype=run_dtype(precision, device))


def sharing_mode(device: str) -> str:
    """How v processes share the device at level v: ``mps``, ``time-sliced`` or ``cpu-split``."""
    if not device.startswith("cuda"):
        return CPU_SPLIT
    from ppipe.profiler.trt_backend import mps_available

    return MPS if mps_available() else TIME_SLICED


def device_name(device: str) -> str:
    torch = import_torch()
    if device.startswith("cuda"):
        return torch.cuda.get_device_name(torch.device(device))
    import platform

    return platform.processor() or platform.machine()


def make_feeds(module: OnnxTorchModule, batch: int, seed: int = 0) -> dict[str, Any]:
    """Seeded random inputs of ``batch`` samples, already on the module's device."""
    rng = np.random.default_rng(seed)
    feeds = {}
    for name, shape, dtype in module.input_specs:
        if shape is None:
            raise UserError(f"block input {name!r} has symbolic dimensions", fix="profile with --input-shape")
        x = rng.standard_normal((batch, *shape)).astype(np.float32)
        feeds[name] = module.torch.as_tensor(x.astype(dtype) if np.dtype(dtype).kind != "f" else x).to(module.device)
    return feeds


def time_module(module: OnnxTorchModule, batch: int, reps: int, warmup: int, statistic: str = "median", barrier: Any = None) -> float:
    """Median (or minimum) latency in us of one run of ``module`` at ``batch``.

    On the GPU each run is one replay of the block captured as a CUDA graph
    (:mod:`ppipe.profiler.cuda_graph`; eager with ``PPIPE_CUDA_GRAPHS=0``); on the CPU an
    eager run. Alone (no ``barrier``), each of ``reps`` runs is timed by itself: two CUDA
    events on the current stream, or ``perf_counter``. With the ``barrier`` of a level's v
    processes on a GPU, each sample is a burst (:func:`_burst_us`); on the CPU the v
    processes wait on it once after the warm-up, then time single runs on their own cores.
    """
    torch = module.torch
    feeds = make_feeds(module, batch)
    cuda = module.device.type == "cuda"
    run = _runner(module, feeds, batch)
    for _ in range(warmup):
        run()
    if cuda:
        torch.cuda.synchronize(module.device)
    if cuda and barrier is not None:
        samples = _burst_us(torch, run, reps, barrier)
    else:
        if barrier is not None:
            barrier.wait(timeout=LEVEL_TIMEOUT_S)
        samples = [_time_once(torch, run, cuda) for _ in range(reps)]
    return float(np.min(samples) if statistic == "min" else np.median(samples))


def _burst_us(torch: Any, run: Callable[[], Any], reps: int, barrier: Any) -> list[float]:
    """``reps`` samples of the wall time per run while the level's v processes all run.

    A sample: the v processes leave the barrier together, each enqueues n runs back to
    back and waits for its GPU work; the sample is the elapsed wall time / n, with n
    chosen so that a burst lasts :data:`BURST_S` at the process's own single-run speed.
    Single runs timed by events would not see the sharing: a run of 50-500 us fits in one
    time slice of the GPU, and an event pair measures only while its context runs. Under
    MPS the bursts run side by side on 1/v of the SMs each; time-sliced, they take turns,
    and a burst's wall time counts the turns of the others.
    """
    n = max(1, math.ceil(BURST_S * 1e6 / max(1.0, _time_once(torch, run, True))))
    samples = []
    for _ in range(reps):
        barrier.wait(timeout=LEVEL_TIMEOUT_S)
        t0 = time.perf_counter()
        for _ in range(n):
            run()
        torch.cuda.synchronize()
        samples.append((time.perf_counter() - t0) * 1e6 / n)
    return samples


def _runner(module: OnnxTorchModule, feeds: dict, batch: int) -> Callable[[], Any]:
    """One run of the block on ``feeds``: a CUDA graph replay where graphs are on, else eager."""
    if graphs_enabled(module.device):
        return GraphedRun(module.torch, module, feeds, what=f"a block at batch {batch}")
    return lambda: module(feeds)


def _time_once(torch: Any, run: Callable[[], Any], cuda: bool) -> float:
    if not cuda:
        t0 = time.perf_counter()
        run()
        return (time.perf_counter() - t0) * 1e6
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    run()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) * 1000.0  # ms -> us


# ---- level v > 1: v processes at once ------------------------------------------------------------------------
def _level_worker(device: str, precision: str, level: int, mode: str, commands: Any, results: Any, barrier: Any) -> None:
    """One of the v processes of a level: times the blocks it is sent until it gets ``None``."""
    if mode == MPS:  # before CUDA initializes in this process: the MPS client reads it once
        os.environ["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"] = str(max(1, 100 // level))
    torch = import_torch()
    if mode == CPU_SPLIT:
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // level))
    modules: dict[str, OnnxTorchModule] = {}
    while True:
        cmd = commands.get()
        if cmd is None:
            return
        path, batch, reps, warmup, statistic = cmd
        try:
            if path not in modules:
                modules.clear()  # one block at a time: the grid goes block by block
                modules[path] = load_block(path, device, precision)
            results.put(("ok", time_module(modules[path], batch, reps, warmup, statistic, barrier)))
        except BaseException as exc:  # noqa: BLE001 - reported to the parent, which raises
            barrier.abort()
            results.put(("error", f"{type(exc).__name__}: {exc}"))


class LevelPool:
    """v spawned processes that time a block at once (see the module docstring)."""

    def __init__(self, device: str, precision: str, level: int, mode: str):
        ctx = mp.get_context("spawn")  # CUDA cannot be used in a forked child
        self.level, self.mode = level, mode
        self.barrier = ctx.Barrier(level)
        self.results = ctx.Queue()
        self.commands = [ctx.Queue() for _ in range(level)]
        self.procs = [
            ctx.Process(target=_level_worker, args=(device, precision, level, mode, q, self.results, self.barrier), daemon=True)
            for q in self.commands
        ]
        for p in self.procs:
            p.start()

    def latency_us(self, block_path: str, batch: int, reps: int, warmup: int, statistic: str) -> float:
        for q in self.commands:
            q.put((str(block_path), batch, reps, warmup, statistic))
        got = [self._result() for _ in self.procs]
        errors = [v for kind, v in got if kind == "error"]
        if errors:
            raise NotAvailableError(f"level {self.level} measurement failed: {errors[0]}", fix="check the GPU (and the MPS daemon, if any)")
        return float(np.mean([v for _, v in got]))

    def _result(self) -> tuple[str, Any]:
        try:
            return self.results.get(timeout=LEVEL_TIMEOUT_S)
        except queue_mod.Empty:
            return ("error", f"no answer in {LEVEL_TIMEOUT_S:.0f} s (a level process died?)")

    def close(self) -> None:
        for q in self.commands:
            q.put(None)
        for p in self.procs:
            p.join(timeout=10)
            if p.is_alive():
                p.terminate()


class TorchTimer:
    """Times block sub-models with PyTorch (the ``latency_us(path, level, batch)`` of the other timers).

    Args:
        device: ``cuda`` / ``cpu`` (default: CUDA where available).
        reps, warmup: timed and untimed runs per measurement.
        precision: ``fp16`` (default on CUDA), ``tf32`` or ``fp32`` (default on the CPU).
        statistic: ``median`` or ``min`` of the timed runs.
    """

    def __init__(self, device: str | None = None, reps: int = 10, warmup: int = 5, precision: str | None = None, statistic: str = "median"):
        self.device = device or default_device()
        self.precision = precision or default_precision(self.device)
        check_precision(self.precision, self.device)
        self.reps, self.warmup, self.statistic = reps, warmup, statistic
        self.mode = sharing_mode(self.device)
        self._module: tuple[str, OnnxTorchModule] | None = None
        self._pools: dict[int, LevelPool] = {}

    def provenance(self) -> str:
        torch = import_torch()
        burst = f", each timing {BURST_S * 1000:.0f} ms bursts of back-to-back runs started together (wall time per run)"
        levels = {
            MPS: "level v = v processes at once under MPS at 100/v% of the SMs" + burst,
            TIME_SLICED: "level v = v processes at once, time-sliced by the GPU (no MPS daemon ran: not MPS)" + burst,
            CPU_SPLIT: "level v = v processes at once with cores/v threads each",
        }[self.mode]
        how = "perf_counter"
        if self.device.startswith("cuda"):
            how = "CUDA events, each run one CUDA graph replay" if graphs_enabled(self.device) else "CUDA events, eager (PPIPE_CUDA_GRAPHS=0)"
        return (
            f"measured: PyTorch {torch.__version__} ({self.precision}, ONNX blocks run by ppipe.profiler.onnx_torch) on "
            f"{device_name(self.device)}, {self.statistic} of {self.reps} runs timed with {how}; {levels}"
        )

    def latency_us(self, block_path: str | Path, level: int, batch: int) -> float:
        """Latency in us of a block at vGPU level ``level`` and batch ``batch``."""
        if level == 1:
            return time_module(self._load(str(block_path)), batch, self.reps, self.warmup, self.statistic)
        pool = self._pools.get(level)
        if pool is None:
            pool = self._pools[level] = LevelPool(self.device, self.precision, level, self.mode)
        return pool.latency_us(str(block_path), batch, self.reps, self.warmup, self.statistic)

    def _load(self, path: str) -> OnnxTorchModule:
        if self._module is None or self._module[0] != path:
            self._module = (path, load_block(path, self.device, self.precision))
        return self._module[1]

    def close(self) -> None:
        for pool in self._pools.values():
            pool.close()
        self._pools.clear()


# ---- per-layer times ---------------------------------------------------------------------------------------------
def layer_times_us(model: Any, node_names: list[str], device: str | None = None, precision: str | None = None, runs: int = 10) -> tuple[list[float], str]:
    """Batch-1 time of every named node (minimum over ``runs``), and the provenance.

    Each node runs between two CUDA events (or ``perf_counter`` readings) with nothing
    fused across nodes: the ``per-node`` method. Nodes folded into constants at load take 0.
    """
    device = device or default_device()
    precision = precision or default_precision(device)
    module = OnnxTorchModule(model, device=device, dtype=run_dtype(precision, device))
    feeds = make_feeds(module, 1)
    best: dict[str, float] = {}
    for i in range(runs + 1):
        spans: list[tuple[str, Any, Any]] = []
        module(feeds, node_timer=_node_timer(module, spans))
        if i == 0:
            continue  # warm-up
        for name, t in _elapsed_us(module, spans):
            best[name] = min(t, best.get(name, float("inf")))
    torch = import_torch()
    prov = (
        f"measured: PyTorch {torch.__version__} ({precision}) on {device_name(device)}, batch 1, each ONNX node timed "
        f"alone (no fusion), minimum of {runs} runs; a node folded into a constant has 0"
    )
    return [round(best.get(n, 0.0), 3) for n in node_names], prov


def _node_timer(module: OnnxTorchModule, spans: list):
    cuda = module.device.type == "cuda"
    torch = module.torch

    @contextmanager
    def timer(name: str):
        if cuda:
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            yield
            b.record()
        else:
            a = time.perf_counter()
            yield
            b = time.perf_counter()
        spans.append((name, a, b))

    return timer


def _elapsed_us(module: OnnxTorchModule, spans: list) -> list[tuple[str, float]]:
    if module.device.type == "cuda":
        module.torch.cuda.synchronize(module.device)
        return [(n, a.elapsed_time(b) * 1000.0) for n, a, b in spans]
    return [(n, (b - a) * 1e6) for n, a, b in spans]


__all__ = ["PRECISIONS", "LevelPool", "TorchTimer", "default_device", "layer_times_us", "load_block", "sharing_mode", "time_module"]


# ---- the hooks of ppipe.profiler.run (``ppipe profile --backend torch``) -------------------------------------
def _profile_device(measure: str) -> tuple[str, str]:
    """(torch device, why) for ``--measure``: the CPU for ``cpu``, else the local CUDA device."""
    if measure == "cpu":
        return "cpu", ""
    device = default_device()
    if device == "cpu":
        raise NotAvailableError(
            f"--measure {measure} --backend torch: torch sees no CUDA device here",
            fix="run on the GPU machine with a CUDA build of torch, or --measure cpu",
        )
    return device, ""


def _profile_precision(req: Any, device: str) -> str:
    """``--precision`` on CUDA (tf32 by default, as TensorRT); fp32 on the CPU."""
    return req.precision if device.startswith("cuda") else "fp32"


def profile_timer(req: Any) -> tuple[list[int], TorchTimer]:
    """The levels to measure and the timer, for a :class:`~ppipe.profiler.run.ProfileRequest`."""
    device, _ = _profile_device(req.measure)
    timer = TorchTimer(device, reps=req.reps, precision=_profile_precision(req, device), statistic=req.statistic)
    levels = list(req.gpu_levels if device.startswith("cuda") else req.cpu_levels)
    return levels, timer


def profile_layers(req: Any, info: Any, device_type: str) -> tuple[list[float], str, str]:
    """Per-layer times for ``ppipe profile``: (times in compute order, method, provenance)."""
    from ppipe.spec.profile import LayerMethod

    device, _ = _profile_device(device_type)
    names = [info.node(p).name for p in range(len(info.compute_nodes))]
    times, prov = layer_times_us(info.model, names, device=device, precision=_profile_precision(req, device))
    return times, LayerMethod.PER_NODE.value, prov
