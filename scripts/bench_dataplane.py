#!/usr/bin/env python
"""Micro-benchmark of the data plane: time per dispatch decision and probe() calls per dispatch.

Plans a model group from the PPipe artifact's real profiles on a 100-GPU cluster (HC2-L by
default) with ``ppipe.planner.api.plan`` (or loads ``--plan``), then drives
``build_scheduler`` with Poisson arrivals at a load factor of the planned throughput, under
a manual clock, with a minimal event loop (arrivals, WakeAt timers, a stage report at each
stage's planned end, optionally jittered). It is not the simulator: nothing models NIC
contention here, so the served fractions printed are the scheduler's own view, for
orientation only. What it measures is the scheduler's CPU time (``time.perf_counter``
around each call, outside the data plane) and its probe() counter.

Usage::

    python scripts/bench_dataplane.py                      # G2 on HC2-L, load 0.9, 5 s
    python scripts/bench_dataplane.py --group G1 --load 1.2 --seconds 10 --jitter 0.1
    python scripts/bench_dataplane.py --plan plan.yaml --profiles-from-artifact
    python scripts/bench_dataplane.py --policies reservation --greedy   # look-ahead vs the paper's greedy probe

Figures are noisy on a shared machine; report the median and p99 of several runs.
"""

from __future__ import annotations

import argparse
import heapq
import os
import statistics
import sys
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parent.parent
DEFAULT_ARTIFACT = Path(os.environ.get("PPIPE_ARTIFACT", REPO.parent / "shared" / "data" / "ppipe-artifact"))

# docs/planning-model.md, "The paper's settings": model groups and Poisson weights.
GROUPS = {
    "G1": ["efficientnet-b8_3rdparty_8xb32-aa-advprop_in1k", "encnet_r101-d8_4xb2-40k_cityscapes-512x1024", "rtmdet_x_8xb32-300e_coco"],
    "G2": ["colorization-v2", "googlenet-v3-pytorch", "repvgg-b3"],
    "G3": ["apcnet_r101-d8_4xb2-40k_cityscapes-512x1024", "atss_r101_fpn_1x_coco", "gcnet_r101-d8_4xb2-40k_cityscapes-512x1024"],
    "G4": ["fcn-d6_r101-d16_4xb2-40k_cityscapes-512x1024", "gfl_x101-32x4d_fpn_ms-2x_coco", "wide_resnet101_2"],
    "G5": ["centernet-update_r50-caffe_fpn_ms-1x_coco", "convnext_large", "dnl_r101-d8_4xb2-40k_cityscapes-512x1024"],
    "G6": ["fsaf_r101_fpn_1x_coco", "nonlocal_r101-d8_4xb2-40k_cityscapes-512x1024", "tf_efficientdet_d1"],
}
POISSON_WEIGHTS = [0.30, 0.33, 0.37]


def make_plan(args, profiles):
    from ppipe.planner.api import plan

    names = list(profiles)
    t0 = time.perf_counter()
    p = plan(
        args.cluster,
        [profiles[n] for n in names],
        formulation=args.formulation,
        max_partitions=args.max_partitions,
        weights={n: w for n, w in zip(names, POISSON_WEIGHTS)},
        time_limit_s=args.time_limit_s,
    )
    print(f"plan: {args.formulation} on {args.cluster} in {time.perf_counter() - t0:.1f} s "
          f"(solver {p.solver.name}, {p.solver.status}, objective {p.solver.objective:.2f})")
    return p


def describe(plan):
    vgpus = len(plan.placement)
    gpus = sum(plan.gpus_used.values()) if plan.gpus_used else "?"
    print(f"plan: {len(plan.models)} models, {sum(len(m.pipelines) for m in plan.models)} pipelines, "
          f"{vgpus} vGPUs on {gpus} GPUs")
    for m in plan.models:
        pipes = ", ".join(
            f"b{pp.batch}:" + "+".join(f"{q.gpu}/{q.vgpu}x{q.count}" for q in pp.partitions) for pp in m.pipelines
        )
        print(f"  {m.name[:40]:40s} SLO {m.slo_ms:7.1f} ms  planned {m.throughput_rps:8.1f} req/s  [{pipes}]")


