"""The offline profiler: ONNX model -> blocks -> latency per GPU type x vGPU level x batch.

Modules:

* :mod:`ppipe.profiler.graph` – load and prepare ONNX models, list cut points and their sizes;
* :mod:`ppipe.profiler.builtin` – the built-in CNNs (onnx's backend test models, seeded weights);
* :mod:`ppipe.profiler.blocks` – pre-partitioning, block sub-models, :func:`ensure_block_models`;
* :mod:`ppipe.profiler.ort_backend` – onnxruntime timing on the CPU (level v = 1/v of the threads);
* :mod:`ppipe.profiler.trt_backend` – TensorRT timing on NVIDIA GPUs (levels under MPS; per-layer
  timing with TensorRT's profiler);
* :mod:`ppipe.profiler.layers` – engine layers -> ONNX nodes, the split rule of fused layers,
  the per-layer inputs of the cross-GPU estimator (pure logic, tested without a GPU);
* :mod:`ppipe.profiler.estimate` – estimates for GPU types that are not here;
* :mod:`ppipe.profiler.run` – the whole ``ppipe profile`` pipeline (grid, resume, output);
* :mod:`ppipe.profiler.cli` – the ``ppipe profile`` command.

Nothing here is imported by the planner, simulator or runtime except through
:func:`ppipe.profiler.blocks.ensure_block_models` (the runtime's onnxruntime backend).
"""

from __future__ import annotations

__all__ = ["ensure_block_models", "ensure_reference_model", "input_spec"]


def ensure_block_models(profile, cache_dir=None):
    """See :func:`ppipe.profiler.blocks.ensure_block_models` (imported lazily: onnx is heavy)."""
    from ppipe.profiler.blocks import ensure_block_models as _impl

    return _impl(profile, cache_dir)


def ensure_reference_model(profile, cache_dir=None):
    """See :func:`ppipe.profiler.blocks.ensure_reference_model`: the whole fp32 model as ONNX."""
    from ppipe.profiler.blocks import ensure_reference_model as _impl

    return _impl(profile, cache_dir)


def input_spec(profile):
    """The model input recorded in model.yaml (name, per-sample shape, dtype)."""
    from ppipe.profiler.blocks import input_spec as _impl

    return _impl(profile)
