"""Frontend shards: which models each owns, the simulator's equivalence, requests passed between
shards, and `ppipe serve --shards 2` under the local launcher (one test under Ray)."""

from __future__ import annotations

import asyncio
import functools
import time

import httpx
import numpy as np
import pytest

from ppipe.planner.placement import place
from ppipe.runtime.control.shard_plan import assign_shards, auto_shards, nic_components, parse_shards, sub_plan
from ppipe.runtime.ingress.shard_router import ShardRouter, merge_metrics
from ppipe.spec.cluster import load_cluster
from ppipe.errors import UserError
from .conftest import make_plan
from .tinynet import write_tinynet


def _two_model_plan(tmp_path, split_a, split_b, servers=2, gpus_per_server=2):
    """Models a and b (tinynet profiles) on `servers` CPU servers; split_x: the partitions
    [(first, last, gpu, vgpu, count)] of model x's one pipeline, placed by the planner's placer."""
    import yaml

    base = load_cluster("local-cpu")
    cluster = base.model_copy(update={"name": "cpus", "servers": [base.servers[0].model_copy(
        update={"count": servers, "gpus_per_server": gpus_per_server})]})
    (tmp_path / "cluster.yaml").write_text(yaml.safe_dump(cluster.model_dump(mode="json"), sort_keys=False))
    cluster = load_cluster(tmp_path / "cluster.yaml")  # the plan's own cluster file: `ppipe serve` checks its GPUs
    models = []
    for name, split in (("a", split_a), ("b", split_b)):
        prof = write_tinynet(tmp_path / name, name=name)
        models.append(make_plan(prof, cluster, split).models[0])
    plan = make_plan(write_tinynet(tmp_path / "a2", name="a"), cluster, split_a)
    return plan.model_copy(update={"models": models, "placement": place(models, cluster), "cluster_file": "cluster.yaml"}), cluster


ONE = [(0, 2, "cpu", 1, 1)]  # one partition: no transfer, no NIC


def test_models_that_transfer_through_a_shared_server_are_one_component(tmp_path):
    two = [(0, 1, "cpu", 2, 1), (2, 2, "cpu", 2, 1)]
    plan, _ = _two_model_plan(tmp_path, two, two, servers=1)  # both pipelines transfer through the one server's NIC
    assert nic_components(plan) == [["a", "b"]]
    assert assign_shards(plan, 4) == [["a", "b"]]
    plan, _ = _two_model_plan(tmp_path, ONE, ONE, servers=1)  # nothing transfers: no NIC is shared
    assert nic_components(plan) == [["a"], ["b"]]
    assert assign_shards(plan, 2) == [["a"], ["b"]] and assign_shards(plan, 1) == [["a", "b"]]
    plan, _ = _two_model_plan(tmp_path, two, ONE, servers=1)  # only a transfers
    assert nic_components(plan) == [["a"], ["b"]]
    with pytest.raises(ValueError, match="n must be >= 1"):
        assign_shards(plan, 0)


def test_shards_balance_the_planned_load_and_a_sub_plan_keeps_only_its_models(tmp_path):
    plan, _ = _two_model_plan(tmp_path, ONE, ONE, servers=1)
    heavy = plan.models[1].model_copy(update={"throughput_rps": 10 * plan.models[0].throughput_rps, "name": "c"})
    three = plan.model_copy(update={"models": [*plan.models, heavy],
                                    "placement": [*plan.placement] + [p.model_copy(update={"model": "c", "vgpu_id": p.vgpu_id + "c"})
                                                                      for p in plan.placement if p.model == "b"]})
    assert assign_shards(three, 2) == [["a", "b"], ["c"]]  # the heavy model alone, the two light ones together
    sub = sub_plan(three, ["c"])
    assert [m.name for m in sub.models] == ["c"] and {p.model for p in sub.placement} == {"c"}
    assert [m.name for m in three.models] == ["a", "b", "c"]  # the plan itself is unchanged


def test_auto_shards_follow_the_planned_rate_the_components_and_the_cores(tmp_path):
    plan, _ = _two_model_plan(tmp_path, ONE, ONE, servers=1)
    slow = plan.model_copy(update={"models": [m.model_copy(update={"throughput_rps": 10.0}) for m in plan.models]})
    fast = plan.model_copy(update={"models": [m.model_copy(update={"throughput_rps": 5000.0}) for m in plan.models]})
    assert auto_shards(slow, cores=16) == 1  # one process carries 20 req/s
    assert auto_shards(fast, cores=16) == 2  # 10,000 req/s needs many, but there are two components
    assert auto_shards(fast, cores=2) == 1  # one core stays for the workers
    busy = plan.model_copy(update={"models": [m.model_copy(update={"throughput_rps": 300.0}) for m in plan.models]})
    assert parse_shards("auto", busy, 16) == 2 and parse_shards("auto", busy, 16, ingress=4) == 1  # a scheduler alone is cheaper
    assert parse_shards("auto", fast, 16, ingress=4) == 2 and parse_shards("auto", fast, 4, ingress=3) == 1  # cores the ingresses leave
    assert parse_shards("3", plan, 2) == 3 and parse_shards("auto", slow, 16) == 1
    with pytest.raises(UserError, match="--shards must be 'auto' or a count >= 1, got 'x'"):
        parse_shards("x", plan, 2)


def test_metrics_of_several_shards_merge_into_one_family_each():
    a = b'# HELP ppipe_requests_total n\n# TYPE ppipe_requests_total counter\nppipe_requests_total{model="a"} 1.0\n'
    b = b'# HELP ppipe_requests_total n\n# TYPE ppipe_requests_total counter\nppipe_requests_total{model="b"} 2.0\n# TYPE x gauge\nx 1\n'
    text = merge_metrics([a, b]).decode()
    assert text.count("# TYPE ppipe_requests_total") == 1 and text.count("# HELP ppipe_requests_total") == 1
    assert 'ppipe_requests_total{model="a"} 1.0' in text and 'ppipe_requests_total{model="b"} 2.0' in text
    assert text.index('model="b"') < text.index("# TYPE x gauge")  # a family's samples stay under its header


def test_the_whole_plans_scheduler_decides_as_the_shards_schedulers_do(tmp_path):
    """Shards share no resource, so simulating the whole plan gives each request the same
    fate and latency as simulating each shard's sub-plan with its models' arrivals."""
    from ppipe.sim.arrivals import model_rng
    from ppipe.sim.simulator import SimConfig, Simulator

    two = [(0, 1, "cpu", 2, 1), (2, 2, "cpu", 2, 1)]
    plan, cluster = _two_model_plan(tmp_path, two, two, servers=2, gpus_per_server=1)
    parts = assign_shards(plan, 2)
    assert parts == [["a"], ["b"]]  # a on one server, b on the other: no shared NIC
    profiles = {m: write_tinynet(tmp_path / f"p{m}", name=m) for m in ("a", "b")}
    arrivals = {}
    for i, m in enumerate(("a", "b")):
        rate = 0.9 * plan.model(m).throughput_rps
        arrivals[m] = np.cumsum(model_rng(7, i).exponential(1e6 / rate, size=300))
    cfg = SimConfig(seed=1)

    def outcomes(p, arr):
        sim = Simulator(p, {m.name: profiles[m.name] for m in p.models}, cluster, cfg).run(arr)
        return sorted((r.model, r.arrival_us, r.dispatch_us, r.completion_us, r.drop_reason) for r in sim.records)

    whole = outcomes(plan, arrivals)
    sharded = sorted(sum((outcomes(sub_plan(plan, ms), {m: arrivals[m] for m in ms}) for ms in parts), []))
    assert len(whole) == 600 and whole == sharded


# ---- passing requests between shards (in-process: two routers, fake workers, real HTTP) -----------------
def _shard_server(plan, tinynet_dir, models, index, owner, grpc=False):
    from ppipe.runtime.scheduler.host import Runtime
    from ppipe.runtime.ingress.http_server import create_app
    from ppipe.runtime.ingress.http_transport import BackgroundServer
    from ppipe.spec.profile import load_profile
    from .fakes import FakeWorker, FifoScheduler, close_workers

    part = sub_plan(plan, models)
    profiles = {m: load_profile(tinynet_dir / m) for m in models}
    workers = {p.vgpu_id: FakeWorker(p.vgpu_id) for p in part.placement}
    rt = Runtime(part, profiles, load_cluster("local-cpu"), workers, scheduler_factory=functools.partial(FifoScheduler, max_batch=1))
    router = ShardRouter(None, index, owner)
    extra = []
    if grpc:
        from ppipe.runtime.ingress.grpc_server import GrpcServer

        extra.append(GrpcServer(rt, port=0, token="t0k", router=router))
        router.grpc_server = extra[0]
    router.app = create_app(rt, token="t0k", decode_workers=0, companions=[router, *extra], on_shutdown=lambda: close_workers(workers.values()))
    return BackgroundServer(router), router


