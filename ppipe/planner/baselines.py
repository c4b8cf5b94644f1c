"""The paper's baselines as planners: NP (no partitioning) and DART-r.

* **NP**: the same MILP with one partition per pipeline and no MPS (level 1 only).
* **DART-r**: for each model take NP's GPU split, GPUs that NP leaves idle shared evenly
  among the models (remainder to the first models); then with a high-class count a and a
  low-class count b, replicate the best two-partition pipeline on 1 high + 1 low whole
  GPU (either order, one batch, SLO met) min(a, b) times, each replica a pipeline of its
  own (DART's pairs are fixed, not pooled), and run the surplus GPUs whole-model (one
  pooled single-partition pipeline with the best level-1 configuration of that type).
"""

from __future__ import annotations

import bisect

import numpy as np

from ppipe.errors import UserError
from ppipe.planner.configs import ModelSpec, enumerate_configs
from ppipe.spec.cluster import ClusterSpec
from ppipe.spec.plan import ModelPlan, PartitionPlan, PipelinePlan


def np_levels(levels: list[dict[str, list[int]]]) -> list[dict[str, list[int]]]:
    """Level 1 only (no MPS)."""
    return [{k: [v for v in lv if v == 1] for k, lv in per_model.items()} for per_model in levels]


def whole_gpu_estimate(spec: ModelSpec, cluster: ClusterSpec, margin: float) -> float:
    """The authors' single-model batch-build estimate x_hat (``get_baseline_plan`` of their
    ``run_ilp_v4_in_batch.py``, which their single-model runs use instead of the NP MILP).

    Every GPU of type k runs the whole model at level 1 with the largest batch b_k whose
    latency L_k(b) = sum_i L[k, 1, b, i] (not clipped to 1 us) plus the margin
    round(margin T) stays below the SLO T (``bisect_left`` over the batches in order:
    the number of batches whose latency is < T); x_hat = sum_k N_k b_k 1e6 / L_k(b_k),
    over the types where b_k >= 1 (0 if none).
    """
    slo_us = spec.slo_ms * 1000.0
    margin_us = round(margin * slo_us)
    prof = spec.profile
    total = 0.0
    for g in cluster.gpu_types:
        batches = sorted(prof.batches(g.name, 1))
        lat = [sum(prof.table[(g.name, 1, b, i)] for i in range(prof.num_blocks)) for b in batches]
        bs = bisect.bisect_left([t + margin_us for t in lat], slo_us)
        if bs > 0:
            total += cluster.gpu_counts[g.name] * batches[bs - 1] * 1e6 / lat[bs - 1]
    return total


def high_low(cluster: ClusterSpec, specs: list[ModelSpec]) -> tuple[str, str]:
    """(high-class, low-class) GPU type: the faster one by total batch-1 model latency."""
    types = list(cluster.gpu_counts)
    if len(types) != 2:
        raise UserError(
            f"the DART-r baseline pairs one high-class and one low-class GPU, but cluster '{cluster.name}' has "
            f"{len(types)} GPU type(s): {', '.join(types)}",
            fix="use a cluster with exactly two GPU types (e.g. HC1..HC4), or --planner ppipe|np",
        )

    def total(k: str) -> float:
        return sum(s.profile.model_latency_us(k, 1, 1) for s in specs)

    hi, lo = sorted(types, key=total)
    return hi, lo


def _pipeline(cs, c: int, count: int) -> PipelinePlan:
    n = int(cs.nparts[c])
    parts = [
        PartitionPlan(
            first_block=int(cs.first[c, d]),
            last_block=int(cs.last[c, d]),
            gpu=cs.types[int(cs.gpu[c, d])],
            vgpu=1,
            count=count,
            infer_us=float(cs.infer_us[c, d]),
            transfer_us=float(cs.transfer_us[c, d]),
            throughput_rps=float(cs.X[c, d] * count),
        )
        for d in range(n)
    ]
    return PipelinePlan(
        batch=int(cs.batch[c]),
        throughput_rps=float(cs.X[c, :n].min() * count),
        latency_us=float(cs.latency_us[c]),
        template=[p.gpu for p in parts],
        partitions=parts,
    )


def dart_r(
    specs: list[ModelSpec],
    cluster: ClusterSpec,
    levels: list[dict[str, list[int]]],
    np_models: list[ModelPlan],
    *,
    margin: float,
) -> list[ModelPlan]:
    """DART-r pipelines for every model from an NP plan (see the module docstring)."""
    hi, lo = high_low(cluster, specs)
    N = cluster.gpu_counts
    used = {(m.name, k): 0 for m in np_models for k in (hi, lo)}
    for m in np_models:
        for p in m.pipelines:
            for part in p.partitions:
                used[(m.name, part.gpu)] += part.count  # level 1: one vGPU = one GPU
    share: dict[tuple[str, str], int] = dict(used)
    M = len(np_models)
    for k in (hi, lo):
        left = N[k] - sum(used[(m.name, k)] for m in np_models)
        for i, m in enumerate(np_models):
            share[(m.name, k)] += left // M + (1 if i < left % M else 0)
    lv1 = np_levels(levels)
    out = []
    for mi, spec in enumerate(specs):
        cs = enumerate_configs(
            mi, spec, cluster, max_partitions=2, margin=margin, levels=lv1[mi], group_by_multiset=False, prune=False
        )
        a, b = share[(spec.name, hi)], share[(spec.name, lo)]
        pipes: list[PipelinePlan] = []
        # 1 high + 1 low (either order): templates of one type twice are not DART's.
        pair = np.nonzero((cs.nparts == 2) & (cs.gpu[:, 0] != cs.gpu[:, 1]))[0]
        r = 0
        if len(pair) and min(a, b) > 0:
            thr = cs.X[pair, :2].min(axis=1)
            best = int(pair[int(np.argmax(thr))])
            r = min(a, b)
            pipes.extend(_pipeline(cs, best, 1) for _ in range(r))
        for k, extra in ((hi, a - r), (lo, b - r)):
            single = np.nonzero((cs.nparts == 1) & (cs.gpu[:, 0] == cs.types.index(k)))[0]
            if extra > 0 and len(single):
                best = int(single[int(np.argmax(cs.X[single, 0]))])
                pipes.append(_pipeline(cs, best, extra))
        out.append(
            ModelPlan(
                name=spec.name,
                profile=spec.profile_ref,
                slo_ms=spec.slo_ms,
                weight=spec.weight,
                throughput_rps=float(sum(p.throughput_rps for p in pipes)),
                pipelines=pipes,
            )
        )
    return out
