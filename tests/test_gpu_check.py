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
    assert "skipped here (dry run" in out and "would start an MPS control daemon for step 1" in out
    summary = json.loads((tmp_path / "out" / "gpu_check.json").read_text())
    assert summary["plan"]["dry_run"] is True and summary["plan"]["points_per_model"] > 0


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