def _two_shards(tmp_path, grpc=False):
    """Models a and b, each on a shard of its own: (server 0, router 0, server 1, router 1)."""
    plan, _ = _two_model_plan(tmp_path, ONE, ONE, servers=1)
    for m in ("a", "b"):
        write_tinynet(tmp_path / m, name=m)
    owner = {"a": 0, "b": 1}
    srv0, r0 = _shard_server(plan, tmp_path, ["a"], 0, owner, grpc)
    srv1, r1 = _shard_server(plan, tmp_path, ["b"], 1, owner, grpc)
    return srv0, r0, srv1, r1


def test_sharded_server_is_ready_while_some_shard_has_a_ready_model(tmp_path):
    srv0, r0, srv1, r1 = _two_shards(tmp_path)
    runtimes = {"a": r0.app.fe.runtime, "b": r1.app.fe.runtime}
    with srv0, srv1, httpx.Client(base_url=srv0.url, timeout=30) as c:
        r0.set_peers([r0.address, r1.address])
        r1.set_peers([r0.address, r1.address])

        def lose(model):  # as mark_failed does for readiness: its vGPUs are failed
            rt = runtimes[model]
            rt.failed.update({p.vgpu_id: 0.0 for p in rt.plan.placement})

        both = c.get("/v2/health/ready").status_code
        lose("b")  # b's shard has no ready model: the server still serves a
        one = c.get("/v2/health/ready").status_code, c.get("/v2/models/b/ready", headers={"authorization": "Bearer t0k"}).status_code
        lose("a")
        none = c.get("/v2/health/ready").status_code
    assert (both, one, none) == (200, (200, 503), 503)


def test_a_shard_passes_other_models_requests_to_their_owner_and_answers_for_all(tmp_path):
    from ppipe.runtime.ingress.protocol import decode_infer_response, encode_infer_request

    srv0, r0, srv1, r1 = _two_shards(tmp_path)
    auth = {"authorization": "Bearer t0k"}
    with srv0, srv1:
        with httpx.Client(base_url=srv0.url, timeout=30) as c:
            starting = c.get("/v2/models/b", headers=auth)
            r0.set_peers([r0.address, r1.address])
            r1.set_peers([r0.address, r1.address])
            body, headers = encode_infer_request({"input": np.full((1, 3, 8, 8), 3.0, np.float32)}, binary=True)
            answers = {m: c.post(f"/v2/models/{m}/infer", content=body, headers={**headers, **auth}) for m in ("a", "b")}
            meta_b = c.get("/v2/models/b", headers=auth)
            no_token = c.post("/v2/models/b/infer", content=body, headers=headers)
            ready = c.get("/v2/health/ready")
            metrics = c.get("/metrics", headers=auth)
            metrics_no_token = c.get("/metrics")
            unknown = c.get("/v2/models/zzz", headers=auth)
        with httpx.Client(base_url=srv1.url, timeout=30) as c:  # the other shard answers for a as well
            a_via_1 = c.post("/v2/models/a/infer", content=body, headers={**headers, **auth})
    assert starting.status_code == 503 and "starting" in starting.json()["error"]
    for m, r in answers.items():
        assert r.status_code == 200, r.text
        out = decode_infer_response(r.content, r.headers.get("inference-header-content-length"))
        assert np.all(out["y"] == 6.0)  # the fake one-stage pipeline: 3 * 2
    assert a_via_1.status_code == 200
    assert meta_b.status_code == 200 and meta_b.json()["name"] == "b"
    assert no_token.status_code == 401  # the owner checks the token, as if reached directly
    assert ready.status_code == 200 and ready.json()["ready"] is True
    text = metrics.text
    assert metrics.status_code == 200 and text.count("# TYPE ppipe_requests_total counter") == 1
    assert 'ppipe_requests_total{code="200",model="a"} 1.0' in text and 'ppipe_requests_total{code="200",model="b"} 1.0' in text
    assert metrics_no_token.status_code == 401
    assert unknown.status_code == 404


def test_a_shard_passes_grpc_calls_for_other_models_to_their_owner(tmp_path):
    """tritonclient.grpc against shard 0 only: b's calls go to shard 1, which answers them
    (errors included) as if reached directly; each request counts once, at its owner."""
    tg = pytest.importorskip("tritonclient.grpc")
    from tritonclient.utils import InferenceServerException

    srv0, r0, srv1, r1 = _two_shards(tmp_path, grpc=True)
    auth = {"authorization": "Bearer t0k"}

    def infer(client, model, shape=(1, 3, 8, 8), headers=auth):
        x = tg.InferInput("input", list(shape), "FP32")
        x.set_data_from_numpy(np.full(shape, 3.0, np.float32))
        return client.infer(model, [x], headers=headers)

    def refusal(call):
        with pytest.raises(InferenceServerException) as info:
            call()
        return info.value.status(), info.value.message()

    with srv0, srv1:
        r0.set_peers([r0.address, r1.address])
        r1.set_peers([r0.address, r1.address])
        client = tg.InferenceServerClient(f"127.0.0.1:{r0.grpc_server.port}")
        outs = {m: infer(client, m).as_numpy("y") for m in ("a", "b")}
        meta_b = client.get_model_metadata("b", headers=auth)
        ready = client.is_server_ready(), client.is_model_ready("b", headers=auth)
        wrong_shape = refusal(lambda: infer(client, "b", shape=(1, 3, 8, 9)))
        no_token = refusal(lambda: infer(client, "b", headers={}))
        unknown = refusal(lambda: client.get_model_metadata("zzz", headers=auth))
        passed = asyncio.run(_grpc_call_with_trailing(f"127.0.0.1:{r0.grpc_server.port}", "b"))
        metrics = httpx.get(srv0.url + "/metrics", headers=auth, timeout=30).text
    assert all(np.all(y == 6.0) for y in outs.values())  # the fake one-stage pipeline: 3 * 2
    assert meta_b.name == "b" and ready == (True, True)
    assert wrong_shape[0] == "StatusCode.INVALID_ARGUMENT" and "shape" in wrong_shape[1]
    assert no_token[0] == "StatusCode.UNAUTHENTICATED"
    assert unknown[0] == "StatusCode.NOT_FOUND"
    assert 'ppipe_requests_total{code="200",model="b"} 2.0' in metrics and 'ppipe_requests_total{code="400",model="b"} 1.0' in metrics
    assert passed[0] == 200 and passed[1]["server-timing"].startswith("ppipe;dur=")  # the owner's timing comes back


async def _grpc_call_with_trailing(address: str, model: str) -> tuple:
    """One ModelInfer through ``ppipe bench``'s gRPC client: (status, trailing metadata)."""
    from ppipe.runtime.client.bench import GrpcInferClient, encode_grpc_request

    client = GrpcInferClient(address, token="t0k")
    try:
        return await client.infer(encode_grpc_request(model, {"input": np.full((1, 3, 8, 8), 3.0, np.float32)}, raw=True))
    finally:
        await client.aclose()


def test_serve_refuses_bad_shard_counts_before_starting_ray(tmp_path):
    from click.testing import CliRunner

    from ppipe.cli import main

    plan, _ = _two_model_plan(tmp_path, ONE, ONE, servers=1)
    plan.save(tmp_path / "plan.yaml")
    r = CliRunner().invoke(main, ["serve", str(tmp_path / "plan.yaml"), "--shards", "0"])
    assert r.exit_code == 2 and "--shards must be 'auto' or a count >= 1, got '0'" in r.output


def _free_ports(n: int) -> list[int]:
    import socket

    ports = []
    for _ in range(n):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            ports.append(s.getsockname()[1])
    return ports


