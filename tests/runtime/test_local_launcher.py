"""The local launcher (ppipe.runtime.launch.local): a plan's workers as processes of this machine, no Ray.

The handles' calls and lifelines over the private socket pairs, start-up errors, a served
plan (`ppipe serve`'s default on one machine) whose killed worker is re-created, and no
worker process left behind when the server goes.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import psutil
import pytest

from ppipe.errors import UserError
from ppipe.runtime.launch.deploy import load_deployment
from ppipe.runtime.launch.handle import WorkerGone
from ppipe.runtime.launch import local
from ppipe.runtime.launch.local import PRELOAD, PROCESS_NAME, start_local_workers
from ppipe.runtime.timerslack import SERVING_TIMER_SLACK_NS
from ppipe.spec.cluster import load_cluster

from .conftest import make_plan
from .raynodes import free_port


@pytest.fixture(scope="module")
def two_stage(tinynet, tmp_path_factory):
    plan = make_plan(tinynet, load_cluster("local-cpu"), [(0, 1, "cpu", 2, 1), (2, 2, "cpu", 2, 1)], slo_ms=400.0)
    path = tmp_path_factory.mktemp("local") / "plan.yaml"
    plan.save(path)
    return load_deployment(path)


def test_each_worker_is_a_process_of_its_own_that_answers_the_handles_calls(two_stage):
    workers = start_local_workers(two_stage, backend="emulated")
    try:
        pids = {h.pid for h in workers.values()}
        assert len(pids) == len(workers) == len(two_stage.plan.placement) and os.getpid() not in pids
        if sys.platform.startswith("linux"):  # its serving thread waits on a serving thread's timer slack
            assert {int(Path(f"/proc/{p}/timerslack_ns").read_text()) for p in pids} == {SERVING_TIMER_SLACK_NS}
        assert all(h.info["vgpu_id"] == v and h.info["pid"] == h.pid for v, h in workers.items())

        async def main():
            addrs = [await h.open_data_path("tcp://127.0.0.1:9") for h in workers.values()]
            assert all(a.startswith("tcp://127.0.0.1:") for a in addrs)
            assert [await h.drop_peer("nobody") for h in workers.values()] == [0, 0]
            pings = await asyncio.gather(*(h.ping() for h in workers.values()))
            assert {p["pid"] for p in pings} == pids

        asyncio.run(main())
    finally:
        for h in workers.values():
            h.kill()


def test_a_worker_process_imports_at_start_only_what_its_fork_server_preloaded():
    """Each worker is forked from the fork server, so what the server has imported costs a
    worker nothing; what the worker's own start imports beyond that, every worker pays
    again (a plan switch starts dozens at once, on the cores that serve). Every module the
    worker's start-up code imports is already in ``sys.modules`` after ``PRELOAD``."""
    import ast
    import inspect

    starting = [local._worker_main, local._loop_factory, local._serve_host]
    imported = sorted({node.module if isinstance(node, ast.ImportFrom) else alias.name
                       for f in starting for node in ast.walk(ast.parse(inspect.getsource(f)))
                       if isinstance(node, (ast.Import, ast.ImportFrom)) for alias in node.names})
    probe = f"import sys; [__import__(m) for m in {PRELOAD!r}]; print([m for m in {imported!r} if m not in sys.modules])"
    missing = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True).stdout.strip()
    assert imported and missing == "[]", f"imported by every worker at start, not preloaded: {missing}"


def test_a_killed_worker_ends_its_lifeline_and_its_calls(two_stage):
    handle = next(iter(start_local_workers(two_stage, backend="emulated").values()))

    async def main():
        life = asyncio.ensure_future(handle.lifeline())
        await asyncio.sleep(0.05)
        assert not life.done()
        fds = len(os.listdir("/proc/self/fd"))
        handle.kill()
        with pytest.raises(WorkerGone, match="exit code -9"):
            await asyncio.wait_for(life, 5)
        # its pair and its sentinel pipe are closed: a server that re-creates workers keeps no fd of the dead
        assert len(os.listdir("/proc/self/fd")) <= fds - 2
        handle.kill()  # again: nothing
        with pytest.raises(WorkerGone):
            await handle.connect_peers([])

    asyncio.run(main())
    assert not psutil.pid_exists(handle.pid) or psutil.Process(handle.pid).status() == psutil.STATUS_ZOMBIE


def test_a_worker_exits_when_its_host_closes_the_pair(two_stage):
    handle = next(iter(start_local_workers(two_stage, backend="emulated").values()))
    handle._calls._sock.close()  # as the host's process ending would
    handle.process.join(5)
    assert handle.process.exitcode == 0


