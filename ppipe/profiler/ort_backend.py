"""onnxruntime timing backend (CPU): per-layer times and block latencies.

**What a vGPU share means on a CPU.** ppipe treats this machine's CPU as one "GPU" of
type ``cpu`` (cluster ``local-cpu``). A vGPU at level v is 1/v of the CPU: its sessions
run with ``threads // v`` intra-op threads (at least 1). Block latency at level v is
measured with that many threads, one block at a time. (On a GPU, the TensorRT backend
instead runs v copies at once under MPS, as the PPipe paper measured; on a CPU, v
concurrent copies on a shared machine would mostly measure the neighbours.)

**Per-layer timing** uses ORT's profiler (``SessionOptions.enable_profiling``) on the
whole model with all optimizations on (per-node minimum over 10 runs). These per-node
times weight the pre-partitioning and are written to ``layers.csv`` (method
``ort-optimized``: a node fused into another has 0); the block latencies written to
``profile.csv`` are measured on the block sub-models.

**Block latency** = the median (or, with ``--stat min``, the minimum) wall time of
``session.run`` over ``reps`` runs after ``warmup`` runs, on a seeded random input batch.
"""

from __future__ import annotations

import json
import os
import tempfile
import time
from pathlib import Path

import numpy as np

from ppipe.errors import UserError

DEFAULT_REPS = 10
DEFAULT_WARMUP = 2
MIN_MEASURE_S = 0.0  # stop after `reps` runs; raise to keep measuring short layers longer


