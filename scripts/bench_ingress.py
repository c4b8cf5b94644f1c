#!/usr/bin/env python
"""``ppipe serve --ingress K`` against ``ppipe serve`` alone: CPU and bytes per request, per process.

A batch-1, three-stage route of 1 us emulated stages (``bench_serve.py``'s null model) whose
input is 16 floats, ResNet-50's (3x224x224 FP32, 0.6 MB) or atss's (3x800x1333 FP32, 12.8
MB), served by the real command under the local launcher and driven by ``ppipe bench
--binary`` (Poisson arrivals, its own process). For each size and each ``--ingress`` count
it prints, per request:

- the CPU of the ``ppipe serve`` process (with ``--ingress 0`` it reads, decodes, schedules
  and sends; with ingresses it only schedules) and of the ingress processes together, each
  less what the process spends idle (measured over 3 s before the run: timers, the
  metrics' exchange), times the run's length;
- the bytes the ``ppipe serve`` process moved through its sockets (``/proc/PID/io``, rchar
  + wchar: every socket read and write, the client's body and the tensor to the first
  worker included): with ingresses, only the scheduler's small messages are left.

Each size runs at several rates: a low one, and up to a rate near what this host holds with the
client and the workers beside the server (its "busy" rate). The CPU per request falls with
the rate: at the low rate each request wakes a process that slept for milliseconds, with
its caches taken by the other processes; at the busy rate the processes stay warm and the
wakes are shared. What one core can take in is read at the busy rate.

Two references in the same run: the HTTP floor (uvicorn as ``ppipe serve`` runs it, a null
app, its own process; ``bench_serve.py --part httpfloor``) for the 16-float case at its low
rate, and for the large inputs the bytes per second a plain loopback TCP socket moves
between two processes (``sendall`` / ``recv_into`` of one input). An ingress's byte rate is
the input's bytes over its CPU per request (what one ingress core takes in), printed at
each rate; for ResNet-50's input also the marginal rate, its bytes over what its request
costs beyond a 16-float request at the same rate (what the bytes themselves cost: the
rest is the per-request cost of HTTP, the one the floor bounds). The targets are ingress
<= 2x the floor's CPU, and >= 0.7 of the plain socket's bytes per second. Last, the
head-node sizing line for the paper's largest group (HC1-L G2, 4,285 req/s at 0.6 MB):
schedulers S cores (the 16-float run's scheduler at its busy rate, whose cost does not
depend on the input's size) and ingress I cores (the ResNet-50 run's at its busy rate),
from the costs measured here; at 4,285 req/s every process is busier still.

What this leaves out: the client and the workers share this host's cores with the server
(on 2 cores the rates are kept low for that); the emulated workers' cost is not counted;
one machine only, so the ingresses cannot stand on the workers' nodes.

    python scripts/bench_ingress.py [--duration-s 10] [--ingress 0,1] [--sizes 16,resnet50,atss]
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_serve import HC1_L_G2_RPS, http_floor, idle_cpu_rate, null_plan, process_cpu_s  # noqa: E402
from hostspeed import host_line  # noqa: E402

SIZES = {  # name -> (per-sample input shape, offered rates req/s on this host: low ... busy)
    "16": ((16,), (300.0, 500.0, 1500.0)),
    "resnet50": ((3, 224, 224), (100.0, 500.0)),
    "atss": ((3, 800, 1333), (8.0, 16.0)),
}


def io_bytes(pid: int) -> int:
    """Bytes the process read and wrote through system calls (sockets included)."""
    with open(f"/proc/{pid}/io") as fh:
        fields = dict(line.split(": ") for line in fh.read().splitlines())
    return int(fields["rchar"]) + int(fields["wchar"])


def children_named(pid: int, name: str) -> list[int]:
    import psutil

    return [p.pid for p in psutil.Process(pid).children(recursive=True) if p.name() == name]


def plain_socket_gbps(nbytes: int, repeat: int = 20) -> float:
    """Bytes per second (GB/s) one loopback TCP connection moves for messages of ``nbytes``
    (sendall here, recv_into in a child process), median of ``repeat`` after a warm-up."""
    code = ("import socket, sys; n = int(sys.argv[2]); buf = bytearray(n); v = memoryview(buf); "
            "s = socket.create_connection(('127.0.0.1', int(sys.argv[1])))\n"
            "while True:\n got = 0\n while got < n:\n  k = s.recv_into(v[got:])\n  if not k: sys.exit()\n  got += k\n s.sendall(b'k')")
    with socket.create_server(("127.0.0.1", 0)) as server:
        proc = subprocess.Popen([sys.executable, "-c", code, str(server.getsockname()[1]), str(nbytes)])
        conn, _ = server.accept()
    payload = np.ones(nbytes, np.uint8).data
    times = []
    try:
        for _ in range(repeat + 1):
            t0 = time.perf_counter()
            conn.sendall(payload)
            conn.recv(1)
            times.append(time.perf_counter() - t0)
    finally:
        conn.close()
        proc.wait(timeout=10)
    return nbytes / float(np.median(times[1:])) / 1e9


def serve(plan_file: Path, port: int, ingress: int) -> subprocess.Popen:
    from ppipe.runtime.client.httpclient import wait_until_ready

    proc = subprocess.Popen([sys.executable, "-m", "ppipe.cli", "serve", str(plan_file), "--backend", "emulated", "--launcher", "local",
                             "--port", str(port), "--ingress", str(ingress), "--max-body-mb", "64"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    wait_until_ready(f"http://127.0.0.1:{port}", proc, timeout_s=120)
    return proc


def one_point(plan_file: Path, ingress: int, rate: float, duration_s: float, seed: int) -> dict:
    """Serve, warm up, then one measured ``ppipe bench`` run: the figures per request."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = serve(plan_file, port, ingress)
    url = f"http://127.0.0.1:{port}"
    try:
        run_bench(url, rate, 2.0, seed + 1)  # connections, first batches
        ingresses = children_named(proc.pid, "ppipe-ingress")
        idle_serve, idle_ingress = idle_cpu_rate([proc.pid]), idle_cpu_rate(ingresses) if ingresses else 0.0
        c0, i0, b0, t0 = process_cpu_s(proc.pid), sum(process_cpu_s(p) for p in ingresses), io_bytes(proc.pid), time.perf_counter()
        res = run_bench(url, rate, duration_s, seed)
        wall = time.perf_counter() - t0
        n = max(1, res["sent"])
        return {"ingress": ingress, "rate": rate, "sent": res["sent"], "on_time": res["slo_attainment"], "p50_ms": res["p50_ms"],
                "serve_us": (process_cpu_s(proc.pid) - c0 - idle_serve * wall) / n * 1e6,
                "ingress_us": (sum(process_cpu_s(p) for p in ingresses) - i0 - idle_ingress * wall) / n * 1e6,
                "idle_cores": idle_serve + idle_ingress, "serve_bytes": (io_bytes(proc.pid) - b0) / n}
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()


