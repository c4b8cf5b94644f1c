"""Real Ray nodes on this machine, as README "Several machines" starts them: ``ray start
--head`` and ``ray start --address`` processes on 127.0.0.1 with token authentication on,
and ``ppipe serve --ray-address auto`` as a subprocess. Used by
``tests/runtime/test_multinode.py`` and ``scripts/bench_node_loss.py``.

Every node has its own ``--temp-dir`` under this object's root, so its processes (and only
they: other Ray instances on the machine are left alone) are found by that path in their
command lines, with their descendants (the raylet's workers and agents). ``ray stop`` is
not used for the clean-up because it stops every Ray process of the machine.
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
RAY = str(Path(sys.executable).with_name("ray"))

# a 2-server cluster: each group pinned to its Ray node by its custom resource
CLUSTER_YAML = """
version: 1
name: two-machines
bandwidth_efficiency: 1.0
gpu_types:
- {name: cpu, vgpu_levels: [1, 2]}
servers:
- {name: l4, gpu_type: cpu, gpus_per_server: 2, count: 1, nic_bandwidth_gbps: 10, ray_resource: l4}
- {name: p4, gpu_type: cpu, gpus_per_server: 1, count: 1, nic_bandwidth_gbps: 10, ray_resource: p4}
"""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _children() -> dict[int, list[int]]:
    kids: dict[int, list[int]] = {}
    for d in os.listdir("/proc"):
        if not d.isdigit():
            continue
        try:
            with open(f"/proc/{d}/stat") as f:
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue
        kids.setdefault(ppid, []).append(int(d))
    return kids


def _cmdline(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


class RayStartFailed(RuntimeError):
    pass


class LocalRayNodes:
    """Ray nodes started with ``ray start`` under ``root``, token auth on as README says:
    ``RAY_AUTH_MODE=token`` in every command's environment and the token made by ``ray
    get-auth-token --generate`` in ``~/.ray/auth_token``, with ``HOME`` set to
    ``root/home`` (this machine's own ~/.ray is left alone; every "machine" here shares it,
    as if it had been copied to each)."""

    def __init__(self, root: Path):
        self.root = Path(root)
        self.root.mkdir(parents=True, exist_ok=True)
        self.home = self.root / "home"
        self.home.mkdir(exist_ok=True)
        self.port = free_port()
        self.address = f"127.0.0.1:{self.port}"
        self.nodes: dict[str, Path] = {}  # name -> its --temp-dir
        self.env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_")}
        self.env.update({
            "HOME": str(self.home),
            "RAY_AUTH_MODE": "token",
            "RAY_ADDRESS": self.address,  # what `--ray-address auto` finds first (not another Ray of this machine)
            "RAY_USAGE_STATS_ENABLED": "0",
            "PYTHONPATH": str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""),
        })
        r = self.ray("get-auth-token", "--generate")
        self.token_file = self.home / ".ray" / "auth_token"
        if r.returncode != 0 or not self.token_file.exists():
            raise RayStartFailed(f"ray get-auth-token --generate failed ({r.returncode}): {r.stderr[-2000:]}")
        self.token_file.chmod(0o600)

    def ray(self, *args: str, timeout: float = 120, env: dict | None = None) -> subprocess.CompletedProcess:
        return subprocess.run([RAY, *args], env=env or self.env, capture_output=True, text=True, timeout=timeout)

    def start_head(self, resources: dict[str, float], num_cpus: int = 1) -> None:
        tmp = self.nodes["head"] = self._tmp("head")  # before the start: a failed one may leave processes
        r = self.ray("start", "--head", "--node-ip-address=127.0.0.1", f"--port={self.port}", f"--num-cpus={num_cpus}",
                     f"--resources={json.dumps(resources)}", f"--temp-dir={tmp}", "--include-dashboard=false",
                     f"--dashboard-port={free_port()}", "--disable-usage-stats", f"--object-store-memory={100 * 1024 * 1024}")
        if r.returncode != 0:
            raise RayStartFailed(f"ray start --head failed ({r.returncode}): {(r.stderr or r.stdout)[-2000:]}")

    def start_node(self, name: str, resources: dict[str, float], num_cpus: int = 1, env: dict | None = None) -> subprocess.CompletedProcess:
        """``ray start --address`` of a second node; returns the finished process (check its returncode)."""
        tmp = self.nodes[name] = self.nodes.get(name) or self._tmp(name)
        r = self.ray("start", f"--address={self.address}", "--node-ip-address=127.0.0.1", f"--num-cpus={num_cpus}",
                     f"--resources={json.dumps(resources)}", f"--temp-dir={tmp}", "--disable-usage-stats",
                     f"--object-store-memory={100 * 1024 * 1024}", env=env)
        return r

    def _tmp(self, name: str) -> Path:
        # short: Ray's unix socket paths must stay under ~107 characters
        d = Path(f"/tmp/pn{os.getpid()}{secrets.token_hex(2)}{name[:4]}")
        d.mkdir(parents=True, exist_ok=True)
        return d

    def pids(self, name: str) -> list[int]:
        """The node's processes: those whose command line names its temp dir, and their descendants."""
        tmp = str(self.nodes[name])
        kids = _children()
        roots = [int(d) for d in os.listdir("/proc") if d.isdigit() and tmp in _cmdline(int(d))]
        out, todo = set(), list(roots)
        while todo:
            p = todo.pop()
            if p not in out and p != os.getpid():
                out.add(p)
                todo.extend(kids.get(p, []))
        return sorted(p for p in out if _alive(p))

    def pids_named(self, name: str, process_name: str) -> list[int]:
        """The node's processes named ``process_name`` (``ps``'s name, e.g. ``ppipe-ingress``)."""
        import psutil

        out = []
        for pid in self.pids(name):
            try:
                if psutil.Process(pid).name() == process_name:
                    out.append(pid)
            except psutil.NoSuchProcess:
                pass
        return out

    def kill_node(self, name: str, wait_s: float = 10.0) -> list[int]:
        """SIGKILL every process of node ``name`` (a machine that loses power); returns their pids."""
        pids = self.pids(name)
        for p in pids:
            try:
                os.kill(p, signal.SIGKILL)
            except ProcessLookupError:
                pass
        t0 = time.monotonic()
        while any(_alive(p) for p in pids) and time.monotonic() - t0 < wait_s:
            time.sleep(0.05)
        return pids

    def stop(self) -> None:
        """Kill every node, the head last (what `ray stop --force` does, for these nodes only)."""
        for name in [n for n in self.nodes if n != "head"] + (["head"] if "head" in self.nodes else []):
            self.kill_node(name)
        for tmp in self.nodes.values():  # the nodes' sessions and logs (outside root: short socket paths)
            shutil.rmtree(tmp, ignore_errors=True)

    def state(self) -> dict:
        """``{"nodes": [{id, alive, resources}], "actors": [{name, state, node}]}`` from the GCS,
        read by a driver joining with the token (``ray list actors`` shows the same, but needs
        the dashboard, which ``ray[default]`` installs)."""
        code = (
            "import json, ray; ray.init(address='auto', log_to_driver=False); from ray._private import state; "
            "print(json.dumps({'nodes': [{'id': n['NodeID'], 'alive': n['Alive'], 'resources': n['Resources']} for n in ray.nodes()], "
            "'actors': [{'name': a['Name'], 'state': a['State'], 'node': a['Address']['NodeID']} for a in state.actors().values()]}))"
        )
        r = subprocess.run([sys.executable, "-c", code], env=self.env, capture_output=True, text=True, timeout=120)
        if r.returncode != 0:
            raise RuntimeError(f"reading the cluster's state failed: {r.stderr[-2000:]}")
        return json.loads(r.stdout.strip().splitlines()[-1])

    def node_offering(self, resource: str, state: dict | None = None) -> str | None:
        """The id of the alive node offering ``resource``."""
        state = state or self.state()
        return next((n["id"] for n in state["nodes"] if n["alive"] and resource in n["resources"]), None)

    def __enter__(self) -> "LocalRayNodes":
        return self

    def __exit__(self, *exc) -> None:
        self.stop()


