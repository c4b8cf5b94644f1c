"""``ppipe serve --ingress N``: ingress processes on the port, the server's process schedules.

tinynet's two stages on the ``ort`` backend (every answer checked against the whole model),
served by the real command under the local launcher: the answers, which process served
them, metrics of every process on any ingress, a plan switch asked of the ingresses'
port under load (every request answered once, every ingress serving the new plan, and one
restarted after the switch too), a killed ingress restarted while the other serves on, and
nothing left after SIGTERM.
"""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import numpy as np
import psutil
import pytest
from click.testing import CliRunner

from ppipe.runtime.client.httpclient import wait_until_ready
from ppipe.runtime.ingress.protocol import decode_infer_response, encode_infer_request
from ppipe.runtime.launch.local_ingresses import PROCESS_NAME

from ppipe.spec.cluster import load_cluster

from .conftest import make_plan
from .raynodes import free_port
from .test_local_launcher import two_stage  # noqa: F401  (the fixture: tinynet's two stages, SLO 400 ms)
from .tinynet import reference

TOKEN = "s3cret"
AUTH = {"authorization": f"Bearer {TOKEN}"}


def _serve(plan: str, port: int, *flags: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "ppipe.cli", "serve", plan, "--backend", "ort", "--port", str(port),
                             "--token", TOKEN, "--report-tolerance-ms", "-1", *flags],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)


def _ingresses(server: psutil.Process) -> list[psutil.Process]:
    # the server starts them; their own children (a decode pool) may carry the name too
    return [p for p in server.children() if _named(p, PROCESS_NAME)]


def _infer(url: str, x: np.ndarray) -> tuple[int, np.ndarray | str]:
    """One request of ``x``'s samples on a connection of its own (so the kernel deals it to any ingress)."""
    return _infer_model(url, "tinynet", x)


def _check_grpc(port: int, x: np.ndarray, directory) -> None:
    """One gRPC request (tritonclient, where installed) through the ingresses' gRPC port."""
    tg = pytest.importorskip("tritonclient.grpc")
    client = tg.InferenceServerClient(f"127.0.0.1:{port}")
    try:
        t = tg.InferInput("input", list(x.shape), "FP32")
        t.set_data_from_numpy(x)
        out = client.infer("tinynet", [t], headers=AUTH).as_numpy("logits")
    finally:
        client.close()
    np.testing.assert_allclose(out, reference(directory, x), rtol=2e-2, atol=2e-2)


def _served_by(metrics: str) -> dict[str, float]:
    """process -> its count of 200 answers, from the merged /metrics."""
    out: dict[str, float] = {}
    for line in metrics.splitlines():
        if line.startswith("ppipe_requests_total{") and 'code="200"' in line:
            process = line.split('process="')[1].split('"')[0]
            out[process] = out.get(process, 0.0) + float(line.rsplit(" ", 1)[1])
    return out


def _slos_seen(url: str, n: int = 8) -> set[float]:
    """The SLO tinynet's metadata gives on ``n`` fresh connections (dealt to any ingress)."""
    seen = set()
    for _ in range(n):
        with httpx.Client(timeout=10) as c:
            seen.add(c.get(f"{url}/v2/models/tinynet", headers=AUTH).json()["parameters"]["slo_ms"])
    return seen


def _switch_under_load(url: str, new_plan: Path, xs: list[np.ndarray]):
    """``ppipe apply new_plan`` through the ingresses' port while requests of ``xs`` keep
    coming; returns (the apply's result, every request's (code, out))."""
    from ppipe.cli import main

    with ThreadPoolExecutor(4) as pool:
        answers = [pool.submit(_infer, url, x) for x in xs]
        time.sleep(0.3)
        applied = CliRunner().invoke(main, ["apply", str(new_plan), "--url", url, "--token", TOKEN])
        answers += [pool.submit(_infer, url, x) for x in xs]
        return applied, [a.result() for a in answers]