def _serve_two_shards(tmp_path, port: int, *flags: str):
    """`ppipe serve plan.yaml --shards 2` (emulated workers) as a user starts it, once ready;
    the local launcher unless ``flags`` say otherwise."""
    import os
    import subprocess
    import sys

    from ppipe.runtime.client.httpclient import wait_until_ready

    proc = subprocess.Popen([sys.executable, "-m", "ppipe.cli", "serve", str(tmp_path / "plan.yaml"), "--backend", "emulated",
                             "--shards", "2", "--port", str(port), *flags],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env={**os.environ, "RAY_ADDRESS": ""},
                            cwd=tmp_path)
    try:
        wait_until_ready(f"http://127.0.0.1:{port}", proc, timeout_s=120)
    except RuntimeError:
        proc.kill()
        raise AssertionError("ppipe serve did not become ready:\n" + proc.communicate()[0][-3000:]) from None
    return proc


def _stop_and_leave_nothing(proc, sig=None) -> str:
    """Stop `ppipe serve` (SIGTERM) and check that no process of it is left (its shards, their
    workers, fork servers and decode pools); its output."""
    import signal
    import time

    import psutil

    def alive(p) -> bool:
        try:
            return p.is_running() and p.status() != psutil.STATUS_ZOMBIE
        except psutil.NoSuchProcess:
            return False

    children = psutil.Process(proc.pid).children(recursive=True) if proc.poll() is None else []
    proc.send_signal(sig or signal.SIGTERM)
    out, _ = proc.communicate(timeout=90)  # EOF: no process of the server holds its output any more
    deadline = time.monotonic() + 10  # a process that outlived its server by then fails the check below
    while any(alive(p) for p in children) and time.monotonic() < deadline:
        time.sleep(0.02)
    left = [p for p in children if alive(p)]
    assert not left, [(p.pid, p.cmdline()) for p in left]
    return out


def _shard_processes(proc) -> list:
    import psutil

    return [p for p in psutil.Process(proc.pid).children() if "ppipe.runtime.launch.local_shards" in " ".join(p.cmdline())]


def _grpc_infer_on_a_new_channel(address: str, model: str, headers: dict | None = None) -> bool:
    """One tritonclient.grpc ModelInfer on a channel of its own (with ``headers``); whether
    it answered (an explicit drop, UNAVAILABLE, is retried twice, as the REST calls are)."""
    tg = pytest.importorskip("tritonclient.grpc")
    from tritonclient.utils import InferenceServerException

    client = tg.InferenceServerClient(address)
    x = tg.InferInput("input", [1, 3, 8, 8], "FP32")
    x.set_data_from_numpy(np.zeros((1, 3, 8, 8), np.float32))
    try:
        for _try in range(3):
            try:
                return client.infer(model, [x], headers=headers).as_numpy("logits").shape == (1, 5)
            except InferenceServerException as exc:
                if exc.status() != "StatusCode.UNAVAILABLE":
                    raise
        return False
    finally:
        client.close()


@pytest.mark.slow
def test_ppipe_serve_with_two_shards_answers_every_model_on_one_port_and_restarts_a_shard_that_dies(tmp_path):
    """The command a user runs, without Ray: two shards (the second a process of its own, with
    its own workers), REST requests and gRPC calls on fresh connections (the kernel spreads
    them over the shards), merged metrics. Then SIGKILL of shard 1's process: a is served
    throughout; b's requests get 200 or an explicit 503 (never a hang: each has a 30 s client
    timeout) until the restarted shard serves b again; /metrics meanwhile is 200 with a's
    series and ppipe_shard_up 0 for shard 1 (1 once it is back); the log says what happened.
    SIGTERM then stops every process of the server."""
    import signal

    from ppipe.runtime.ingress.protocol import decode_infer_response, encode_infer_request

    plan, _ = _two_model_plan(tmp_path, ONE, ONE, servers=1)
    plan.save(tmp_path / "plan.yaml")
    port, grpc_port = _free_ports(2)
    proc = _serve_two_shards(tmp_path, port, "--grpc-port", str(grpc_port))
    url = f"http://127.0.0.1:{port}"
    request = {"inputs": [{"name": "input", "shape": [1, 3, 8, 8], "datatype": "FP32", "data": [0.0] * 192}]}
    try:
        (victim,) = _shard_processes(proc)  # shard 1; shard 0 is the server's process
        codes, drops = {}, []
        body, headers = encode_infer_request({"input": np.zeros((1, 3, 8, 8), np.float32)}, binary=True)
        for m in ("a", "b"):
            for _ in range(6):
                # a new connection each; a request the scheduler drops while the fresh workers are
                # slow on a loaded host (an explicit 503 with its reason) is sent again, twice at most
                for _try in range(3):
                    r = httpx.post(f"{url}/v2/models/{m}/infer", content=body, headers=headers, timeout=30)
                    if r.status_code != 503:
                        break
                    drops.append(r.headers.get("ppipe-drop-reason"))
                codes.setdefault(m, []).append(r.status_code)
                assert decode_infer_response(r.content, r.headers.get("inference-header-content-length"))["logits"].shape == (1, 5)
        metrics = httpx.get(url + "/metrics", timeout=10).text
        grpc_ok = {m: sum(_grpc_infer_on_a_new_channel(f"127.0.0.1:{grpc_port}", m) for _ in range(4)) for m in ("a", "b")}

        victim.send_signal(signal.SIGKILL)
        victim.wait(timeout=30)
        during = httpx.get(url + "/metrics", timeout=30)  # shard 1 is restarting: its exit is seen at once, its start takes seconds
        answers = {"a": [], "b": []}
        for _ in range(400):  # b is back once the new shard serves (a few seconds); a bound, not a time
            for m in ("a", "b"):
                r = httpx.post(f"{url}/v2/models/{m}/infer", json=request, timeout=30)
                answers[m].append((r.status_code, r.json().get("error", "")))
            if answers["b"][-1][0] == 200:
                break
        (restarted,) = _shard_processes(proc)
        after = httpx.get(url + "/metrics", timeout=30)
    finally:
        out = _stop_and_leave_nothing(proc)
    assert codes == {"a": [200] * 6, "b": [200] * 6}
    assert grpc_ok == {"a": 4, "b": 4}  # each channel reaches one shard, which serves or passes the call
    assert all(drops) and len(drops) <= 3, drops  # each 503 says why; a few at most
    assert 'ppipe_requests_total{code="200",model="a"} 6.0' in metrics and 'ppipe_requests_total{code="200",model="b"} 6.0' in metrics
    assert "2 shards: a, b" in out and "local launcher" in out
    # the shard that died
    assert restarted.pid != victim.pid and answers["b"][-1][0] == 200, answers["b"][-3:]
    refused = [(code, why) for code, why in answers["b"] if code != 200]
    assert all(code == 503 and why for code, why in refused), refused  # explicit, with the reason
    assert any("shard 1 of this server is down" in why for _, why in refused), refused
    assert sum(code == 200 for code, _ in answers["a"]) >= len(answers["a"]) - 2, answers["a"]  # a: its shard never stopped
    # metrics while it restarted: shard 0's series, and the gauge that says shard 1 is down
    assert during.status_code == 200, during.text
    assert 'ppipe_requests_total{code="200",model="a"}' in during.text and 'model="b"' not in during.text
    assert 'ppipe_shard_up{shard="0"} 1' in during.text and 'ppipe_shard_up{shard="1"} 0' in during.text
    assert after.status_code == 200 and 'ppipe_shard_up{shard="1"} 1' in after.text, after.text
    assert f"shard 1 (b; pid {victim.pid}) is gone: exit code -9" in out and "restarting it" in out
    assert f"shard 1 (b; pid {restarted.pid}) is back" in out
    assert "Traceback" not in out


