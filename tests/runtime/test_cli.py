"""`ppipe serve` and `ppipe bench` from the command line."""

from __future__ import annotations

import functools
import json
import time

import pytest
from click.testing import CliRunner

from ppipe.cli import main


def test_serve_names_a_missing_plan_file(tmp_path):
    r = CliRunner().invoke(main, ["serve", str(tmp_path / "nope.yaml")])
    assert r.exit_code == 2
    assert "nope.yaml" in r.output


def test_serve_rejects_a_plan_for_another_cluster(tmp_path, tinynet):
    from ppipe.spec.cluster import load_cluster
    from .conftest import make_plan

    plan = make_plan(tinynet, load_cluster("local-cpu"), [(0, 2, "cpu", 1, 1)])
    plan.save(tmp_path / "plan.yaml")
    r = CliRunner().invoke(main, ["serve", str(tmp_path / "plan.yaml"), "--cluster", "HC1-S"])
    assert r.exit_code == 2
    assert "plan is for cluster 'local-cpu'" in r.output and "--cluster" in r.output


def test_serve_rejects_a_placement_on_a_gpu_the_cluster_lacks(tmp_path, tinynet):
    from ppipe.spec.cluster import load_cluster
    from .conftest import make_plan

    plan = make_plan(tinynet, load_cluster("local-cpu"), [(0, 2, "cpu", 1, 1)])  # local-cpu: one GPU on its one server
    moved = plan.model_copy(update={"placement": [plan.placement[0].model_copy(update={"gpu_index": 1})]})
    moved.save(tmp_path / "plan.yaml")
    r = CliRunner().invoke(main, ["serve", str(tmp_path / "plan.yaml"), "--backend", "emulated"])
    assert r.exit_code == 2, r.output
    assert "placement[0].gpu_index 1: server 'localhost-0' of cluster 'local-cpu' has 1 GPU(s)" in r.output and "plan.yaml" in r.output


def test_serve_rejects_an_unknown_policy_before_starting_ray(tmp_path, tinynet):
    from ppipe.spec.cluster import load_cluster
    from .conftest import make_plan

    plan = make_plan(tinynet, load_cluster("local-cpu"), [(0, 2, "cpu", 1, 1)])
    plan.save(tmp_path / "plan.yaml")
    r = CliRunner().invoke(main, ["serve", str(tmp_path / "plan.yaml"), "--policy", "reservaton"])
    assert r.exit_code == 2
    assert "did you mean 'reservation'" in r.output


def test_bench_without_a_server_says_so():
    r = CliRunner().invoke(main, ["bench", "http://127.0.0.1:9", "--model", "m", "--rate", "10", "--duration-s", "1"])
    assert r.exit_code == 2
    assert "cannot reach http://127.0.0.1:9" in r.output


def test_bench_refuses_a_start_time_that_has_passed():
    r = CliRunner().invoke(main, ["bench", "http://127.0.0.1:9", "--model", "m", "--rate", "10", "--start-at", "1000"])
    assert r.exit_code == 2 and "--start-at is" in r.output and "in the past" in r.output


def test_bench_against_a_running_server(tinynet, tmp_path):
    from ppipe.runtime.launch.deploy import load_deployment
    from ppipe.runtime.launch.local import start_local_workers
    from ppipe.runtime.scheduler.host import Runtime
    from ppipe.runtime.ingress.http_server import create_app
    from ppipe.runtime.ingress.http_transport import BackgroundServer
    from ppipe.spec.cluster import load_cluster
    from .conftest import make_plan

    plan = make_plan(tinynet, load_cluster("local-cpu"), [(0, 1, "cpu", 2, 1), (2, 2, "cpu", 2, 1)])
    plan.save(tmp_path / "plan.yaml")
    dep = load_deployment(tmp_path / "plan.yaml")
    workers = start_local_workers(dep, backend="emulated")
    rt = Runtime(dep.plan, dep.profiles, dep.cluster, workers)
    out = tmp_path / "bench.json"
    try:
        with BackgroundServer(create_app(rt, token="s3cret", decode_workers=0)) as srv:
            r = CliRunner().invoke(main, ["bench", srv.url, "--model", "tinynet", "--rate", "40", "--duration-s", "1.0",
                                          "--binary", "--token", "s3cret", "--json-out", str(out)])
            denied = CliRunner().invoke(main, ["bench", srv.url, "--model", "tinynet", "--rate", "5", "--duration-s", "0.5"])
            t0 = time.time()
            later = CliRunner().invoke(main, ["bench", srv.url, "--model", "tinynet", "--rate", "20", "--duration-s", "0.3",
                                              "--token", "s3cret", "--start-at", f"{t0 + 1.0}"])
            waited_s = time.time() - t0
    finally:
        for h in workers.values():
            h.kill()
    assert r.exit_code == 0, r.output
    assert "SLO attainment" in r.output and "goodput" in r.output
    res = json.loads(out.read_text())
    assert res["sent"] > 20 and res["ok"] + sum(res["drops"].values()) + sum(res["errors"].values()) == res["sent"]
    assert res["slo_attainment"] > 0.5 and res["p50_ms"] > 0
    # the server's own time per request (its Server-Timing header): within the client's, each 200 counted
    assert 0 < res["server_p50_ms"] <= res["p50_ms"] and res["server_p99_ms"] <= res["p99_ms"]
    assert res["on_time"] <= res["server_on_time"] <= res["ok"]
    assert "at the server" in r.output and "held within the SLO" in r.output
    assert denied.exit_code == 2 and "HTTP 401" in denied.output
    assert later.exit_code == 0, later.output
    assert waited_s >= 1.3 and "SLO attainment" in later.output  # it began at --start-at, then sent for 0.3 s