def test_ingress_processes_answer_with_the_models_outputs_and_one_restarts_while_the_other_serves(two_stage, tmp_path):
    new_plan = tmp_path / "one-stage.yaml"  # the same model, one partition, a new SLO
    make_plan(two_stage.profiles["tinynet"], load_cluster("local-cpu"), [(0, 2, "cpu", 1, 1)], slo_ms=300.0).save(new_plan)
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    directory = two_stage.profiles["tinynet"].directory
    grpc_port = free_port()
    proc = _serve(two_stage.plan_file, port, "--ingress", "2", "--grpc-port", str(grpc_port))
    try:
        wait_until_ready(url, proc, timeout_s=90)
        server = psutil.Process(proc.pid)
        ingresses = _ingresses(server)
        assert len(ingresses) == 2
        rng = np.random.default_rng(0)
        xs = [rng.normal(0, 1, (1 + i % 3, 3, 8, 8)).astype(np.float32) for i in range(24)]
        with ThreadPoolExecutor(4) as pool:
            answers = list(pool.map(lambda x: _infer(url, x), xs))
        for x, (code, out) in zip(xs, answers):
            assert code == 200, out
            np.testing.assert_allclose(out, reference(directory, x), rtol=2e-2, atol=2e-2)

        _check_grpc(grpc_port, xs[4], directory)

        time.sleep(2.5)  # the ingresses' metrics reach the scheduler, and the merge comes back
        metrics = httpx.get(f"{url}/metrics", headers=AUTH, timeout=5).text
        served = _served_by(metrics)
        assert set(served) <= {"ingress-0", "ingress-1"} and sum(served.values()) == len(xs) + 1, served  # + gRPC's
        assert 'process="scheduler"' in metrics and "ppipe_batch_size" in metrics

        assert _slos_seen(url) == {400.0}
        no_token = httpx.post(f"{url}/v2/admin/plan", content=new_plan.read_text(), timeout=10)
        assert no_token.status_code == 401, no_token.text  # refused by the ingress itself
        applied, answers = _switch_under_load(url, new_plan, xs)
        assert applied.exit_code == 0 and "1 started" in applied.output, applied.output
        for x, (code, out) in zip(xs + xs, answers):
            assert code == 200, out
            np.testing.assert_allclose(out, reference(directory, x), rtol=2e-2, atol=2e-2)
        status = httpx.get(f"{url}/v2/admin/plan", headers=AUTH, timeout=5).json()
        assert status["models"] == ["tinynet"] and len(status["switches"]) == 1 and status["vgpus"] == 1, status
        assert _slos_seen(url) == {300.0}  # both ingresses serve the new plan

        victim = ingresses[0]
        victim.kill()
        deadline = time.monotonic() + 30  # the other serves on meanwhile; the dead one comes back
        while time.monotonic() < deadline:
            code, out = _infer(url, xs[0])
            assert code == 200, out  # the kernel deals new connections to the listeners that are left
            alive = _ingresses(server)
            if len(alive) == 2 and victim.pid not in {p.pid for p in alive}:
                break
            time.sleep(0.2)
        else:
            raise AssertionError("the killed ingress was not restarted")
        with ThreadPoolExecutor(4) as pool:
            assert all(code == 200 for code, _ in pool.map(lambda x: _infer(url, x), xs[:8]))
        assert _slos_seen(url, 12) == {300.0}  # the restarted ingress too: the scheduler told it at its hello
    finally:
        children = psutil.Process(proc.pid).children(recursive=True) if proc.poll() is None else []
        proc.send_signal(signal.SIGTERM)
        out, _ = proc.communicate(timeout=40)
    assert "2 ingress processes" in out, out
    time.sleep(0.5)
    assert not [p for p in children if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]


def _post(url: str, model: str, x: np.ndarray) -> tuple[int, str]:
    body, headers = encode_infer_request({"input": x}, binary=True)
    with httpx.Client(timeout=30) as c:
        r = c.post(f"{url}/v2/models/{model}/infer", content=body, headers={**headers, **AUTH})
    return r.status_code, "" if r.status_code == 200 else r.json()["error"]


def _shards(server: psutil.Process) -> list[psutil.Process]:
    out = []
    for p in server.children():
        try:
            if "ppipe.runtime.launch.local_shards" in " ".join(p.cmdline()):
                out.append(p)
        except psutil.NoSuchProcess:
            pass
    return out


