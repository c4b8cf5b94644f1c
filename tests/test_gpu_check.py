"""scripts/gpu_check.sh (issue 23): its dry run completes anywhere (CI has no GPU), and its arithmetic.

The GPU steps themselves only run on a GPU machine; nothing here stands in for them.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import click
import pytest

REPO = Path(__file__).resolve().parent.parent


def test_the_dry_run_completes_and_says_what_it_would_do_and_skip(tmp_path):
    env = {**os.environ, "PYTHON": sys.executable}
    env.pop("OUT", None)
    res = subprocess.run(
        ["bash", "scripts/gpu_check.sh", "--dry-run", "--mps", "--out", str(tmp_path / "out")],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=240,
    )
    assert res.returncode == 0, res.stdout + res.stderr
    out = res.stdout
    assert "would run:" in out and "-m gpu" in out
    assert "would profile resnet50, inception_v2, densenet121" in out and "would chain" in out and "would hand" in out
    assert "skipped here (dry run" in out and "would start an MPS control daemon for steps 1 and 1c" in out
    assert "would plan local-gpu for resnet50, inception_v2" in out and "ppipe plan local-gpu" in out
    assert "ppipe serve" in out and "--launcher local --backend torch" in out
    for load in ("0.5", "0.8", "1"):
        assert f"would bench resnet50 at load {load}: ppipe bench" in out and f"would simulate load {load}" in out
    assert "--binary" in out and "compare its answer with onnxruntime" in out
    summary = json.loads((tmp_path / "out" / "gpu_check.json").read_text())
    assert summary["plan"]["dry_run"] is True and summary["plan"]["points_per_model"] > 0
    assert summary["plan"]["serve"]["commands_parsed"] is True


def test_an_unknown_option_is_refused():
    res = subprocess.run(["bash", "scripts/gpu_check.sh", "--bogus"], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert res.returncode == 2 and "unknown option --bogus" in res.stderr


@pytest.fixture
def gpu_check(monkeypatch):
    monkeypatch.syspath_prepend(str(REPO / "scripts"))
    import gpu_check

    return gpu_check


def test_roofline_errors_are_relative_to_the_measured_latency(gpu_check):
    table = {("H100", 1, b, 0): 100.0 * b for b in range(1, 11)} | {("cpu", 1, 1, 0): 5.0}
    est = {k: v * (1 + 0.1 * k[2]) for k, v in table.items() if k[0] == "H100"}  # 10%..100% too slow
    prof = SimpleNamespace(table=table, manifest=SimpleNamespace(provenance={"H100": "measured: PyTorch"}))
    r = gpu_check._compare(prof, est, "H100", 1.0)
    assert r["points"] == 10
    assert r["median_rel_error"] == pytest.approx(0.55) and r["p90_rel_error"] == pytest.approx(0.91)


def test_device_names_map_to_spec_sheet_types(gpu_check):
    assert gpu_check.gpu_type_of("NVIDIA H100 80GB HBM3") == "H100"
    assert gpu_check.gpu_type_of("Tesla T4") == "T4"
    assert gpu_check.gpu_type_of("NVIDIA GeForce RTX 4090") is None
    assert gpu_check.gpu_type_of("NVIDIA L40S") is None and gpu_check.short_name("NVIDIA L40S") == "L40S"
    assert gpu_check.short_name("NVIDIA H200") == "H200"


def test_the_serve_step_s_commands_are_parsed_by_the_cli(gpu_check, tmp_path):
    dirs = {"resnet50": str(tmp_path / "resnet50")}
    cmds = gpu_check.serve_commands("local-gpu", "torch", dirs, {"resnet50": "12.5"}, tmp_path, 8000, {0.5: {"resnet50": "40"}})
    gpu_check.check_commands(cmds)
    assert cmds["bench"][0.5]["resnet50"][3:6] == ["bench", "http://127.0.0.1:8000", "--model"]
    cmds["serve"].append("--no-such-flag")
    with pytest.raises(click.NoSuchOption, match="no-such-flag"):
        gpu_check.check_commands(cmds)


def test_serve_slos_are_five_times_the_measured_batch_1_latency_and_at_least_10_ms(gpu_check):
    prof = lambda us: SimpleNamespace(model_latency_us=lambda gpu, vgpu, batch: us if (gpu, vgpu, batch) == ("H200", 1, 1) else 0)  # noqa: E731
    assert gpu_check.serve_slos({"a": prof(3000.0), "b": prof(1000.0)}, "H200") == {"a": 15.0, "b": 10.0}
