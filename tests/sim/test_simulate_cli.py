"""`ppipe simulate`: a run from files on disk with the real data plane, and its exit codes."""

from __future__ import annotations

import csv
import json
from pathlib import Path

import pytest
import yaml
from click.testing import CliRunner
from sim_fakes import tiny_cluster, tiny_plan, tiny_profile

from ppipe.cli import main
from ppipe.dataplane.margins import DEFAULT_DISPATCH_LEAD_US


@pytest.fixture
def plan_dir(tmp_path: Path) -> Path:
    tiny_profile().save(tmp_path / "models" / "tiny")
    (tmp_path / "cluster.yaml").write_text(yaml.safe_dump(tiny_cluster().model_dump(mode="json")))
    plan = tiny_plan(profile_path="models/tiny").model_copy(update={"cluster_file": "cluster.yaml"})
    plan.save(tmp_path / "plan.yaml")
    return tmp_path


def invoke(*args, margins: bool = False):
    """`ppipe simulate ARGS`; the toy plan's SLO of a few ms has no room for the runtime's
    default margins, so they are off unless asked for."""
    off = [] if margins else ["--dispatch-lead-ms", "0", "--answer-budget-ms", "0"]
    return CliRunner().invoke(main, ["simulate", *map(str, args), *off])


def test_the_runtimes_margins_apply_by_default_and_a_plan_without_room_for_them_is_flagged(plan_dir):
    out = {}
    for name, extra in (("default", []), ("paper", ["--dispatch-lead-ms", 0, "--answer-budget-ms", 0])):
        r = invoke(plan_dir / "plan.yaml", "--load", 0.3, "--duration-s", 1, "--json", plan_dir / f"{name}.json", *extra, margins=True)
        assert r.exit_code == 0 and "leaves no time" not in r.output, r.output
        out[name] = json.loads((plan_dir / f"{name}.json").read_text())["overall"]
    # at a low load every request waits for nothing but the lead (0.5 ms plus its input's transfer)
    assert out["default"]["p50_latency_ms"] >= out["paper"]["p50_latency_ms"] + DEFAULT_DISPATCH_LEAD_US / 1e3
    r = invoke(plan_dir / "plan.yaml", "--load", 0.3, "--duration-s", 1, "--answer-budget-ms", 1000, margins=True)
    assert r.exit_code == 0, r.output
    assert "leaves no time for the runtime's margins" in r.output and "`ppipe serve` refuses this plan" in r.output
    for flag in ("--dispatch-lead-ms", "--wake-lead-ms"):
        r = invoke(plan_dir / "plan.yaml", "--load", 0.3, "--duration-s", 1, flag, -1, margins=True)
        assert r.exit_code == 2 and "--dispatch-lead-ms, --answer-budget-ms and --wake-lead-ms must be >= 0" in r.output


def test_one_point_with_json_and_plots(plan_dir, tmp_path):
    out = tmp_path / "r.json"
    figs = tmp_path / "figs"
    recs = tmp_path / "requests.csv"
    r = invoke(plan_dir / "plan.yaml", "--load", 0.3, "--duration-s", 1, "--json", out, "--plot", figs, "--records", recs)
    assert r.exit_code == 0, r.output
    rows = list(csv.DictReader(recs.read_text().splitlines()))
    assert rows and all(row["outcome"] == "ok" for row in rows)
    first = rows[0]
    # two stages, block 0 on a B vGPU then block 1 on the A vGPU; latency = completion - arrival
    assert [s.split("@")[0] for s in first["stages"].split(";")] == ["0", "1"]
    assert float(first["latency_us"]) == pytest.approx(float(first["completion_us"]) - float(first["arrival_us"]))
    data = json.loads(out.read_text())
    assert data["load"] == 0.3 and data["overall"]["attainment"] == 1.0
    assert data["overall"]["requests"] == data["overall"]["ok"] > 300
    assert data["anomaly_count"] == 0
    assert (figs / "timeline.png").stat().st_size > 1000 and (figs / "utilization.png").exists()
    assert "attainment" in r.output


def test_sweep_writes_the_attainment_curve(plan_dir, tmp_path):
    figs = tmp_path / "figs"
    r = invoke(plan_dir / "plan.yaml", "--sweep", "--search", "guided", "--duration-s", 0.25, "--plot", figs, "--policy", "reactive")
    assert r.exit_code == 0, r.output
    assert "largest load factor" in r.output and (figs / "attainment_vs_load.png").exists()