@pytest.mark.slow
def test_ingresses_send_each_models_requests_to_its_own_scheduler_and_a_dead_one_is_refused_until_it_is_back(tmp_path):
    """``--ingress 2 --shards 2``: models a and b, each scheduled by its own process (shard 0
    is the server's, shard 1 a process of its own); two ingress processes hold the port and
    send each request to its model's scheduler. Every answer is the model's; the merged
    /metrics has every process, both schedulers'; ``ppipe apply`` of new SLOs through the
    port switches both schedulers, and every ingress serves both models' new SLO; SIGKILL of shard 1: a is served
    throughout, b is refused 503 ``shard-down`` (never a hang) until the restarted shard
    schedules it, and every ingress then sends b there."""
    plan = _two_models_on_two_cpus(tmp_path)
    plan.save(tmp_path / "plan.yaml")
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    proc = _serve(str(tmp_path / "plan.yaml"), port, "--ingress", "2", "--shards", "2")
    rng = np.random.default_rng(1)
    xs = [rng.normal(0, 1, (1 + i % 2, 3, 8, 8)).astype(np.float32) for i in range(8)]
    try:
        wait_until_ready(url, proc, timeout_s=90)
        server = psutil.Process(proc.pid)
        assert len(_ingresses(server)) == 2
        (victim,) = _shards(server)
        for m in ("a", "b"):
            with ThreadPoolExecutor(4) as pool:
                answers = list(pool.map(lambda x: _infer_model(url, m, x), xs))
            for x, (code, out) in zip(xs, answers):
                assert code == 200, out
                np.testing.assert_allclose(out, reference(tmp_path / m, x), rtol=2e-2, atol=2e-2)
        time.sleep(2.5)  # every process's metrics reach scheduler 0, and the merge comes back
        metrics = httpx.get(f"{url}/metrics", headers=AUTH, timeout=5).text
        batches = {p: _count(metrics, "ppipe_batch_size_count", p) for p in ("scheduler", "scheduler-1")}
        assert batches["scheduler"] > 0 and batches["scheduler-1"] > 0, batches  # a's batches there, b's here

        from ppipe.cli import main

        slower = plan.model_copy(update={"models": [m.model_copy(update={"slo_ms": 300.0}) for m in plan.models]})
        slower.save(tmp_path / "slower.yaml")
        applied = CliRunner().invoke(main, ["apply", str(tmp_path / "slower.yaml"), "--url", url, "--token", TOKEN])
        assert applied.exit_code == 0, applied.output
        for m in ("a", "b"):
            seen = set()
            for _ in range(8):
                with httpx.Client(timeout=10) as c:
                    seen.add(c.get(f"{url}/v2/models/{m}", headers=AUTH).json()["parameters"]["slo_ms"])
            assert seen == {300.0}, (m, seen)

        victim.kill()
        victim.wait(timeout=30)
        answers = {"a": [], "b": []}
        for _ in range(400):  # b is back once the new shard schedules it (seconds); a bound, not a time
            for m in ("a", "b"):
                answers[m].append(_post(url, m, xs[0]))
            if len(answers["b"]) > len(xs) and all(code == 200 for code, _ in answers["b"][-len(xs):]):
                break  # each ingress takes the new inbox as its own loop reads scheduler 0's word: one may lag the other
        (restarted,) = _shards(server)
        assert restarted.pid != victim.pid
        served = [_post(url, "b", x) for x in xs]
        assert all(code == 200 for code, _ in served), served  # on fresh connections: both ingresses know the new shard

        dead = _ingresses(server)[0]
        dead.kill()  # every scheduler forgets it (shard 1 told by shard 0); the other ingress serves both models meanwhile
        deadline, back = time.monotonic() + 60, False
        while time.monotonic() < deadline and not back:
            assert all(_post(url, m, xs[0])[0] == 200 for m in ("a", "b"))
            time.sleep(0.2)
            pids = {p.pid for p in _ingresses(server)}  # one listing decides (two could disagree while the restart forks)
            back = len(pids) == 2 and dead.pid not in pids
        after = [_post(url, m, x) for m in ("a", "b") for x in xs] if back else []
    finally:
        out = _stop(proc)
    assert back and all(code == 200 for code, _ in after), ([a for a in after if a[0] != 200], out[-4000:])
    refused = [(code, why) for code, why in answers["b"] if code != 200]
    assert refused and all(code == 503 and "scheduler 1 of this server" in why for code, why in refused), [r for r in refused if "scheduler 1 of this server" not in r[1]]
    assert sum(code == 200 for code, _ in answers["a"]) >= len(answers["a"]) - 2, answers["a"]
    assert "2 ingress processes" in out and "Traceback" not in out, out[-3000:]


