#!/usr/bin/env python
"""What deciding a plan with K schedulers costs: max load factor at 99 % with one scheduler
against K (``ppipe.dataplane.split``), in the simulator, on the paper's 24 main cases.

Each case (model group G1..G6 x cluster HC1-L..HC4-L) is planned as
``scripts/reproduce_fig6.py`` plans PPipe (the paper's formulation, SLO 5 x L4 batch 1,
margin 0.4, two partitions, Poisson weights 0.30/0.33/0.37; the PPipe artifact's profiles),
then swept twice with the same arrivals: the plan's one scheduler, and the plan's servers
in K groups with a scheduler each (arrivals dealt to the groups by their capacity). The
split's own figures come first: the share of each model's capacity the groups keep and
each group's share. The issue's target: two schedulers cost at most 2 points of max load
factor. What it leaves out: the runtime's costs (the schedulers' processes, the messages
between ingress and schedulers), which `scripts/bench_serve.py` measures.

    python scripts/bench_split.py                          # 24 cases, K = 2, 10 s points
    python scripts/bench_split.py --groups G1 --clusters HC1-L --k 2 --duration-s 10
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import reproduce_fig6 as fig6  # noqa: E402
from hostspeed import host_line  # noqa: E402


def case(task: tuple) -> dict:
    group, cluster_name, k, duration_s, artifact = task
    from ppipe.dataplane.split import build_split_scheduler, split_report, split_servers
    from ppipe.sim import SimConfig, sweep
    from ppipe.sim.simulator import default_feedback
    from ppipe.sim.sweep import base_rates
    from ppipe.spec.artifact import load_artifact_model
    from ppipe.spec.cluster import load_cluster

    t0 = time.perf_counter()
    profiles = [load_artifact_model(artifact, fig6.resolve(artifact, s)) for s in fig6.GROUPS[group]]
    cluster = load_cluster(cluster_name)
    plan = fig6._plan(cluster, profiles, "ppipe", 0.4, 2, fig6.WEIGHTS["poisson"])
    rates = base_rates(plan)
    cfg = SimConfig(duration_s=duration_s, seed=0, feedback=default_feedback("reservation"))
    by_name = {p.name: p for p in profiles}
    one = sweep(plan, by_name, cluster, rates_rps=rates, config=cfg, search="guided")
    split = sweep(plan, by_name, cluster, rates_rps=rates, config=cfg, search="guided",
                  scheduler_factory=lambda pl, pr, cl, clock: build_split_scheduler(pl, pr, cl, clock, k))
    report = split_report(plan, split_servers(plan, k))
    return {"group": group, "cluster": cluster_name, "one": one.max_load, "split": split.max_load, "report": report,
            "wall_s": time.perf_counter() - t0}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--groups", default=",".join(fig6.GROUPS), help="model groups, comma-separated")
    ap.add_argument("--clusters", default=",".join(fig6.CLUSTERS), help="clusters, comma-separated")
    ap.add_argument("--k", type=int, default=2, help="schedulers per plan")
    ap.add_argument("--duration-s", type=float, default=10.0, help="simulated seconds per load point")
    ap.add_argument("--artifact", default=str(fig6.DEFAULT_ARTIFACT), help="the PPipe artifact folder")
    ap.add_argument("--jobs", type=int, default=1, help="cases at once (processes)")
    args = ap.parse_args()
    artifact = Path(args.artifact)
    if not (artifact / "model_list.txt").exists():
        print(f"error: no PPipe artifact at {artifact}; give --artifact", file=sys.stderr)
        return 2
    print(host_line())
    print(f"load average {os.getloadavg()[0]:.2f}; K = {args.k}, {args.duration_s:g} s per point, guided sweep, seed 0")
    tasks = [(g, c, args.k, args.duration_s, artifact) for c in args.clusters.split(",") for g in args.groups.split(",")]
    with mp.get_context("spawn").Pool(args.jobs) as pool:
        results = pool.map(case, tasks) if args.jobs > 1 else [case(t) for t in tasks]
    diffs = []
    print(f"\n{'case':14s} {'model':28s} {'kept':>6s} {'one':>6s} {'split':>6s} {'diff':>6s}")
    for r in results:
        shares = " / ".join(f"{s:.2f}" for s in r["report"]["shares"])
        print(f"{r['group']} {r['cluster']:9s}  groups' shares {shares} ({'balanced' if r['report']['balanced'] else 'NOT balanced'}), "
              f"{r['wall_s']:.0f} s")
        for m, one in r["one"].items():
            split = r["split"][m]
            d = (split or 0.0) - (one or 0.0)
            diffs.append(d)
            print(f"{'':14s} {m[:28]:28s} {r['report']['kept'].get(m, 0.0):6.3f} {one or 0:6.2f} {split or 0:6.2f} {d:+6.2f}")
    mean = sum(diffs) / len(diffs)
    worst = min(diffs)
    verdict = "met" if mean >= -0.02 else "NOT met"
    print(f"\nbench_split: K = {args.k} costs {max(0.0, -mean) * 100:.1f} points of max load factor on average over {len(diffs)} models "
          f"(worst {max(0.0, -worst) * 100:.0f}); target 2 points: {verdict}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