@pytest.mark.ray
@pytest.mark.slow
def test_ppipe_serve_with_two_ray_shards_answers_every_model_on_one_port_and_restarts_a_shard_actor_that_dies(tmp_path):
    """Under Ray (--launcher ray), the second shard is a Ray actor given shard 0's worker
    handles: both models answer on one port. SIGKILL of the actor's process: a is served
    throughout, b gets 200 or an explicit 503 until a new actor, with workers of its own,
    serves b again; the log says what happened, and SIGINT stops the server cleanly."""
    import signal

    import psutil

    plan, _ = _two_model_plan(tmp_path, ONE, ONE, servers=1)
    plan.save(tmp_path / "plan.yaml")
    (port,) = _free_ports(1)
    proc = _serve_two_shards(tmp_path, port, "--launcher", "ray", "--num-cpus", "2")
    url = f"http://127.0.0.1:{port}"
    request = {"inputs": [{"name": "input", "shape": [1, 3, 8, 8], "datatype": "FP32", "data": [0.0] * 192}]}

    def actors(name: str) -> list:
        return [p for p in psutil.process_iter(["cmdline"]) if name in " ".join(p.info["cmdline"] or [])]

    def shard_actors() -> list:
        return actors("_RayShardServer")

    def worker_count_settles_at(n: int) -> int:
        for _ in range(100):  # a killed actor's process ends within moments; a bound, not a time
            if len(actors("VgpuActor")) == n:
                break
            time.sleep(0.1)
        return len(actors("VgpuActor"))

    try:
        codes = {}
        for m in ("a", "b"):
            for _ in range(4):
                for _try in range(3):  # an explicit drop (503 with its reason) while the workers are cold is sent again
                    r = httpx.post(f"{url}/v2/models/{m}/infer", json=request, timeout=30)
                    if r.status_code != 503:
                        break
                codes.setdefault(m, []).append(r.status_code)
        (victim,) = shard_actors()
        workers_before = len(actors("VgpuActor"))
        victim.send_signal(signal.SIGKILL)
        victim.wait(timeout=30)
        answers = {"a": [], "b": []}
        for _ in range(600):  # b is back once the new actor and its workers serve; a bound, not a time
            for m in ("a", "b"):
                r = httpx.post(f"{url}/v2/models/{m}/infer", json=request, timeout=30)
                answers[m].append((r.status_code, r.json().get("error", "")))
            if answers["b"][-1][0] == 200 and any(code != 200 for code, _ in answers["b"]):
                break
        restarted = shard_actors()
        workers_after = worker_count_settles_at(workers_before)  # the ones it was given are killed, its own replace them
    finally:
        proc.send_signal(signal.SIGINT)
        out, _ = proc.communicate(timeout=60)
    assert codes == {"a": [200] * 4, "b": [200] * 4}, out[-3000:]
    assert "2 shards: a, b" in out and "ray launcher" in out
    assert [p.pid for p in restarted] != [victim.pid] and len(restarted) == 1, out[-3000:]
    assert workers_before == 2 and workers_after == workers_before
    assert answers["b"][-1][0] == 200, (answers["b"][-3:], out[-3000:])
    refused = [(code, why) for code, why in answers["b"] if code != 200]
    assert refused and all(code == 503 and why for code, why in refused), refused  # explicit, with the reason
    assert sum(code == 200 for code, _ in answers["a"]) >= len(answers["a"]) - 2, answers["a"]  # a: its shard never stopped
    assert "shard 1 (b; Ray actor 1) is gone" in out and "restarting it" in out and "shard 1 (b; Ray actor 2) is back" in out, out[-3000:]
    assert "Traceback" not in out


# ---- the messages between shards' routers (ppipe.runtime.wire.shard_messages) ------------------------------
def _shard_messages():
    from ppipe.runtime.wire.shard_messages import GrpcAnswer, HttpRequest, PassAnswer, PassGrpc, PassRequest

    request = HttpRequest("POST", "/v2/models/b/infer", b"x=1", ((b"authorization", b"Bearer t0k"),), "1.1", ("10.0.0.1", 5000))
    return [
        PassRequest(1, "tcp://127.0.0.1:9", request),
        PassRequest(2, "tcp://127.0.0.1:9", HttpRequest("GET", "/metrics", b"", ())),  # scope defaults left off the wire
        PassAnswer(1, 200, ((b"content-type", b"application/json"),)),
        PassGrpc(3, "tcp://127.0.0.1:9", "ModelInfer", (("authorization", "Bearer t0k"),), (("trace-bin", b"\x00\x01"),)),
        GrpcAnswer(3, None, "", ()),
        GrpcAnswer(4, "INVALID_ARGUMENT", "bad shape", (("ppipe-drop-reason", "deadline"),)),
    ]


@pytest.mark.parametrize("msg", _shard_messages(), ids=lambda m: type(m).__name__)
def test_every_kind_of_shard_message_crosses_the_wire_as_it_was_sent(msg):
    from ppipe.runtime.wire.frames import pack, unpack
    from ppipe.runtime.wire.shard_messages import ShardEnvelope

    frame = b"".join(bytes(p) for p in pack(ShardEnvelope(msg), {"body": np.frombuffer(b"body!", np.uint8)}))[4:]
    got, tensors = unpack(frame, ShardEnvelope)
    assert type(got.msg) is type(msg) and got.msg == msg
    assert tensors["body"].tobytes() == b"body!"


def test_grpc_metadata_travels_as_its_text_and_its_bytes_values():
    from ppipe.runtime.wire.shard_messages import join_metadata, split_metadata

    text, binary = split_metadata([("a", "x"), ("k-bin", b"\x00"), ("b", "y")])
    assert text == (("a", "x"), ("b", "y")) and binary == (("k-bin", b"\x00"),)
    assert join_metadata(text, binary) == [("a", "x"), ("b", "y"), ("k-bin", b"\x00")]


def test_a_malformed_shard_message_is_logged_and_dropped(caplog):
    """Bytes that are no message, another boundary's message, an unknown kind and a field of
    the wrong type: each is one log line, nothing raised, no request waiting on it answered."""
    import logging

    import msgspec

    from ppipe.runtime.wire.frames import pack
    from ppipe.runtime.wire.messages import EdgeRef

    def frame(header) -> bytes:
        head = msgspec.msgpack.encode(header)
        return len(head).to_bytes(4, "little") + head

    router = ShardRouter(None, 1, {"a": 0, "b": 1})
    bad = [
        b"\x01\x02",
        b"".join(bytes(p) for p in pack(EdgeRef("w", 1)))[4:],
        frame([[["nope", 1]], []]),
        frame([[["answer", "one", 200, []]], []]),
    ]
    with caplog.at_level(logging.WARNING, logger="ppipe.runtime"):
        for message in bad:
            router._on_message(message)
    dropped = [r for r in caplog.records if "dropped a malformed message" in r.getMessage()]
    assert len(dropped) == len(bad) and not router._waiting


def test_a_shard_answers_each_plan_switch_request_with_its_own_handler():
    """ShardControl: each request type to one method of the shard's switcher (or its router's
    owner map); anything else is refused, never looked up by name."""
    import asyncio
    from types import SimpleNamespace

    from ppipe.runtime.control.shard_control import (
        Abort, Commit, Lift, LogArrivals, Prepare, SetOwner, SetPeers, ShardControl, TakeArrivals,
    )

    asked = []

    class Switcher:
        def __getattr__(self, name):
            async def method(*args):
                asked.append((name, *args))
                return name
            return method

    router = SimpleNamespace(owner={"a": 0}, set_peers=lambda addresses: asked.append(("set_peers", addresses)))
    control = ShardControl(Switcher(), router)
    requests = [Prepare("dep"), Commit({"g0": None}), Abort(), Lift("g0", 5.0), LogArrivals(True), TakeArrivals(),
                SetOwner({"a": 1}), SetPeers(("tcp://x:1", None))]
    answers = [asyncio.run(control.call(r)) for r in requests]
    assert asked == [("prepare", "dep"), ("commit", {"g0": None}), ("abort",), ("lift", "g0", 5.0), ("log_arrivals", True),
                     ("take_arrivals",), ("set_peers", ["tcp://x:1", None])]
    assert answers == ["prepare", "commit", "abort", "lift", "log_arrivals", "take_arrivals", None, None]
    assert router.owner == {"a": 1}
    with pytest.raises(TypeError, match="not a shard request"):
        asyncio.run(control.call("commit"))
    asyncio.run(ShardControl(Switcher(), None).call(SetOwner({"a": 0})))  # a shard without a router: nothing to tell