TWO_CPUS = """
version: 1
name: two-cpus
bandwidth_efficiency: 1.0
gpu_types:
- {name: cpu, vgpu_levels: [1, 2]}
servers:
- {name: h, gpu_type: cpu, gpus_per_server: 2, count: 1, nic_bandwidth_gbps: 10}
"""


def _two_models_on_two_cpus(tmp_path):
    """Models a and b (tinynet profiles), one partition each, on the two CPU 'GPUs' of one
    server (the cluster TWO_CPUS, saved as cluster.yaml beside the plan). Batch 1: a lone
    request is dispatched at once, not held for a batch until its last moment, where a wake
    that this busy host runs late would drop it (these tests are about the shards)."""
    from ppipe.planner.placement import place

    from .tinynet import write_tinynet

    (tmp_path / "cluster.yaml").write_text(TWO_CPUS)
    cluster = load_cluster(tmp_path / "cluster.yaml")
    models = [make_plan(write_tinynet(tmp_path / m, name=m), cluster, [(0, 2, "cpu", 1, 1)], batch=1).models[0] for m in ("a", "b")]
    plan = make_plan(write_tinynet(tmp_path / "a", name="a"), cluster, [(0, 2, "cpu", 1, 1)], batch=1)
    return plan.model_copy(update={"models": models, "placement": place(models, cluster), "cluster_file": "cluster.yaml"})


def _infer_model(url: str, model: str, x: np.ndarray) -> tuple[int, np.ndarray | str]:
    """One request of ``x``'s samples for ``model`` on a connection of its own: (200, its logits) or (status, body)."""
    body, headers = encode_infer_request({"input": x}, binary=True)
    with httpx.Client(timeout=30) as c:
        r = c.post(f"{url}/v2/models/{model}/infer", content=body, headers={**headers, **AUTH})
    if r.status_code != 200:
        return r.status_code, r.text
    return 200, decode_infer_response(r.content, r.headers.get("inference-header-content-length"))["logits"]


def _count(metrics: str, name: str, process: str) -> float:
    return sum(float(line.rsplit(" ", 1)[1]) for line in metrics.splitlines()
               if line.startswith(name) and f'process="{process}"' in line)


def _stop(proc: subprocess.Popen) -> str:
    children = psutil.Process(proc.pid).children(recursive=True) if proc.poll() is None else []
    proc.send_signal(signal.SIGTERM)
    out, _ = proc.communicate(timeout=60)
    time.sleep(0.5)
    left = [p for p in children if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]
    assert not left, [(p.pid, p.cmdline()) for p in left]
    return out


