"""ONNX block sub-models run by PyTorch: a small interpreter over the graph's nodes.

The torch backend (:mod:`ppipe.profiler.torch_backend`, ``--backend torch``) runs the same
block sub-models that onnxruntime and TensorRT run, so that the three measure one thing.
Why not ``onnx2torch``: it pins torchvision and trails current torch and onnx releases;
the CNNs ppipe profiles need a few dozen operators, which a direct translation to
``torch.nn.functional`` covers in a page, with no code generation and no tracing.

What it does:

* initializers become tensors on the target device; nodes whose inputs are all constant
  (the ``Unsqueeze -> Mul`` of an unfolded batch-norm, a ``Reshape``'s shape) are folded
  once, in fp32, at load;
* floating constants are then cast to the run dtype (fp16 on CUDA by default, as a
  TensorRT fp16 engine would run; fp32 with TF32 tensor cores for ``tf32``);
* ``__call__`` takes and returns named tensors; inputs of another float dtype are cast to
  the run dtype (fp16 feature maps from the previous worker, fp32 images).

An operator outside :data:`OPS` raises :class:`~ppipe.errors.NotAvailableError` naming it,
at load rather than at the first batch.
"""

from __future__ import annotations

import math
from typing import Any, Callable

import numpy as np

from ppipe.errors import NotAvailableError

Tensors = dict[str, Any]


def import_torch():
    """``torch``, or a :class:`NotAvailableError` that names the extra to install."""
    try:
        import torch
    except ImportError:
        raise NotAvailableError(
            "the torch backend needs PyTorch, which is not installed",
            fix="pip install 'ppipe[torch]' (on GPU servers, a CUDA build of torch: see pytorch.org), "
            "or use --backend ort / tensorrt",
        ) from None
    return torch


# ---- operators: f(F, attrs, opset, *inputs) -> output or tuple of outputs ---------------------------------
def _torch_pad(begin: list[int], end: list[int]) -> list[int]:
    """ONNX pads (all begins, then all ends) as F.pad's (last dim first, begin/end pairs)."""
    out: list[int] = []
    for b, e in zip(reversed(begin), reversed(end)):
        out += [int(b), int(e)]
    return out


def _spatial_pads(a: dict, n: int) -> tuple[list[int], list[int]]:
    auto = a.get("auto_pad", b"NOTSET")
    if auto not in (b"NOTSET", "NOTSET", b"VALID", "VALID"):
        raise NotAvailableError(f"auto_pad={auto!r} is not supported by the torch backend", fix="export the model with explicit pads")
    pads = list(a.get("pads", [0] * (2 * n)))
    return pads[:n], pads[n:]


def _conv(F, a, opset, x, w, b=None):
    n = x.dim() - 2
    begin, end = _spatial_pads(a, n)
    padding: Any = tuple(begin)
    if begin != end:
        x, padding = F.pad(x, _torch_pad(begin, end)), 0
    conv = {1: F.conv1d, 2: F.conv2d, 3: F.conv3d}[n]
    return conv(
        x, w, b, stride=tuple(a.get("strides", [1] * n)), padding=padding, dilation=tuple(a.get("dilations", [1] * n)),
        groups=int(a.get("group", 1)),
    )


def _max_pool(F, a, opset, x):
    n = x.dim() - 2
    begin, end = _spatial_pads(a, n)
    padding: Any = tuple(begin)
    if begin != end:
        x, padding = F.pad(x, _torch_pad(begin, end), value=-math.inf), 0
    pool = {1: F.max_pool1d, 2: F.max_pool2d, 3: F.max_pool3d}[n]
    k = tuple(a["kernel_shape"])
    return pool(x, k, stride=tuple(a.get("strides", k)), padding=padding, dilation=tuple(a.get("dilations", [1] * n)), ceil_mode=bool(a.get("ceil_mode", 0)))


def _avg_pool(F, a, opset, x):
    n = x.dim() - 2
    begin, end = _spatial_pads(a, n)
    include = bool(a.get("count_include_pad", 0))
    if begin != end:
        if not include:
            raise NotAvailableError("AveragePool with asymmetric pads and count_include_pad=0", fix="use --backend ort for this model")
        x, begin = F.pad(x, _torch_pad(begin, end)), [0] * n
    pool = {1: F.avg_pool1d, 2: F.avg_pool2d, 3: F.avg_pool3d}[n]
    k = tuple(a["kernel_shape"])
    return pool(x, k, stride=tuple(a.get("strides", k)), padding=tuple(begin), ceil_mode=bool(a.get("ceil_mode", 0)), count_include_pad=include)


def _gemm(F, a, opset, x, w, c=None):
    x = x.t() if a.get("transA", 0) else x
    w = w.t() if a.get("transB", 0) else w
    y = (x @ w) * a.get("alpha", 1.0)
    return y if c is None else y + c * a.get("beta", 1.0)


