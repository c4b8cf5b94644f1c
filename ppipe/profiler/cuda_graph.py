"""Block sub-models replayed as CUDA graphs: what the torch backend times and serves on a GPU.

Run eagerly, :class:`~ppipe.profiler.onnx_torch.OnnxTorchModule` launches each ONNX node's
kernels from Python, one after another. A CNN block has 10-60 nodes and a kernel on a
modern GPU often finishes before the next launch is issued, so the GPU waits on the host
and an eager timing measures Python's launches, not the GPU (the H100 run in
``docs/measurements/h100-2026-11-27``). TensorRT, the backend the PPipe paper profiles with, enqueues a whole
engine at once. A CUDA graph (``torch.cuda.CUDAGraph``) does the same for PyTorch: the
block's kernels are captured once for fixed input shapes and replayed with one launch.

:class:`GraphedRun` captures ``fn(static_inputs)`` for one set of input shapes and
dtypes: three warm-up calls on a side stream (cuDNN picks its algorithms, the caching
allocator settles), then the capture. A replay first copies the new inputs into the
static input tensors, then replays; its outputs are the same static output tensors every
time, so a caller that keeps them past the next replay clones them. Each graph has its
own memory pool: replays of different batch sizes come in any order, which a shared
pool does not allow. The capture is ``thread_local``: a serving worker's other threads (the
transport's) may call CUDA meanwhile without breaking it.

Graphs are used on CUDA devices unless ``PPIPE_CUDA_GRAPHS=0``; the profile's
provenance and the serving backend say which. The ops of ``onnx_torch`` keep shapes and
axes on the host, so a capture does not sync; one that fails raises a
:class:`~ppipe.errors.NotAvailableError` that names the switch.
"""

from __future__ import annotations

import os
from typing import Any, Callable

from ppipe.errors import NotAvailableError

Tensors = dict[str, Any]
WARMUP_CALLS = 3
ENV_SWITCH = "PPIPE_CUDA_GRAPHS"


def graphs_enabled(device: Any) -> bool:
    """Whether blocks on ``device`` run as CUDA graphs: CUDA devices, unless ``PPIPE_CUDA_GRAPHS=0``."""
    kind = device.type if hasattr(device, "type") else str(device).split(":")[0]
    return kind == "cuda" and os.environ.get(ENV_SWITCH, "1").strip() not in ("0", "false", "no", "off")


def shape_key(feeds: Tensors) -> tuple:
    """The capture key of a set of inputs: each name with its shape and dtype."""
    return tuple(sorted((k, tuple(v.shape), str(v.dtype)) for k, v in feeds.items()))


class GraphedRun:
    """``fn`` captured as one CUDA graph for the shapes and dtypes of ``example`` (device tensors).

    Args:
        torch: the torch module.
        fn: named device tensors -> named tensors (all work on the current stream).
        example: inputs of the shapes to capture; cloned into the static input tensors.
        what: names the captured work in a capture error.
    """

    def __init__(self, torch: Any, fn: Callable[[Tensors], Tensors], example: Tensors, what: str = "a block"):
        self.torch = torch
        try:
            with torch.inference_mode():  # the static inputs are updated in place: inference tensors throughout
                self.static_in = {k: v.clone() for k, v in example.items()}
                side = torch.cuda.Stream()
                side.wait_stream(torch.cuda.current_stream())  # the warm-ups read the clones
                with torch.cuda.stream(side):
                    for _ in range(WARMUP_CALLS):
                        fn(self.static_in)
                torch.cuda.current_stream().wait_stream(side)
                self.graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(self.graph, capture_error_mode="thread_local"):
                    self.static_out = fn(self.static_in)
        except RuntimeError as exc:
            raise NotAvailableError(
                f"capturing {what} as a CUDA graph failed: {exc}",
                fix=f"run it eagerly with {ENV_SWITCH}=0 (slower: every node is launched from Python)",
            ) from exc

    def __call__(self, feeds: Tensors | None = None) -> Tensors:
        """Copy ``feeds`` (tensors of the captured shapes, any device) into place and replay."""
        with self.torch.inference_mode():
            for k, v in (feeds or {}).items():
                self.static_in[k].copy_(v, non_blocking=True)
        self.graph.replay()
        return self.static_out


__all__ = ["ENV_SWITCH", "GraphedRun", "graphs_enabled", "shape_key"]
