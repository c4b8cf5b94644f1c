"""README "Several machines" as written, on real ``ray start`` processes with token auth on:
a head (``{"l4": 1, "l4-0": 1}``) and a second node (``{"p4": 1, "p4-0": 1}``) on 127.0.0.1,
a 2-server cluster YAML with ``ray_resource``, and ``ppipe serve --ray-address auto
--backend emulated`` as a subprocess. Then the second node is killed and restarted while
``ppipe serve`` keeps running. Figures (times) are printed by scripts/bench_node_loss.py;
these tests assert the invariants only.
"""

from __future__ import annotations

import os
import time

import httpx
import pytest

from .raynodes import LocalRayNodes, RayStartFailed, Serve, can_run_ray_start, metric, run_node_loss, write_two_model_plan

pytestmark = [pytest.mark.ray, pytest.mark.slow]

HEAD = {"l4": 1, "l4-0": 1}
SECOND = {"p4": 1, "p4-0": 1}
VGPU_A, VGPU_B0, VGPU_B1 = "l4-0/gpu0/s0", "l4-0/gpu1/s0", "p4-0/gpu0/s0"  # a; b's stages on l4-0, then p4-0


@pytest.fixture(scope="module")
def two_machines(tmp_path_factory):
    why = can_run_ray_start()
    if why:
        pytest.skip(why)
    root = tmp_path_factory.mktemp("nodes")
    try:
        nodes = LocalRayNodes(root)
    except RayStartFailed as exc:
        pytest.skip(f"the ray CLI cannot run here: {exc}")
    serve = None
    try:
        try:
            nodes.start_head(HEAD)
        except RayStartFailed as exc:
            pytest.skip(f"ray start --head cannot run here: {exc}")
        # README: a machine without RAY_AUTH_MODE=token and the token cannot join a token cluster
        no_auth = {k: v for k, v in nodes.env.items() if not k.startswith("RAY_AUTH")}
        no_auth["HOME"] = str(root)  # no .ray/auth_token there
        refused = nodes.start_node("refused", SECOND, env=no_auth)
        joined = nodes.start_node("p4", SECOND)
        assert joined.returncode == 0, joined.stderr[-3000:]
        plan, _ = write_two_model_plan(root)
        serve = Serve(nodes, plan, root)
        serve.wait_ready()
        yield nodes, serve, refused, no_auth
    finally:
        if serve is not None:
            serve.stop()
        nodes.stop()


def test_readme_steps_work_with_token_auth_and_place_workers_by_ray_resource(two_machines):
    nodes, serve, refused, no_auth = two_machines
    assert refused.returncode != 0 and "RAY_AUTH_MODE" in refused.stdout + refused.stderr
    for _ in range(15):  # the autoscaler's summary, which `ray status` prints, follows a joined node within seconds
        status = nodes.ray("status")
        if status.returncode != 0 or ("p4-0" in status.stdout and "l4-0" in status.stdout):
            break
        time.sleep(2.0)
    assert status.returncode == 0 and "p4-0" in status.stdout and "l4-0" in status.stdout, status.stdout[-2000:] + status.stderr[-2000:]
    assert nodes.ray("status", env=no_auth).returncode != 0  # `ray status` needs the token too

    state = nodes.state()
    head, second = nodes.node_offering("l4-0", state), nodes.node_offering("p4-0", state)
    assert head and second and head != second
    alive = {a["name"]: a["node"] for a in state["actors"] if a["state"] == "ALIVE"}
    assert alive == {f"ppipe-vgpu-{VGPU_A}": head, f"ppipe-vgpu-{VGPU_B0}": head, f"ppipe-vgpu-{VGPU_B1}": second}

    import numpy as np

    from ppipe.runtime.ingress.protocol import decode_infer_response, encode_infer_request

    body, headers = encode_infer_request({"input": np.zeros((2, 3, 8, 8), np.float32)}, binary=True)
    with httpx.Client(base_url=serve.url, timeout=30) as c:
        for model in ("a", "b"):
            r = c.post(f"/v2/models/{model}/infer", content=body, headers=headers)
            assert r.status_code == 200, r.text
            out = decode_infer_response(r.content, r.headers.get("inference-header-content-length"))
            assert out["logits"].shape == (2, 5)
        text = c.get("/metrics").text
    assert metric(text, "ppipe_model_capacity_alive_ratio", model="a") == 1.0
    assert metric(text, "ppipe_model_capacity_alive_ratio", model="b") == 1.0


