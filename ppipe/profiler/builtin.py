"""Built-in models: the real CNN architectures shipped inside the ``onnx`` package.

``onnx`` ships, as backend test data, light versions of nine classic ImageNet CNNs
(``onnx/backend/test/data/light/light_<name>.onnx``). Their architectures are real but
their weights are not: the files use an old IR (initializers listed as graph inputs) and
generate most weights with ``ConstantOfShape`` from one constant, so the output does not
depend on the input and activations overflow fp16 at the cuts.

:func:`load_builtin` therefore **materializes seeded random weights at a sane scale**:

* Conv / Gemm weights: He (Kaiming) normal, std = sqrt(2 / fan_in), each filter shifted
  to zero mean (otherwise, after ReLUs, every input lands in the same class);
* biases (Conv, Gemm, the additive half of an unfolded batch-norm): 0;
* batch-norm scale 1, bias 0, running mean 0, running variance 1 (so batch-norm is the
  identity and activations keep the scale He init gives them);
* multiplicative parameters of an unfolded batch-norm (``Unsqueeze`` -> ``Mul``): 1.

Values are drawn from a generator seeded by (seed, tensor name), so the same seed gives
bit-identical models: the block sub-models of built-in profiles are not committed; they
are regenerated from the recorded seed (:func:`ppipe.profiler.blocks.ensure_block_models`).
Timings do not depend on weight values; only the numerics of the correctness check do.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

import numpy as np

from ppipe.errors import UserError

BUILTIN_MODELS = (
    "resnet50",
    "inception_v1",
    "inception_v2",
    "densenet121",
    "vgg19",
    "shufflenet",
    "squeezenet",
    "bvlc_alexnet",
    "zfnet512",
)
DEFAULT_SEED = 0
WEIGHTS_NOTE = (
    "architecture from onnx's backend test data (light_{name}.onnx); weights materialized with seed {seed}: "
    "He-normal conv/gemm weights, zero biases, batch-norm statistics 0/1 (not trained weights)"
)


def builtin_onnx_path(name: str) -> Path:
    """Path of the ``light_<name>.onnx`` file inside the installed onnx package."""
    import onnx

    if name not in BUILTIN_MODELS:
        import difflib

        close = difflib.get_close_matches(name, BUILTIN_MODELS, n=1)
        hint = f"did you mean {close[0]!r}? " if close else ""
        raise UserError(f"no built-in model {name!r}", fix=f"{hint}choose one of: {', '.join(BUILTIN_MODELS)}")
    p = Path(onnx.__file__).parent / "backend" / "test" / "data" / "light" / f"light_{name}.onnx"
    if not p.is_file():
        raise UserError(
            f"the installed onnx package has no {p.name}",
            fix="install onnx>=1.16 (it ships the light_*.onnx backend test models)",
            file=str(p),
        )
    return p


def _rng(seed: int, name: str) -> np.random.Generator:
    digest = hashlib.sha256(f"{seed}:{name}".encode()).digest()
    return np.random.default_rng(int.from_bytes(digest[:8], "little"))


def _zero_mean(w: np.ndarray, axes: tuple[int, ...]) -> np.ndarray:
    # Inputs to most layers are post-ReLU (non-negative), so a filter's mean weight times
    # the mean activation would dominate its output and every input would end in the same
    # class. Zero-mean filters respond to the input's structure instead.
    return w - w.mean(axis=axes, keepdims=True)


def materialize_weights(model, seed: int = DEFAULT_SEED) -> int:
    """Replace constant-generated and placeholder float parameters by seeded values (in place).

    Args:
        model: an ``onnx.ModelProto`` (old IR is fine: run before :func:`prepare_model`).
        seed: weights seed.

    Returns:
        The number of parameter tensors written.
    """
    from onnx import helper, numpy_helper

    g = model.graph
    inits = {i.name: i for i in g.initializer}
    consumers: dict[str, list[tuple[object, int]]] = {}
    for n in g.node:
        for k, x in enumerate(n.input):
            consumers.setdefault(x, []).append((n, k))

    # parameters: float initializers, and ConstantOfShape outputs of a constant shape
    params: dict[str, tuple[int, ...]] = {}
    cos_nodes = []
    for n in g.node:
        if n.op_type == "ConstantOfShape" and n.input and n.input[0] in inits:
            shape = tuple(int(d) for d in numpy_helper.to_array(inits[n.input[0]]))
            params[n.output[0]] = shape
            cos_nodes.append(n)
    for name, t in inits.items():
        if t.data_type == 1 and name not in params:
            params[name] = tuple(t.dims)

    def role(name: str) -> tuple[str, object, int] | None:
        """(op, node, input index) of the first real consumer, looking through Unsqueeze."""
        for node, k in consumers.get(name, []):
            if node.op_type in ("Unsqueeze", "Reshape", "Identity") and k == 0:
                r = role(node.output[0])
                if r is not None:
                    return r
                continue
            return node.op_type, node, k
        return None

    new_values: dict[str, np.ndarray] = {}
    for name, shape in params.items():
        r = role(name)
        if r is None:
            continue
        op, node, k = r
        rng = _rng(seed, name)
        if op == "Conv" and k == 1 and len(shape) >= 2:
            fan_in = int(np.prod(shape[1:]))
            val = _zero_mean(rng.standard_normal(shape), axes=tuple(range(1, len(shape)))) * np.sqrt(2.0 / max(fan_in, 1))
        elif op == "Gemm" and k == 1 and len(shape) == 2:
            trans_b = any(a.name == "transB" and a.i == 1 for a in node.attribute)
            fan_in = shape[1] if trans_b else shape[0]
            val = _zero_mean(rng.standard_normal(shape), axes=(1,) if trans_b else (0,)) * np.sqrt(2.0 / max(fan_in, 1))
        elif op == "MatMul" and k == 1 and len(shape) == 2:
            val = _zero_mean(rng.standard_normal(shape), axes=(0,)) * np.sqrt(2.0 / max(shape[0], 1))
        elif op == "BatchNormalization" and k in (1, 4):  # scale, variance
            val = np.ones(shape)
        elif op == "BatchNormalization" and k in (2, 3):  # bias, mean
            val = np.zeros(shape)
        elif op in ("Conv", "Gemm") and k == 2:
            val = np.zeros(shape)
        elif op == "Mul":
            val = np.ones(shape)
        elif op in ("Add", "Sum", "Sub"):
            val = np.zeros(shape)
        else:
            continue
        new_values[name] = val.astype(np.float32)

    # write: ConstantOfShape outputs become initializers (the node goes), others replaced
    drop = {id(n) for n in cos_nodes if n.output[0] in new_values}
    keep_nodes = [n for n in g.node if id(n) not in drop]
    del g.node[:]
    g.node.extend(keep_nodes)
    for name, val in new_values.items():
        tensor = numpy_helper.from_array(val, name)
        if name in inits:
            inits[name].CopyFrom(tensor)
        else:
            g.initializer.append(tensor)
            if not any(i.name == name for i in g.input) and model.ir_version < 4:
                g.input.append(helper.make_tensor_value_info(name, 1, list(val.shape)))
    # shape initializers no one reads any more
    used = {x for n in g.node for x in n.input}
    outputs = {o.name for o in g.output}
    dead = [i for i in g.initializer if i.name not in used and i.name not in outputs]
    dead_names = {i.name for i in dead}
    for t in dead:
        g.initializer.remove(t)
    kept_inputs = [i for i in g.input if i.name not in dead_names]
    del g.input[:]
    g.input.extend(kept_inputs)
    return len(new_values)


def load_builtin(name: str, seed: int = DEFAULT_SEED):
    """The built-in model ``name`` with materialized weights (not yet prepared).

    Returns:
        ``(onnx.ModelProto, source path)``.
    """
    from ppipe.profiler.graph import load_onnx

    path = builtin_onnx_path(name)
    model = load_onnx(path)
    materialize_weights(model, seed)
    return model, path


__all__ = ["BUILTIN_MODELS", "DEFAULT_SEED", "builtin_onnx_path", "load_builtin", "materialize_weights"]
