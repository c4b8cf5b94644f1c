"""The ``torch`` serving backend (``ppipe serve --backend torch``): blocks run by PyTorch.

The same block sub-models as ``ort`` and ``tensorrt``, run by
:class:`~ppipe.profiler.onnx_torch.OnnxTorchModule` (shared with ``ppipe profile
--backend torch``, so served latencies are the profiled ones). On a GPU pool the worker's
GPU is the only one it sees (``CUDA_VISIBLE_DEVICES``, set by the worker before this
loads) and the precision is the profile's for that GPU type (``fp16`` when its provenance
says so, else ``tf32``); on the CPU, fp32 with ``cores // v`` threads.

On a GPU the partition runs as one CUDA graph per input shape (:mod:`ppipe.profiler.cuda_graph`;
eager with ``PPIPE_CUDA_GRAPHS=0``): the profile timed graph replays, so the served
latencies are the profiled ones. The worker has the graphs of batches 1..its planned batch
captured when it starts (:meth:`TorchBackend.warm`), so no request waits for a capture. Host inputs
are copied to the device, the blocks run and the outputs come back, all on the
backend's own CUDA stream (``torch.cuda.stream``), which is synchronized before ``run``
returns: the feature maps handed on are complete whatever stream reads them next. On an
NCCL edge the feature maps stay on the GPU: CuPy arrays from a receive are read in place
and outputs are handed to the send as CuPy arrays over DLPack (``device_out``).
"""

from __future__ import annotations

import asyncio
import contextlib
from typing import Any

import numpy as np

from ppipe.errors import NotAvailableError
from ppipe.spec.profile import ModelProfile

Tensors = dict[str, np.ndarray]


def serving_device(torch: Any, gpu: str) -> str:
    """``cpu`` for CPU pools; ``cuda`` for GPU pools, or a NotAvailableError if torch sees none."""
    if gpu == "cpu":
        return "cpu"
    if not torch.cuda.is_available():
        raise NotAvailableError(
            f"the torch backend serves a {gpu} pool here, and torch sees no CUDA device",
            fix="install a CUDA build of torch on the GPU servers (pip install 'ppipe[torch]'), or use --backend emulated",
        )
    return "cuda"