def default_threads() -> int:
    """Intra-op threads of a whole CPU: the cores this process may use."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:  # pragma: no cover - non-Linux
        return max(1, os.cpu_count() or 1)


def provenance(threads: int, reps: int, statistic: str = "median") -> str:
    import platform

    import onnxruntime as ort

    cpu = platform.processor() or platform.machine()
    return (
        f"measured: onnxruntime {ort.__version__} CPUExecutionProvider on {cpu} ({threads} intra-op threads at level 1; "
        f"level v = 1/v of the threads), {statistic} of {reps} runs; vGPU level v on a CPU = 1/v of the intra-op threads"
    )


def _ort():
    import onnxruntime as ort

    return ort


def make_session(model, threads: int, *, optimize: bool = True, profile_prefix: str | None = None):
    """An onnxruntime CPU session (``threads`` 0: ORT's default); UserError if ORT cannot load the model."""
    ort = _ort()
    so = ort.SessionOptions()
    so.log_severity_level = 3
    so.intra_op_num_threads = max(0, threads)
    so.inter_op_num_threads = 1
    so.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL if optimize else ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    if profile_prefix is not None:
        so.enable_profiling = True
        so.profile_file_prefix = profile_prefix
    src = str(model) if isinstance(model, (str, Path)) else model.SerializeToString()
    try:
        return ort.InferenceSession(src, sess_options=so, providers=["CPUExecutionProvider"])
    except Exception as exc:  # ORT's own exception types: NOT_IMPLEMENTED, INVALID_GRAPH, ...
        raise UserError(
            f"onnxruntime cannot run this model: {str(exc).strip().splitlines()[0][:400]}",
            fix="use ops that onnxruntime's CPU provider supports (or profile on another backend)",
        ) from None


def _feeds(sess, batch: int, seed: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    feeds = {}
    for x in sess.get_inputs():
        shape = [batch] + [d if isinstance(d, int) else 1 for d in x.shape[1:]]
        if "float16" in x.type:
            feeds[x.name] = rng.standard_normal(shape).astype(np.float16)
        elif "float" in x.type or "double" in x.type:
            feeds[x.name] = rng.standard_normal(shape).astype(np.float32 if "double" not in x.type else np.float64)
        elif "int" in x.type:
            feeds[x.name] = np.zeros(shape, dtype=np.int64)
        else:
            raise UserError(f"input {x.name!r} has type {x.type}, which the profiler cannot feed", fix="use float or integer inputs")
    return feeds


def layer_times_us(model, node_names: list[str], threads: int, runs: int = 10) -> list[float]:
    """Minimum time of each named node over ``runs`` runs at batch 1 (0 for nodes fused away).

    The minimum, not the median: on a machine shared with other work, single layers are
    hit by preemption at random, and cuts chosen from noisy layer times give blocks of
    very unequal measured latency (seen on the 2-core development machine).

    The session runs with all graph optimizations, as the blocks will: a node that ORT
    fused into another gets 0 and its time counts for the node it was fused into. ORT
    names an optimized node after the original node, or after the tensor it produces with
    a suffix (``<tensor>_nchwc`` for the NCHWc convolutions); both map back.

    Args:
        model: the prepared whole model (``onnx.ModelProto``).
        node_names: names of the compute nodes, in compute order.
        threads: intra-op threads.
        runs: timed runs after one warm-up.
    """
    g = model.graph
    by_output = {o: n.name for n in g.node for o in n.output}
    wanted = set(node_names)
    with tempfile.TemporaryDirectory(prefix="ppipe-ortprof-") as tmp:
        sess = make_session(model, threads, optimize=True, profile_prefix=str(Path(tmp) / "prof"))
        feeds = _feeds(sess, 1)
        for _ in range(runs + 1):
            sess.run(None, feeds)
        path = sess.end_profiling()
        events = json.loads(Path(path).read_text())
    per_run: dict[str, list[float]] = {}
    for ev in events:
        if ev.get("cat") != "Node":
            continue
        name = ev.get("name", "")
        if not name.endswith("_kernel_time"):
            continue
        node = _map_node(name[: -len("_kernel_time")], wanted, by_output)
        if node is not None:
            per_run.setdefault(node, []).append(float(ev.get("dur", 0.0)))
    out = []
    for n in node_names:
        samples = per_run.get(n, [])[1:]  # the first run is the warm-up
        out.append(float(np.min(samples)) if samples else 0.0)
    return out


def _map_node(event_node: str, wanted: set[str], by_output: dict[str, str]) -> str | None:
    if event_node in wanted:
        return event_node
    base = event_node
    for _ in range(3):  # strip suffixes such as _nchwc, _fused, _token_12
        if base in wanted:
            return base
        if base in by_output:
            return by_output[base]
        if "_" not in base:
            break
        base = base.rsplit("_", 1)[0]
    return None


class BlockTimer:
    """Times block sub-models with onnxruntime at a given number of threads.

    Args:
        threads: intra-op threads (the whole CPU = level 1).
        reps: timed runs per measurement (median reported).
        warmup: untimed runs first.
        statistic: ``median`` (default) or ``min`` of the timed runs; ``min`` is the
            better estimate of the uncontended latency on a machine shared with others.
    """

    def __init__(self, threads: int, reps: int = DEFAULT_REPS, warmup: int = DEFAULT_WARMUP, statistic: str = "median"):
        if statistic not in ("median", "min"):
            raise UserError(f"statistic {statistic!r} is not 'median' or 'min'", fix="use --stat median or --stat min")
        self.statistic = statistic
        self.threads = threads
        self.reps = reps
        self.warmup = warmup
        self._cache: dict[tuple[str, int], object] = {}

    def threads_at(self, level: int) -> int:
        return max(1, self.threads // level)

    def latency_us(self, block_path: str | Path, level: int, batch: int) -> float:
        """Median latency of one block at vGPU level ``level`` and batch ``batch``, in us."""
        key = (str(block_path), level)
        sess = self._cache.get(key)
        if sess is None:
            # one session per (block, level): sessions are reused across batch sizes
            self._cache.clear()
            sess = self._cache[key] = make_session(block_path, self.threads_at(level))
        feeds = _feeds(sess, batch)
        for _ in range(self.warmup):
            sess.run(None, feeds)
        samples = []
        t_end = time.perf_counter() + MIN_MEASURE_S
        while len(samples) < self.reps or time.perf_counter() < t_end:
            t0 = time.perf_counter()
            sess.run(None, feeds)
            samples.append((time.perf_counter() - t0) * 1e6)
        return float(np.min(samples) if self.statistic == "min" else np.median(samples))


__all__ = ["BlockTimer", "default_threads", "layer_times_us", "make_session", "provenance"]
