#!/usr/bin/env python
"""How long `ppipe serve` takes to be ready, and what it costs at idle, per launcher.

For each plan and each launcher (``--launcher local`` and ``--launcher ray``), starts
`ppipe serve` as a user does (a fresh process, nothing running before: ``ray stop`` first),
and prints:

* **ready**: wall seconds from the command's start until ``/v2/health/ready`` answers 200
  (polled every 20 ms), the median of ``--repeat`` starts;
* **idle CPU**: cores used by the server's whole process tree (the server, its workers,
  and for Ray its daemons, which run outside the server's tree: every process of this
  host is counted, less the script itself) over ``--idle-s`` seconds once ready, with no
  request; printed in all, and split into the server's tree and the rest of the host
  (Ray's daemons, and whatever else this host runs: a VM's agent, kernel threads);
* the processes it runs.

Plans: the README's first one (``ppipe plan local-cpu resnet50 --slo-ms 1500``, onnxruntime
workers) and the default plan (HC2-S, three models, 24 vGPUs, emulated workers).

What it leaves out: the first start after installing (Python's bytecode cache is warm
after the first repeat; the first of all is printed apart), and GPU backends (loading
TensorRT engines or CUDA contexts takes seconds more, whatever the launcher).

    python scripts/bench_launch.py [--repeat 3] [--idle-s 10]
"""

from __future__ import annotations

import argparse
import http.client
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil

sys.path.insert(0, str(Path(__file__).resolve().parent))

import hostspeed  # noqa: E402  (a script next to this one)

PORT = 8731


def host_line() -> str:
    return f"{hostspeed.host_line()}; load average {', '.join(f'{x:.2f}' for x in os.getloadavg())}"


def ppipe(*args: str) -> list[str]:
    return [sys.executable, "-m", "ppipe.cli", *args]


def stop_ray() -> None:
    subprocess.run([str(Path(sys.executable).with_name("ray")), "stop", "--force"], capture_output=True)


def start(plan: Path, launcher: str, backend: str) -> tuple[subprocess.Popen, float]:
    """Start `ppipe serve`; (process, seconds until ready)."""
    t0 = time.perf_counter()
    proc = subprocess.Popen(ppipe("serve", str(plan), "--launcher", launcher, "--backend", backend, "--port", str(PORT)),
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    while time.perf_counter() - t0 < 120:
        if proc.poll() is not None:
            raise SystemExit(f"ppipe serve --launcher {launcher} exited with {proc.returncode}")
        if ready():
            return proc, time.perf_counter() - t0
        time.sleep(0.02)
    proc.kill()
    raise SystemExit(f"ppipe serve --launcher {launcher} not ready in 120 s")


def ready() -> bool:
    """Whether ``/v2/health/ready`` answers 200 (http.client: a poll costs the starting server
    next to no CPU, where building an httpx client every 20 ms took a fifth of a core)."""
    conn = http.client.HTTPConnection("127.0.0.1", PORT, timeout=0.5)
    try:
        conn.request("GET", "/v2/health/ready")
        return conn.getresponse().status == 200
    except OSError:
        return False
    finally:
        conn.close()


def idle_cores(idle_s: float, tree: frozenset[int] | set[int] = frozenset()) -> tuple[float, float]:
    """Cores the host's processes (this script's aside) use over ``idle_s`` seconds: the
    processes of ``tree`` (pids), and all the others. A process that starts or ends in
    the window counts only where it is seen at both ends."""
    me = {os.getpid()}
    before = {p.pid: p for p in psutil.process_iter()}
    a = {pid: _cpu(p) for pid, p in before.items() if pid not in me}
    time.sleep(idle_s)
    b = {pid: _cpu(p) for pid, p in before.items() if pid not in me}
    used = {k: b[k] - a[k] for k in a if a[k] is not None and b.get(k) is not None}
    return sum(v for k, v in used.items() if k in tree) / idle_s, sum(v for k, v in used.items() if k not in tree) / idle_s


def _cpu(p: psutil.Process) -> float | None:
    try:
        t = p.cpu_times()
        return t.user + t.system
    except (psutil.NoSuchProcess, psutil.AccessDenied):
        return None


def stop(proc: subprocess.Popen) -> None:
    proc.terminate()
    try:
        proc.wait(30)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(10)


def measure(plan: Path, launcher: str, backend: str, repeat: int, idle_s: float) -> None:
    readies, idle, procs = [], None, 0
    for i in range(repeat):
        stop_ray()
        time.sleep(1.0)
        proc, ready = start(plan, launcher, backend)
        readies.append(ready)
        if i == repeat - 1:
            time.sleep(1.0)  # the start's last work (first collections, Ray's registrations) settles
            tree = {proc.pid, *(c.pid for c in psutil.Process(proc.pid).children(recursive=True))}
            idle = idle_cores(idle_s, tree)
            procs = len(tree)
        stop(proc)
    rest = readies[1:] or readies
    print(f"  --launcher {launcher:5}  ready {statistics.median(rest):5.2f} s (median of {len(rest)}; first start {readies[0]:.2f} s)"
          f"   idle {sum(idle):.3f} cores over {idle_s:g} s (the server's tree {idle[0]:.3f}, the rest of the host {idle[1]:.3f})"
          f"   {procs} processes in the server's tree")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--idle-s", type=float, default=10.0)
    ap.add_argument("--launchers", nargs="+", default=["local", "ray"])
    args = ap.parse_args()
    print(host_line())
    with tempfile.TemporaryDirectory() as tmp:
        r50, default = Path(tmp) / "r50.yaml", Path(tmp) / "default.yaml"
        subprocess.run(ppipe("plan", "local-cpu", "resnet50", "--slo-ms", "1500", "-o", str(r50)), check=True, capture_output=True)
        subprocess.run(ppipe("plan", "-o", str(default)), check=True, capture_output=True)
        for plan, backend, what in ((r50, "ort", "local-cpu resnet50 (README's first plan), ort workers"),
                                    (default, "emulated", "default plan (HC2-S, 3 models, 24 vGPUs), emulated workers")):
            print(f"{what}:")
            for launcher in args.launchers:
                measure(plan, launcher, backend, args.repeat, args.idle_s)
    stop_ray()
    print(host_line())


if __name__ == "__main__":
    main()