@pytest.mark.slow
def test_ingresses_deal_a_models_requests_over_the_schedulers_of_its_servers(tmp_path):
    """``--ingress 2 --shards 2 --shard-by servers``: model a's two servers, each scheduled by
    its own process; the ingresses deal a's requests over both by capacity (both schedulers
    run batches), and every answer is the model's."""
    from .test_shards import _split_plan

    plan, _ = _split_plan(tmp_path)
    plan.save(tmp_path / "plan.yaml")
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    proc = _serve(str(tmp_path / "plan.yaml"), port, "--ingress", "2", "--shards", "2", "--shard-by", "servers")
    rng = np.random.default_rng(2)
    xs = [rng.normal(0, 1, (1, 3, 8, 8)).astype(np.float32) for _ in range(16)]
    drops = []

    def infer(x):  # an explicit drop on a loaded host (503 with its reason) is sent again, twice at most
        for _try in range(3):
            code, got = _infer_model(url, "a", x)
            if code != 503:
                break
            drops.append(got)
        return code, got

    try:
        wait_until_ready(url, proc, timeout_s=90)
        with ThreadPoolExecutor(4) as pool:
            answers = list(pool.map(infer, xs))
        time.sleep(2.5)
        metrics = httpx.get(f"{url}/metrics", headers=AUTH, timeout=5).text
        meta = httpx.get(f"{url}/v2/models/a", headers=AUTH, timeout=5).json()["parameters"]
    finally:
        out = _stop(proc)
    assert meta["planned_throughput_rps"] == pytest.approx(plan.model("a").throughput_rps), meta  # both halves of a
    for x, (code, got) in zip(xs, answers):
        assert code == 200, got
        np.testing.assert_allclose(got, reference(tmp_path / "a", x), rtol=2e-2, atol=2e-2)
    assert len(drops) <= 3 and all("dropped" in d for d in drops), drops
    batches = {p: _count(metrics, "ppipe_batch_size_count", p) for p in ("scheduler", "scheduler-1")}
    assert batches["scheduler"] > 0 and batches["scheduler-1"] > 0, batches
    assert "2 shards by servers" in out and "2 ingress processes" in out, out[-3000:]


@pytest.mark.ray
@pytest.mark.slow
def test_under_ray_ingresses_send_each_models_requests_to_its_own_scheduler_actor(tmp_path):
    """``--launcher ray --ingress 1 --shards 2``: an ingress on the (one) Ray node, shard 1 a
    Ray actor. Every answer is the model's, both schedulers run batches (the merged
    /metrics), ``ppipe apply`` through the port switches both, and SIGTERM leaves no ingress."""
    plan = _two_models_on_two_cpus(tmp_path)
    plan.save(tmp_path / "plan.yaml")
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    proc = _serve(str(tmp_path / "plan.yaml"), port, "--launcher", "ray", "--num-cpus", "2", "--ingress", "1", "--shards", "2")
    rng = np.random.default_rng(2)
    xs = [rng.normal(0, 1, (1 + i % 2, 3, 8, 8)).astype(np.float32) for i in range(6)]
    ingresses = []
    try:
        wait_until_ready(url, proc, timeout_s=120)
        ingresses = [p for p in psutil.Process(proc.pid).children(recursive=True) if _named(p, PROCESS_NAME)]
        for m in ("a", "b"):
            for x in xs:
                code, out = _infer_model(url, m, x)
                assert code == 200, out
                np.testing.assert_allclose(out, reference(tmp_path / m, x), rtol=2e-2, atol=2e-2)
        time.sleep(2.5)  # every process's metrics reach scheduler 0, and the merge comes back
        metrics = httpx.get(f"{url}/metrics", headers=AUTH, timeout=5).text
        assert _count(metrics, "ppipe_batch_size_count", "scheduler") > 0 and _count(metrics, "ppipe_batch_size_count", "scheduler-1") > 0

        from ppipe.cli import main

        slower = plan.model_copy(update={"models": [m.model_copy(update={"slo_ms": 300.0}) for m in plan.models]})
        slower.save(tmp_path / "slower.yaml")
        applied = CliRunner().invoke(main, ["apply", str(tmp_path / "slower.yaml"), "--url", url, "--token", TOKEN])
        assert applied.exit_code == 0, applied.output
        for m in ("a", "b"):
            assert httpx.get(f"{url}/v2/models/{m}", headers=AUTH, timeout=10).json()["parameters"]["slo_ms"] == 300.0
            assert _infer_model(url, m, xs[0])[0] == 200
    finally:
        proc.send_signal(signal.SIGTERM)
        out, _ = proc.communicate(timeout=90)
    assert len(ingresses) == 1, out[-3000:]
    time.sleep(1.0)
    assert not [p for p in ingresses if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]
    assert "1 ingress processes on every Ray node" in out and "2 shards" in out and "Traceback" not in out, out[-3000:]


def _named(p: psutil.Process, name: str) -> bool:
    try:
        return p.name() == name
    except psutil.NoSuchProcess:  # a process of a killed ingress's group that ended meanwhile
        return False
