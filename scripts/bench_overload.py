#!/usr/bin/env python
"""Overload of `ppipe serve`, JSON and binary: 3x its capacity, then 0.5x (no GPU needed).

The README's local plan (`ppipe plan local-cpu resnet50 --slo-ms 1500`), served as a user
serves it (`ppipe serve --backend emulated --token ...`, a subprocess). For each encoding:

1. its capacity C on this host: the highest of (1.0, 0.8, 0.6, 0.4, 0.2) x the planned rate
   at which >= 99 % of requests are answered 200 within the SLO (JSON is often bounded by
   decoding ResNet-50's 600 kB input on the frontend's cores, not by the plan);
2. Poisson arrivals at 3 C for ``--phase-s`` seconds, then at 0.5 C for as long, from one
   client process (the second phase starts on time, whatever the first is waiting for).

It prints what issue 20 asks: every request answered (200, or 503 with its reason) and
within SLO + 1 s; goodput during the overload (answers 200 within the SLO, per second) as a
share of C (target >= 90 %); the share on time of the requests sent from 5 s after the
overload ends (target >= 99 %).

    python scripts/bench_overload.py
    python scripts/bench_overload.py --encodings binary --phase-s 5
"""

from __future__ import annotations

import argparse
import asyncio
import os
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "scripts"))
TOKEN = "overload"
PORT = 18431


def start_server(tmp: Path) -> tuple[subprocess.Popen, str, float, float]:
    """Plan and serve the README's local plan; returns (process, url, planned req/s, SLO ms)."""
    from ppipe.runtime.client.httpclient import wait_until_ready
    from ppipe.spec.plan import load_plan

    plan_file = tmp / "r50.yaml"
    subprocess.run([sys.executable, "-m", "ppipe.cli", "plan", "local-cpu", "resnet50", "--slo-ms", "1500", "-o", str(plan_file)],
                   check=True, stdout=subprocess.DEVNULL)
    plan = load_plan(plan_file)
    proc = subprocess.Popen([sys.executable, "-m", "ppipe.cli", "serve", str(plan_file), "--backend", "emulated", "--token", TOKEN,
                             "--port", str(PORT), "--shards", "1"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            env={**os.environ, "RAY_ADDRESS": ""})
    url = f"http://127.0.0.1:{PORT}"
    wait_until_ready(url, proc, timeout_s=300)
    return proc, url, plan.models[0].throughput_rps, plan.models[0].slo_ms


async def one_run(url: str, rate: float, duration_s: float, binary: bool, seed: int, delay_s: float = 0.0) -> list:
    from ppipe.runtime.client.bench import run_bench

    await asyncio.sleep(delay_s)
    records: list = []
    await run_bench(url, "resnet50", rate, duration_s, binary=binary, seed=seed, token=TOKEN, records=records)
    return [(t + delay_s, outcome, ms) for t, outcome, ms in records]


def on_time_share(records, slo_ms: float) -> float:
    return sum(o == "200" and ms <= slo_ms for _, o, ms in records) / max(1, len(records))


def capacity(url: str, planned: float, slo_ms: float, binary: bool, seconds: float) -> float:
    for f in (1.0, 0.8, 0.6, 0.4, 0.2):
        share = on_time_share(asyncio.run(one_run(url, f * planned, seconds, binary, 1)), slo_ms)
        print(f"   capacity scan: {f:.1f} x planned ({f * planned:.1f} req/s): {100 * share:.2f} % on time")
        if share >= 0.99:
            return f * planned
    return 0.0


def overload(url: str, cap: float, slo_ms: float, binary: bool, phase_s: float) -> dict:
    async def both():
        return await asyncio.gather(one_run(url, 3 * cap, phase_s, binary, 2), one_run(url, 0.5 * cap, phase_s, binary, 3, delay_s=phase_s))

    high, low = asyncio.run(both())
    records = high + low
    by: dict[str, int] = {}
    for _, o, _ in records:
        by[o] = by.get(o, 0) + 1
    answered = sum(v for k, v in by.items() if k == "200" or not (k.startswith("HTTP") or "Error" in k or "Timeout" in k))
    slowest = max((ms for _, _, ms in records), default=0.0)
    late_after = [r for r in low if r[0] >= phase_s + 5.0]
    return {"sent": len(records), "answered": answered, "by_outcome": by, "slowest_answer_ms": slowest,
            "within_slo_plus_1s": slowest <= slo_ms + 1000.0,
            "overload_goodput_share": sum(o == "200" and ms <= slo_ms for _, o, ms in high) / phase_s / cap,
            "on_time_5s_after": on_time_share(late_after, slo_ms), "after_count": len(late_after)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--encodings", default="binary,json")
    ap.add_argument("--phase-s", type=float, default=10.0, help="length of the overload phase and of the recovery phase")
    ap.add_argument("--scan-s", type=float, default=6.0, help="length of each capacity-scan run")
    args = ap.parse_args()
    sys.stdout.reconfigure(line_buffering=True)
    from bench_serve import stop_server
    from hostspeed import host_line

    print(host_line())
    with tempfile.TemporaryDirectory() as d:
        proc, url, planned, slo = start_server(Path(d))
        try:
            print(f"resnet50 on local-cpu, emulated workers: planned {planned:.1f} req/s, SLO {slo:.0f} ms")
            for enc in args.encodings.split(","):
                binary = enc == "binary"
                print(f"\n== {enc}")
                cap = capacity(url, planned, slo, binary, args.scan_s)
                if not cap:
                    print("   capacity: below 0.2 x planned on this host; skipped")
                    continue
                r = overload(url, cap, slo, binary, args.phase_s)
                print(f"   capacity C = {cap:.1f} req/s; 3 C for {args.phase_s:g} s, then 0.5 C for {args.phase_s:g} s")
                print(f"   sent {r['sent']}, answered {r['answered']} (200 or 503 with a reason), by outcome {r['by_outcome']}")
                print(f"   slowest answer {r['slowest_answer_ms']:.0f} ms: within SLO + 1 s: {r['within_slo_plus_1s']}")
                print(f"   goodput during the overload: {100 * r['overload_goodput_share']:.1f} % of C (target >= 90 %)")
                print(f"   on time from 5 s after the overload: {100 * r['on_time_5s_after']:.2f} % of {r['after_count']} "
                      f"(target >= 99 %)")
        finally:
            stop_server(proc)


if __name__ == "__main__":
    main()