def test_a_worker_that_cannot_build_its_backend_is_a_user_error_and_nothing_is_left(two_stage, tmp_path):
    before = {p.pid for p in psutil.Process().children(recursive=True)}
    pytest.importorskip("onnxruntime")
    try:
        import tensorrt  # noqa: F401
        pytest.skip("tensorrt is installed: its backend would build")
    except ImportError:
        pass
    with pytest.raises(UserError) as err:  # raised in the worker's process, with its message and fix
        start_local_workers(two_stage, backend="tensorrt")
    assert "tensorrt" in str(err.value).lower() and err.value.fix
    time.sleep(0.2)
    left = [p for p in psutil.Process().children(recursive=True) if p.pid not in before and p.name() == PROCESS_NAME]
    assert not [p for p in left if p.status() != psutil.STATUS_ZOMBIE]


# ---- `ppipe serve` on one machine ---------------------------------------------------------------------------
def without_ray(tmp_path: Path) -> dict:
    """An environment in which ``import ray`` fails in every process (the server, its fork
    server, its workers), as on a machine where the extra ppipe[ray] is not installed."""
    (tmp_path / "ray").mkdir()
    (tmp_path / "ray" / "__init__.py").write_text('raise ImportError("no Ray here (the test blocks it)")\n')
    return {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(tmp_path), os.environ.get("PYTHONPATH")]))}


def _serve(plan: Path, port: int, *flags: str, env: dict | None = None) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "ppipe.cli", "serve", str(plan), "--backend", "emulated", "--port", str(port), *flags],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True, env=env)


def _wait_ready(url: str, proc: subprocess.Popen, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        assert proc.poll() is None, proc.stdout.read()
        try:
            if httpx.get(f"{url}/v2/health/ready", timeout=1).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.1)
    raise AssertionError("not ready in time")


def _workers(server: psutil.Process) -> list[psutil.Process]:
    return [p for p in server.children(recursive=True) if p.name() == PROCESS_NAME]


def _infer(url: str, tinynet) -> httpx.Response:
    body = {"inputs": [{"name": "input", "shape": [1, 3, 8, 8], "datatype": "FP32", "data": [0.0] * 192}]}
    return httpx.post(f"{url}/v2/models/{tinynet.name}/infer", json=body, timeout=10)


def test_ppipe_serve_runs_its_workers_locally_without_ray_and_recreates_a_killed_one(two_stage, tinynet, tmp_path):
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    proc = _serve(Path(two_stage.plan_file), port, "--report-tolerance-ms", "-1", env=without_ray(tmp_path))
    try:
        _wait_ready(url, proc)
        server = psutil.Process(proc.pid)
        workers = _workers(server)
        names = " ".join(" ".join(p.cmdline()) for p in server.children(recursive=True))
        assert "raylet" not in names and "gcs_server" not in names
        assert len(workers) == len(two_stage.plan.placement)
        for _ in range(5):  # the first, cold request may be dropped (503 with its reason) on a busy host
            if _infer(url, tinynet).status_code == 200:
                break
        answers = [_infer(url, tinynet) for _ in range(5)]
        assert all(r.status_code == 200 for r in answers), [(r.status_code, r.text[:200]) for r in answers]
        victim = workers[0]
        victim.kill()
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:  # re-created: a new process, and the plan served again
            time.sleep(0.3)
            alive = {p.pid for p in _workers(server)}
            if victim.pid not in alive and len(alive) == len(workers) and _infer(url, tinynet).status_code == 200:
                break
        else:
            raise AssertionError("the killed worker was not re-created")
        metrics = httpx.get(f"{url}/metrics", timeout=5).text
        failed = [ln for ln in metrics.splitlines() if ln.startswith("ppipe_vgpu_failed{")]
        assert failed and all(ln.endswith(" 0.0") for ln in failed), failed
    finally:
        children = psutil.Process(proc.pid).children(recursive=True) if proc.poll() is None else []
        proc.send_signal(signal.SIGTERM)
        out, _ = proc.communicate(timeout=30)  # EOF: no process of the server holds its stdout any more
    assert "local launcher" in out, out
    assert re.search(r"ready \d+\.\d s after start \(warmed up in \d+\.\d\d s: \d+ requests of zeros", out), out
    time.sleep(0.5)
    assert not [p for p in children if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]


def test_the_local_launcher_refuses_what_takes_ray(two_stage):
    from click.testing import CliRunner

    from ppipe.cli import main

    for flags, says in ((["--launcher", "local", "--ray-address", "auto"], "--ray-address"),
                        (["--launcher", "local", "--transport", "ring"], "--transport ring")):
        r = CliRunner().invoke(main, ["serve", two_stage.plan_file, "--backend", "emulated", *flags])
        assert r.exit_code == 2 and says in r.output, r.output


def test_serving_with_ray_where_it_is_not_installed_names_the_extra(two_stage, tmp_path):
    r = subprocess.run([sys.executable, "-m", "ppipe.cli", "serve", two_stage.plan_file, "--backend", "emulated", "--launcher", "ray"],
                       capture_output=True, text=True, env=without_ray(tmp_path), timeout=60)
    assert r.returncode == 2, r.stdout + r.stderr
    assert "ppipe[ray]" in r.stderr and "--launcher local" in r.stderr and "Traceback" not in r.stderr, r.stderr
