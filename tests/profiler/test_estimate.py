"""Latency estimators: spec sheet, ONNX costs, roofline sanity, cross-GPU accuracy."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from ppipe.errors import UserError

LIGHT = Path(__import__("onnx").__file__).parent / "backend" / "test" / "data" / "light"


def _light(name: str) -> Path:
    p = LIGHT / f"light_{name}.onnx"
    if not p.exists():
        pytest.skip(f"{p} not shipped by this onnx release")
    return p


# ---- spec sheet ----------------------------------------------------------------------
def test_spec_sheet_loads_with_the_required_gpus():
    from ppipe.profiler.estimate.gpus import gpu_spec, known_gpus

    assert {"P4", "T4", "L4", "V100", "A10", "A100", "H100"} <= set(known_gpus())
    h100, p4 = gpu_spec("H100"), gpu_spec("P4")
    assert h100.peak_matmul_tflops > p4.peak_matmul_tflops
    assert h100.memory_bandwidth_gbps > p4.memory_bandwidth_gbps
    # TF32 is used only where the GPU has it
    for g in known_gpus():
        s = gpu_spec(g)
        assert (s.matmul_precision == "tf32") == (s.peak_tf32_tensor_tflops is not None)


def test_unknown_gpu_is_a_user_error_naming_the_known_types():
    from ppipe.profiler.estimate.gpus import gpu_spec

    with pytest.raises(UserError, match=r"unknown GPU type 'RTX9090'.*A100, H100, L4, P4, T4, V100"):
        gpu_spec("RTX9090")


def test_unknown_gpu_in_roofline_table_fails_before_reading_onnx(tmp_path):
    from ppipe.profiler.estimate import roofline_table

    with pytest.raises(UserError, match="did you mean L4"):
        roofline_table([tmp_path / "missing.onnx"], ["l4"], {"l4": [1]}, {1: [1]})


# ---- ONNX costs ----------------------------------------------------------------------
def test_resnet50_flops_match_the_published_count():
    from ppipe.profiler.estimate.onnx_cost import graph_costs

    costs = graph_costs(_light("resnet50"))
    gflops = sum(c.flops for c in costs) / 1e9
    # ResNet-50 at 224x224: 4.1 GMAC = 8.2 GFLOP (He et al. 2016 count 3.8-4.1 GMAC)
    assert 7.6 < gflops < 8.6
    conv = [c for c in costs if c.op_type == "Conv"]
    assert len(conv) == 53 and all(c.kernel for c in conv)


def test_rebuilt_graphs_reproduce_the_artifact_cut_bytes(artifact_dir):
    from ppipe.profiler.estimate.reference_graphs import REFERENCE_GRAPHS, check_against_artifact

    for name in REFERENCE_GRAPHS:
        rows = check_against_artifact(name, artifact_dir)
        assert rows and all(ours == theirs for _cut, ours, theirs in rows), (name, rows)


# ---- roofline --------------------------------------------------------------------------
@pytest.fixture(scope="module")
def resnet_table():
    from ppipe.profiler.estimate import roofline_table

    gpus = ["P4", "T4", "L4", "V100", "A10", "A100", "H100"]
    return roofline_table([_light("resnet50")], gpus, {g: [1, 2, 4] for g in gpus}, {1: [1, 2, 8], 2: [1, 2], 4: [1]})


def test_roofline_h100_faster_than_p4_on_a_conv_heavy_block(resnet_table):
    assert resnet_table[("H100", 1, 1, 0)] * 3 < resnet_table[("P4", 1, 1, 0)]
    assert resnet_table[("A100", 1, 8, 0)] < resnet_table[("T4", 1, 8, 0)]


def test_roofline_batch_and_level_monotone(resnet_table):
    for g in ("P4", "T4", "L4", "V100", "A10", "A100", "H100"):
        assert resnet_table[(g, 1, 2, 0)] >= resnet_table[(g, 1, 1, 0)]
        assert resnet_table[(g, 1, 8, 0)] > resnet_table[(g, 1, 2, 0)]
        assert resnet_table[(g, 2, 1, 0)] > resnet_table[(g, 1, 1, 0)]
        assert resnet_table[(g, 4, 1, 0)] > resnet_table[(g, 2, 1, 0)]
        # batching amortizes: 8 samples cost less than 8 single ones
        assert resnet_table[(g, 1, 8, 0)] < 8 * resnet_table[(g, 1, 1, 0)]


def test_roofline_level_without_batches_is_a_user_error():
    from ppipe.profiler.estimate import roofline_table

    with pytest.raises(UserError, match="no batch sizes given for level 2"):
        roofline_table([_light("squeezenet")], ["T4"], {"T4": [1, 2]}, {1: [1]})


def test_roofline_fit_on_one_model_predicts_the_other(artifact_dir):
    """Calibrate on wide_resnet101_2 only; repvgg-b3 (another architecture) must come out
    within a factor 1.6 per block on the GPU types whose path both share."""
    from ppipe.profiler.estimate.artifact_data import load_model
    from ppipe.profiler.estimate.gpus import gpu_spec
    from ppipe.profiler.estimate.reference_graphs import block_costs
    from ppipe.profiler.estimate.roofline import BlockWork, block_latency_us, fit_roofline

    doc = fit_roofline(artifact_dir, models=["wide_resnet101_2"])
    prof = load_model(artifact_dir, "repvgg-b3").profile
    works = [BlockWork.from_costs(c) for c in block_costs("repvgg-b3", artifact_dir)]
    for g in ("P4", "T4", "L4"):
        err = [
            block_latency_us(works[blk], gpu_spec(g), doc["gpus"][g], v, 1) / lat - 1
            for (gg, v, b, blk), lat in prof.table.items()
            if gg == g and b == 1
        ]
        assert np.median(np.abs(err)) < 0.3 and np.max(np.abs(err)) < 0.6, (g, err)


# ---- cross-GPU -----------------------------------------------------------------------------
def _source_only(profile, gpu):
    from ppipe.spec.profile import ModelProfile

    return ModelProfile(manifest=profile.manifest, table={k: v for k, v in profile.table.items() if k[0] == gpu})


@pytest.fixture(scope="module")
def artifact_data(artifact_dir):
    from ppipe.profiler.estimate.artifact_data import load_all

    return load_all(artifact_dir)


@pytest.mark.parametrize("held_out", ["wide_resnet101_2", "atss_r101_fpn_1x_coco"])
@pytest.mark.parametrize("source,target", [("L4", "P4"), ("T4", "V100")])
def test_cross_gpu_leave_one_out_beats_the_naive_ratio(artifact_data, held_out, source, target):
    """Fit without the model; predict its target-GPU blocks from a source-only copy."""
    err_model, err_naive = _leave_one_out_errors(artifact_data, held_out, source, target, with_layers=True)
    assert np.median(err_model) < np.median(err_naive)
    assert np.percentile(err_model, 90) < np.percentile(err_naive, 90)
    assert np.median(err_model) < 0.25


def test_cross_gpu_blocks_only_leave_one_out_beats_the_naive_ratio(artifact_data):
    """Without per-layer timings the model is weaker (V100 -> L4 is its worst pair in the
    benchmark, p90 about 48 %: the 13 mmseg ResNet-101 segmenters dominate the training set),
    and on single held-out models it can lose to the naive ratio. Pooled over held-out
    models it must still win. Every third model is held out in turn (9 refits, each with
    its own inner hyper-parameter selection, instead of 28, to keep the suite fast); the
    benchmark script runs them all."""
    model, naive = [], []
    for held_out in sorted(artifact_data)[::3]:
        m, n = _leave_one_out_errors(artifact_data, held_out, "V100", "L4", with_layers=False)
        model += m
        naive += n
    assert np.median(model) < np.median(naive)
    assert np.percentile(model, 90) < np.percentile(naive, 90)


def _leave_one_out_errors(artifact_data, held_out, source, target, *, with_layers):
    from ppipe.profiler.estimate.crossgpu import artifact_layer_inputs, cross_gpu_table, fit_cross_gpu_from_models

    train = [am for n, am in artifact_data.items() if n != held_out]
    fitted = fit_cross_gpu_from_models(train, pairs=[(source, target)], with_layers=(with_layers,))
    am = artifact_data[held_out]
    prof = am.profile
    src = _source_only(prof, source)
    layer, nodes = artifact_layer_inputs(am, source) if with_layers else (None, None)
    pred = cross_gpu_table(src, source, target, model=fitted, layer_latency_us=layer, node_blocks=nodes)
    truth = {k: v for k, v in prof.table.items() if k[0] == target}
    assert set(truth) <= set(pred)
    ratio = np.median([a.profile.model_latency_us(target) / a.profile.model_latency_us(source) for a in train])
    err_model, err_naive = [], []
    for (g, v, b, blk), lat in truth.items():
        v_src = v if v in prof.levels(source) else 1
        err_model.append(abs(pred[(g, v, b, blk)] / lat - 1))
        err_naive.append(abs(ratio * prof.table[(source, v_src, b, blk)] / lat - 1))
    return err_model, err_naive


def test_shipped_cross_gpu_model_loads_and_predicts(artifact_profiles):
    from ppipe.profiler.estimate import cross_gpu_table, default_cross_gpu_model
    from ppipe.spec.profile import load_profile

    model = default_cross_gpu_model()
    assert set(model.gpus()) == {"L4", "P4", "T4", "V100"}
    prof = load_profile(artifact_profiles["repvgg-b3"])
    table = cross_gpu_table(_source_only(prof, "L4"), "L4", "T4")
    assert {(v, b) for (_g, v, b, _i) in table} == {(v, b) for v, bs in model.grid("L4", "T4").items() for b in bs}
    assert all(np.isfinite(x) and x > 0 for x in table.values())
    # the model is fitted on this very model, so it must be close (a sanity check of the
    # shipped file, not an accuracy claim: that is the leave-one-out test above)
    err = [abs(table[k] / prof.table[k] - 1) for k in table]
    assert np.median(err) < 0.2


def test_cross_gpu_unknown_gpu_and_missing_batches_are_user_errors(artifact_profiles):
    from ppipe.profiler.estimate import cross_gpu_table
    from ppipe.spec.profile import ModelProfile, load_profile

    prof = load_profile(artifact_profiles["repvgg-b3"])
    with pytest.raises(UserError, match="unknown target GPU type 'H100'; known: L4, P4, T4, V100"):
        cross_gpu_table(prof, "L4", "H100")
    thin = ModelProfile(manifest=prof.manifest, table={k: v for k, v in prof.table.items() if k[0] == "L4" and k[2] == 1})
    with pytest.raises(UserError, match=r"lacks level-1 batches \[2, 4, 8\]"):
        cross_gpu_table(thin, "L4", "T4")


def test_estimate_profile_adds_targets_with_provenance(artifact_profiles):
    from ppipe.profiler.estimate.profile import estimate_profile
    from ppipe.spec.profile import load_profile

    prof = load_profile(artifact_profiles["googlenet-v3-pytorch"])
    src = _source_only(prof, "V100")
    out = estimate_profile(src, ["L4", "P4"])
    assert out.gpus() == ["L4", "P4", "V100"]
    assert out.levels("P4") == [1] and out.levels("L4") == [1, 2, 3, 4]
    assert out.batches("L4", 2) == (1, 2, 3, 4)
    assert "cross-GPU" in out.manifest.provenance["L4"] and "V100" in out.manifest.provenance["L4"]
    assert out.table[("V100", 1, 1, 0)] == src.table[("V100", 1, 1, 0)]
    with pytest.raises(UserError, match="no block ONNX files"):
        estimate_profile(src, ["H100"])


def test_fit_cli_writes_loadable_parameters(artifact_dir, tmp_path):
    from ppipe.profiler.estimate.__main__ import main
    from ppipe.profiler.estimate.roofline import roofline_params

    out = tmp_path / "roofline.json"
    assert main(["fit-roofline", str(artifact_dir), "--out", str(out)]) == 0
    p = roofline_params("A100", out)  # borrows L4's constants
    assert 0 < p["eff"] <= 2.5 and p["launch_us"] > 0
    assert main(["fit-roofline", str(tmp_path)]) == 2  # not an artifact folder



def test_cross_gpu_regressor_clips_to_training_range_and_round_trips():
    """A block far outside the training features cannot get a log ratio beyond the training
    targets' range (the clip), and the packed weights predict the same after unpacking."""
    from ppipe.profiler.estimate.crossgpu import CLIP_MARGIN, _Regressor

    rng = np.random.default_rng(0)
    x = rng.normal(size=(60, 4))
    y = 0.3 * x[:, 0] - 0.2 * x[:, 1] + 0.05 * rng.normal(size=60)
    reg = _Regressor.fit(x, y)
    far = np.array([[50.0, -50, 0, 0], [-80, 80, 5, 5], [0.1, 0.2, 0, 0]])
    pred = reg.predict(far)
    span = y.max() - y.min()
    assert np.all(pred >= y.min() - CLIP_MARGIN * span - 1e-6) and np.all(pred <= y.max() + CLIP_MARGIN * span + 1e-6)
    unclipped = reg.predict_unclipped(far)
    assert abs(unclipped[0]) > y.max() - y.min()  # the model alone would have extrapolated
    back = _Regressor.unpack(reg.pack())
    np.testing.assert_allclose(back.predict(far), pred, rtol=1e-4, atol=1e-4)


