#!/usr/bin/env python
"""Planner benchmark at fleet scale: 1,000 GPUs of six types, ten models, max-min (issue 38).

The cluster (:func:`fleet_cluster`): A100, V100, L4, A10, T4 and P4 on servers of 4-8
GPUs, 1,000 GPUs in all, every NIC 50 Gbit/s nominal at the paper's efficiency of 1/5
(10 Gbit/s effective); vGPU levels 1-4 except on the P4 (level 1, as the artifact times it).

The models: the first ten of the artifact's ``model_list.txt`` (the paper's evaluation
models), equal weights. The artifact times L4, P4, T4 and V100; the A100's and A10's rows
are derived (:func:`with_derived_types`): every block latency of the V100 times
:data:`A100_FROM_V100`, and of the L4 times :data:`A10_FROM_L4`, at the same level and
batch. Those two factors are this benchmark's assumption (a rough ratio of the types'
dense throughput), not a measurement; what the benchmark measures is the planner.

One ``ppipe.plan(...)`` call per run with the default formulation (physical packing,
several configurations per template), the given time limit and maximum partitions. It
prints a host line (CPU, cores, Python, load average), then columns, status, objective,
proven gap, wall time and the process's peak RSS. With ``--replan``, the load then shifts
by ``--shift`` (that share of the total weight moves from the last half of the models to
the first half, e.g. 0.2: weights 1.4 and 0.6 instead of 1 and 1), and the fleet is
re-planned to ``--replan-gap`` twice: cold, and warm from the first plan (``warm_start``,
as ``ppipe serve --replan auto`` does), each line with the load average at its end and the
seconds of the planner's phases. Usage::

    nice -n 19 python scripts/bench_fleet.py --time-limit-s 60 --max-partitions 3
    nice -n 19 python scripts/bench_fleet.py --time-limit-s 60 --max-partitions 3 --replan
    nice -n 19 python scripts/bench_fleet.py --time-limit-s 300 --max-partitions 2

The artifact is read in place (``--artifact``, default ``../shared/data/ppipe-artifact``);
without it the script says so and exits with status 2.
"""

from __future__ import annotations

import argparse
import functools
import os
import platform
import resource
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

import ppipe  # noqa: E402
from ppipe.errors import UserError  # noqa: E402
from ppipe.spec.artifact import load_artifact_model  # noqa: E402
from ppipe.spec.cluster import ClusterSpec, GpuType, ServerGroup  # noqa: E402
from ppipe.spec.profile import ModelProfile  # noqa: E402

A100_FROM_V100 = 0.5  # A100 block latency = this x the V100's (same level and batch)
A10_FROM_L4 = 0.8  # A10 block latency = this x the L4's
NUM_MODELS = 10
# (type, vGPU levels, GPUs per server, servers): 1,000 GPUs.
FLEET = [
    ("A100", [1, 2, 3, 4], 8, 10),
    ("V100", [1, 2, 3, 4], 8, 15),
    ("L4", [1, 2, 3, 4], 8, 25),
    ("A10", [1, 2, 3, 4], 4, 40),
    ("T4", [1, 2, 3, 4], 4, 60),
    ("P4", [1], 4, 50),
]
NIC_GBPS = 50.0
BANDWIDTH_EFFICIENCY = 0.2  # the paper's: 50 Gbit/s nominal counts as 10


def fleet_cluster() -> ClusterSpec:
    """The 1,000-GPU, six-type cluster of issue 38 (see the module docstring)."""
    return ClusterSpec(
        name="fleet-1000",
        description="1,000 GPUs of six types (scripts/bench_fleet.py)",
        bandwidth_efficiency=BANDWIDTH_EFFICIENCY,
        gpu_types=[GpuType(name=k, vgpu_levels=lv) for k, lv, _s, _n in FLEET],
        servers=[ServerGroup(name=k.lower(), gpu_type=k, gpus_per_server=s, count=n, nic_bandwidth_gbps=NIC_GBPS)
                 for k, _lv, s, n in FLEET],
    )


