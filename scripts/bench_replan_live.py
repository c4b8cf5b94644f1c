#!/usr/bin/env python
"""`ppipe serve --replan auto` against a live shifting load (emulated workers; no GPU needed).

Two PPipe-artifact models on the paper's HC1-S (4 L4 + 12 P4), served by `ppipe serve`
started as a user starts it, from the max-min plan for equal weights. Each model gets
the simulator's shifting mix (:func:`ppipe.sim.workloads.shifting_poisson_arrivals`: the
total rate is steady, the shares move as ``1/2 +- a sin(2 pi t / P)``), written to a
timestamp file and replayed by `ppipe bench --arrivals trace` (one process per model).
The total rate is set so that each model's peak demand is ``--peak`` times its capacity in
the served plan: a fixed plan must drop requests at the peaks, while a plan re-made for
the observed mix can move the capacity to where the load is. The defaults are the
simulator's benchmark setting (`scripts/bench_replan.py`: a 600 s period, a 60 s window,
60 s between switches); the controller's look-ahead is the least interval plus the
server's load delay, so compressing the period alone makes its straight-line forecast
overshoot (see docs/benchmarks.md).

Two runs on the same arrivals:

* ``static``: `ppipe serve` (the plan stays);
* ``auto``: `ppipe serve --replan auto` with the window and the least interval between
  switches scaled to the run (``--window-s``, ``--min-interval-s``).

For each it prints requests sent and answered (0 unanswered is the target), SLO
attainment per model and overall, and for ``auto`` every switch the server made (from
``GET /v2/admin/plan``): when, what triggered it, vGPUs kept and started, and the
switch step. The re-plans run the real planner, in a process of the server's.

    python scripts/bench_replan_live.py                    # 600 s per run (one period), peak 1.2
    python scripts/bench_replan_live.py --duration-s 120 --window-s 10 --min-interval-s 20   # compressed
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "scripts"))
from bench_switch import ARTIFACT, make_plans  # noqa: E402 - after the path set-up

TOKEN = "bench-replan-live"


def write_traces(plan, peak: float, duration_s: float, period_s: float, seed: int, tmp: Path) -> dict[str, tuple[Path, float]]:
    """Per model, a file of arrival times (s) of the shifting mix and its mean rate.

    The total rate R is such that the model whose peak demand is nearest its capacity
    reaches ``peak`` times it: model i's peak rate is ``R (1/n + a)``.
    """
    from ppipe.sim.workloads import default_amplitude, shifting_poisson_arrivals

    names = [m.name for m in plan.models]
    n, a = len(names), default_amplitude(len(names))
    total = peak * min(m.throughput_rps for m in plan.models) / (1.0 / n + a)
    arrivals = shifting_poisson_arrivals(names, total, duration_s * 1e6, seed, period_s=period_s)
    out = {}
    for name, t_us in arrivals.items():
        path = tmp / f"{name}.trace"
        path.write_text("timestamp_s\n" + "\n".join(f"{t / 1e6:.6f}" for t in t_us) + "\n")
        # `ppipe bench` scales a trace to --rate: its own rate, (n - 1) gaps over its span, keeps it as it is
        out[name] = (path, (len(t_us) - 1) / ((t_us[-1] - t_us[0]) / 1e6))
    print(f"   shifting mix: total {total:.0f} req/s, period {period_s:g} s, shares 1/{n} +- {a:.2f}; "
          + ", ".join(f"{m.name}: capacity {m.throughput_rps:.0f}, peak demand {total * (1 / n + a):.0f} req/s" for m in plan.models))
    return out


def start_server(tmp: Path, port: int, replan: bool, window_s: float, min_interval_s: float) -> tuple[subprocess.Popen, str]:
    cmd = [sys.executable, "-m", "ppipe.cli", "serve", str(tmp / "a.yaml"), "--backend", "emulated", "--emulated-max-bytes", "4096",
           "--port", str(port), "--token", TOKEN, "--shards", "1"]
    if replan:
        cmd += ["--replan", "auto", "--replan-window-s", str(window_s), "--replan-min-interval-s", str(min_interval_s)]
    log = open(tmp / f"serve-{'auto' if replan else 'static'}.log", "w")
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    import httpx

    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"ppipe serve exited with {proc.returncode}; see {log.name}")
        try:
            if httpx.get(f"{url}/v2/health/ready", timeout=2).status_code == 200:
                return proc, url
        except httpx.HTTPError:
            pass
        time.sleep(1)
    proc.terminate()
    raise RuntimeError("ppipe serve did not get ready within 300 s")


def run(name: str, tmp: Path, traces: dict, duration_s: float, port: int, window_s: float, min_interval_s: float, seed: int) -> dict:
    from bench_serve import stop_server

    import httpx

    proc, url = start_server(tmp, port, name == "auto", window_s, min_interval_s)
    try:
        benches = []
        for i, (model, (path, rate)) in enumerate(traces.items()):
            out = tmp / f"{name}-{i}.json"
            cmd = [sys.executable, "-m", "ppipe.cli", "bench", url, "--model", model, "--arrivals", "trace", "--trace", str(path),
                   "--rate", f"{rate:.6f}", "--duration-s", str(duration_s), "--seed", str(seed + i), "--json-out", str(out),
                   "--binary", "--token", TOKEN, "--input-shape", "16"]
            benches.append((model, subprocess.Popen(cmd, stdout=subprocess.DEVNULL), out))
        results = {}
        for model, p, out in benches:
            p.wait()
            results[model] = json.loads(out.read_text())
        status = httpx.get(f"{url}/v2/admin/plan", headers={"authorization": f"Bearer {TOKEN}"}, timeout=10).json()
    finally:
        stop_server(proc)
    return {"results": results, "switches": status.get("switches", [])}


def report(name: str, r: dict, t0_wall_us: float | None = None) -> None:
    res = r["results"]
    sent = sum(x["sent"] for x in res.values())
    answered = sum(x["ok"] + sum(x["drops"].values()) + sum(x["errors"].values()) for x in res.values())
    on_time = sum(x["on_time"] for x in res.values())
    print(f"\n== {name}: sent {sent}, answered {answered} (unanswered {sent - answered}), SLO attainment {100 * on_time / max(1, sent):.2f} %")
    for model, x in res.items():
        print(f"   {model}: sent {x['sent']}, on time {100 * x['on_time'] / max(1, x['sent']):.2f} %, drops {x['drops']}, errors {x['errors']}")
    for i, s in enumerate(r["switches"]):
        print(f"   switch {i + 1}: {s.get('kept')} vGPUs kept, {s.get('started')} started, {s.get('retiring')} retired; "
              f"loading {s.get('load_s', 0):.2f} s, switch step {s.get('switch_us', 0) / 1e3:.2f} ms")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", default="atss_r101_fpn_1x_coco,rtmdet_x_8xb32-300e_coco", help="two PPipe-artifact models")
    ap.add_argument("--peak", type=float, default=1.2, help="each model's peak demand, as a multiple of the smaller planned capacity")
    ap.add_argument("--duration-s", type=float, default=600.0, help="arrival window of each run")
    ap.add_argument("--period-s", type=float, default=None, help="period of the mix (default: the duration)")
    ap.add_argument("--window-s", type=float, default=60.0, help="the controller's estimation window (--replan-window-s)")
    ap.add_argument("--min-interval-s", type=float, default=60.0, help="least time between switches (--replan-min-interval-s)")
    ap.add_argument("--runs", default="static,auto")
    ap.add_argument("--port", type=int, default=8613)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json-out", default=None)
    args = ap.parse_args()
    sys.stdout.reconfigure(line_buffering=True)
    from hostspeed import host_line

    print(host_line())
    if not (ARTIFACT / "block-timing").is_dir():
        print(f"skipped: PPipe artifact not found at {ARTIFACT} (set PPIPE_ARTIFACT)")
        return
    out = {}
    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        plan, _ = make_plans(args.models.split(","), tmp)  # a.yaml: the max-min plan for equal weights
        print("plan (equal weights): " + ", ".join(f"{m.name} {m.throughput_rps:.0f} req/s" for m in plan.models) + f"; {len(plan.placement)} vGPUs")
        traces = write_traces(plan, args.peak, args.duration_s, args.period_s or args.duration_s, args.seed, tmp)
        for name in args.runs.split(","):
            out[name] = run(name, tmp, traces, args.duration_s, args.port, args.window_s, args.min_interval_s, args.seed)
            report(name, out[name])
            if name == "auto":
                tail = (tmp / "serve-auto.log").read_text().splitlines()
                for line in tail:
                    if "re-plan" in line:
                        print(f"   log: {line.strip()[:220]}")
    if args.json_out:
        Path(args.json_out).write_text(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
