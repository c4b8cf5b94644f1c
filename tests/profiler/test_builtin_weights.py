"""Materialized weights of the built-in CNNs: seeded, He-scaled, batch-norm identity."""

from __future__ import annotations

import numpy as np
import pytest

from ppipe.errors import UserError
from ppipe.profiler.builtin import builtin_onnx_path, load_builtin


def _params(model):
    from onnx import numpy_helper

    return {t.name: numpy_helper.to_array(t) for t in model.graph.initializer}


def test_constant_weights_become_seeded_he_scaled_tensors():
    model, _ = load_builtin("squeezenet", seed=0)
    assert not any(n.op_type == "ConstantOfShape" for n in model.graph.node)
    params = _params(model)
    conv = next(n for n in model.graph.node if n.op_type == "Conv")
    w = params[conv.input[1]]
    fan_in = int(np.prod(w.shape[1:]))
    assert w.std() == pytest.approx(np.sqrt(2.0 / fan_in), rel=0.1)
    assert np.abs(w.reshape(w.shape[0], -1).mean(axis=1)).max() < 1e-6  # zero-mean filters
    assert not np.any(params[conv.input[2]])  # zero bias


def test_batch_norm_is_the_identity():
    model, _ = load_builtin("resnet50", seed=0)
    params = _params(model)
    bn = next(n for n in model.graph.node if n.op_type == "BatchNormalization")
    scale, bias, mean, var = (params[x] for x in bn.input[1:5])
    assert (scale == 1).all() and (bias == 0).all() and (mean == 0).all() and (var == 1).all()


def test_same_seed_same_weights_other_seed_other_weights():
    a, _ = load_builtin("squeezenet", seed=0)
    b, _ = load_builtin("squeezenet", seed=0)
    c, _ = load_builtin("squeezenet", seed=1)
    pa, pb, pc = _params(a), _params(b), _params(c)
    name = next(k for k, v in pa.items() if v.ndim == 4)
    assert np.array_equal(pa[name], pb[name]) and not np.array_equal(pa[name], pc[name])


def test_unknown_builtin_suggests_a_name():
    with pytest.raises(UserError, match="did you mean 'densenet121'"):
        builtin_onnx_path("densenet")