def with_derived_types(p: ModelProfile) -> ModelProfile:
    """The profile with A100 rows (from the V100's) and A10 rows (from the L4's) added."""
    table = dict(p.table)
    bs1 = dict(p.manifest.latency_bs1_us)
    for new, src, factor in (("A100", "V100", A100_FROM_V100), ("A10", "L4", A10_FROM_L4)):
        for (gpu, v, b, blk), lat in p.table.items():
            if gpu == src:
                table[(new, v, b, blk)] = lat * factor
        if src in bs1:
            bs1[new] = bs1[src] * factor
    prov = dict(p.manifest.provenance)
    prov.update(A100=f"derived: V100 x {A100_FROM_V100} (scripts/bench_fleet.py)", A10=f"derived: L4 x {A10_FROM_L4} (scripts/bench_fleet.py)")
    manifest = p.manifest.model_copy(update=dict(latency_bs1_us=bs1, provenance=prov))
    return ModelProfile(manifest=manifest, table=table)


def fleet_models(artifact: Path, n: int = NUM_MODELS) -> list[ModelProfile]:
    """The first ``n`` models of the artifact's model_list.txt, with the derived types."""
    names = (artifact / "model_list.txt").read_text().split()[:n]
    return [with_derived_types(load_artifact_model(artifact, name)) for name in names]


def host_line() -> str:
    from hostspeed import cpu_model

    la = ", ".join(f"{x:.2f}" for x in os.getloadavg())
    return f"host: {cpu_model()}, {os.cpu_count()} cores, Python {platform.python_version()}; load average {la}"


