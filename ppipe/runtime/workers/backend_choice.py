"""Which backend runs a plan's partitions here: ``ppipe serve --backend auto``.

A plan whose pools are all ``cpu`` runs on onnxruntime. A plan with GPU pools runs on the
best GPU backend installed, in this order: TensorRT (``tensorrt`` and ``cupy``, a CUDA
device), PyTorch on CUDA, onnxruntime with its CUDA execution provider. With none of them,
``ppipe serve`` refuses the plan and names the extra to install: running GPU pools on the
CPU would serve every request late, and quietly. An explicit ``--backend ort`` on GPU pools
without onnxruntime's CUDA provider still runs, on the CPU, with a warning that says so.

The probes run in the serving process, before any worker starts: on one machine they see
the workers' GPUs; across machines (``--launcher ray``) they see the head node's, so a head
without GPUs names the backend with ``--backend``.
"""

from __future__ import annotations

import importlib.util
from typing import Callable

from ppipe.errors import UserError

GPU_ORDER = ("tensorrt", "torch", "ort")  # the GPU backends auto tries, best first


def _tensorrt() -> bool:
    if importlib.util.find_spec("tensorrt") is None or importlib.util.find_spec("cupy") is None:
        return False
    try:
        import cupy

        return cupy.cuda.runtime.getDeviceCount() > 0
    except Exception:  # no driver, no device
        return False


def _torch_cuda() -> bool:
    if importlib.util.find_spec("torch") is None:
        return False
    import torch

    return bool(torch.cuda.is_available())


def _ort_cuda() -> bool:
    import onnxruntime

    return "CUDAExecutionProvider" in onnxruntime.get_available_providers()


PROBES: dict[str, Callable[[], bool]] = {"tensorrt": _tensorrt, "torch": _torch_cuda, "ort": _ort_cuda}


def choose_backend(requested: str, pool_types: set[str], probes: dict[str, Callable[[], bool]] | None = None) -> tuple[str, str | None]:
    """``(backend, warning or None)`` for ``--backend requested`` on pools of ``pool_types``.

    Raises:
        UserError: ``auto`` on GPU pools with no GPU backend usable here.
    """
    probes = PROBES if probes is None else probes
    gpus = sorted(pool_types - {"cpu"})
    if requested == "auto":
        if not gpus:
            return "ort", None
        for name in GPU_ORDER:
            if probes[name]():
                return name, None
        raise UserError(
            f"the plan's pools are GPUs ({', '.join(gpus)}) and no GPU backend can run here: no TensorRT with CuPy and a "
            "CUDA device, no PyTorch with CUDA, no onnxruntime CUDA provider",
            fix="pip install 'ppipe[gpu]' (TensorRT, CUDA 12; 'ppipe[gpu-cu13]' for CUDA 13) or 'ppipe[torch]' on the GPU "
            "servers; or --backend emulated to rehearse the plan without GPUs, or --backend ort to run it on the CPU anyway",
        )
    if requested == "ort" and gpus and not probes["ort"]():
        return "ort", (f"warning: --backend ort runs the plan's {', '.join(gpus)} pools on the CPU (onnxruntime has no CUDA "
                       "provider here): latencies will not be the profiled ones")
    return requested, None


def pool_types(plan) -> set[str]:
    """The GPU types of a plan's pools."""
    return {p.gpu for m in plan.models for pp in m.pipelines for p in pp.partitions}