class TorchBackend:
    """PyTorch over the partition's block sub-models, run one after another.

    Args:
        profile, gpu, vgpu, first, last: the partition (as for the other backends).
        precision: ``fp16``, ``tf32`` or ``fp32`` (default: see the module docstring).
        warm_batch: on a GPU, capture the graphs of batches 1..warm_batch now (the worker
            passes the pipeline's planned batch, the largest the scheduler dispatches), so
            that no request waits for a capture (:meth:`warm`).
    """

    name = "torch"

    def __init__(
        self, profile: ModelProfile, gpu: str, vgpu: int, first: int, last: int, precision: str | None = None, warm_batch: int = 0
    ):
        from ppipe.profiler.cuda_graph import graphs_enabled
        from ppipe.profiler.onnx_torch import import_torch
        from ppipe.profiler.torch_backend import load_block
        from ppipe.profiler.trt_backend import precision_of
        from ppipe.runtime.workers.backends import _cpu_threads, block_model_paths, keep_after

        torch = self.torch = import_torch()
        self.device = serving_device(torch, gpu)
        cuda = self.device == "cuda"
        self.precision = precision or (precision_of(profile.manifest.provenance.get(gpu, "")) if cuda else "fp32")
        if not cuda:
            torch.set_num_threads(_cpu_threads(vgpu))
        self.modules = [load_block(p, self.device, self.precision) for p in block_model_paths(profile, first, last)]
        self.keep = keep_after(profile, last)
        self.is_last = last == profile.num_blocks - 1
        self.gpu_resident = cuda
        # NCCL edges (ppipe.runtime.workers.worker): CuPy inputs from a receive are read in place
        # (torch.as_tensor reads __cuda_array_interface__), outputs can stay on the GPU
        self.accepts_device = self.device_outputs = cuda
        self.stream = torch.cuda.Stream() if cuda else None
        # one CUDA graph per input shape on a GPU (ppipe.profiler.cuda_graph), as the profile was timed
        self.graphs: dict[tuple, Any] | None = {} if graphs_enabled(self.device) else None
        self.inputs = partition_inputs(self.modules, profile, first)
        if self.graphs is not None and warm_batch > 0:
            self.warm(warm_batch)

    def warm(self, max_batch: int) -> None:
        """Run batches 1..``max_batch`` of zeros shaped as :attr:`inputs` (on a GPU: capture their graphs).

        A batch whose inputs differ from :attr:`inputs` (a tensor passed through this
        partition unread, whose shape no block here declares) is captured at its first
        arrival instead.
        """
        if self.inputs is None:
            return
        for b in range(1, max_batch + 1):
            self.run_sync({name: np.zeros((b, *shape), dtype) for name, (shape, dtype) in self.inputs.items()})

    def _on_stream(self) -> Any:
        return self.torch.cuda.stream(self.stream) if self.stream is not None else contextlib.nullcontext()

    def run_sync(self, inputs: Tensors, device_out: bool = False) -> Tensors:
        """Run the blocks; outputs on the host (fp32 for the model's outputs), or with
        ``device_out`` as CuPy device arrays of their own memory (DLPack), for an NCCL
        send: complete when this returns (the stream is synchronized)."""
        with self._on_stream():
            if self.graphs is None:
                out = self._chain(inputs)
            else:
                out = self._replay(inputs)
                if device_out:  # a graph's outputs are overwritten by its next replay
                    out = {k: v.clone() for k, v in out.items()}
            pick = self._to_cupy if device_out else self._to_host
            out = {k: pick(v) for k, v in out.items()}
            if self.stream is not None:
                self.stream.synchronize()
        return out

    def _chain(self, inputs: Tensors) -> Tensors:
        """The partition's blocks one after another (the modules copy and cast their inputs themselves)."""
        env: dict[str, Any] = dict(inputs)
        last_outs: list[str] = []
        with self.torch.inference_mode():
            for m in self.modules:
                outs = m(env)
                env.update(outs)
                last_outs = list(outs)
        return {k: env[k] for k in (self.keep or last_outs)}

    def _replay(self, inputs: Tensors) -> Tensors:
        """The partition as one CUDA graph per input shape (captured at its first batch, unless warmed)."""
        from ppipe.profiler.cuda_graph import GraphedRun, shape_key

        torch = self.torch
        key = shape_key(inputs)
        tensors = {k: torch.as_tensor(v) for k, v in inputs.items()}  # host arrays stay on the host until copied in
        graph = self.graphs.get(key)
        if graph is None:
            example = {k: v.to(self.device) for k, v in tensors.items()}
            graph = self.graphs[key] = GraphedRun(torch, self._chain, example, what=f"the partition at input shapes {key}")
        return graph(tensors)

    def _to_host(self, t: Any) -> np.ndarray:
        if self.is_last and t.is_floating_point():
            t = t.float()  # the model's answer in fp32, like the other backends
        return t.cpu().numpy()

    def _to_cupy(self, t: Any) -> Any:
        import cupy

        if self.is_last and t.is_floating_point():
            t = t.float()
        return cupy.from_dlpack(t.contiguous())  # the array keeps the tensor's memory alive

    async def run(self, inputs: Tensors, batch: int, device_out: bool = False) -> Tensors:
        # torch releases the GIL in its kernels: a thread keeps the actor's loop answering pings
        return await asyncio.get_running_loop().run_in_executor(None, self.run_sync, inputs, device_out)


def partition_inputs(modules: list[Any], profile: ModelProfile, first: int) -> dict[str, tuple[tuple[int, ...], Any]] | None:
    """The tensors a partition reads from outside, as they arrive: {name: (per-sample shape, dtype)}.

    Every block input that no earlier block of the partition produces. Floating tensors
    arrive in fp16 from an upstream worker (feature maps cross partitions in fp16) and in
    the model's input dtype at the first block. None where a block declares a symbolic
    dimension.
    """
    model_input = profile.manifest.input
    produced: set[str] = set()
    inputs: dict[str, tuple[tuple[int, ...], Any]] = {}
    for m in modules:
        for name, shape, dtype in m.input_specs:
            if name in produced or name in inputs:
                continue
            if shape is None:
                return None
            if first == 0 and name == model_input.name:
                dtype = np.dtype(model_input.dtype)
            elif np.dtype(dtype).kind == "f":
                dtype = np.dtype(np.float16)
            inputs[name] = (tuple(shape), np.dtype(dtype))
        produced.update(m.output_names)
    return inputs


__all__ = ["TorchBackend", "partition_inputs", "serving_device"]