def test_a_lost_node_fails_its_model_fast_and_serves_it_again_once_back(two_machines):
    nodes, serve, _, _ = two_machines
    res = run_node_loss(nodes, serve, "p4", SECOND, lost_model="b", models=["a", "b"], rate=10.0, phase_s=2.0)
    table = res["table"]

    # every request got exactly one HTTP answer
    assert res["sent"] == len(res["answers"]) and all(status != 0 for _, _, status, _ in res["answers"]), table
    # a, on the head only, never noticed
    for phase in ("before", "during", "returning", "after"):
        assert set(table[phase]["a"]) == {"answered", "200"}, table
    # b: served before (a batch in flight at the kill may fail), failed fast during, served after
    assert table["before"]["b"].get("200", 0) > 0 and set(table["before"]["b"]) <= {"answered", "200", "503 worker-failed"}, table
    assert set(table["during"]["b"]) <= {"answered", "503 worker-failed", "503 no-pipeline"}, table
    assert table["during"]["b"].get("503 no-pipeline", 0) > 0, table  # once known lost: refused at once
    assert set(table["returning"]["b"]) <= {"answered", "200", "503 no-pipeline"}, table  # refused until back
    assert set(table["after"]["b"]) == {"answered", "200"}, table

    assert res["ready_during"] == {"server": 200, "a": 200, "b": 503}  # the server still serves a
    assert res["capacity_during"] == {"a": 1.0, "b": 0.0} and res["capacity_after"] == {"a": 1.0, "b": 1.0}
    assert res["restart_rc"] == 0, res["restart_output"] and res["back"]

    # the re-created worker is a new incarnation on the new node; the first is dead
    state = nodes.state()
    second = nodes.node_offering("p4-0", state)
    mine = {a["name"]: (a["state"], a["node"]) for a in state["actors"] if a["name"].startswith(f"ppipe-vgpu-{VGPU_B1}")}
    alive = [n for n, (s, _) in mine.items() if s == "ALIVE"]
    assert len(alive) == 1 and alive[0].startswith(f"ppipe-vgpu-{VGPU_B1}-") and mine[alive[0]][1] == second, mine
    assert mine[f"ppipe-vgpu-{VGPU_B1}"][0] == "DEAD"

    # one line per event the user acts on, and no Ray tracebacks for references ppipe dropped
    log = serve.log()
    assert log.count(f"vGPU {VGPU_B1} (server p4-0) lost") == 1, log[-5000:]
    assert log.count(f"vGPU {VGPU_B1} (server p4-0) is back") == 1, log[-5000:]
    # the node itself: at most once gone, and back as often (a re-creation try may land on the
    # dead node before Ray noticed it, and the next one on the node back: then neither is said)
    gone, back = log.count("server p4-0: no Ray node offers"), log.count("server p4-0: its Ray node is back")
    assert gone == back <= 1, log[-5000:]
    assert "Unhandled error" not in log and "Traceback" not in log, log[-5000:]
    assert log.count("data path: cannot connect") <= 1, log[-5000:]  # the worker before it: once, not per batch
    assert serve.proc.poll() is None  # never restarted


def _ingress_pids(nodes, name: str) -> list[int]:
    return nodes.pids_named(name, "ppipe-ingress")


def _served_by(text: str, process: str) -> float:
    """Requests answered 200 by ``process`` in a merged /metrics text."""
    return sum(float(line.split()[-1]) for line in text.splitlines()
               if line.startswith("ppipe_requests_total{") and f'process="{process}"' in line and 'code="200"' in line)


def test_ingresses_on_every_ray_node_serve_the_port_and_one_killed_comes_back(two_machines):
    """``--ingress 1`` under Ray: an ingress on each node (its agent actor there), both on
    the server's port; requests on fresh connections are answered by both; SIGKILL of the
    second node's ingress: the head's serves meanwhile, and a new one starts on that node;
    SIGTERM of the server leaves no ingress process on either node."""
    import numpy as np

    from ppipe.runtime.ingress.protocol import decode_infer_response, encode_infer_request

    nodes, serve, _, _ = two_machines
    serve.stop()  # its workers hold the nodes' vGPU resources
    ing = Serve(nodes, serve.plan, serve.log_dir, extra=("--ingress", "1"))
    body, headers = encode_infer_request({"input": np.zeros((1, 3, 8, 8), np.float32)}, binary=True)

    def served(n: int) -> list[int]:
        codes = []
        for i in range(n):
            with httpx.Client(base_url=ing.url, timeout=30) as c:  # a fresh connection each: the kernel deals them
                r = c.post(f"/v2/models/{'ab'[i % 2]}/infer", content=body, headers=headers)
                codes.append(r.status_code)
                if r.status_code == 200:
                    assert decode_infer_response(r.content, r.headers.get("inference-header-content-length"))["logits"].shape == (1, 5)
        return codes

    try:
        ing.wait_ready()
        state = nodes.state()
        agents = {a["node"] for a in state["actors"] if a["name"].startswith("ppipe-ingress-") and a["state"] == "ALIVE"}
        assert agents == {nodes.node_offering("l4-0", state), nodes.node_offering("p4-0", state)}, state["actors"]
        (victim,) = _ingress_pids(nodes, "p4")
        assert len(_ingress_pids(nodes, "head")) == 1
        assert served(40) == [200] * 40
        time.sleep(2.5)  # every ingress's metrics reach the scheduler, and the merge comes back
        text = httpx.get(ing.url + "/metrics", timeout=10).text
        assert _served_by(text, "ingress-0") > 0 and _served_by(text, "ingress-1") > 0, text[-3000:]

        os.kill(victim, 9)
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and _ingress_pids(nodes, "p4") in ([], [victim]):
            assert set(served(2)) == {200}  # the head's ingress takes every connection meanwhile
            time.sleep(0.2)
        back = _ingress_pids(nodes, "p4")
        assert len(back) == 1 and back != [victim], ing.log()[-4000:]
        assert served(20) == [200] * 20
    finally:
        ing.stop()
    time.sleep(1.0)
    assert _ingress_pids(nodes, "p4") == [] and _ingress_pids(nodes, "head") == []
    log = ing.log()
    assert "ingress processes on every Ray node" in ing.stdout.read_text() and "Traceback" not in log, log[-4000:]
    assert log.count("is gone (exit code") == 1, log[-4000:]
