#!/usr/bin/env python
"""Micro-benchmark of the reservation probe (``ReservationScheduler.probe``) on real plans.

Plans two of the paper's cases from the PPipe artifact's profiles (``ppipe-atc25``
formulation, at most 2 partitions): model group G1 on HC1-L (efficientnet-b8's pool of
dozens of P4 vGPUs) and G2 on HC2-L. Each is replayed under a manual clock with Poisson
arrivals at ``--load`` times the planned rates, every stage reported at its planned start
with a uniform jitter of its duration (so feedback correction moves reservations), with the
look-ahead probe (the default) and the paper's greedy one (``probe_lookahead=False``).

Printed per case: the mean wall time of one ``probe`` call (``perf_counter`` around each
call), the scheduler's mean wall time per dispatched batch over all its calls (submit,
wake, report), probes per dispatch, and a digest of every decision taken.

``--baseline REV`` runs the probe of git revision REV (its ``ppipe/dataplane/reservation.py``
and ``topology.py``: the probe and the pools' indexes; the working tree's other modules)
in lockstep with the working tree's: both get every event, one after the other (alternating which goes first), and
their decisions must be equal. On a shared host this pairs each call with its twin under
the same load; the calls the host interrupted (a pair's slower call above 5 times the
median of its kind) are left out of both sums, and the share left out is printed.

Usage::

    python scripts/bench_probe.py                          # the working tree
    python scripts/bench_probe.py --baseline HEAD~3 --seconds 5
"""

from __future__ import annotations

import argparse
import hashlib
import heapq
import importlib.util
import os
import random
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
OUTLIER = 5.0


def make_plan(artifact: Path, case: str):
    """The case's plan (max-min, the paper's formulation) and its profiles."""
    from ppipe.planner.api import plan
    from ppipe.spec.artifact import load_artifact_model

    cluster, names = CASES[case]
    profiles = {n: load_artifact_model(artifact, n) for n in names}
    p = plan(cluster, list(profiles.values()), formulation="ppipe-atc25", max_partitions=2,
             weights=dict(zip(names, WEIGHTS)), time_limit_s=60.0)
    biggest = max(q.count for m in p.models for pp in m.pipelines for q in pp.partitions)
    print(f"plan {case}: {len(p.models)} models, {sum(len(m.pipelines) for m in p.models)} pipelines, "
          f"{len(p.placement)} vGPUs (largest pool {biggest})")
    return p, profiles


def arrivals(plan, load: float, seconds: float, seed: int):
    from ppipe.dataplane import Request

    rnd = random.Random(seed)
    out = []
    for m in plan.models:
        rate_per_us, slo_us, t = m.throughput_rps * load / 1e6, m.slo_ms * 1000.0, 0.0
        while True:
            t += rnd.expovariate(rate_per_us)
            if t >= seconds * 1e6:
                break
            out.append((t, m.name, slo_us))
    out.sort()
    return [Request(i, name, t, t + slo_us) for i, (t, name, slo_us) in enumerate(out)]


class Timed:
    """A scheduler whose probe() calls are timed (the batcher calls ``self.probe``)."""

    def __init__(self, sched, clock):
        self.sched, self.clock = sched, clock
        self.probe_s = 0.0
        real = sched.probe
        pc = time.perf_counter

        def timed_probe(pipeline, bs, t0=None):
            a = pc()
            r = real(pipeline, bs, t0)
            self.probe_s += pc() - a
            return r

        sched.probe = timed_probe

    def call(self, kind, x, t):
        """(decisions, wall s of the call, wall s inside probe)."""
        self.clock.t_us = max(self.clock.t_us, t)
        p0 = self.probe_s
        a = time.perf_counter()
        out = self.sched.submit(x) if kind == "arrive" else self.sched.wake() if kind == "wake" else self.sched.report(x)
        return out, time.perf_counter() - a, self.probe_s - p0