def can_run_ray_start() -> str | None:
    """None when the ``ray`` CLI is here, else why not (the reason a test skips with)."""
    if not Path(RAY).exists():
        return f"no ray CLI next to {sys.executable}"
    if not Path("/proc").is_dir():
        return "needs /proc to find and stop the nodes' processes"
    return None


# ---- the scenario: two models on two machines, ppipe serve as a user runs it ----------------------------
def write_two_model_plan(directory: Path) -> tuple[Path, Path]:
    """plan.yaml and cluster.yaml: model ``a`` on server l4-0 only (the head node), model
    ``b`` in two stages, l4-0 then p4-0 (the second node). Returns (plan, cluster) paths.

    Pipelines plan batch 1, so that a request is dispatched as it comes: with a planned
    batch of 4 at a few requests per second, the reservation scheduler holds a request
    until the latest start that still meets its deadline, and a wake-up a few ms late on a
    busy host drops it (deadline-unreachable): seen here with sequential single requests,
    a matter of the scheduler, not of nodes."""
    from ppipe.spec.plan import ModelPlan, PartitionPlan, PipelinePlan, Plan, PlanSettings, SolverReport, VgpuPlacement
    from tests.runtime.tinynet import write_tinynet

    directory = Path(directory)
    cluster = directory / "cluster.yaml"
    cluster.write_text(CLUSTER_YAML)
    models, placement = [], []
    stages = {"a": [(0, 2, "l4-0", 0)], "b": [(0, 1, "l4-0", 1), (2, 2, "p4-0", 0)]}  # (first, last, server, GPU)
    for name, parts in stages.items():
        prof = write_tinynet(directory / name, base_us=1000.0, name=name)
        pps = []
        for k, (first, last, server, gpu) in enumerate(parts):
            infer = prof.partition_latency_us("cpu", 2, 1, first, last)
            pps.append(PartitionPlan(first_block=first, last_block=last, gpu="cpu", vgpu=2, count=1, infer_us=infer,
                                     throughput_rps=1 / infer * 1e6))
            placement.append(VgpuPlacement(model=name, pipeline=0, partition=k, replica=0, server=server, gpu_index=gpu, vgpu=2, slot=0))
        thr = min(p.throughput_rps for p in pps)
        models.append(ModelPlan(name=name, profile=str(prof.directory), slo_ms=400.0, weight=1.0, throughput_rps=thr,
                                pipelines=[PipelinePlan(batch=1, throughput_rps=thr, latency_us=sum(p.infer_us for p in pps), partitions=pps)]))
    plan = Plan(
        cluster="two-machines", cluster_file=str(cluster),
        settings=PlanSettings(planner="hand", formulation="ppipe", gpu_rule="physical", objective="none", margin=0.0, max_partitions=3),
        solver=SolverReport(name="none", status="heuristic", seconds=0.0, objective=0.0),
        models=models, placement=placement,
    )
    path = directory / "plan.yaml"
    plan.save(path)
    return path, cluster


