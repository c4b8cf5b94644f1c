"""What a served model takes and gives, as the KServe v2 APIs show it: its metadata, and
the check of a decoded infer request against its manifest. The REST and the gRPC
frontends both use them, so that both describe a model alike and refuse alike."""

from __future__ import annotations

from typing import Any

import numpy as np

from ppipe.runtime.ingress.protocol import DATATYPES, InferInput, ProtocolError, brief

MAX_SAMPLES_PER_REQUEST = 256

_DATATYPE_OF_NUMPY = {v: k for k, v in DATATYPES.items()}


def model_metadata(name: str, model_plan, manifest) -> dict[str, Any]:
    """The v2 model metadata of model ``name``: its inputs and outputs from ``manifest``
    (with a leading batch axis of -1), its SLO and pipelines from ``model_plan``."""
    dt, spec = _DATATYPE_OF_NUMPY, manifest.input
    inputs = (
        [{"name": spec.name, "datatype": dt.get(spec.dtype, spec.dtype.upper()), "shape": [-1, *spec.shape],
          **({"parameters": {"also_accepts": "BYTES [-1]: encoded images (JPEG, PNG, WebP, BMP, TIFF), prepared as "
                                             + _describe(manifest.preprocess)}} if manifest.preprocess else {})}]
        if spec
        else [{"name": "input", "datatype": "FP32", "shape": [-1], "note": "any name and shape: the profile has no input spec"}]
    )
    outputs = [{"name": o.name, "datatype": dt.get(o.dtype, o.dtype.upper()), "shape": [-1, *o.shape]} for o in manifest.outputs]
    return {
        "name": name,
        "versions": ["1"],
        "platform": "ppipe",
        "inputs": inputs,
        "outputs": outputs,
        "parameters": {"slo_ms": model_plan.slo_ms, "pipelines": len(model_plan.pipelines),
                       "planned_throughput_rps": model_plan.throughput_rps},
    }


def _describe(pre) -> str:
    """The preprocess in one line, for the metadata."""
    return (f"{pre.color} {pre.layout}, {pre.resize} ({pre.interpolation}), x {pre.scale:g}, mean {pre.mean}, std {pre.std}")


def check_infer_inputs(name: str, man, inputs: list[InferInput], requested_outputs: list[str]) -> tuple[str, np.ndarray]:
    """Check a decoded infer request against model ``name``'s manifest ``man``: one input
    of the manifest's name, datatype and shape [N, ...] (or, for a model that declares a
    preprocess, a BYTES tensor of N encoded images, shape [N] or [N, 1]),
    1..MAX_SAMPLES_PER_REQUEST samples, only known outputs requested. The REST and the gRPC
    frontends both call it.

    Returns:
        (input name, its array of N samples; for images, N byte strings).

    Raises:
        ProtocolError: 400, naming the field at fault and what it must be.
    """
    if len(inputs) != 1:
        raise ProtocolError(400, f"model '{name}' takes 1 input tensor, got {len(inputs)}")
    t = inputs[0]
    arr = t.array
    if arr.dtype == object:
        arr = _image_input(name, man, t.name, arr)
    elif man.input is not None:
        spec = man.input
        if t.name != spec.name:
            raise ProtocolError(400, f"model '{name}' has input '{spec.name}', not {brief(t.name)}")
        if np.dtype(spec.dtype) != arr.dtype:
            want = _DATATYPE_OF_NUMPY.get(np.dtype(spec.dtype).name, spec.dtype)
            raise ProtocolError(400, f"input '{t.name}' must have datatype {want}, got {_dt(arr.dtype)}")
        if list(arr.shape[1:]) != list(spec.shape) or arr.ndim != len(spec.shape) + 1:
            raise ProtocolError(
                400, f"input '{t.name}' must have shape [N, {', '.join(map(str, spec.shape))}], got {list(arr.shape)}"
            )
    elif arr.ndim < 1:
        raise ProtocolError(400, f"input {brief(t.name)} needs a leading batch axis")
    n = arr.shape[0]
    if not 1 <= n <= MAX_SAMPLES_PER_REQUEST:
        raise ProtocolError(400, f"input {brief(t.name)} holds {n} samples; send 1..{MAX_SAMPLES_PER_REQUEST} per request")
    known = [o.name for o in man.outputs]
    for o in requested_outputs:
        if known and o not in known:
            raise ProtocolError(400, f"model '{name}' has no output {brief(o)} (outputs: {', '.join(known)})")
    return t.name, arr


def _image_input(name: str, man, input_name: str, arr: np.ndarray) -> np.ndarray:
    """The encoded images of a BYTES input, flat: [N] or [N, 1] elements of a model that declares a preprocess."""
    if man.preprocess is None or man.input is None:
        want = f"{_dt(np.dtype(man.input.dtype))} [N, {', '.join(map(str, man.input.shape))}]" if man.input else "numeric"
        raise ProtocolError(400, f"model '{name}' takes {want} tensors; it declares no image preprocessing (no 'preprocess' "
                                 "in its model.yaml), so BYTES inputs are refused")
    if input_name != man.input.name:
        raise ProtocolError(400, f"model '{name}' has input '{man.input.name}', not {brief(input_name)}")
    if arr.ndim not in (1, 2) or (arr.ndim == 2 and arr.shape[1] != 1):
        raise ProtocolError(400, f"input '{input_name}' of BYTES holds encoded images: shape [N] or [N, 1], got {list(arr.shape)}")
    return arr.reshape(-1)


def _dt(dtype: np.dtype) -> str:
    return _DATATYPE_OF_NUMPY.get(np.dtype(dtype).name, str(dtype))