def replay(scheds: list[Timed], reqs, jitter: float, seed: int) -> list[dict]:
    """Drive every scheduler through the same events; returns per scheduler its figures."""
    from ppipe.dataplane import Dispatch, StageReport, WakeAt

    rnd = random.Random(seed)
    ev = [(r.arrival_us, 1, i, "arrive", r) for i, r in enumerate(reqs)]
    heapq.heapify(ev)
    seq = len(ev)
    digest = hashlib.sha256()
    rows: list[tuple[str, list[float], list[float]]] = []  # (kind, call s per scheduler, probe s per scheduler)
    n = 0
    while ev:
        t, _p, _s, kind, x = heapq.heappop(ev)
        order = range(len(scheds)) if n % 2 == 0 else range(len(scheds) - 1, -1, -1)
        n += 1
        res = [None] * len(scheds)
        for i in order:
            res[i] = scheds[i].call(kind, x, t)
        out = res[0][0]
        if any(r[0] != out for r in res[1:]):
            raise SystemExit(f"the two probes decided differently at t={t:.3f} us ({kind})")
        rows.append((kind, [r[1] for r in res], [r[2] for r in res]))
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
    # Leave out the events whose slower call the host interrupted, for every scheduler alike.
    medians = {k: statistics.median(max(r[1]) for r in rows if r[0] == k) for k in {r[0] for r in rows}}
    kept = [r for r in rows if max(r[1]) <= OUTLIER * medians[r[0]]]
    stats = scheds[0].sched.stats()
    out = []
    for i in range(len(scheds)):
        out.append({
            "probe_us": 1e6 * sum(r[2][i] for r in kept) / max(stats["probes"], 1) * len(rows) / len(kept),
            "us_per_dispatch": 1e6 * sum(r[1][i] for r in kept) / max(stats["dispatches"], 1) * len(rows) / len(kept),
            "left_out": 1 - len(kept) / len(rows),
            "probes_per_dispatch": stats["probes_per_dispatch"],
            "dispatches": stats["dispatches"],
            "digest": digest.hexdigest()[:16],
        })
    return out


def load_baseline(rev: str, name: str):
    """Module ``ppipe/dataplane/<name>.py`` at git revision ``rev`` (its ``ppipe`` imports: the working tree's)."""
    src = subprocess.run(["git", "-C", str(REPO), "show", f"{rev}:ppipe/dataplane/{name}.py"], check=True,
                         capture_output=True, text=True).stdout
    path = Path(tempfile.mkdtemp(prefix="bench-probe-")) / f"baseline_{name}.py"
    path.write_text(src)
    spec = importlib.util.spec_from_file_location(f"baseline_{name}", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--artifact", type=Path, default=DEFAULT_ARTIFACT, help="PPipe artifact folder")
    ap.add_argument("--load", type=float, default=1.0, help="load factor (1.0 = planned throughput)")
    ap.add_argument("--seconds", type=float, default=3.0, help="seconds of arrivals (virtual time) per case")
    ap.add_argument("--jitter", type=float, default=0.1, help="uniform +-share of inference time in the reports")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--baseline", metavar="REV", help="also run reservation.py of this git revision, in lockstep")
    args = ap.parse_args(argv)

    if not (args.artifact / "block-timing").is_dir():
        print(f"skipped: PPipe artifact not found at {args.artifact} (set PPIPE_ARTIFACT or --artifact)")
        return 0
    sys.path.insert(0, str(REPO / "scripts"))
    from hostspeed import host_line

    from ppipe.dataplane import reservation, topology
    from ppipe.dataplane.options import SchedulerOptions
    from ppipe.dataplane.testing import ManualClock
    from ppipe.spec.cluster import load_cluster

    print(host_line())
    print(f"load {args.load}, {args.seconds:g} s of arrivals, jitter {args.jitter}, seed {args.seed}")
    versions = {"working tree": (topology, reservation)}
    if args.baseline:
        versions = {f"baseline {args.baseline}": (load_baseline(args.baseline, "topology"),
                                                  load_baseline(args.baseline, "reservation")), **versions}
    lines = []
    for case in CASES:
        plan, profiles = make_plan(args.artifact, case)
        cluster = load_cluster(plan.cluster)
        reqs = arrivals(plan, args.load, args.seconds, args.seed)
        for probe, options in PROBES.items():
            scheds = []
            for topo, res in versions.values():
                clock = ManualClock()
                s = res.ReservationScheduler(topo.compile_plan(plan, profiles, cluster), clock, SchedulerOptions.from_kwargs(options))
                scheds.append(Timed(s, clock))
            for name, r in zip(versions, replay(scheds, reqs, args.jitter, args.seed)):
                lines.append(f"{case:9s} {probe:9s} {name:22s} {r['probe_us']:13.2f} {r['us_per_dispatch']:21.1f} "
                             f"{r['probes_per_dispatch']:11.2f} {100 * r['left_out']:8.1f} %  {r['digest']} ({r['dispatches']} dispatches)")
    print(f"\n{'case':9s} {'probe':9s} {'code':22s} {'probe us/call':>13s} {'scheduler us/dispatch':>21s} "
          f"{'probes/disp':>11s} {'left out':>10s}  decisions")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
