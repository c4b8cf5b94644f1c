"""The GPU spec sheet (``gpus.yaml`` next to this module): datasheet peaks per GPU type."""

from __future__ import annotations

import difflib
from functools import lru_cache
from pathlib import Path
from typing import Literal

from pydantic import Field, PositiveFloat, PositiveInt

from ppipe.errors import UserError
from ppipe.spec.base import StrictModel, load_yaml_model

SHEET = Path(__file__).with_name("gpus.yaml")


class GpuSpec(StrictModel):
    architecture: str = Field(description="GPU architecture and chip, free text.")
    sm_count: PositiveInt = Field(description="Streaming multiprocessors.")
    peak_fp32_tflops: PositiveFloat = Field(description="Peak fp32 (CUDA core) throughput, TFLOP/s.")
    peak_fp16_tensor_tflops: PositiveFloat | None = Field(description="Peak dense fp16 tensor-core throughput, TFLOP/s (null: none).")
    peak_tf32_tensor_tflops: PositiveFloat | None = Field(description="Peak dense TF32 tensor-core throughput, TFLOP/s (null: no TF32).")
    memory_bandwidth_gbps: PositiveFloat = Field(description="DRAM bandwidth in GB/s (gigaBYTES per second).")
    memory_gib: PositiveFloat = Field(description="DRAM capacity, GiB.")
    l2_cache_mib: PositiveFloat = Field(description="L2 cache, MiB.")
    tdp_w: PositiveFloat = Field(description="Board power, W.")
    mps_levels: list[int] = Field(description="vGPU (MPS) levels the estimate offers by default.")
    matmul_precision: Literal["fp32", "tf32", "fp16"] = Field(
        description="Precision TensorRT uses for conv/matmul with TF32 allowed (fp32 where the GPU has no TF32)."
    )
    peak_matmul_tflops: PositiveFloat = Field(description="Peak of the matmul_precision path, TFLOP/s.")
    calibration: str = Field(description="GPU type whose fitted efficiencies this type uses (roofline_params.json).")
    source: str = Field(description="Where the figures come from.")


class GpuSheet(StrictModel):
    version: int = Field(default=1, description="File format version.")
    gpus: dict[str, GpuSpec] = Field(description="GPU type name -> spec.")


@lru_cache(maxsize=4)
def load_gpu_sheet(path: str | None = None) -> GpuSheet:
    """The spec sheet (default: the one shipped with ppipe)."""
    return load_yaml_model(GpuSheet, Path(path) if path else SHEET)


def known_gpus() -> list[str]:
    return sorted(load_gpu_sheet().gpus)


def gpu_spec(name: str) -> GpuSpec:
    """The spec of one GPU type.

    Raises:
        UserError: the type is not on the sheet (the message lists the known types).
    """
    sheet = load_gpu_sheet()
    if name in sheet.gpus:
        return sheet.gpus[name]
    close = difflib.get_close_matches(name, list(sheet.gpus), n=1) or [
        g for g in sheet.gpus if g.lower() == name.lower()
    ]
    hint = f" (did you mean {close[0]}?)" if close else ""
    raise UserError(
        f"unknown GPU type '{name}'{hint}; the spec sheet knows: {', '.join(sorted(sheet.gpus))}",
        fix="use one of those names, or add the GPU's datasheet figures to ppipe/profiler/estimate/gpus.yaml",
        file=str(SHEET),
    )