@pytest.mark.parametrize("header, ms", [("ppipe;dur=12.5", 12.5), ("db;dur=3, ppipe;desc=\"x\";dur=0.25", 0.25),
                                        ("ppipe", None), ("ppipe;dur=fast", None), (None, None), ("other;dur=1", None)])
def test_bench_reads_the_servers_time_from_its_server_timing_header(header, ms):
    from ppipe.runtime.client.bench import server_timing_ms

    assert server_timing_ms(header) == ms


def test_serve_refuses_a_policy_that_dispatches_partial_paths(tmp_path, tinynet):
    from ppipe.dataplane import POLICIES
    from ppipe.spec.cluster import load_cluster
    from .conftest import make_plan

    partial = [name for name, f in POLICIES.items() if getattr(f, "partial_dispatches", False)]
    assert partial == ["reactive-pool"]  # the data plane's per-pool baseline (ppipe.dataplane.reactive_pool)
    plan = make_plan(tinynet, load_cluster("local-cpu"), [(0, 1, "cpu", 2, 1), (2, 2, "cpu", 2, 1)])
    plan.save(tmp_path / "plan.yaml")
    r = CliRunner().invoke(main, ["serve", str(tmp_path / "plan.yaml"), "--policy", partial[0]])
    assert r.exit_code == 2
    assert "dispatches partial paths" in r.output


def test_serve_refuses_nccl_with_emulated_workers_before_starting_ray(tmp_path):
    r = CliRunner().invoke(main, ["serve", str(tmp_path / "plan.yaml"), "--backend", "emulated", "--transport", "nccl"])
    assert r.exit_code == 2
    assert "--transport nccl needs GPU workers" in r.output


def test_serve_refuses_a_negative_dispatch_lead(tmp_path):
    r = CliRunner().invoke(main, ["serve", str(tmp_path / "plan.yaml"), "--dispatch-lead-ms", "-1"])
    assert r.exit_code == 2
    assert "--dispatch-lead-ms must be >= 0" in r.output


def test_serve_refuses_a_negative_answer_budget(tmp_path):
    r = CliRunner().invoke(main, ["serve", str(tmp_path / "plan.yaml"), "--answer-budget-ms", "-1"])
    assert r.exit_code == 2
    assert "--answer-budget-ms must be >= 0" in r.output


def test_serve_refuses_a_plan_without_room_for_its_margins_before_starting_ray(tmp_path, monkeypatch):
    import ppipe.runtime.cli as serve_cli

    monkeypatch.setattr(serve_cli, "init_ray", lambda *a, **k: pytest.fail("Ray started for a plan that is refused"))
    r = CliRunner().invoke(main, ["plan", "-o", str(tmp_path / "plan.yaml")])  # the README's default plan
    assert r.exit_code == 0, r.output
    r = CliRunner().invoke(main, ["serve", str(tmp_path / "plan.yaml"), "--backend", "emulated", "--answer-budget-ms", "6"])
    assert r.exit_code == 2, r.output
    # resnet50's fastest path leaves 6.15 ms of its 15.26 ms SLO; the lead and this budget take more
    assert "resnet50: the fastest path leaves 6.15 ms of its SLO, the runtime needs 6.98 ms" in r.output
    assert "--margin" in r.output


def test_serve_replan_auto_is_checked_before_anything_starts(tmp_path, tinynet):
    from ppipe.spec.cluster import load_cluster
    from .conftest import make_plan

    plan = make_plan(tinynet, load_cluster("local-cpu"), [(0, 1, "cpu", 2, 1), (2, 2, "cpu", 2, 1)])  # objective "none"
    plan.save(tmp_path / "plan.yaml")
    not_max_min = CliRunner().invoke(main, ["serve", str(tmp_path / "plan.yaml"), "--replan", "auto", "--shards", "2"])
    assert not_max_min.exit_code == 2 and "max-min" in not_max_min.output
