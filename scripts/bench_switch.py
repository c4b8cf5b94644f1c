#!/usr/bin/env python
"""A live plan switch of `ppipe serve` under load (emulated workers; no GPU needed).

Two PPipe-artifact models on the paper's HC1-S (4 L4 + 12 P4). Plan A gives them equal
weights; plan B weights them 1:3 (the mix has shifted towards the second). Each model gets
Poisson arrivals (`ppipe bench`, its own process) at ``--load`` (default 80 %) of the
smaller of its two planned capacities, for ``--duration-s``; halfway through, `ppipe apply
B` (a subprocess, as a user runs it) switches the server. Three scenarios:

0. no switch (the baseline: what this host serves at this load at all);
1. the switch alone;
2. the switch while a worker of plan A that plan B does not keep is killed (when the
   command is issued: it dies while the new workers load).

For each it prints: requests sent, answered, by status (0 unanswered is the target: every
request gets one answer); SLO attainment over the run, which is the window around the
switch (target >= 99 % for scenario 1); the time from the command to the first batch
dispatched on the new plan, split into loading the new workers and the switch step; the
switch step's duration, which is the only time the event loop does not take requests
(PPipe pauses ingestion for about one SLO); and the longest a request arriving within 1 s
of the switch waited for its dispatch, next to the p99 wait elsewhere (a pause would show
there).

    python scripts/bench_switch.py                       # the three scenarios, 20 s each
    python scripts/bench_switch.py --scenarios 1 --duration-s 10
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "scripts"))
ARTIFACT = Path(os.environ.get("PPIPE_ARTIFACT", REPO.parent / "shared" / "data" / "ppipe-artifact"))
TOKEN = "bench-switch"


def make_plans(models: list[str], tmp: Path):
    """Plan A (equal weights) and plan B (weights 1:3) for ``models`` on HC1-S, saved under ``tmp``."""
    from ppipe.planner.api import plan as make_plan
    from ppipe.spec.artifact import import_artifact
    from ppipe.spec.cluster import load_cluster

    dirs = import_artifact(ARTIFACT, tmp / "profiles", models)
    cluster = load_cluster("HC1-S")
    a = make_plan(cluster, [str(d) for d in dirs], time_limit_s=60, weights=[1.0, 1.0])
    b = make_plan(cluster, [str(d) for d in dirs], time_limit_s=60, weights=[1.0, 3.0])
    a.save(tmp / "a.yaml")
    b.save(tmp / "b.yaml")
    return a, b


def serve(tmp: Path):
    """Plan A served in this process (emulated workers, `ppipe serve`'s defaults, a token);
    returns (server, runtime, switcher, workers)."""
    from ppipe.runtime.cli import DEFAULT_ANSWER_BUDGET_MS, DEFAULT_DISPATCH_LEAD_MS, DEFAULT_WAKE_LEAD_MS
    from ppipe.runtime.launch.deploy import load_deployment, start_workers
    from ppipe.runtime.scheduler.host import Runtime
    from ppipe.runtime.ingress.http_server import create_app
    from ppipe.runtime.ingress.http_transport import BackgroundServer
    from ppipe.runtime.control.switch import PlanSwitcher

    dep = load_deployment(tmp / "a.yaml", "HC1-S")
    opts = {"max_bytes_per_sample": 4096}  # feature maps capped (they still wait their planned NIC time)
    workers = start_workers(dep, backend="emulated", backend_options=opts)
    rt = Runtime(dep.plan, dep.profiles, dep.cluster, workers, scheduler_options={"wake_lead_us": DEFAULT_WAKE_LEAD_MS * 1e3},
                 dispatch_lead_us=DEFAULT_DISPATCH_LEAD_MS * 1e3, answer_budget_us=DEFAULT_ANSWER_BUDGET_MS * 1e3, keep_traces=10**6)
    app = create_app(rt, token=TOKEN)
    switcher = PlanSwitcher(rt, dep, backend="emulated", backend_options=opts)
    app.fe.switcher = switcher
    return BackgroundServer(app).__enter__(), rt, switcher, workers


def bench_procs(url: str, rates: dict[str, float], duration_s: float, seed: int) -> list[tuple[subprocess.Popen, str]]:
    out = []
    for i, (m, rate) in enumerate(rates.items()):
        fh = tempfile.NamedTemporaryFile(suffix=".json", delete=False)
        fh.close()
        cmd = [sys.executable, "-m", "ppipe.cli", "bench", url, "--model", m, "--rate", f"{rate:.3f}", "--duration-s", str(duration_s),
               "--seed", str(seed + i), "--json-out", fh.name, "--binary", "--token", TOKEN, "--input-shape", "16"]
        out.append((subprocess.Popen(cmd, stdout=subprocess.DEVNULL), fh.name))
    return out


def dispatch_waits(rt, at_us: float) -> tuple[float, float]:
    """How long requests waited from arrival to their batch's dispatch (ms): the largest
    wait of those that arrived within 1 s of ``at_us``, and the p99 of the others. A pause
    in ingestion would show as waits near the switch as long as the pause."""
    near, other = [], []
    for tr in rt.traces:
        for a in tr.arrivals_us:
            (near if abs(a - at_us) <= 1e6 else other).append((tr.dispatched_us - a) / 1e3)
    return max(near, default=0.0), float(np.percentile(other, 99)) if other else 0.0


def scenario(mode: str, tmp: Path, a, b, load: float, duration_s: float, seed: int) -> dict:
    import ray

    srv, rt, switcher, workers = serve(tmp)
    try:
        rates = {m.name: load * min(m.throughput_rps, b.model(m.name).throughput_rps) for m in a.models}
        procs = bench_procs(srv.url, rates, duration_s, seed)
        time.sleep(duration_s / 2)
        kill = mode == "2"
        doomed = sorted(set(workers) - {p.vgpu_id for p in b.placement})
        t_cmd = rt.clock.true_now_us()
        applied = ""
        if mode != "0":
            apply = subprocess.Popen([sys.executable, "-m", "ppipe.cli", "apply", str(tmp / "b.yaml"), "--url", srv.url, "--token", TOKEN],
                                     stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
            if kill and doomed:
                workers[doomed[0]].kill()
            applied = apply.communicate(timeout=600)[0]
        results = []
        for p, f in procs:
            p.wait()
            results.append(json.loads(Path(f).read_text()))
        time.sleep(0.5)
        sw = rt.switches[-1] if rt.switches else None
        at = sw["at_us"] if sw else t_cmd
        wait_near, wait_usual = dispatch_waits(rt, at)
    finally:
        srv.__exit__(None, None, None)
        for h in [*workers.values(), *switcher.started]:
            h.kill()
    sent = sum(r["sent"] for r in results)
    answered = sum(r["ok"] + sum(r["drops"].values()) + sum(r["errors"].values()) for r in results)
    by_status: dict[str, int] = {"200": sum(r["ok"] for r in results)}
    for r in results:
        for k, v in {**r["drops"], **r["errors"]}.items():
            by_status[k] = by_status.get(k, 0) + v
    on_time = sum(r["on_time"] for r in results)
    out = {"kill": kill, "killed": doomed[0] if kill and doomed else None, "rates": rates, "sent": sent, "answered": answered,
           "by_status": by_status, "attainment": on_time / max(1, sent), "apply_output": applied.strip().splitlines()[:1]}
    out.update(max_wait_near_switch_ms=wait_near, p99_wait_elsewhere_ms=wait_usual)
    if sw:
        out.update(load_s=sw["load_s"], switch_ms=sw["switch_us"] / 1e3, kept=sw["kept"], started=sw["started"], retiring=sw["retiring"],
                   command_to_first_dispatch_s=(sw["first_dispatch_us"] - t_cmd) / 1e6 if sw["first_dispatch_us"] else None)
    return out


def report(name: str, r: dict) -> None:
    print(f"\n== scenario {name}")
    print("   offered: " + ", ".join(f"{m} {v:.0f} req/s" for m, v in r["rates"].items()))
    if r["killed"]:
        print(f"   killed at the command: {r['killed']} (a plan-A worker plan B does not keep)")
    if r["apply_output"]:
        print(f"   apply: {r['apply_output'][0]}")
    print(f"   requests: sent {r['sent']}, answered {r['answered']} (unanswered {r['sent'] - r['answered']}), by status {r['by_status']}")
    print(f"   SLO attainment over the run (the switch at its middle): {100 * r['attainment']:.2f} %")
    if "switch_ms" in r:
        c2f = r["command_to_first_dispatch_s"]
        print(f"   vGPUs: {r['kept']} kept, {r['started']} started, {r['retiring']} retired after draining")
        print(f"   command -> first batch on the new plan: {c2f:.2f} s (loading the new workers {r['load_s']:.2f} s); "
              f"the switch step: {r['switch_ms']:.2f} ms (the loop's only stop; PPipe pauses ~1 SLO)")
    print(f"   arrival -> dispatch: at most {r['max_wait_near_switch_ms']:.2f} ms for requests arriving within 1 s of the "
          f"{'switch' if 'switch_ms' in r else 'middle'} (p99 elsewhere {r['p99_wait_elsewhere_ms']:.2f} ms)")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", default="atss_r101_fpn_1x_coco,rtmdet_x_8xb32-300e_coco", help="two PPipe-artifact models")
    ap.add_argument("--load", type=float, default=0.8, help="offered load, as a fraction of each model's smaller planned capacity")
    ap.add_argument("--duration-s", type=float, default=20.0, help="arrival window per scenario; the switch is at its middle")
    ap.add_argument("--scenarios", default="0,1,2", help="which scenarios (0: no switch; 1: switch; 2: switch while an old worker is killed)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json-out", default=None)
    args = ap.parse_args()
    sys.stdout.reconfigure(line_buffering=True)
    from hostspeed import host_line

    print(host_line())
    if not (ARTIFACT / "block-timing").is_dir():
        print(f"skipped: PPipe artifact not found at {ARTIFACT} (set PPIPE_ARTIFACT)")
        return
    import ray

    os.environ.setdefault("RAY_worker_niceness", "0")  # as `ppipe serve` starts its Ray (ppipe.runtime.cli.init_ray)
    ray.init(include_dashboard=False, log_to_driver=False)
    out = {}
    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        a, b = make_plans(args.models.split(","), tmp)
        for name, p in (("A (equal weights)", a), ("B (weights 1:3)", b)):
            print(f"plan {name}: " + ", ".join(f"{m.name} {m.throughput_rps:.0f} req/s" for m in p.models) + f"; {len(p.placement)} vGPUs")
        for s in args.scenarios.split(","):
            r = scenario(s, tmp, a, b, args.load, args.duration_s, args.seed)
            report({"0": "0: no switch (baseline)", "1": "1: switch", "2": "2: switch while an old worker dies"}[s], r)
            out[s] = r
    ray.shutdown()
    if args.json_out:
        Path(args.json_out).write_text(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