def test_a_shard_of_ingress_schedulers_forgets_a_dead_ingress_and_gives_its_metrics_and_shard_0_tells_the_directory():
    """``--ingress N --shards K``: IngressGone and Scrape go to the shard's runtime; the
    IngressDirectory stands where a router stands, and only shard 0's tells the ingresses."""
    import asyncio
    from types import SimpleNamespace

    from ppipe.runtime.control.shard_control import IngressGone, Scrape, SetOwner, SetPeers, ShardControl
    from ppipe.runtime.scheduler.ingresses import IngressDirectory

    told, gone = [], []
    runtime = SimpleNamespace(ingress_gone=gone.append, render_metrics=lambda: b"m 1\n", ingress_address="tcp://s:1",
                              tell_directory=lambda *a: told.append(a))
    control = ShardControl(SimpleNamespace(runtime=runtime), IngressDirectory(runtime, 0, {"a": 0, "b": [(0, 1.0), (1, 0.0)]}))
    assert asyncio.run(control.call(IngressGone(3))) is None and gone == [3]
    assert asyncio.run(control.call(Scrape())) == b"m 1\n"
    assert control.router.address == "tcp://s:1" and runtime.shard_index == 0
    asyncio.run(control.call(SetPeers(("tcp://s:1", None))))
    asyncio.run(control.call(SetOwner({"a": 1})))
    assert told == [(("tcp://s:1", ""), {"a": ((0, 1.0),), "b": ((0, 1.0),)}), (("tcp://s:1", ""), {"a": ((1, 1.0),)})]
    other = SimpleNamespace(ingress_address="tcp://s:2", tell_directory=lambda *a: told.append(("shard 1", a)))
    ShardControl(SimpleNamespace(runtime=other), IngressDirectory(other, 1, {"a": 0})).router.set_peers(["tcp://s:1", "tcp://s:2"])
    assert len(told) == 2 and other.shard_index == 1  # shard 1 tells nobody: shard 0 is the ingresses' directory


def test_a_server_of_shards_is_ready_once_every_shard_has_started_and_then_while_one_is():
    from ppipe.runtime.ingress.shard_router import merge_readiness

    ready = (200, [], b'{"ready": true, "started": true}')
    lost = (503, [], b'{"ready": false, "started": true}')  # its models' workers are gone
    starting = (503, [], b'{"ready": false, "started": false}')
    unreachable = (503, [], b'{"error": "the server is starting; retry shortly"}')  # a peer not connected yet
    assert merge_readiness([ready, lost]) == ready
    assert merge_readiness([ready, starting]) == starting
    assert merge_readiness([unreachable, ready]) == unreachable
    assert merge_readiness([lost, lost]) == lost


def test_a_request_waiting_for_a_shard_that_goes_down_is_answered_503_and_so_is_every_later_one():
    """Shard 1 takes a request and never answers (its process died): once shard 0's router
    learns that shard 1 is down, the waiting request and every new one for shard 1's models
    get an explicit 503 (REST) or UNAVAILABLE (gRPC) at once; shard 0's own models are
    not affected."""
    import asyncio

    async def run():
        taken = asyncio.Event()

        async def never_answers(scope, receive, send):
            taken.set()
            await asyncio.Event().wait()

        r0, r1 = ShardRouter(None, 0, {"a": 0, "b": 1}), ShardRouter(never_answers, 1, {"a": 0, "b": 1})
        await r0.start()
        await r1.start()
        try:
            r0.set_peers([r0.address, r1.address])
            scope = {"type": "http", "method": "POST", "path": "/v2/models/b/infer", "headers": [], "query_string": b""}
            waiting = asyncio.ensure_future(r0._ask(1, scope, b"{}"))
            await taken.wait()
            r0.set_peers([r0.address, None])  # as the supervisor tells it when shard 1's process is gone
            first = await waiting
            later = await r0._ask(1, scope, b"{}")
            grpc = await r0.ask_grpc(1, "ModelInfer", b"", [])
        finally:
            await r0.stop()
            await r1.stop()
        return first, later, grpc

    first, later, grpc = asyncio.run(run())
    for status, _, body in (first, later):
        assert status == 503 and b"shard 1 of this server is down" in body
    assert grpc[0] == "UNAVAILABLE" and "shard 1 of this server is down" in grpc[1]


@pytest.mark.parametrize("kind", ["local", "ray"])
def test_a_shard_restarts_with_the_part_its_last_committed_switch_gave_it(kind):
    """A shard's handle (a local process's, a Ray actor's) keeps what the shard serves as
    requests through it are answered: a prepared part only once committed (an aborted one
    never), the owners, the arrival log."""
    from types import SimpleNamespace

    from ppipe.runtime.control.shard_control import Abort, Commit, LogArrivals, Prepare, SetOwner
    from ppipe.runtime.launch.local_shards import LocalShard
    from ppipe.runtime.launch.ray_shards import RayShard
    from ppipe.runtime.launch.shards import ShardStart

    def part(*models):
        return SimpleNamespace(plan=SimpleNamespace(models=[SimpleNamespace(name=m) for m in models]))

    start = ShardStart(1, part("b"), ["b"], None, {"a": 0, "b": 1}, "127.0.0.1", 1)
    shard = LocalShard(start) if kind == "local" else RayShard(start, {}, {})
    shard._note(Prepare(part("b", "x")))
    shard._note(Abort())
    shard._note(Commit({}))  # a commit with nothing prepared (this shard did not switch) changes nothing
    assert shard.spec.models == ["b"]
    new = part("b", "c")
    shard._note(Prepare(new))
    assert shard.spec.models == ["b"]  # prepared, not yet serving
    shard._note(SetOwner({"a": 0, "b": 1, "c": 1}))
    shard._note(Commit({"g0": None}))
    shard._note(LogArrivals(True))
    assert shard.spec.dep is new and shard.spec.models == ["b", "c"]
    assert shard.spec.owner == {"a": 0, "b": 1, "c": 1} and shard.spec.log_arrivals is True


def test_several_shards_run_under_the_local_launcher_unless_ray_is_asked_for(tmp_path):
    from ppipe.runtime.cli import _choose_launcher

    plan, cluster = _two_model_plan(tmp_path, ONE, ONE, servers=1)
    assert _choose_launcher("auto", None, cluster, "2", 2, "auto") == ("local", 2)
    assert _choose_launcher("auto", None, cluster, "auto", 2, "auto") == ("local", 2)
    assert _choose_launcher("ray", None, cluster, "2", 2, "auto") == ("ray", 2)
    assert _choose_launcher("auto", "auto", cluster, "2", 2, "auto") == ("ray", 2)  # a Ray address
    ray_nodes = cluster.model_copy(update={"servers": [cluster.servers[0].model_copy(update={"ray_resource": "nodeA"})]})
    assert _choose_launcher("auto", None, ray_nodes, "2", 2, "auto") == ("ray", 2)
    with pytest.raises(UserError, match="--launcher local cannot serve with the cluster's ray_resource"):
        _choose_launcher("local", None, ray_nodes, "2", 2, "auto")
    with pytest.raises(UserError, match="--transport nccl needs --launcher ray"):
        _choose_launcher("auto", None, cluster, "2", 2, "nccl")


# ---- plan switches of a server of shards (ppipe.runtime.control.switch.ShardedSwitcher) -----------------
class _RecordingShard:
    """A shard handle (ppipe.runtime.control.shard_control.ShardHandle) in this process: it
    appends ``(index, request)`` to ``calls`` and answers ``answer(index, request)``."""

    def __init__(self, index, calls, answer):
        self.index, self.calls, self.answer = index, calls, answer

    async def call(self, request):
        self.calls.append((self.index, request))
        return self.answer(self.index, request)


def _swapped(plan):
    """The plan with models a and b on each other's GPUs."""
    gpu = {p.model: (p.gpu_index, p.vgpu_id) for p in plan.placement}
    other = {"a": "b", "b": "a"}
    return plan.model_copy(update={"placement": [p.model_copy(update={"gpu_index": gpu[other[p.model]][0], "vgpu_id": gpu[other[p.model]][1]})
                                                 for p in plan.placement]})