class Serve:
    """``ppipe serve PLAN --ray-address auto --backend emulated [EXTRA...]`` as a subprocess of ``nodes``'s environment."""

    def __init__(self, nodes: LocalRayNodes, plan: Path, log_dir: Path, extra: tuple[str, ...] = ()):
        self.plan, self.log_dir = plan, log_dir
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.stdout, self.stderr = log_dir / "serve.out", log_dir / "serve.err"
        cmd = [sys.executable, "-c", "from ppipe.cli import main; main()", "serve", str(plan), "--ray-address", "auto",
               "--backend", "emulated", "--port", str(self.port), "--shards", "1", *extra]
        self._logs = [open(self.stdout, "w"), open(self.stderr, "w")]  # closed by stop()
        self.proc = subprocess.Popen(cmd, env=nodes.env, stdout=self._logs[0], stderr=self._logs[1],
                                     cwd=str(REPO), start_new_session=True)

    def wait_ready(self, timeout_s: float = 180.0) -> None:
        import httpx

        t0 = time.monotonic()
        while time.monotonic() - t0 < timeout_s:
            if self.proc.poll() is not None:
                raise RuntimeError(f"ppipe serve exited with {self.proc.returncode}: {self.stderr.read_text()[-3000:]}")
            try:
                if httpx.get(self.url + "/v2/health/ready", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.3)
        raise TimeoutError(f"ppipe serve not ready within {timeout_s} s: {self.stderr.read_text()[-3000:]}")

    def stop(self) -> int | None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
            try:
                self.proc.wait(20)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(10)
        for f in self._logs:
            f.close()
        return self.proc.returncode

    def log(self) -> str:
        return self.stderr.read_text() if self.stderr.exists() else ""