def test_rates_from_another_plan(plan_dir, tmp_path):
    base = tiny_plan(profile_path="models/tiny")
    other = base.model_copy(update={
        "models": [base.models[0].model_copy(update={"throughput_rps": 100.0})],
        "solver": base.solver.model_copy(update={"objective": 100.0}),  # max-min value (weight 1)
    })
    other.save(plan_dir / "other.yaml")
    out = tmp_path / "r.json"
    r = invoke(plan_dir / "plan.yaml", "--load", 1.0, "--duration-s", 2, "--rates-from", plan_dir / "other.yaml", "--json", out)
    assert r.exit_code == 0, r.output
    assert json.loads(out.read_text())["overall"]["offered_rps"] == pytest.approx(100, rel=0.2)


@pytest.mark.parametrize(
    "extra,match",
    [
        (["--load", "0.5", "--sweep"], "exclude each other"),
        (["--policy", "fifo"], "unknown --policy"),
        (["--arrivals", "trace"], "needs --trace"),
        (["--load", "-1"], "load factor must be > 0"),
        (["--duration-s", "0"], "duration must be > 0"),
        (["--cluster", "no-such-cluster"], "no such cluster"),
        (["--arrivals", "bursty", "--cv", "0"], "cv"),
    ],
)
def test_bad_input_exits_2(plan_dir, extra, match):
    r = invoke(plan_dir / "plan.yaml", *extra)
    assert r.exit_code == 2, r.output
    assert match in r.output


def test_missing_plan_and_bad_profile_exit_2(plan_dir, tmp_path):
    r = invoke(tmp_path / "nope.yaml")
    assert r.exit_code == 2 and "plan file not found" in r.output
    data = yaml.safe_load((plan_dir / "plan.yaml").read_text())
    data["models"][0]["profile"] = "models/missing"
    (plan_dir / "bad.yaml").write_text(yaml.safe_dump(data))
    r = invoke(plan_dir / "bad.yaml")
    assert r.exit_code == 2 and "models/missing" in r.output
    data["models"][0]["profil"] = data["models"][0].pop("profile")
    (plan_dir / "typo.yaml").write_text(yaml.safe_dump(data))
    r = invoke(plan_dir / "typo.yaml")
    assert r.exit_code == 2 and "profile" in r.output


def test_trace_and_bursty_arrivals(plan_dir, tmp_path):
    trace = tmp_path / "azure.csv"
    rows = ["app,func,end_timestamp,duration"] + [f"a,f,{1.0 + 0.01 * i + (0.5 if i % 10 == 0 else 0)},0.5" for i in range(200)]
    trace.write_text("\n".join(rows) + "\n")
    out = tmp_path / "t.json"
    r = invoke(plan_dir / "plan.yaml", "--load", 0.25, "--duration-s", 1, "--trace", trace, "--json", out)
    assert r.exit_code == 0, r.output
    data = json.loads(out.read_text())
    assert data["arrivals"] == "trace"
    assert data["overall"]["offered_rps"] == pytest.approx(0.25 * 2000, rel=0.15)
    r = invoke(plan_dir / "plan.yaml", "--load", 0.25, "--duration-s", 1, "--arrivals", "bursty", "--cv", 3, "--json", out)
    assert r.exit_code == 0, r.output
    assert json.loads(out.read_text())["arrivals"] == "bursty"


def test_schedulers_split_the_servers_and_say_what_they_keep(plan_dir):
    from ppipe.spec.plan import load_plan

    servers = {p.server for p in load_plan(plan_dir / "plan.yaml").placement}
    r = invoke(plan_dir / "plan.yaml", "--load", 0.3, "--duration-s", 1, "--schedulers", len(servers))
    assert r.exit_code == 0, r.output
    assert f"{len(servers)} schedulers over disjoint server groups" in r.output and "capacity kept:" in r.output
    for bad, match in ((0, "--schedulers must be >= 1"), (len(servers) + 1, f"cannot split a plan on {len(servers)} servers")):
        r = invoke(plan_dir / "plan.yaml", "--load", 0.3, "--duration-s", 1, "--schedulers", bad)
        assert r.exit_code == 2 and match in r.output, r.output


def test_decode_ms_decodes_before_the_scheduler_and_drops_what_cannot_decode_in_time(plan_dir):
    r = invoke(plan_dir / "plan.yaml", "--load", 0.3, "--duration-s", 1, "--decode-ms", 0.2, "--decode-workers", 2)
    assert r.exit_code == 0 and "where: decode" not in r.output, r.output  # a pool that keeps up drops nothing
    r = invoke(plan_dir / "plan.yaml", "--load", 0.3, "--duration-s", 1, "--decode-ms", 3)  # past the SLO's decode share
    assert r.exit_code == 0 and "deadline-unreachable" in r.output and "where: decode:" in r.output, r.output
    for bad in (["--decode-ms", -1], ["--decode-ms", 1, "--decode-workers", 0]):
        r = invoke(plan_dir / "plan.yaml", "--load", 0.3, "--duration-s", 1, *bad)
        assert r.exit_code == 2 and "must be >=" in r.output, r.output