def test_a_switch_keeps_each_model_on_its_shard_and_refuses_what_would_move_one(tmp_path):
    from ppipe.runtime.control.shard_plan import incoming_resources, shard_owners

    plan, _ = _two_model_plan(tmp_path, ONE, ONE, servers=1)
    owner = {"a": 0, "b": 1}
    assert shard_owners(plan, owner, plan, 2) == owner
    heavy = plan.models[0].model_copy(update={"name": "c", "throughput_rps": 5 * plan.models[0].throughput_rps})
    with_c = plan.model_copy(update={"models": [*plan.models, heavy],
                                     "placement": [*plan.placement, plan.placement[0].model_copy(update={"model": "c", "vgpu_id": "x/gpu9/s0"})]})
    assert shard_owners(plan, owner, with_c, 2)["c"] == 0  # a new model: the least loaded shard (ties: the lower)
    with pytest.raises(UserError, match="shard 1 of this server with no model"):
        shard_owners(plan, owner, sub_plan(plan, ["a"]), 2)
    two = [(0, 1, "cpu", 2, 1), (2, 2, "cpu", 2, 1)]
    joined, _ = _two_model_plan(tmp_path, two, two, servers=1)  # a and b now transfer through one NIC
    with pytest.raises(UserError, match="shards 0, 1 of this server serve them"):
        shard_owners(plan, owner, joined, 2)
    # the GPUs swap: each shard takes the other's GPU; a shard that keeps its part takes nothing
    assert incoming_resources(plan, owner, _swapped(plan), owner, {0, 1}) == {0: {"localhost-0/gpu1": {1}}, 1: {"localhost-0/gpu0": {0}}}
    assert incoming_resources(plan, owner, _swapped(plan), owner, {0}) == {1: {"localhost-0/gpu0": {0}}}


def test_shards_commit_givers_first_and_a_cycle_under_an_embargo_that_the_later_commit_lifts(tmp_path):
    import asyncio

    from ppipe.runtime.control.shard_control import Commit, Lift
    from ppipe.runtime.control.switch import ShardedSwitcher

    calls = []

    def retired(shard, request):
        return {"retired": {"g0": 100.0 + shard, "g1": 200.0 + shard}} if isinstance(request, Commit) else None

    class Recorder(ShardedSwitcher):
        def __init__(self):  # no runtime: only the commit order is under test
            self.shards = [_RecordingShard(i, calls, retired) for i in range(3)]

    # shard 1 takes g0 from shard 0; shard 2 takes g1 from shard 1: a chain, no embargo
    asyncio.run(Recorder()._commit_in_waves([0, 1, 2], {1: {"g0": {0}}, 2: {"g1": {1}}}))
    assert calls == [(0, Commit({})), (1, Commit({"g0": 100.0})), (2, Commit({"g1": 201.0}))]
    calls.clear()
    # a cycle: 0 takes g1 from 1 and 1 takes g0 from 0
    asyncio.run(Recorder()._commit_in_waves([0, 1], {0: {"g1": {1}}, 1: {"g0": {0}}}))
    assert calls == [(0, Commit({"g1": None})), (1, Commit({"g0": 100.0})), (0, Lift("g1", 201.0))]


@pytest.mark.slow
def test_ppipe_apply_switches_a_server_of_two_shards_that_swap_their_gpus(tmp_path):
    """`ppipe apply` on `ppipe serve --shards 2` (local shards) while both models are under
    load: the new plan swaps the models' GPUs, so each shard takes the GPU the other gives up
    (the cycle that commits under an embargo); shard 1's part of the switch reaches its
    process as typed requests. Every request is answered; a plan that would leave a shard
    without a model is refused and the server serves on."""
    import asyncio
    import signal
    import threading
    import time

    from click.testing import CliRunner

    from ppipe.cli import main
    from ppipe.runtime.client.bench import run_bench

    plan, _ = _two_model_plan(tmp_path, ONE, ONE, servers=1)
    plan.save(tmp_path / "plan.yaml")
    _swapped(plan).save(tmp_path / "swapped.yaml")
    sub_plan(plan, ["a"]).save(tmp_path / "only_a.yaml")
    (port,) = _free_ports(1)
    proc = _serve_two_shards(tmp_path, port, "--token", "s3cret")
    url = f"http://127.0.0.1:{port}"
    results = {}
    try:
        loads = [threading.Thread(target=lambda m=m: results.update(
            {m: asyncio.run(run_bench(url, m, 15.0, 3.0, binary=True, token="s3cret"))})) for m in ("a", "b")]
        for t in loads:
            t.start()
        time.sleep(1.0)
        applied = CliRunner().invoke(main, ["apply", str(tmp_path / "swapped.yaml"), "--url", url, "--token", "s3cret", "--as-placed"])
        for t in loads:
            t.join()
        refused = CliRunner().invoke(main, ["apply", str(tmp_path / "only_a.yaml"), "--url", url, "--token", "s3cret"])
        status = httpx.get(url + "/v2/admin/plan", headers={"authorization": "Bearer s3cret"}, timeout=10).json()
        after = {m: httpx.post(f"{url}/v2/models/{m}/infer", timeout=30, headers={"authorization": "Bearer s3cret"},
                               json={"inputs": [{"name": "input", "shape": [1, 3, 8, 8], "datatype": "FP32",
                                                 "data": [0.0] * 192}]}).status_code for m in ("a", "b")}
    finally:
        out = _stop_and_leave_nothing(proc, signal.SIGINT)
    assert applied.exit_code == 0, applied.output + out[-3000:]
    assert "0 vGPUs kept, 2 started, 2 finishing their batches" in applied.output
    for m in ("a", "b"):
        res = results[m]
        assert res.sent > 20 and res.ok + sum(res.drops.values()) == res.sent and not res.errors, (m, res.drops, res.errors)
        # the requests a shard holds under its embargo wait for the lift (a probe would drop them all)
        assert sum(res.drops.values()) <= 2, (m, res.drops)
    assert refused.exit_code == 2 and "no model to serve" in refused.output
    assert len(status["switches"]) == 1 and sorted(status["switches"][0]["shards"]) == ["0", "1"]
    assert after == {"a": 200, "b": 200}
    assert "Traceback" not in out


def test_a_switch_that_fails_part_way_says_which_shards_serve_which_plan_and_refuses_more():
    import asyncio
    from types import SimpleNamespace

    from ppipe.runtime.control.shard_control import Commit
    from ppipe.runtime.control.switch import PartialSwitch, ShardedSwitcher

    calls = []

    def dies_at_one(shard, request):
        if isinstance(request, Commit) and shard == 1:
            raise ConnectionError("shard 1 is gone")
        return {"retired": {}}

    class ShardOneDies(ShardedSwitcher):
        def __init__(self):  # no runtime: only what happens around the commits is under test
            self._lock, self._broken, self.owner = asyncio.Lock(), "", {}
            self.shards = [_RecordingShard(i, calls, dies_at_one) for i in range(2)]
            self.dep = SimpleNamespace(plan=SimpleNamespace(models=[SimpleNamespace(slo_ms=100.0)]))

        def _prepare(self, plan, source, keep_live):
            return SimpleNamespace(plan=plan)

        def _split(self, dep, source):  # a cycle: shard 0 commits under an embargo on shard 1's g1
            return {}, {0: "part 0", 1: "part 1"}, {0: {"g1": {1}}, 1: {"g0": {0}}}, 0

    async def twice():
        sw, errors = ShardOneDies(), []
        for _ in range(2):
            try:
                await sw.apply(None, "new.yaml")
            except PartialSwitch as exc:
                errors.append(str(exc))
        return errors

    first, second = asyncio.run(twice())
    assert "shards [0] serve the plan from new.yaml, shards [1] the one before" in first and "shard 1 is gone" in first
    kinds = [(shard, type(request).__name__) for shard, request in calls]
    assert kinds == [(0, "Prepare"), (1, "Prepare"), (0, "Commit"), (1, "Commit"), (0, "Lift")]  # shard 0 serves on
    assert second == first  # refused at once: the server serves two plans until it restarts