def _softmax(F, a, opset, x):
    if opset >= 13:
        return F.softmax(x, dim=int(a.get("axis", -1)))
    axis = int(a.get("axis", 1)) % x.dim()  # before opset 13: softmax of the input flattened at axis
    return F.softmax(x.reshape(int(np.prod(x.shape[:axis])), -1), dim=1).reshape(x.shape)


def _reshape(F, a, opset, x, shape=None):
    dims = [int(d) for d in (a["shape"] if shape is None else shape.tolist())]
    if not a.get("allowzero", 0):
        dims = [x.shape[i] if d == 0 else d for i, d in enumerate(dims)]
    return x.reshape(dims)


def _axes(a, opset, axes):
    return [int(v) for v in (a.get("axes", []) if axes is None else axes.tolist())]


def _unsqueeze(F, a, opset, x, axes=None):
    out_rank = x.dim() + len(_axes(a, opset, axes))
    for ax in sorted(v % out_rank for v in _axes(a, opset, axes)):
        x = x.unsqueeze(ax)
    return x


def _squeeze(F, a, opset, x, axes=None):
    ax = _axes(a, opset, axes)
    return x.squeeze() if not ax else x.squeeze(tuple(v % x.dim() for v in ax))


def _clip(F, a, opset, x, lo=None, hi=None):
    lo = a.get("min") if lo is None and opset < 11 else lo
    hi = a.get("max") if hi is None and opset < 11 else hi
    return x.clamp(min=lo, max=hi)


def _batch_norm(F, a, opset, x, scale, bias, mean, var):
    return F.batch_norm(x, mean, var, scale, bias, training=False, eps=float(a.get("epsilon", 1e-5)))


def _reduce_mean(F, a, opset, x, axes=None):
    ax = a.get("axes") if opset < 18 else (None if axes is None else axes.tolist())
    if not ax:
        if a.get("noop_with_empty_axes", 0):
            return x
        ax = range(x.dim())
    return x.mean(dim=tuple(int(v) for v in ax), keepdim=bool(a.get("keepdims", 1)))


def _flatten(F, a, opset, x):
    axis = int(a.get("axis", 1)) % max(1, x.dim())
    return x.reshape(int(np.prod(x.shape[:axis])), -1)


def _sum(F, a, opset, *xs):
    out = xs[0]
    for x in xs[1:]:
        out = out + x
    return out


def _lrn(F, a, opset, x):
    return F.local_response_norm(x, int(a["size"]), alpha=float(a.get("alpha", 1e-4)), beta=float(a.get("beta", 0.75)), k=float(a.get("bias", 1.0)))


OPS: dict[str, Callable[..., Any]] = {
    "Conv": _conv,
    "MaxPool": _max_pool,
    "AveragePool": _avg_pool,
    "GlobalAveragePool": lambda F, a, o, x: x.mean(dim=tuple(range(2, x.dim())), keepdim=True),
    "GlobalMaxPool": lambda F, a, o, x: x.amax(dim=tuple(range(2, x.dim())), keepdim=True),
    "BatchNormalization": _batch_norm,
    "Relu": lambda F, a, o, x: F.relu(x),
    "LeakyRelu": lambda F, a, o, x: F.leaky_relu(x, float(a.get("alpha", 0.01))),
    "Sigmoid": lambda F, a, o, x: x.sigmoid(),
    "Tanh": lambda F, a, o, x: x.tanh(),
    "Clip": _clip,
    "Add": lambda F, a, o, x, y: x + y,
    "Sub": lambda F, a, o, x, y: x - y,
    "Mul": lambda F, a, o, x, y: x * y,
    "Div": lambda F, a, o, x, y: x / y,
    "Sum": _sum,
    "MatMul": lambda F, a, o, x, y: x @ y,
    "Gemm": _gemm,
    "Concat": lambda F, a, o, *xs: __import__("torch").cat(xs, dim=int(a["axis"])),
    "Reshape": _reshape,
    "Flatten": _flatten,
    "Transpose": lambda F, a, o, x: x.permute(*(a["perm"] if "perm" in a else reversed(range(x.dim())))),
    "Unsqueeze": _unsqueeze,
    "Squeeze": _squeeze,
    "Softmax": _softmax,
    "ReduceMean": _reduce_mean,
    "LRN": _lrn,
    "Identity": lambda F, a, o, x: x,
    "Dropout": lambda F, a, o, x, *rest: x,  # inference: the identity (a mask output is not supported)
}