class Load:
    """Requests to each model at ``rate`` req/s from a thread, every answer recorded with the
    phase it was sent in: ``(phase, model, status, drop reason)``; a request that got no HTTP
    answer records status 0 and the exception's name."""

    def __init__(self, url: str, models: list[str], rate: float = 20.0):
        import threading

        import numpy as np

        from ppipe.runtime.ingress.protocol import encode_infer_request

        self.url, self.models, self.rate = url, models, rate
        self.body, self.headers = encode_infer_request({"input": np.zeros((1, 3, 8, 8), np.float32)}, binary=True)
        self.phase = "before"
        self.sent = 0
        self.answers: list[tuple[str, str, int, str]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> "Load":
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join(120)

    def _run(self) -> None:
        import asyncio

        asyncio.run(self._main())

    async def _main(self) -> None:
        import asyncio

        import httpx

        async with httpx.AsyncClient(base_url=self.url, timeout=60) as c:
            async def one(model: str, phase: str) -> None:
                try:
                    r = await c.post(f"/v2/models/{model}/infer", content=self.body, headers=self.headers)
                    self.answers.append((phase, model, r.status_code, r.headers.get("ppipe-drop-reason", "")))
                except Exception as exc:
                    self.answers.append((phase, model, 0, type(exc).__name__))

            tasks = []
            while not self._stop.is_set():
                for m in self.models:
                    self.sent += 1
                    tasks.append(asyncio.create_task(one(m, self.phase)))
                await asyncio.sleep(1 / self.rate)
            await asyncio.gather(*tasks)

    def table(self) -> dict[str, dict[str, dict[str, int]]]:
        """{phase: {model: {"sent"/"answered"/"200"/"503 worker-failed"/...: count}}}"""
        out: dict[str, dict[str, dict[str, int]]] = {}
        for phase, model, status, reason in self.answers:
            row = out.setdefault(phase, {}).setdefault(model, {"answered": 0})
            row["answered"] += status != 0
            key = f"{status} {reason}".strip() if status != 200 else "200"
            row[key] = row.get(key, 0) + 1
        return out


def metric(text: str, name: str, **labels: str) -> float | None:
    """The value of the first sample ``name`` whose labels include ``labels`` in a Prometheus
    text exposition (None: absent); other labels (a merged server's ``process``) may be there."""
    import re

    for line in text.splitlines():
        m = re.match(r"([a-zA-Z_:][a-zA-Z0-9_:]*)(?:\{(.*)\})? (\S+)$", line)
        if m is None or m.group(1) != name:
            continue
        have = dict(re.findall(r'([a-zA-Z_][a-zA-Z0-9_]*)="((?:[^"\\]|\\.)*)"', m.group(2) or ""))
        if all(have.get(k) == v for k, v in labels.items()):
            return float(m.group(3))
    return None


def run_node_loss(nodes: LocalRayNodes, serve: Serve, node: str, resources: dict[str, float], lost_model: str,
                  models: list[str], rate: float = 10.0, phase_s: float = 3.0, back_timeout_s: float = 180.0) -> dict:
    """Load every model at ``rate`` req/s each; after ``phase_s`` kill Ray node ``node``
    (every process of it), keep the load ``phase_s`` after ``lost_model`` turned unready,
    restart the node (``ray start`` with the same ``resources``), wait until ``lost_model``
    is ready again, and keep the load ``phase_s`` more. Requests are labelled by the phase
    they were sent in: before, during (from the kill until the restart), returning (from the
    restart until ``lost_model`` is seen ready again), after. Returns the answers by phase
    and the times (s, monotonic, from the kill)."""
    import httpx

    def get(path: str) -> httpx.Response:
        return httpx.get(serve.url + path, timeout=10)

    out: dict = {"times": {}}
    with Load(serve.url, models, rate) as load:
        time.sleep(phase_s)
        load.phase = "during"
        t_kill = time.monotonic()
        out["killed_pids"] = len(nodes.kill_node(node))
        while get(f"/v2/models/{lost_model}/ready").status_code == 200 and time.monotonic() - t_kill < back_timeout_s:
            time.sleep(0.02)
        out["times"]["unready"] = time.monotonic() - t_kill
        time.sleep(phase_s)
        out["ready_during"] = {"server": get("/v2/health/ready").status_code,
                               **{m: get(f"/v2/models/{m}/ready").status_code for m in models}}
        text = get("/metrics").text
        out["capacity_during"] = {m: metric(text, "ppipe_model_capacity_alive_ratio", model=m) for m in models}
        load.phase = "returning"
        t0 = time.monotonic()
        r = nodes.start_node(node, resources)
        out["restart_rc"], out["restart_output"] = r.returncode, (r.stderr or r.stdout)[-2000:]
        out["times"]["node_started"] = time.monotonic() - t_kill
        out["times"]["ray_start_s"] = time.monotonic() - t0
        while get(f"/v2/models/{lost_model}/ready").status_code != 200 and time.monotonic() - t_kill < back_timeout_s:
            time.sleep(0.05)
        out["times"]["ready_again"] = time.monotonic() - t_kill
        out["back"] = get(f"/v2/models/{lost_model}/ready").status_code == 200
        load.phase = "after"
        time.sleep(phase_s)
    text = get("/metrics").text
    out["capacity_after"] = {m: metric(text, "ppipe_model_capacity_alive_ratio", model=m) for m in models}
    out["sent"], out["answers"], out["table"] = load.sent, list(load.answers), load.table()
    return out


def print_node_loss(res: dict, file=None) -> None:
    """The figures of :func:`run_node_loss`, as a table."""
    p = lambda *a: print(*a, file=file or sys.stdout)  # noqa: E731
    t = res["times"]
    p(f"requests sent {res['sent']}, answered {sum(s != 0 for _, _, s, _ in res['answers'])}")
    p(f"{'phase':8} {'model':6} {'sent':>5} {'answered':>8}  by status")
    for phase in ("before", "during", "returning", "after"):
        for model, row in sorted(res["table"].get(phase, {}).items()):
            sent = sum(v for k, v in row.items() if k != "answered")
            rest = ", ".join(f"{k}: {v}" for k, v in sorted(row.items()) if k != "answered")
            p(f"{phase:8} {model:6} {sent:5d} {row['answered']:8d}  {rest}")
    p(f"node killed at 0 s; model unready after {t['unready']:.2f} s; readiness during the loss {res['ready_during']}; "
      f"capacity gauge {res['capacity_during']}")
    p(f"ray start of the node took {t['ray_start_s']:.1f} s (done at {t['node_started']:.1f} s); model ready again at "
      f"{t['ready_again']:.1f} s: recovery {t['ready_again'] - t['node_started']:.1f} s after the node was back")