def test_a_new_models_owner_is_told_to_every_shard_before_its_owner_commits():
    """Between the owner's commit and the last broadcast, the other shards would answer 404
    for the new model: they learn its owner right after every shard prepared."""
    import asyncio
    from types import SimpleNamespace

    from ppipe.runtime.control.shard_control import Commit, Prepare, SetOwner
    from ppipe.runtime.control.switch import ShardedSwitcher

    calls = []

    def record(shard, request):
        return {"retired": {}, "kept": 0, "started": 1, "retiring": 0, "moved": 0, "load_s": 0.1, "switch_us": 1.0}

    class AddsModelC(ShardedSwitcher):
        def __init__(self):  # no runtime: only the order of the calls is under test
            self._lock, self._broken, self._records = asyncio.Lock(), "", []
            self.shards = [_RecordingShard(i, calls, record) for i in range(2)]
            self.owner = {"a": 0, "b": 1}

        def _prepare(self, plan, source, keep_live):
            return SimpleNamespace(plan=SimpleNamespace(models=[SimpleNamespace(name=m) for m in "abc"]))

        def _split(self, dep, source):  # c joins shard 1, which alone changes
            return {"a": 0, "b": 1, "c": 1}, {1: "part 1"}, {}, 0

    asyncio.run(AddsModelC().apply(None, "new.yaml"))
    with_c = {"a": 0, "b": 1, "c": 1}
    assert calls[:4] == [(1, Prepare("part 1")), (0, SetOwner(with_c)), (1, SetOwner(with_c)), (1, Commit({}))]


# ---- --shard-by servers: one model's servers split over shards --------------------------------------------
SPLIT_CLUSTER = """
version: 1
name: split-cpus
bandwidth_efficiency: 1.0
gpu_types:
- {name: cpu, vgpu_levels: [1, 2]}
servers:
- {name: h, gpu_type: cpu, gpus_per_server: 2, count: 2, nic_bandwidth_gbps: 10}
"""
TWO_POOLS = [(0, 1, "cpu", 1, 2), (2, 2, "cpu", 1, 2)]  # two partitions, each pool one vGPU on each server


def _split_plan(tmp_path, partitions=TWO_POOLS):
    """Model a (tinynet) on two servers of two CPU 'GPUs' (SPLIT_CLUSTER, saved as cluster.yaml):
    each of its pools has a vGPU on each server, so the servers split into two whole halves."""
    (tmp_path / "cluster.yaml").write_text(SPLIT_CLUSTER)
    cluster = load_cluster(tmp_path / "cluster.yaml")
    plan = make_plan(write_tinynet(tmp_path / "a", name="a"), cluster, partitions)
    return plan.model_copy(update={"cluster_file": "cluster.yaml"}), cluster


def test_a_split_by_servers_gives_each_shard_its_servers_sub_plan_and_weights_by_capacity(tmp_path):
    from ppipe.runtime.control.shard_plan import shard_layout

    plan, _ = _split_plan(tmp_path)
    layout = shard_layout(plan, 2, "servers")
    assert layout.by == "servers" and layout.parts == [["a"], ["a"]] and layout.servers == [["h-0"], ["h-1"]]
    for i, p in enumerate(layout.plans):
        assert {pl.server for pl in p.placement} == {f"h-{i}"} and [len(pp.partitions) for pp in p.model("a").pipelines] == [2]
    (s0, w0), (s1, w1) = layout.routes["a"]
    assert (s0, s1) == (0, 1) and w0 == pytest.approx(w1) and w0 + w1 == pytest.approx(plan.model("a").pipelines[0].throughput_rps)
    assert layout.kept == {"a": pytest.approx(1.0)} and layout.shares == [pytest.approx(0.5)] * 2
    assert layout.describe() == ["shard 0: a 50% on 1 server (h-0), 50% of the plan's capacity",
                                 "shard 1: a 50% on 1 server (h-1), 50% of the plan's capacity"]
    by_models = shard_layout(plan, 2, "models")  # one model: one shard, as before
    assert by_models.parts == [["a"]] and by_models.owner() == {"a": 0} and by_models.plans == [plan]


def test_a_split_that_loses_a_models_capacity_or_needs_more_servers_is_refused(tmp_path):
    from ppipe.runtime.control.shard_plan import auto_split_shards, shard_layout

    plan, _ = _split_plan(tmp_path)
    # partition 0 on h-0 only, partition 1 on h-1 only: any split of the two servers cuts the pipeline
    cut = plan.model_copy(update={"placement": [pl.model_copy(update={"server": f"h-{pl.partition}", "gpu_index": pl.replica})
                                                for pl in plan.placement]})
    with pytest.raises(UserError) as info:
        shard_layout(cut, 2, "servers")
    assert "do not split well" in info.value.message and "keeps 0% of a's capacity" in info.value.message
    assert "--shards 1" in info.value.fix and "--shard-by models" in info.value.fix
    with pytest.raises(UserError) as info:
        shard_layout(plan, 3, "servers")
    assert "on 2 servers" in info.value.message and "--shards 2 or fewer" in info.value.fix
    assert auto_split_shards(cut, cores=16) == 1 and parse_shards("auto", cut, 16, by="servers") == 1


def test_routes_deal_a_models_requests_over_its_shards_by_weight_and_a_passed_request_stays():
    from ppipe.runtime.ingress.shard_router import _PASSED, Routes

    routes = Routes({"a": [(0, 2.0), (1, 1.0)], "b": 1, "c": [(0, 0.0), (2, 3.0)]}, index=0)
    assert [routes.get("a") for _ in range(6)] == [0, 1, 0, 0, 1, 0]  # smooth: 2 : 1, never two 1s in a row
    assert [routes.get("b") for _ in range(3)] == [1, 1, 1] and routes.get("c") == 2  # one shard (weight 0 left out)
    assert routes.get("zzz", 0) == 0 and "a" in routes and "zzz" not in routes
    assert routes.shards() == [0, 1, 2] and routes.shards_of("a") == [0, 1] and routes.split()
    assert not Routes({"a": 0, "b": 1}, 0).split() and set(Routes({"a": 0, "b": 1}, 0).values()) == {0, 1}
    token = _PASSED.set(True)
    try:
        assert [routes.get("a") for _ in range(3)] == [0, 0, 0]  # served where it was passed to
    finally:
        _PASSED.reset(token)


def test_metrics_of_shards_that_share_a_model_carry_the_shard_label():
    a = b'# HELP ppipe_requests_total n\n# TYPE ppipe_requests_total counter\nppipe_requests_total{model="a"} 1.0\nup 1\n'
    b = b'# HELP ppipe_requests_total n\n# TYPE ppipe_requests_total counter\nppipe_requests_total{model="a"} 2.0\nup 1\n'
    text = merge_metrics([a, b], shards=[0, 1]).decode()
    assert 'ppipe_requests_total{model="a",shard="0"} 1.0' in text and 'ppipe_requests_total{model="a",shard="1"} 2.0' in text
    assert 'up{shard="0"} 1' in text and text.count("# TYPE ppipe_requests_total") == 1



def test_metrics_of_shards_with_one_down_keep_the_others_series_and_say_which_is_down():
    """Shard 1 did not answer (its process is being restarted): shard 0's and 2's series are
    kept, and ppipe_shard_up says 1 for them, 0 for shard 1; with the shard label (a model on
    several shards) the gauge's own label is not doubled."""
    a = b'# HELP ppipe_requests_total n\n# TYPE ppipe_requests_total counter\nppipe_requests_total{model="a"} 1.0\n'
    c = b'# HELP ppipe_requests_total n\n# TYPE ppipe_requests_total counter\nppipe_requests_total{model="c"} 3.0\n'
    up = {0: True, 1: False, 2: True}
    text = merge_metrics([a, c], up=up).decode()
    assert 'ppipe_requests_total{model="a"} 1.0' in text and 'ppipe_requests_total{model="c"} 3.0' in text
    assert text.count("# TYPE ppipe_shard_up gauge") == 1
    lines = text.splitlines()
    assert [line for line in lines if line.startswith("ppipe_shard_up")] == [
        'ppipe_shard_up{shard="0"} 1', 'ppipe_shard_up{shard="1"} 0', 'ppipe_shard_up{shard="2"} 1']
    assert lines.index("# TYPE ppipe_shard_up gauge") < lines.index('ppipe_shard_up{shard="0"} 1')
    labelled = merge_metrics([a, c], shards=[0, 2], up=up).decode()
    assert 'ppipe_requests_total{model="c",shard="2"} 3.0' in labelled and 'ppipe_shard_up{shard="1"} 0' in labelled
    assert "ppipe_shard_up" not in merge_metrics([a, c]).decode()  # only where the caller says which shards answered


