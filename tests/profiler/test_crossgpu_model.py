"""Cross-GPU model internals: exact leave-one-model-out, layer ratio model, selection, I/O."""

from __future__ import annotations

import numpy as np
import pytest

from ppipe.errors import UserError


def _explicit_refit_errors(z, phi, y, groups, rho, lam, offset=None):
    """Kernel ridge refitted without each group, the slow way (the reference): scikit-learn's
    KernelRidge on every LeaveOneGroupOut fold."""
    from sklearn.kernel_ridge import KernelRidge
    from sklearn.model_selection import LeaveOneGroupOut

    from ppipe.profiler.estimate.crossgpu import INTERCEPT_PRIOR

    m = INTERCEPT_PRIOR + z @ z.T + rho * (phi @ phi.T)
    off = np.zeros_like(y) if offset is None else offset
    labels = np.empty(len(y), dtype=int)
    for k, g in enumerate(groups):
        labels[g] = k
    out = np.empty_like(y)
    for rest, g in LeaveOneGroupOut().split(z, groups=labels):
        fit = KernelRidge(alpha=lam, kernel="precomputed").fit(m[np.ix_(rest, rest)], y[rest] - off[rest])
        pred = off[g] + fit.predict(m[np.ix_(g, rest)])
        pred = np.clip(pred, y[rest].min(axis=0), y[rest].max(axis=0))
        out[g] = np.exp(pred - y[g]) - 1
    return out


def test_closed_form_leave_one_group_out_equals_refitting():
    from ppipe.profiler.estimate.crossgpu import (
        INTERCEPT_PRIOR, _group_index, _group_loo_errors, _rest_bounds, _rff,
    )

    rng = np.random.default_rng(1)
    sizes = [5, 4, 5, 6, 5, 4, 5]
    groups, start = [], 0
    for s in sizes:
        groups.append(np.arange(start, start + s))
        start += s
    z = rng.normal(size=(start, 3))
    y = np.stack([np.sin(z[:, 0]) + 0.1 * z[:, 1], z[:, 2] ** 2 * 0.2], axis=1) + 0.05 * rng.normal(size=(start, 2))
    phi = _rff(z, 1.0)
    rho, lam = 3.0, 0.7
    evals, evecs = np.linalg.eigh(INTERCEPT_PRIOR + z @ z.T + rho * (phi @ phi.T))
    stacked = _group_index(groups)
    bounds = _rest_bounds(y, stacked)
    fast = _group_loo_errors(evecs, np.maximum(evals, 0), lam, y, stacked, bounds)
    np.testing.assert_allclose(fast, _explicit_refit_errors(z, phi, y, groups, rho, lam), rtol=1e-6, atol=1e-8)
    offset = np.stack([0.8 * np.sin(z[:, 0]), 0.1 * z[:, 2]], axis=1)  # a prior mean per row and target
    fast = _group_loo_errors(evecs, np.maximum(evals, 0), lam, y, stacked, bounds, offset)
    np.testing.assert_allclose(fast, _explicit_refit_errors(z, phi, y, groups, rho, lam, offset), rtol=1e-6, atol=1e-8)


def test_regressor_from_dual_matches_the_kernel_prediction_and_round_trips():
    from ppipe.profiler.estimate.crossgpu import INTERCEPT_PRIOR, _Regressor, _rff

    rng = np.random.default_rng(2)
    x = rng.normal(size=(50, 4)) * [1, 10, 0.1, 3] + [0, 5, 1, -2]
    y = 0.4 * x[:, 0] - 0.03 * x[:, 1] + np.cos(x[:, 3]) * 0.2
    reg = _Regressor.fit(x, y, gamma=1.0, rho=5.0, lam=0.5)
    z = (x - reg.mu) / reg.sd
    phi = _rff(z, 1.0)
    m = INTERCEPT_PRIOR + z @ z.T + 5.0 * (phi @ phi.T)
    alpha = np.linalg.solve(m / 0.5 + np.eye(50), y)
    np.testing.assert_allclose(reg.predict_unclipped(x), m @ alpha / 0.5, rtol=1e-6, atol=1e-8)
    back = _Regressor.unpack(reg.pack())
    np.testing.assert_allclose(back.predict(x), reg.predict(x), rtol=1e-4, atol=1e-4)
    assert back.gamma == 1.0 and back.offset_col == -1
    # with an offset column the model fits y - x[:, 3] and adds it back
    with_off = _Regressor.fit(x, y, gamma=1.0, rho=5.0, lam=0.5, offset_col=3)
    alpha = np.linalg.solve(m / 0.5 + np.eye(50), y - x[:, 3])
    np.testing.assert_allclose(with_off.predict_unclipped(x), x[:, 3] + m @ alpha / 0.5, rtol=1e-6, atol=1e-8)
    back = _Regressor.unpack(with_off.pack())
    assert back.offset_col == 3
    np.testing.assert_allclose(back.predict(x), with_off.predict(x), rtol=1e-4, atol=1e-4)


