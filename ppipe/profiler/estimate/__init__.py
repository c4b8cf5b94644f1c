"""Latency estimates for GPU types that are not at hand.

Two estimators, one table format (``{(gpu, vgpu, batch, block): latency_us}``, the keys
of :class:`ppipe.spec.profile.ModelProfile`):

* :func:`cross_gpu_table` — from a model's *measured* profile on one GPU type to another,
  by ratios learned from real TensorRT timings (the PPipe artifact; :mod:`.crossgpu`).
  Use it whenever the model was profiled on one of the artifact's GPU types (L4, P4, T4,
  V100); it is the accurate one.
* :func:`roofline_table` — from the block ONNX graphs and a GPU spec sheet alone
  (:mod:`.roofline`, ``gpus.yaml``), for any GPU type on the sheet. A first-order
  estimate: see ``scripts/bench_estimator.py`` for how far it is off.

:func:`estimate_profile` wraps both: it returns a new :class:`ModelProfile` with the
estimated GPU types added and their provenance recorded.
"""

from ppipe.profiler.estimate.crossgpu import (
    CrossGpuModel,
    cross_gpu_table,
    default_cross_gpu_model,
    fit_cross_gpu,
)

__all__ = [
    "CrossGpuModel",
    "cross_gpu_table",
    "default_cross_gpu_model",
    "fit_cross_gpu",
]

from ppipe.profiler.estimate.gpus import gpu_spec, known_gpus  # noqa: E402
from ppipe.profiler.estimate.roofline import fit_roofline, provenance, roofline_table  # noqa: E402

from ppipe.profiler.estimate.profile import estimate_profile  # noqa: E402

__all__ += ["gpu_spec", "known_gpus", "fit_roofline", "provenance", "roofline_table", "estimate_profile"]