def run_bench(url: str, rate: float, duration_s: float, seed: int) -> dict:
    with tempfile.NamedTemporaryFile(suffix=".json", delete=False) as fh:
        out = fh.name
    subprocess.run([sys.executable, "-m", "ppipe.cli", "bench", url, "--model", "null", "--rate", f"{rate:.3f}", "--binary",
                    "--duration-s", str(duration_s), "--seed", str(seed), "--json-out", out], check=True, stdout=subprocess.DEVNULL)
    with open(out) as fh:
        return json.load(fh)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--duration-s", type=float, default=10.0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--ingress", default="0,1", help="ingress counts to compare")
    ap.add_argument("--sizes", default="16,resnet50,atss", help=f"inputs: {', '.join(SIZES)}")
    args = ap.parse_args()
    print(host_line())
    print(f"load average {os.getloadavg()[0]:.2f} (run with nothing else on the cores)")
    counts = [int(k) for k in args.ingress.split(",")]
    rows: dict = {}
    with tempfile.TemporaryDirectory() as tmp:
        for size in args.sizes.split(","):
            measure_size(size, counts, Path(tmp), args, rows)
    print_sizing(rows, max(counts))
    return 0


def measure_size(size: str, counts: list[int], tmp: Path, args, rows: dict) -> None:
    """Every ingress count at both of the size's rates, then its reference: the floor or the plain socket."""
    from ppipe.spec.cluster import load_cluster

    shape, rates = SIZES[size]
    plan, _ = null_plan(tmp / size, load_cluster("local-cpu"), ["null"], batch=1, vgpus=1, stages=3, input_shape=shape)
    plan_file = tmp / size / "plan.yaml"
    plan.save(plan_file)
    nbytes = 4 * int(np.prod(shape))
    print(f"\n== input {size}: {'x'.join(map(str, shape))} FP32, {nbytes / 1e6:.3f} MB; {args.duration_s:g} s per point")
    print(f"   {'req/s':>6s} {'ingress':>7s} {'on time':>8s} {'p50 ms':>7s} {'serve CPU us':>13s} {'ingress CPU us':>15s} "
          f"{'serve bytes':>12s}  (per request; idle cores)")
    for rate in rates:
        for k in counts:
            r = rows[(size, k, rate)] = one_point(plan_file, k, rate, args.duration_s, args.seed)
            print(f"   {rate:6.0f} {k:7d} {100 * r['on_time']:7.2f}% {r['p50_ms'] or 0:7.2f} {r['serve_us']:13.0f} "
                  f"{r['ingress_us']:15.0f} {r['serve_bytes']:12.0f}  {r['idle_cores']:.3f}")
    ingresses = [k for k in counts if k]
    if size == "16":
        low = rates[0]
        floor = http_floor(args.duration_s, args.seed, [low])[str(low)]["server_cpu_ms_per_request"] * 1e3
        for k in ingresses:
            print(f"   ingress {k} at {low:g} req/s: {rows[(size, k, low)]['ingress_us'] / floor:.2f}x "
                  f"the HTTP floor ({floor:.0f} us per request at that rate; target <= 2x)")
        return
    plain = plain_socket_gbps(nbytes)
    for k in ingresses:
        for rate in rates:
            took = nbytes / (rows[(size, k, rate)]["ingress_us"] / 1e6) / 1e9
            line = f"   ingress {k} at {rate:g} req/s: {took:.2f} GB/s per ingress core, {took / plain:.2f} of a plain socket's {plain:.2f} GB/s"
            small = rows.get(("16", k, rate))
            beyond = rows[(size, k, rate)]["ingress_us"] - small["ingress_us"] if small else 0.0
            if beyond > 0:
                marginal = nbytes / (beyond / 1e6) / 1e9
                line += f"; beyond a 16-float request ({beyond:.0f} us): {marginal:.2f} GB/s, {marginal / plain:.2f} of it"
            print(line + " (target >= 0.7)")


def print_sizing(rows: dict, k: int) -> None:
    """The head-node sizing line, from the busy rates' costs (nothing where a size did not run)."""
    sched = rows.get(("16", k, SIZES["16"][1][-1]))  # the scheduler's cost does not depend on the input's size
    resnet = rows.get(("resnet50", k, SIZES["resnet50"][1][-1]))
    if sched and resnet and k:
        s_cores = sched["serve_us"] * HC1_L_G2_RPS / 1e6
        i_cores = resnet["ingress_us"] * HC1_L_G2_RPS / 1e6
        print(f"\n{HC1_L_G2_RPS:,.0f} req/s: schedulers {s_cores:.2f} cores, ingress {i_cores:.2f} cores "
              f"(HC1-L G2 at 0.6 MB inputs, from the costs at {sched['rate']:g} and {resnet['rate']:g} req/s above; "
              "targets S <= 0.5, I <= 3)")


if __name__ == "__main__":
    raise SystemExit(main())