def test_layer_ratio_model_learns_per_op_ratios_and_sums_them_into_blocks():
    from ppipe.profiler.estimate.crossgpu import LayerRatioModel, _layer_solve, _layer_stats

    rng = np.random.default_rng(3)
    ops = ("Conv", "Relu")
    xtx, xty = 0, 0
    for _model in range(30):  # as many models as the artifact: the ridge shrinks little
        types = list(rng.choice(["Conv", "Relu", "Reshape"], size=60))
        src = rng.uniform(5, 200, size=60)
        tgt = src * np.array([{"Conv": 3.0, "Relu": 1.5, "Reshape": 1.0}[t] for t in types])
        a, b = _layer_stats(types, src, tgt, ops)
        xtx, xty = xtx + a, xty + b
    lm = LayerRatioModel(ops=ops, coef=_layer_solve(xtx, xty))
    pred = lm.predict(["Conv", "Relu"], np.array([50.0, 50.0]))
    np.testing.assert_allclose(np.exp(pred), [3.0, 1.5], rtol=0.1)
    # block 0: two Conv nodes; block 1: a Conv of 10 us and a Relu of 30 us -> (30 + 45) / 40
    blocks = lm.block_log_ratios(["Conv", "Conv", "Conv", "Relu"], np.array([20.0, 40, 10, 30]), np.array([0, 0, 1, 1]), 2)
    np.testing.assert_allclose(np.exp(blocks), [3.0, 75 / 40], rtol=0.1)


@pytest.fixture(scope="module")
def small_fit(artifact_dir):
    """A fit on 7 artifact models for one pair, with selection over a 2-point grid, with and
    without the per-layer offset (so the offset path is fitted, saved and loaded too)."""
    from ppipe.profiler.estimate.artifact_data import load_all
    from ppipe.profiler.estimate.crossgpu import fit_cross_gpu_from_models

    data = load_all(artifact_dir)
    names = sorted(data)[::4]
    grid = ((1.0, 10.0, 3.0), (0.5, 3.0, 30.0))
    model = fit_cross_gpu_from_models([data[n] for n in names[1:]], pairs=[("L4", "T4")], hyper_grid=grid,
                                      offsets=(False, True))
    return data[names[0]], model, grid


def test_selection_is_recorded_and_comes_from_the_grid(small_fit):
    _held, model, grid = small_fit
    assert set(model.selection) == {("L4", "T4", False), ("L4", "T4", True)}
    for sel in model.selection.values():
        assert (sel.gamma, sel.rho, sel.lam) in grid
        assert 0 < sel.inner_median <= sel.inner_p90 < 5
    assert model.selection[("L4", "T4", False)].offset is False  # no per-layer ratio to use
    assert model.gpus() == ["L4", "T4"]


def test_saved_model_predicts_the_same_after_loading(small_fit, tmp_path):
    from ppipe.profiler.estimate.crossgpu import CrossGpuModel, artifact_layer_inputs, cross_gpu_table
    from ppipe.spec.profile import ModelProfile

    held, model, _grid = small_fit
    src = ModelProfile(manifest=held.profile.manifest, table={k: v for k, v in held.profile.table.items() if k[0] == "L4"})
    layer, nodes = artifact_layer_inputs(held, "L4")
    back = CrossGpuModel.load(model.save(tmp_path / "m.npz"))
    assert back.selection == model.selection
    for kw in ({}, {"layer_latency_us": layer, "node_blocks": nodes}):
        a = cross_gpu_table(src, "L4", "T4", model=model, **kw)
        b = cross_gpu_table(src, "L4", "T4", model=back, **kw)
        assert a.keys() == b.keys()
        np.testing.assert_allclose([b[k] for k in a], [a[k] for k in a], rtol=1e-3)


def test_model_fitted_without_layer_features_refuses_layer_inputs(artifact_dir):
    from ppipe.profiler.estimate.artifact_data import load_all
    from ppipe.profiler.estimate.crossgpu import artifact_layer_inputs, cross_gpu_table, fit_cross_gpu_from_models

    data = load_all(artifact_dir)
    names = sorted(data)[:4]
    model = fit_cross_gpu_from_models([data[n] for n in names[1:]], pairs=[("T4", "P4")], with_layers=(False,),
                                      hyper_grid=((1.0, 10.0, 3.0),))
    held = data[names[0]]
    layer, nodes = artifact_layer_inputs(held, "T4")
    with pytest.raises(UserError, match="fitted without per-layer features"):
        cross_gpu_table(held.profile, "T4", "P4", model=model, layer_latency_us=layer, node_blocks=nodes)


def test_fitting_needs_three_complete_models(artifact_dir):
    from ppipe.profiler.estimate.artifact_data import load_all
    from ppipe.profiler.estimate.crossgpu import fit_cross_gpu_from_models

    data = load_all(artifact_dir)
    two = [data[n] for n in sorted(data)[:2]]
    with pytest.raises(UserError, match="at least three models"):
        fit_cross_gpu_from_models(two)