def peak_rss_mib() -> float:
    """Peak resident set of this process so far, in MiB (Linux reports KiB)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--artifact", default=str(REPO.parent / "shared" / "data" / "ppipe-artifact"), help="PPipe artifact folder.")
    ap.add_argument("--time-limit-s", type=float, default=60.0, help="Time budget of the ppipe.plan call (its time_limit_s).")
    ap.add_argument("--max-partitions", type=int, default=3, help="D, at most this many partitions per pipeline.")
    ap.add_argument("--models", type=int, default=NUM_MODELS, help="How many models of model_list.txt to plan.")
    ap.add_argument("--gap", type=float, default=1e-4, help="Relative gap at which the solver stops.")
    ap.add_argument("--replan", action="store_true",
                    help="Then re-plan for a shifted load (--shift), cold and from the first plan (warm_start).")
    ap.add_argument("--shift", type=float, default=0.2,
                    help="Share of the total weight that the re-plan's load moves from the last half of the models to the first.")
    ap.add_argument("--replan-gap", type=float, default=0.01, help="Relative gap of the re-plans (ppipe.control.replan.REPLAN_GAP).")
    args = ap.parse_args(argv)
    art = Path(args.artifact)
    if not (art / "block-timing").is_dir() or not (art / "model_list.txt").is_file():
        print(f"skipped: the PPipe artifact is not at {art} (pass --artifact; the data is never copied into the repo)", file=sys.stderr)
        return 2
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    print(host_line(), flush=True)
    cluster = fleet_cluster()
    models = fleet_models(art, args.models)
    print(f"cluster {cluster.name}: " + ", ".join(f"{k} {n}" for k, n in cluster.gpu_counts.items())
          + f"; {len(models)} models; max partitions {args.max_partitions}; time limit {args.time_limit_s:g} s", flush=True)
    kw = dict(max_partitions=args.max_partitions, time_limit_s=args.time_limit_s, gap=args.gap)
    plan = run("plan", cluster, models, **kw)
    if plan is None:
        return 1
    used = ", ".join(f"{k} {n}/{cluster.gpu_counts[k]}" for k, n in plan.gpus_used.items())
    print(f"GPUs used: {used}; pipelines {sum(len(m.pipelines) for m in plan.models)}")
    if args.replan:
        shifted = shifted_weights(len(models), args.shift)
        print(f"re-plans: weights {', '.join(f'{w:g}' for w in shifted)} (a {args.shift:.0%} shift), gap {args.replan_gap:g}", flush=True)
        rkw = {**kw, "gap": args.replan_gap}
        run("re-plan, cold", cluster, models, weights=shifted, phases=True, **rkw)
        run("re-plan, warm", cluster, models, weights=shifted, warm_start=plan, phases=True, **rkw)
    return 0


def shifted_weights(n: int, shift: float) -> list[float]:
    """Equal weights with ``shift`` of their total moved from the last half of the n models
    to the first half: 1 + 2 shift and 1 - 2 shift (n even; the middle model of an odd n
    keeps 1), so the shares move by ``shift`` in total variation."""
    if not 0 <= shift < 0.5:
        raise SystemExit(f"--shift must be in [0, 0.5), got {shift}")
    half = n // 2
    return [1 + 2 * shift] * half + [1.0] * (n % 2) + [1 - 2 * shift] * half


class Phases:
    """Seconds spent in the planner's phases during one plan call (wrapped module functions)."""

    TIMED = [("configurations", "ppipe.planner.api", "plan_configs"), ("NP relaxation", "ppipe.planner.colgen", "relaxation_rates"),
             ("estimate x_hat", "ppipe.planner.api", "_with_batch_build"), ("column generation", "ppipe.planner.colgen", "generate_columns"),
             ("restricted MILP", "ppipe.planner.colgen", "_restricted_solve"), ("headroom", "ppipe.planner.headroom", "add_headroom"),
             ("placement", "ppipe.planner.api", "_placed")]

    def __enter__(self):
        import importlib

        self.seconds: dict[str, float] = {}
        self._saved = []
        for label, mod_name, fn in self.TIMED:
            mod = importlib.import_module(mod_name)
            real = getattr(mod, fn, None)
            if real is None:
                continue  # a planner without that step (an older tree)
            self._saved.append((mod, fn, real))
            setattr(mod, fn, self._timed(label, real))
        return self

    def _timed(self, label, real):
        @functools.wraps(real)
        def wrapped(*a, **k):
            t0 = time.perf_counter()
            try:
                return real(*a, **k)
            finally:
                self.seconds[label] = self.seconds.get(label, 0.0) + time.perf_counter() - t0
        return wrapped

    def __exit__(self, *exc):
        for mod, fn, real in self._saved:
            setattr(mod, fn, real)

    def line(self) -> str:
        """The phases' seconds (nested ones are also in their callers': the estimate holds the
        NP relaxation and the configurations made on the way)."""
        return ", ".join(f"{k} {v:.2f} s" for k, v in self.seconds.items())


def run(label: str, cluster, models, phases: bool = False, **kw):
    """One ppipe.plan call and its line of figures (``phases``: and a line of the planner's
    phases); None (and the error printed) where it fails."""
    timer = Phases() if phases else None
    t0 = time.perf_counter()
    try:
        if timer is None:
            plan = ppipe.plan(cluster, models, **kw)
        else:
            with timer:
                plan = ppipe.plan(cluster, models, **kw)
    except UserError as err:
        print(f"{label}: error: {err}\nwall {time.perf_counter() - t0:.1f} s, peak RSS {peak_rss_mib():.0f} MiB", flush=True)
        return None
    wall = time.perf_counter() - t0
    s = plan.solver
    la = ", ".join(f"{x:.2f}" for x in os.getloadavg())
    print(f"{label}: columns {s.columns}, status {s.status}, objective {s.objective:.3f}, gap {s.gap:.3%}, nodes {s.nodes}, "
          f"method {s.method or 'b&b'}; wall {wall:.2f} s (planner {s.seconds:.2f} s), "
          f"peak RSS {peak_rss_mib():.0f} MiB; load average {la}", flush=True)
    if timer is not None:
        print(f"  phases: {timer.line()}", flush=True)
    return plan


if __name__ == "__main__":
    sys.exit(main())
