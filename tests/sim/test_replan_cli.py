"""`ppipe simulate --replan auto --arrivals shifting`: the flag, its output, and its refusals."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml
from click.testing import CliRunner
from sim_fakes import tiny_cluster, tiny_plan, tiny_profile

import ppipe
from ppipe.cli import main


@pytest.fixture(scope="module")
def two_model_dir(tmp_path_factory) -> Path:
    d = tmp_path_factory.mktemp("replan")
    profiles = [tiny_profile("a"), tiny_profile("b")]
    for p in profiles:
        p.save(d / "models" / p.name)
    (d / "cluster.yaml").write_text(yaml.safe_dump(tiny_cluster().model_dump(mode="json")))
    plan = ppipe.plan(tiny_cluster(), profiles, slo_ms=50, time_limit_s=5)
    models = [m.model_copy(update={"profile": f"models/{m.name}"}) for m in plan.models]
    plan.model_copy(update={"models": models, "cluster_file": "cluster.yaml"}).save(d / "plan.yaml")
    return d


def invoke(*args):
    return CliRunner().invoke(main, ["simulate", *map(str, args)])


def test_replan_auto_switches_under_a_shifting_mix(two_model_dir, tmp_path):
    out = tmp_path / "r.json"
    args = [two_model_dir / "plan.yaml", "--load", 0.9, "--arrivals", "shifting", "--period-s", 40, "--duration-s", 40,
            "--replan-min-interval-s", 5, "--replan-load-delay-s", 1, "--replan-window-s", 4, "--json", out]
    r = invoke(*args, "--replan", "auto")
    assert r.exit_code == 0, r.output
    data = json.loads(out.read_text())
    assert data["switches"] and "plan switches:" in r.output and "vGPUs kept" in r.output
    assert data["anomaly_count"] == 0 and data["overall"]["unfinished"] == 0
    off = invoke(*args)
    assert off.exit_code == 0, off.output
    static = json.loads(out.read_text())
    assert "switches" not in static and "plan switches" not in off.output  # off by default, and silent
    assert data["overall"]["attainment"] > static["overall"]["attainment"]


def test_replan_refuses_a_plan_without_the_max_min_objective(tmp_path):
    tiny_profile().save(tmp_path / "models" / "tiny")
    (tmp_path / "cluster.yaml").write_text(yaml.safe_dump(tiny_cluster().model_dump(mode="json")))
    plan = tiny_plan(profile_path="models/tiny")
    plan = plan.model_copy(update={"cluster_file": "cluster.yaml", "settings": plan.settings.model_copy(update={"objective": "total"})})
    plan.save(tmp_path / "plan.yaml")
    r = invoke(tmp_path / "plan.yaml", "--replan", "auto", "--duration-s", 1)
    assert r.exit_code == 2 and "max-min" in r.output and "To fix" in r.output


def test_bad_period_is_refused(two_model_dir):
    r = invoke(two_model_dir / "plan.yaml", "--arrivals", "shifting", "--period-s", 0, "--duration-s", 1)
    assert r.exit_code == 2 and "--period-s" in r.output


def test_a_curvature_window_shorter_than_three_bins_is_refused(two_model_dir):
    r = invoke(two_model_dir / "plan.yaml", "--replan", "auto", "--replan-curvature-window-s", 1, "--duration-s", 1)
    assert r.exit_code == 2 and "curvature_window_s must be >= 3 x bin_s" in r.output and "To fix" in r.output