def run(plan, profiles, cluster, policy, args, options):
    from ppipe.dataplane import Dispatch, Request, StageReport, WakeAt, build_scheduler
    from ppipe.dataplane.testing import ManualClock

    clock = ManualClock()
    sched = build_scheduler(plan, profiles, cluster, clock, policy=policy, **options)
    rng = np.random.default_rng(args.seed)
    ev: list = []
    seq = 0
    horizon_us = args.seconds * 1e6
    n_req = 0
    for m in plan.models:
        rate = m.throughput_rps * args.load
        if rate <= 0:
            continue
        gaps = rng.exponential(1e6 / rate, size=int(rate * args.seconds * 1.2) + 10)
        ts = np.cumsum(gaps)
        ts = ts[ts < horizon_us]
        slo_us = m.slo_ms * 1000.0
        for t in ts:
            heapq.heappush(ev, (float(t), 1, seq, "arrive", Request(seq, m.name, float(t), float(t) + slo_us)))
            seq += 1
            n_req += 1
    jit = rng.random
    call_us: list[float] = []
    dispatch_call_us: list[float] = []
    served = 0
    late_in_plan = 0
    batch_sizes: list[int] = []
    t_total = 0.0

    def apply(decisions):
        nonlocal seq, served, late_in_plan
        for d in decisions:
            if isinstance(d, Dispatch):
                if d.stages[0].partition == 0:  # one-stage policies dispatch a request once per partition
                    served += d.batch
                batch_sizes.append(d.batch)
                if d.finish_us > min(r.deadline_us for r in d.requests) + 1e-6:
                    late_in_plan += d.batch
                shift = 0.0
                for st in d.stages:
                    dur = st.infer_us * (1.0 + args.jitter * (2 * jit() - 1))
                    start = st.start_us + shift
                    shift += dur - st.infer_us
                    rep = StageReport(d.batch_id, st.partition, st.vgpu_id, start, start + dur, st.transfer_start_us,
                                      None if st.transfer_start_us is None else st.transfer_start_us + st.transfer_us)
                    heapq.heappush(ev, (start + dur, 2, seq, "report", rep))
                    seq += 1
            elif isinstance(d, WakeAt):
                heapq.heappush(ev, (d.t_us, 3, seq, "wake", None))
                seq += 1

    pc = time.perf_counter
    tc = time.thread_time
    cpu_us: list[float] = []
    dispatch_cpu_us: list[float] = []
    while ev:
        t, _p, _s, kind, x = heapq.heappop(ev)
        clock.t_us = max(clock.t_us, t)
        c0 = tc()
        t0 = pc()
        if kind == "arrive":
            out = sched.submit(x)
        elif kind == "wake":
            out = sched.wake()
        else:
            out = sched.report(x)
        dt = (pc() - t0) * 1e6
        dc = (tc() - c0) * 1e6
        t_total += dc
        call_us.append(dt)
        cpu_us.append(dc)
        nd = sum(1 for d in out if isinstance(d, Dispatch))
        if nd == 1 and kind != "report":
            dispatch_call_us.append(dt)
            dispatch_cpu_us.append(dc)
        apply(out)
    st = sched.stats()
    q = np.percentile
    print(f"\n[{policy}{' ' + str(options) if options else ''}] load {args.load}, {args.seconds:g} s, {n_req} requests, jitter {args.jitter}")
    print(f"  dispatch decision (a submit/wake call that dispatched one batch, n={len(dispatch_call_us)}):")
    print(f"    wall (perf_counter): median {statistics.median(dispatch_call_us):.1f} us, p99 {q(dispatch_call_us, 99):.1f} us")
    print(f"    CPU (thread_time):   median {statistics.median(dispatch_cpu_us):.1f} us, p99 {q(dispatch_cpu_us, 99):.1f} us")
    print(f"  all scheduler calls (submit, wake, report; n={len(call_us)}): wall median {statistics.median(call_us):.1f} us, "
          f"p99 {q(call_us, 99):.1f} us; CPU of all calls per dispatch {t_total / max(st['dispatches'], 1):.1f} us")
    print(f"  probe() calls per dispatch: {st['probes_per_dispatch']:.2f}  ({st['probes']} probes, {st['dispatches']} dispatches, "
          f"{st['waits']} waits)")
    print(f"  mean batch {np.mean(batch_sizes):.2f}; dispatched {served}/{n_req} ({100 * served / max(n_req, 1):.1f} %), "
          f"late in plan {late_in_plan}; drops {st['drops']}")
    return statistics.median(dispatch_cpu_us) if dispatch_cpu_us else float("nan")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--artifact", type=Path, default=DEFAULT_ARTIFACT, help="PPipe artifact folder")
    ap.add_argument("--cluster", default="HC2-L", help="cluster name or YAML (default HC2-L, 100 GPUs)")
    ap.add_argument("--group", default="G2", choices=sorted(GROUPS), help="model group of the paper")
    ap.add_argument("--plan", type=Path, help="use this plan.yaml instead of planning (profiles from the artifact)")
    ap.add_argument("--save-plan", type=Path, help="write the plan made here")
    ap.add_argument("--formulation", default="ppipe-atc25", help="planner formulation (default: the paper's)")
    ap.add_argument("--max-partitions", type=int, default=2)
    ap.add_argument("--time-limit-s", type=float, default=60.0)
    ap.add_argument("--load", type=float, default=0.9, help="load factor (1.0 = planned throughput)")
    ap.add_argument("--seconds", type=float, default=5.0, help="seconds of arrivals (virtual time)")
    ap.add_argument("--jitter", type=float, default=0.0, help="uniform +-share of inference time in the reports")
    ap.add_argument("--policies", default="reservation,reactive")
    ap.add_argument("--overload-fix", type=int, default=0,
                    help="also run reservation with min_batch_on_overload=K and defer_small_batches")
    ap.add_argument("--greedy", action="store_true",
                    help="also run reservation with probe_lookahead=False (the paper's exact greedy probe)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--repeat", type=int, default=1,
                    help="run each policy N times; on a busy machine the smallest median is the least disturbed")
    args = ap.parse_args(argv)

    if not (args.artifact / "block-timing").is_dir():
        print(f"PPipe artifact not found at {args.artifact} (set PPIPE_ARTIFACT or --artifact)", file=sys.stderr)
        return 2
    from ppipe.spec.artifact import load_artifact_model
    from ppipe.spec.cluster import load_cluster
    from ppipe.spec.plan import load_plan

    cluster = load_cluster(args.cluster)
    if args.plan:
        plan = load_plan(args.plan)
        profiles = {m.name: load_artifact_model(args.artifact, m.name) for m in plan.models}
    else:
        profiles = {n: load_artifact_model(args.artifact, n) for n in GROUPS[args.group]}
        plan = make_plan(args, profiles)
        if args.save_plan:
            plan.save(args.save_plan)
    describe(plan)
    for policy in [p.strip() for p in args.policies.split(",") if p.strip()]:
        medians = [run(plan, profiles, cluster, policy, args, {}) for _ in range(max(1, args.repeat))]
        if len(medians) > 1:
            print(f"  [{policy}] CPU median per dispatch decision over {len(medians)} runs: "
                  f"best {min(medians):.1f} us, worst {max(medians):.1f} us")
    if args.greedy:
        run(plan, profiles, cluster, "reservation", args, {"probe_lookahead": False})
    if args.overload_fix:
        run(plan, profiles, cluster, "reservation", args, {"min_batch_on_overload": args.overload_fix, "defer_small_batches": True})
    return 0


if __name__ == "__main__":
    sys.exit(main())
