#!/usr/bin/env python
"""Micro-benchmark of the reservation probe (``ReservationScheduler.probe``) on real plans.

Plans two of the paper's cases from the PPipe artifact's profiles (``ppipe-atc25``
formulation, at most 2 partitions): model group G1 on HC1-L (efficientnet-b8's pool of 75
P4 vGPUs) and G2 on HC2-L. Each case is replayed under a manual clock with Poisson arrivals
at ``--load`` times the planned rates, every stage reported at its planned start with a
uniform jitter of its duration (so feedback correction moves reservations), with the
look-ahead probe (the default) and the paper's greedy one (``probe_lookahead=False``).

Per run it prints: the mean wall time of one ``probe`` call (``perf_counter`` around each
call), the scheduler's CPU time (``thread_time``) per dispatched batch over all its calls
(submit, wake, report), probes per dispatch, and a digest of every decision the scheduler
took (so two versions of the code can be checked to decide the same).

``--baseline REV`` also runs the ``ppipe`` package of git revision REV (exported to a
temporary folder), alternating with the working tree, ``--repeat`` times each, and
prints both: timings of different code compare only within one such run.

Usage::

    python scripts/bench_probe.py                       # the working tree, 3 runs per case
    python scripts/bench_probe.py --baseline HEAD~3 --repeat 5 --seconds 3
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
DEFAULT_ARTIFACT = Path(os.environ.get("PPIPE_ARTIFACT", REPO.parent / "shared" / "data" / "ppipe-artifact"))

# docs/planning-model.md, "The paper's settings": model groups and Poisson weights.
CASES = {
    "G1/HC1-L": ("HC1-L", ["efficientnet-b8_3rdparty_8xb32-aa-advprop_in1k", "encnet_r101-d8_4xb2-40k_cityscapes-512x1024",
                           "rtmdet_x_8xb32-300e_coco"]),
    "G2/HC2-L": ("HC2-L", ["colorization-v2", "googlenet-v3-pytorch", "repvgg-b3"]),
}
WEIGHTS = [0.30, 0.33, 0.37]
PROBES = {"lookahead": {}, "greedy": {"probe_lookahead": False}}


def make_plans(artifact: Path, folder: Path) -> dict[str, Path]:
    """Plan every case once (with the working tree's planner) and save it as YAML."""
    from ppipe.planner.api import plan
    from ppipe.spec.artifact import load_artifact_model

    out = {}
    for case, (cluster, names) in CASES.items():
        profiles = [load_artifact_model(artifact, n) for n in names]
        p = plan(cluster, profiles, formulation="ppipe-atc25", max_partitions=2, weights=dict(zip(names, WEIGHTS)),
                 time_limit_s=60.0)
        path = folder / (case.replace("/", "-") + ".yaml")
        p.save(path)
        vgpus = len(p.placement)
        biggest = max(q.count for m in p.models for pp in m.pipelines for q in pp.partitions)
        print(f"plan {case}: {len(p.models)} models, {sum(len(m.pipelines) for m in p.models)} pipelines, "
              f"{vgpus} vGPUs (largest pool {biggest})")
        out[case] = path
    return out


def replay(plan_path: Path, artifact: Path, options: dict, load: float, seconds: float, jitter: float, seed: int) -> dict:
    """One timed run of the scheduler of whichever ``ppipe`` is on the path."""
    import heapq
    import random

    from ppipe.dataplane import Dispatch, Request, StageReport, WakeAt, build_scheduler
    from ppipe.dataplane.testing import ManualClock
    from ppipe.spec.artifact import load_artifact_model
    from ppipe.spec.cluster import load_cluster
    from ppipe.spec.plan import load_plan

    plan = load_plan(plan_path)
    profiles = {m.name: load_artifact_model(artifact, m.name) for m in plan.models}
    clock = ManualClock()
    sched = build_scheduler(plan, profiles, load_cluster(plan.cluster), clock, policy="reservation", **options)
    rnd = random.Random(seed)
    ev: list = []
    seq = 0
    for m in plan.models:
        rate = m.throughput_rps * load
        t, slo_us = 0.0, m.slo_ms * 1000.0
        while True:
            t += rnd.expovariate(rate / 1e6)
            if t >= seconds * 1e6:
                break
            ev.append((t, 1, seq, "arrive", Request(seq, m.name, t, t + slo_us)))
            seq += 1
    heapq.heapify(ev)

    pc = time.perf_counter
    probe_s = 0.0
    real_probe = sched.probe

    def timed_probe(pipeline, bs, t0=None):
        nonlocal probe_s
        a = pc()
        r = real_probe(pipeline, bs, t0)
        probe_s += pc() - a
        return r

    sched.probe = timed_probe  # the batcher calls self.probe: every probe is timed
    digest = hashlib.sha256()
    tc = time.thread_time
    cpu_s = 0.0
    while ev:
        t, _p, _s, kind, x = heapq.heappop(ev)
        clock.t_us = max(clock.t_us, t)
        c0 = tc()
        out = sched.submit(x) if kind == "arrive" else sched.wake() if kind == "wake" else sched.report(x)
        cpu_s += tc() - c0
        for d in out:
            digest.update(repr(d).encode())
            if isinstance(d, Dispatch):
                shift = 0.0
                for st in d.stages:
                    dur = st.infer_us * (1.0 + jitter * (2 * rnd.random() - 1))
                    start = st.start_us + shift
                    shift += dur - st.infer_us
                    end_tr = None if st.transfer_start_us is None else st.transfer_start_us + st.transfer_us
                    rep = StageReport(d.batch_id, st.partition, st.vgpu_id, start, start + dur, st.transfer_start_us, end_tr)
                    heapq.heappush(ev, (start + dur, 2, seq, "report", rep))
                    seq += 1
            elif isinstance(d, WakeAt):
                heapq.heappush(ev, (d.t_us, 3, seq, "wake", None))
                seq += 1
    st = sched.stats()
    return {
        "probe_us": 1e6 * probe_s / max(st["probes"], 1),
        "cpu_us_per_dispatch": 1e6 * cpu_s / max(st["dispatches"], 1),
        "probes": st["probes"],
        "dispatches": st["dispatches"],
        "digest": digest.hexdigest()[:16],
    }


def export_tree(rev: str, folder: Path) -> Path:
    """``ppipe/`` of git revision ``rev``, extracted under ``folder``."""
    archive = subprocess.run(["git", "-C", str(REPO), "archive", rev, "ppipe"], check=True, capture_output=True).stdout
    subprocess.run(["tar", "-x", "-C", str(folder)], input=archive, check=True)
    return folder


def run_worker(tree: Path, plan_path: Path, args, probe: str) -> dict:
    cmd = [sys.executable, __file__, "--worker", str(plan_path), "--probe", probe, "--artifact", str(args.artifact),
           "--load", str(args.load), "--seconds", str(args.seconds), "--jitter", str(args.jitter), "--seed", str(args.seed)]
    env = dict(os.environ, PYTHONPATH=str(tree))
    out = subprocess.run(cmd, check=True, capture_output=True, text=True, env=env).stdout
    return json.loads(out.strip().splitlines()[-1])


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--artifact", type=Path, default=DEFAULT_ARTIFACT, help="PPipe artifact folder")
    ap.add_argument("--load", type=float, default=1.0, help="load factor (1.0 = planned throughput)")
    ap.add_argument("--seconds", type=float, default=2.0, help="seconds of arrivals (virtual time) per run")
    ap.add_argument("--jitter", type=float, default=0.1, help="uniform +-share of inference time in the reports")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--repeat", type=int, default=3, help="runs per case and code version (the fastest is least disturbed)")
    ap.add_argument("--baseline", metavar="REV", help="also time the ppipe package of this git revision, alternately")
    ap.add_argument("--worker", type=Path, help=argparse.SUPPRESS)
    ap.add_argument("--probe", default="lookahead", choices=sorted(PROBES), help=argparse.SUPPRESS)
    args = ap.parse_args(argv)

    if not (args.artifact / "block-timing").is_dir():
        print(f"skipped: PPipe artifact not found at {args.artifact} (set PPIPE_ARTIFACT or --artifact)", file=sys.stderr)
        return 0
    if args.worker:
        res = replay(args.worker, args.artifact, PROBES[args.probe], args.load, args.seconds, args.jitter, args.seed)
        print(json.dumps(res))
        return 0

    sys.path.insert(0, str(REPO / "scripts"))
    from hostspeed import host_line

    print(host_line())
    print(f"load {args.load}, {args.seconds:g} s of arrivals, jitter {args.jitter}, seed {args.seed}, {args.repeat} runs each")
    with tempfile.TemporaryDirectory(prefix="bench-probe-") as tmp:
        tmp = Path(tmp)
        plans = make_plans(args.artifact, tmp)
        trees = {"working tree": REPO}
        if args.baseline:
            trees = {f"baseline {args.baseline}": export_tree(args.baseline, Path(tempfile.mkdtemp(dir=tmp))), **trees}
        results: dict[tuple[str, str, str], list[dict]] = {}
        for _ in range(args.repeat):
            for case, plan_path in plans.items():
                for probe in PROBES:
                    for name, tree in trees.items():  # alternate the versions: the host's drift hits both
                        results.setdefault((case, probe, name), []).append(run_worker(tree, plan_path, args, probe))
    print(f"\n{'case':10s} {'probe':9s} {'code':22s} {'probe us/call (min, median)':>28s} "
          f"{'sched CPU us/dispatch (min, median)':>36s} {'probes/disp':>11s}  decisions")
    for (case, probe, name), runs in results.items():
        p = [r["probe_us"] for r in runs]
        c = [r["cpu_us_per_dispatch"] for r in runs]
        digests = sorted({r["digest"] for r in runs})
        print(f"{case:10s} {probe:9s} {name:22s} {min(p):14.2f} {statistics.median(p):13.2f} "
              f"{min(c):18.1f} {statistics.median(c):17.1f} {runs[0]['probes'] / max(runs[0]['dispatches'], 1):11.2f}  "
              f"{','.join(digests)} ({runs[0]['dispatches']} dispatches)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
