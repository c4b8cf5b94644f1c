"""``ppipe profile --torch package.module:factory``: a PyTorch model exported to ONNX, then profiled.

The factory (any importable callable that returns an ``nn.Module``) is called once; the
module is put in eval mode and exported with ``torch.onnx.export(..., dynamo=True)``, the
exporter PyTorch recommends since 2.5 (``torch.export`` graph capture, then onnxscript),
at batch 1 (the profiler makes the batch symbolic, see :func:`_reshapes_without_allowzero`). The ONNX file is written next to the profile
(``<out>/<name>.onnx``) and profiled like any ONNX file, so the blocks, the resume rule
and the serving backends are the same as for a model that arrived as ONNX.
"""

from __future__ import annotations

import importlib
from pathlib import Path
from typing import Any, Callable, Sequence

from ppipe.errors import UserError
from ppipe.profiler.onnx_torch import import_torch

OPSET = 18  # the dynamo exporter's floor; onnxruntime 1.18+ and the torch backend read it


def load_factory(spec: str) -> Callable[[], Any]:
    """The callable named by ``package.module:factory``."""
    module_name, sep, attr = spec.partition(":")
    if not sep or not module_name or not attr:
        raise UserError(f"--torch {spec!r}: expected MODULE:FACTORY", fix="e.g. --torch torchvision.models:resnet18")
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise UserError(f"--torch {spec!r}: cannot import {module_name!r} ({exc})", fix="put the module on PYTHONPATH") from None
    fn: Any = module
    for part in attr.split("."):
        fn = getattr(fn, part, None)
    if not callable(fn):
        raise UserError(f"--torch {spec!r}: {attr!r} is not a callable of {module_name}", fix="name a function or class that returns an nn.Module")
    return fn


def export_onnx(spec: str, input_shape: Sequence[int], out_path: str | Path) -> Path:
    """Export ``factory()`` to ``out_path`` (batch 1, weights inside the file); returns the path.

    Raises:
        UserError: the factory is not found, does not return an ``nn.Module``, or the
            exporter fails (its message is kept).
        NotAvailableError: torch (or onnxscript, which the exporter needs) is missing.
    """
    torch = import_torch()
    model = load_factory(spec)()
    if not isinstance(model, torch.nn.Module):
        raise UserError(f"--torch {spec!r} returned {type(model).__name__}, not a torch.nn.Module", fix="return the model from the factory")
    model.eval()
    out_path = Path(out_path)
    out_path.parent.mkdir(parents=True, exist_ok=True)
    x = torch.randn(1, *[int(d) for d in input_shape])
    try:
        with torch.no_grad():
            torch.onnx.export(model, (x,), str(out_path), dynamo=True, opset_version=OPSET, input_names=["input"], external_data=False)
    except ImportError as exc:
        from ppipe.errors import NotAvailableError

        raise NotAvailableError(f"the ONNX exporter needs {exc.name}", fix="pip install 'ppipe[torch]' (torch and onnxscript)") from None
    except Exception as exc:  # the exporter's many error types: keep its message
        raise UserError(f"--torch {spec!r}: torch.onnx.export failed: {type(exc).__name__}: {str(exc)[:800]}", fix="make the model exportable with torch.export (see its error)") from None
    _reshapes_without_allowzero(out_path)
    return out_path


def _reshapes_without_allowzero(path: Path) -> None:
    """Clear ``allowzero`` on every Reshape (the exporter sets it on ``view``).

    The export is at batch 1 and the profiler makes the batch symbolic by rewriting the
    Reshape targets that hard-code batch 1 to ``0``, "copy the input's dimension"
    (:func:`ppipe.profiler.graph.prepare_model`); with ``allowzero=1`` that ``0`` would mean
    an empty dimension. A static export's targets hold no zeros, so clearing it changes
    nothing else. (A dynamic-batch export instead leaves Flatten's batch as an unknown
    symbol after shape inference, which the profiler cannot size.)
    """
    import onnx

    model = onnx.load(str(path))
    for node in model.graph.node:
        if node.op_type == "Reshape":
            kept = [a for a in node.attribute if a.name != "allowzero"]
            del node.attribute[:]
            node.attribute.extend(kept)
    onnx.save(model, str(path))


__all__ = ["export_onnx", "load_factory"]