def _input_spec(value_info) -> tuple[str, tuple[int, ...] | None, Any]:
    """(name, per-sample shape or None where a dimension is symbolic, NumPy dtype) of a graph input."""
    from onnx import helper

    t = value_info.type.tensor_type
    dims = [d.dim_value if d.HasField("dim_value") else 0 for d in t.shape.dim][1:]
    return value_info.name, (tuple(dims) if all(dims) else None), helper.tensor_dtype_to_np_dtype(t.elem_type)


# ---- the module ----------------------------------------------------------------------------------------------
class OnnxTorchModule:
    """One ONNX (block sub-)model as PyTorch operations on ``device`` in ``dtype``.

    Args:
        model: an ``onnx.ModelProto`` or the path of one.
        device: ``cuda`` (or ``cuda:N``) or ``cpu``.
        dtype: the run dtype of floating tensors, ``torch.float16`` or ``torch.float32``.

    Raises:
        NotAvailableError: torch is missing, or the model uses an operator outside :data:`OPS`.
    """

    def __init__(self, model: Any, device: str = "cpu", dtype: Any = None):
        import onnx
        from onnx import numpy_helper

        torch = import_torch()
        self.torch, self.F = torch, torch.nn.functional
        if not isinstance(model, onnx.ModelProto):
            model = onnx.load(str(model))
        g = model.graph
        self.opset = max((o.version for o in model.opset_import if o.domain in ("", "ai.onnx")), default=13)
        self.device, self.dtype = torch.device(device), dtype or torch.float32
        unknown = sorted({n.op_type for n in g.node if n.op_type not in OPS and n.op_type != "Constant"})
        if unknown:
            raise NotAvailableError(
                f"the torch backend does not implement ONNX operator(s) {', '.join(unknown)}",
                fix="profile and serve this model with --backend ort or tensorrt (or add the operator to ppipe.profiler.onnx_torch.OPS)",
            )
        consts = {t.name: torch.from_numpy(np.array(numpy_helper.to_array(t))) for t in g.initializer}
        self.input_names = [i.name for i in g.input if i.name not in consts]
        self.input_specs = [_input_spec(i) for i in g.input if i.name not in consts]
        self.output_names = [o.name for o in g.output]
        self.nodes = []  # (op_type, name, attrs, input names, output names) of the nodes left to run
        with torch.inference_mode():
            for node in g.node:
                self._add_node(node, consts)
        self.consts = {k: self._placed(v) for k, v in consts.items()}

    def _add_node(self, node, consts: dict) -> None:
        """Fold a node whose inputs are all constant, else keep it to run."""
        from onnx import helper, numpy_helper

        attrs = {a.name: helper.get_attribute_value(a) for a in node.attribute}
        if node.op_type == "Constant":
            consts[node.output[0]] = self.torch.from_numpy(np.array(numpy_helper.to_array(attrs["value"])))
            return
        ins = list(node.input)
        if all(n == "" or n in consts for n in ins):
            outs = self._apply(node.op_type, attrs, [consts.get(n) for n in ins])
            consts.update(zip(node.output, outs))
            return
        self.nodes.append((node.op_type, node.name, attrs, ins, list(node.output)))

    def _placed(self, t):
        """A floating constant on the device in the run dtype; integer ones stay on the host.

        Integer constants here are shapes and axes (Reshape, Unsqueeze), read with
        ``tolist()``: on the device every read would stall the host on a GPU sync.
        """
        return t.to(self.device, self.dtype) if t.is_floating_point() else t

    def _apply(self, op: str, attrs: dict, args: list) -> tuple:
        while args and args[-1] is None:
            args.pop()  # trailing optional inputs left out
        out = OPS[op](self.F, attrs, self.opset, *args)
        return out if isinstance(out, tuple) else (out,)

    def __call__(self, feeds: Tensors, node_timer: Callable[[str], Any] | None = None) -> Tensors:
        """Run the graph on named inputs (NumPy or torch); returns the graph outputs as torch tensors.

        ``node_timer(name)``, if given, is a context manager entered around each node
        (per-layer timing, :func:`ppipe.profiler.torch_backend.layer_times_us`).
        """
        torch = self.torch
        env: dict[str, Any] = dict(self.consts)
        for name in self.input_names:
            if name not in feeds:
                raise KeyError(f"input {name!r} missing (have {sorted(feeds)})")
            x = torch.as_tensor(feeds[name])
            env[name] = x.to(self.device, self.dtype if x.is_floating_point() else x.dtype)
        with torch.inference_mode():
            for op, name, attrs, ins, outs in self.nodes:
                args = [env[n] if n else None for n in ins]
                if node_timer is None:
                    results = self._apply(op, attrs, args)
                else:
                    with node_timer(name):
                        results = self._apply(op, attrs, args)
                env.update(zip(outs, results))
        return {n: env[n] for n in self.output_names}


__all__ = ["OPS", "OnnxTorchModule", "import_torch"]