def test_a_shard_answers_metrics_of_the_shards_that_are_up_while_another_is_down(tmp_path):
    """Shard 1 is down (None among the peers, as the supervisor tells it while it restarts):
    shard 0's /metrics is 200 with a's series and ppipe_shard_up 1 for shard 0, 0 for shard 1;
    a bad token still gets 401; readiness is still merge_readiness's (ready: a is)."""
    from ppipe.runtime.ingress.protocol import encode_infer_request

    srv0, r0, srv1, r1 = _two_shards(tmp_path)
    auth = {"authorization": "Bearer t0k"}
    with srv0, srv1, httpx.Client(base_url=srv0.url, timeout=30) as c:
        r0.set_peers([r0.address, r1.address])
        r1.set_peers([r0.address, r1.address])
        body, headers = encode_infer_request({"input": np.full((1, 3, 8, 8), 3.0, np.float32)}, binary=True)
        served = c.post("/v2/models/a/infer", content=body, headers={**headers, **auth}).status_code
        both = c.get("/metrics", headers=auth)
        r0.set_peers([r0.address, None])
        one = c.get("/metrics", headers=auth)
        no_token = c.get("/metrics")
        ready = c.get("/v2/health/ready").status_code
    assert served == 200 and both.status_code == 200
    assert 'ppipe_shard_up{shard="0"} 1' in both.text and 'ppipe_shard_up{shard="1"} 1' in both.text
    assert one.status_code == 200, one.text
    assert 'ppipe_requests_total{code="200",model="a"} 1.0' in one.text and 'model="b"' not in one.text
    assert 'ppipe_shard_up{shard="0"} 1' in one.text and 'ppipe_shard_up{shard="1"} 0' in one.text
    assert no_token.status_code == 401 and ready == 200

def test_shards_of_one_split_model_deal_rest_and_grpc_requests_by_capacity(tmp_path):
    """Model a on two shards (each its server's sub-plan) weighted 2 : 1; six REST requests
    to shard 0 and six gRPC calls to shard 1: each shard deals what it receives (0, 1, 0 per
    three), a passed call is served where it lands, and the merged metrics say per shard."""
    tg = pytest.importorskip("tritonclient.grpc")
    from ppipe.runtime.control.shard_plan import shard_layout
    from ppipe.runtime.ingress.protocol import encode_infer_request

    plan, _ = _split_plan(tmp_path)
    layout = shard_layout(plan, 2, "servers")
    routes = {"a": [(0, 2.0), (1, 1.0)]}
    (srv0, r0), (srv1, r1) = (_shard_server(p, tmp_path, ["a"], i, routes, grpc=True) for i, p in enumerate(layout.plans))
    auth = {"authorization": "Bearer t0k"}
    with srv0, srv1:
        r0.set_peers([r0.address, r1.address])
        r1.set_peers([r0.address, r1.address])
        body, headers = encode_infer_request({"input": np.full((1, 3, 8, 8), 3.0, np.float32)}, binary=True)
        with httpx.Client(base_url=srv0.url, timeout=30) as c:
            rest = [c.post("/v2/models/a/infer", content=body, headers={**headers, **auth}).status_code for _ in range(6)]
        client = tg.InferenceServerClient(f"127.0.0.1:{r1.grpc_server.port}")
        x = tg.InferInput("input", [1, 3, 8, 8], "FP32")
        x.set_data_from_numpy(np.full((1, 3, 8, 8), 3.0, np.float32))
        grpc_ok = [client.infer("a", [x], headers=auth).as_numpy("y").shape for _ in range(6)]
        client.close()
        metrics = httpx.get(srv1.url + "/metrics", headers=auth, timeout=30).text
        ready = httpx.get(srv1.url + "/v2/health/ready", timeout=30).status_code
    assert rest == [200] * 6 and grpc_ok == [(1, 3, 8, 8)] * 6 and ready == 200, grpc_ok
    assert 'ppipe_requests_total{code="200",model="a",shard="0"} 8.0' in metrics, metrics
    assert 'ppipe_requests_total{code="200",model="a",shard="1"} 4.0' in metrics


def test_serve_refuses_a_split_by_servers_that_the_plan_does_not_take_and_replan_with_it(tmp_path):
    from click.testing import CliRunner

    from ppipe.cli import main

    plan, _ = _split_plan(tmp_path)
    cut = plan.model_copy(update={"placement": [pl.model_copy(update={"server": f"h-{pl.partition}", "gpu_index": pl.replica})
                                                for pl in plan.placement]})
    cut.save(tmp_path / "cut.yaml")
    r = CliRunner().invoke(main, ["serve", str(tmp_path / "cut.yaml"), "--shards", "2", "--shard-by", "servers", "--backend", "emulated"])
    assert r.exit_code == 2, r.output
    assert "do not split well into 2 shards" in r.output and "kept: a 0%" in r.output and "--shard-by models" in r.output
    plan.save(tmp_path / "plan.yaml")
    r = CliRunner().invoke(main, ["serve", str(tmp_path / "plan.yaml"), "--shards", "2", "--shard-by", "servers",
                                  "--backend", "emulated", "--replan", "auto"])
    assert r.exit_code == 2 and "--replan auto cannot run with --shard-by servers" in r.output, r.output


@pytest.mark.slow
def test_ppipe_serve_splits_one_models_servers_over_two_shards(tmp_path):
    """`ppipe serve --shards 2 --shard-by servers`, local launcher: model a's two servers, one
    per shard (each starts its own server's workers). REST requests and gRPC calls on fresh
    connections are all answered, both shards serve some (the merged metrics' shard label),
    the start-up log says what each shard holds, and `ppipe apply`'s request is refused
    (409, why), and so is SIGHUP's, while the plan serves on."""
    import signal

    plan, _ = _split_plan(tmp_path)
    plan.save(tmp_path / "plan.yaml")
    port, grpc_port = _free_ports(2)
    proc = _serve_two_shards(tmp_path, port, "--shard-by", "servers", "--grpc-port", str(grpc_port), "--token", "t0k")
    url, auth = f"http://127.0.0.1:{port}", {"authorization": "Bearer t0k"}
    request = {"inputs": [{"name": "input", "shape": [1, 3, 8, 8], "datatype": "FP32", "data": [0.0] * 192}]}
    try:
        assert len(_shard_processes(proc)) == 1
        codes, drops = [], []
        for _ in range(12):
            for _try in range(3):  # an explicit drop on a loaded host (503 with its reason) is sent again, twice at most
                r = httpx.post(f"{url}/v2/models/a/infer", json=request, headers=auth, timeout=30)
                if r.status_code != 503:
                    break
                drops.append(r.headers.get("ppipe-drop-reason"))
            codes.append(r.status_code)
        grpc_ok = sum(_grpc_infer_on_a_new_channel(f"127.0.0.1:{grpc_port}", "a", auth) for _ in range(4))
        metrics = httpx.get(url + "/metrics", headers=auth, timeout=10).text
        switch = httpx.post(url + "/v2/admin/plan", content=(tmp_path / "plan.yaml").read_text(),
                            headers={**auth, "content-type": "application/yaml"}, timeout=60)
        proc.send_signal(signal.SIGHUP)  # refused too: logged, and the plan serves on
        after = httpx.post(f"{url}/v2/models/a/infer", json=request, headers=auth, timeout=30).status_code
        status = httpx.get(url + "/v2/admin/plan", headers=auth, timeout=30).json()
    finally:
        out = _stop_and_leave_nothing(proc)
    assert codes == [200] * 12 and grpc_ok == 4, (codes, grpc_ok, out[-3000:])
    assert all(drops) and len(drops) <= 3, drops
    served = {k: sum(float(line.rsplit(" ", 1)[1]) for line in metrics.splitlines()
                     if line.startswith("ppipe_requests_total{") and 'code="200"' in line and f'shard="{k}"' in line)
              for k in ("0", "1")}
    assert served["0"] > 0 and served["1"] > 0 and served["0"] + served["1"] >= 16, (served, metrics)
    assert switch.status_code == 409 and "--shard-by servers" in switch.json()["error"] and after in (200, 503)
    assert status["models"] == ["a"] and status["vgpus"] == 4 and status["switches"] == []
    assert "is not served" in out and "does not switch plans live" in out  # SIGHUP's refusal, in the log
    assert "2 shards by servers:" in out and "shard 0: a 50% on 1 server (h-0)" in out and "shard 1: a 50% on 1 server (h-1)" in out
    assert "Traceback" not in out
