"""`ppipe plan` end to end, and every bad input ends with exit code 2 and a clear message."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml
from click.testing import CliRunner

from planner_synth import profile
from ppipe.cli import main
from ppipe.spec.plan import load_plan

HC2S = Path(__file__).resolve().parents[2] / "clusters" / "HC2-S.yaml"
LEVELS = {"L4": [1, 2], "T4": [1, 2]}
LAT = {"L4": [2000.0, 3000.0, 1000.0], "T4": [3000.0, 9000.0, 1500.0]}


@pytest.fixture
def model_dir(tmp_path) -> Path:
    return profile("tiny", LAT, [100_000, 50_000], LEVELS).save(tmp_path / "models" / "tiny")


def run(*args):
    return CliRunner().invoke(main, list(args))


def test_plan_writes_yaml_with_relative_profile(tmp_path, model_dir):
    out = tmp_path / "out" / "plan.yaml"
    r = run("plan", "HC2-S", str(model_dir), "--slo-ms", "40", "--margin", "0.2", "-o", str(out))
    assert r.exit_code == 0, r.output
    assert "tiny" in r.output and "optimal" in r.output
    plan = load_plan(out)
    m = plan.model("tiny")
    assert m.throughput_rps > 0 and m.slo_ms == 40.0
    assert not Path(m.profile).is_absolute() and (out.parent / m.profile / "model.yaml").exists()
    assert plan.settings.margin == 0.2 and plan.settings.planner == "ppipe"
    assert plan.placement


def test_default_slo_is_five_times_l4_batch1(tmp_path, model_dir):
    out = tmp_path / "plan.yaml"
    r = run("plan", "HC2-S", str(model_dir), "--planner", "np", "-o", str(out), "--quiet")
    assert r.exit_code == 0, r.output
    assert load_plan(out).model("tiny").slo_ms == pytest.approx(5 * sum(LAT["L4"]) / 1000)


def test_infeasible_slo_names_smallest_slo(tmp_path, model_dir):
    r = run("plan", "HC2-S", str(model_dir), "--slo-ms", "2", "-o", str(tmp_path / "p.yaml"))
    assert r.exit_code == 2
    assert "meets the SLO of 2.00 ms" in r.output and "model.yaml" in r.output
    smallest = float(r.output.split("smallest feasible SLO is ")[1].split(" ms")[0])
    assert smallest == pytest.approx(sum(LAT["L4"]) / 1000 / 0.6, rel=1e-3)
    ok = run("plan", "HC2-S", str(model_dir), "--slo-ms", f"{smallest + 0.01}", "-o", str(tmp_path / "p.yaml"), "--quiet")
    assert ok.exit_code == 0, ok.output
    assert "Traceback" not in r.output


def test_cluster_type_missing_from_profile(tmp_path):
    d = profile("l4only", {"L4": LAT["L4"]}, [100_000, 50_000], {"L4": [1]}).save(tmp_path / "l4only")
    r = run("plan", "HC2-S", str(d), "-o", str(tmp_path / "p.yaml"))
    assert r.exit_code == 2
    assert "no timings for GPU type 'T4'" in r.output and "model.yaml" in r.output and "To fix" in r.output


def test_profile_types_disjoint_from_cluster(tmp_path, model_dir):
    r = run("plan", "local-cpu", str(model_dir), "-o", str(tmp_path / "p.yaml"))
    assert r.exit_code == 2
    assert "no timings for GPU type 'cpu'" in r.output


def test_missing_timings_in_profile_csv(tmp_path, model_dir):
    csv = model_dir / "profile.csv"
    lines = csv.read_text().splitlines()
    csv.write_text("\n".join(lines[:-1]) + "\n")  # drop one block's row
    r = run("plan", "HC2-S", str(model_dir), "-o", str(tmp_path / "p.yaml"))
    assert r.exit_code == 2
    assert "profile.csv" in r.output and "missing timings" in r.output


def test_malformed_cluster_yaml(tmp_path, model_dir):
    bad = tmp_path / "c.yaml"
    bad.write_text("name: x\ngpu_types: [\n")
    r = run("plan", str(bad), str(model_dir), "-o", str(tmp_path / "p.yaml"))
    assert r.exit_code == 2 and "malformed YAML" in r.output and str(bad) in r.output


def test_cluster_unknown_field(tmp_path, model_dir):
    c = yaml.safe_load(HC2S.read_text())
    c["gpu_type"] = c.pop("gpu_types")
    p = tmp_path / "c.yaml"
    p.write_text(yaml.safe_dump(c))
    r = run("plan", str(p), str(model_dir), "-o", str(tmp_path / "p.yaml"))
    assert r.exit_code == 2 and "did you mean 'gpu_types'" in r.output


def test_malformed_model_yaml(tmp_path, model_dir):
    (model_dir / "model.yaml").write_text("name: tiny\nblocks: {oops\n")
    r = run("plan", "HC2-S", str(model_dir), "-o", str(tmp_path / "p.yaml"))
    assert r.exit_code == 2 and "model.yaml" in r.output


def test_unknown_model_and_bad_flags(tmp_path, model_dir):
    r = run("plan", "HC2-S", str(tmp_path / "nope"))
    assert r.exit_code == 2 and "no model.yaml here" in r.output
    r = run("plan", "HC2-S", str(model_dir), "--weights", "1,2")
    assert r.exit_code == 2 and "2 value(s) for 1 model(s)" in r.output
    r = run("plan", "HC2-S", str(model_dir), "--slo-ms", "other=30")
    assert r.exit_code == 2 and "unknown model(s) ['other']" in r.output
    r = run("plan", "HC2-S", str(model_dir), "--margin", "1.5")
    assert r.exit_code == 2 and "margin" in r.output
    r = run("plan", "HC2-S", str(model_dir), "--objective", "min-cost")
    assert r.exit_code == 2 and "--required-rps" in r.output


def test_no_models_and_no_builtin_models(tmp_path, monkeypatch):
    import ppipe.spec.cluster as c

    monkeypatch.setattr(c, "builtin_dirs", lambda kind: [])
    r = run("plan", str(HC2S), "-o", str(tmp_path / "p.yaml"))
    assert r.exit_code == 2 and "no built-in models found" in r.output
    r = run("plan", "-o", str(tmp_path / "p.yaml"))
    assert r.exit_code == 2 and "no such cluster" in r.output


def test_warnings_during_planning_print_as_one_line(capsys):
    import warnings

    from ppipe.planner.cli import one_line_warnings

    before = warnings.showwarning
    with one_line_warnings():
        warnings.warn("Gurobi refused the model (too large); solving with HiGHS instead", stacklevel=1)
    err = capsys.readouterr().err
    assert err == "warning: Gurobi refused the model (too large); solving with HiGHS instead\n"
    assert warnings.showwarning is before


def test_column_generation_flag(tmp_path, model_dir):
    out = tmp_path / "plan.yaml"
    r = run("plan", "HC2-S", str(model_dir), "--slo-ms", "40", "--margin", "0.2", "--column-generation", "-o", str(out), "--quiet")
    assert r.exit_code == 0, r.output
    assert load_plan(out).solver.method.startswith("column generation")
    bad = run("plan", "HC2-S", str(model_dir), "--slo-ms", "40", "--gpu-rule", "paper", "--column-generation", "-o", str(out))
    assert bad.exit_code == 2 and "To fix" in bad.output and "Traceback" not in bad.output
