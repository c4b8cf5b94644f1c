#!/usr/bin/env python
"""The gRPC frontend's ceiling next to REST's, on one server (emulated workers; no GPU).

The same frontend-bound case as the ceiling part of scripts/bench_serve.py: a one-block
model with 1 us emulated latency and a 16-float input, batch 16 on 2 vGPUs, a 500 ms SLO,
so that the frontend (protocol, decoding, scheduler, data path) is the bottleneck. One
`ppipe serve`-like process serves it over REST and gRPC at once (the gRPC server on the
runtime's loop, as `ppipe serve --grpc-port` does); `ppipe bench` in a subprocess offers
Poisson load at rising rates, REST (binary tensors) and gRPC (raw_input_contents)
one after the other at each rate (in turns first), so that both see the same host load. A frontend's ceiling is the
highest offered rate it serves at >= 99 % attainment. CPU per request of the server
process and of the load generator are printed too: on a shared host they say more than
req/s do.

    python scripts/bench_grpc.py                                  # rates 1000..5000
    python scripts/bench_grpc.py --rates 500,1000 --duration-s 3  # a quick look
"""

from __future__ import annotations

import argparse
import os
import json
import resource
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
from bench_serve import CEILING_SLO_MS as SLO_MS  # noqa: E402 - after the path set-up


def null_plan(tmp: Path):
    """The plan and profiles of bench_serve.py's ceiling: 1 block, 1 us, batch 16 on 2 vGPUs."""
    from bench_serve import null_plan as plan_of  # scripts/ is this script's directory
    from ppipe.spec.cluster import load_cluster

    cluster = load_cluster("local-cpu")
    plan, profiles = plan_of(tmp, cluster, ["null"], batch=16, vgpus=2)
    return plan, profiles, cluster


def bench(url: str, grpc_address: str | None, rate: float, duration_s: float, seed: int) -> dict:
    """One `ppipe bench` run in a subprocess; returns its JSON figures plus CPU per request."""
    with tempfile.NamedTemporaryFile(suffix=".json", delete=False) as fh:
        out = fh.name
    cmd = [sys.executable, "-m", "ppipe.cli", "bench", url, "--model", "null", "--rate", f"{rate:.3f}", "--duration-s", str(duration_s),
           "--seed", str(seed), "--json-out", out, "--binary"]
    if grpc_address:
        cmd += ["--grpc", grpc_address]
    self0, kids0 = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
    self1, kids1 = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    res = json.loads(Path(out).read_text())
    n = max(1, res["sent"])
    res["server_cpu_ms_per_request"] = 1e3 * ((self1.ru_utime + self1.ru_stime) - (self0.ru_utime + self0.ru_stime)) / n
    res["client_cpu_ms_per_request"] = 1e3 * ((kids1.ru_utime + kids1.ru_stime) - (kids0.ru_utime + kids0.ru_stime)) / n
    return res


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rates", default="1000,2000,3000,4000,5000", help="offered rates, req/s, in rising order")
    ap.add_argument("--duration-s", type=float, default=5.0, help="arrival window per point")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json-out", default=None, help="write all figures to this JSON file")
    args = ap.parse_args()
    sys.stdout.reconfigure(line_buffering=True)
    sys.path.insert(0, str(REPO / "scripts"))
    from hostspeed import host_line

    import ray

    from ppipe.runtime.launch.deploy import Deployment, start_workers
    from ppipe.runtime.scheduler.host import Runtime
    from ppipe.runtime.ingress.grpc_server import GrpcServer
    from ppipe.runtime.ingress.http_server import create_app
    from ppipe.runtime.ingress.http_transport import BackgroundServer

    print(host_line())
    os.environ.setdefault("RAY_worker_niceness", "0")  # as `ppipe serve` starts its Ray (ppipe.runtime.cli.init_ray)
    ray.init(include_dashboard=False, log_to_driver=False)
    results: dict[str, dict] = {"rest": {}, "grpc": {}}
    with tempfile.TemporaryDirectory() as tmp:
        plan, profiles, cluster = null_plan(Path(tmp))
        workers = start_workers(Deployment(plan=plan, cluster=cluster, profiles=profiles), backend="emulated")
        rt = Runtime(plan, profiles, cluster, workers)
        g = GrpcServer(rt, port=0)
        print(f"== frontend ceiling, REST (binary) vs gRPC (raw): 1-block model, 1 us, batch 16 on 2 vGPUs, SLO {SLO_MS:g} ms, "
              f"{args.duration_s:g} s per point")
        try:
            with BackgroundServer(create_app(rt, companions=[g])) as srv:
                alive = {"rest": True, "grpc": True}
                for i, rate in enumerate(float(r) for r in args.rates.split(",")):
                    for kind in (("rest", "grpc"), ("grpc", "rest"))[i % 2]:  # neither always runs on the host the other warmed
                        if not alive[kind]:
                            continue
                        r = bench(srv.url, g.address if kind == "grpc" else None, rate, args.duration_s, args.seed)
                        results[kind][str(rate)] = r
                        print(f"   {kind:4s} {rate:6.0f} req/s: attainment {100 * r['slo_attainment']:6.2f} %  p50 {r['p50_ms'] or 0:6.1f} ms  "
                              f"p99 {r['p99_ms'] or 0:6.1f} ms  errors {r['errors'] or r['drops'] or 0}  client lag p99 "
                              f"{r['client_lag_p99_ms']:.1f} ms  CPU/request: server {r['server_cpu_ms_per_request']:.2f} ms, "
                              f"client {r['client_cpu_ms_per_request']:.2f} ms")
                        if r["slo_attainment"] < 0.99:
                            alive[kind] = False
                        else:
                            results[kind]["ceiling_rps"] = rate
        finally:
            for h in workers.values():
                h.kill()
            ray.shutdown()
    summary = {k: v.get("ceiling_rps") for k, v in results.items()}
    print(f"   highest offered rate at >= 99 % attainment: REST {summary['rest']} req/s, gRPC {summary['grpc']} req/s")
    if args.json_out:
        Path(args.json_out).write_text(json.dumps(results, indent=2))
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