# ---- calibration on measured profiles (fit_measured) ---------------------------------
MEASURED_H100 = Path(__file__).resolve().parents[2] / "docs" / "measurements" / "h100-2026-11-27"


def _measured_copy(tmp_path, gpu: str, params: dict) -> Path:
    """The H100 record's resnet50 profile, its rows replaced by the roofline at ``params`` for ``gpu``."""
    from ppipe.profiler.blocks import ensure_block_models
    from ppipe.profiler.estimate.gpus import gpu_spec
    from ppipe.profiler.estimate.roofline import block_latency_us, block_work_from_onnx
    from ppipe.spec.profile import ModelProfile, load_profile

    prof = load_profile(MEASURED_H100 / "resnet50")
    works = block_work_from_onnx(ensure_block_models(prof))
    table = {(gpu, v, b, blk): block_latency_us(works[blk], gpu_spec(gpu), params, v, b) for (_g, v, b, blk) in prof.table}
    man = prof.manifest.model_copy(update={"provenance": {gpu: "measured: synthetic rows from known constants"}})
    return ModelProfile(man, table).save(tmp_path / "synthetic")


def test_a_fit_on_measured_rows_recovers_the_constants_that_made_them(tmp_path):
    from ppipe.profiler.estimate.roofline import PARAMS_FILE, fit_measured

    h = json.loads(PARAMS_FILE.read_text())["gpus"]["L4"]["half_sat_flops_per_sm"]
    truth = {"eff": 0.3, "eff_mem": 0.5, "launch_us": 4.0, "gamma": 1.1, "half_sat_flops_per_sm": h}
    got = fit_measured("A100", [_measured_copy(tmp_path, "A100", truth)])["gpus"]["A100"]
    for k in ("eff", "eff_mem", "launch_us", "gamma"):
        assert got[k] == pytest.approx(truth[k], rel=0.02), k
    assert got["rms_log_error"] < 1e-3 and got["measured_on"]["points"] == 160


def test_the_shipped_h100_constants_are_the_fit_of_the_recorded_measurements(tmp_path):
    from ppipe.profiler.estimate.roofline import PARAMS_FILE, fit_measured

    dirs = sorted(MEASURED_H100.glob("*/model.yaml"))
    assert len(dirs) == 3
    shipped = json.loads(PARAMS_FILE.read_text())["gpus"]["H100"]
    refit = fit_measured("H100", [d.parent for d in reversed(dirs)], out=tmp_path / "p.json")["gpus"]["H100"]
    for k in ("eff", "eff_mem", "launch_us", "gamma", "rms_log_error"):
        assert refit[k] == pytest.approx(shipped[k], rel=1e-6), k
    assert refit["measured_on"] == shipped["measured_on"]


def test_a_profile_without_measured_rows_for_the_gpu_is_a_user_error_naming_it():
    from ppipe.profiler.estimate.roofline import fit_measured

    builtin = Path(__file__).resolve().parents[2] / "models" / "resnet50"  # its H100 rows are estimates
    with pytest.raises(UserError, match="no measured rows for H100") as exc:
        fit_measured("H100", [builtin])
    assert "--measure H100" in exc.value.fix
