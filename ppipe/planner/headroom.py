"""Headroom: GPUs a plan leaves idle become extra vGPUs for its busiest pools.

Why. The MILP sizes every pool for the objective alone. At the optimum of the max-min
objective the bottleneck pools of the binding models run at 100 % of their capacity at
load 1.0, and the GPUs of the types that do not bind are left dark (PPipe's plan for
G2 on HC3-L uses 40 of its 75 P4s). A pool near 100 % utilization queues, and a model
whose SLO leaves one or two service times of slack then drops requests well below load
1.0 (the queueing of an M/D/c station, not a scheduling choice). Extra vGPUs in the pools
that sit on idle GPU types lower that queueing without taking anything from any other
pool: the objective value, the pipelines' block ranges, levels and batches stay the
MILP's, and so do the rates a load factor refers to (:func:`ppipe.sim.sweep.base_rates`
uses the solver's objective).

An optimal plan of the paper's MILP. The max-min MILP has many optimal solutions: the
vGPU counts of pools that do not bind are free as long as the GPU rows hold, and nothing
in the model (ppipe's or the paper's) says which of them to run. The pass only raises
counts of existing pools within constraint (2), so every row still holds and
``z = min_m x_m / w_m`` keeps the solver's value: the grown plan is an optimal solution of
the MILP with the paper's pool bounds ``g <= N_k v``. It may exceed ppipe's own tighter
bounds ``U_{c,d} = min(N_k v, ceil(x_max,c / X_{c,d}))`` (:func:`ppipe.planner.formulation.build`):
those only cut pools larger than their pipeline could ever carry, which changes neither
the optimum's value nor the rows, but is exactly the slack the pass adds (a pool sized
for the rate its pipeline reaches with every GPU of its bottleneck type is at 100 %).
``tests/planner/test_headroom.py`` checks the grown plan row by row against that MILP
(``build(..., tight_bounds=False)``, :func:`ppipe.planner.formulation.solution_vector`,
:func:`ppipe.planner.core.is_feasible`), and that the plan before the pass also meets the
tight bounds. Hence the pass is on by default in both formulations.

Rule (greedy, deterministic). For every pool (a partition of a pipeline):

* its *load* is the planned throughput of its pipeline before headroom (the MILP's), its
  capacity the per-vGPU throughput (``throughput_rps / count``, NIC caps included) times
  its vGPUs, and its utilization ``u = load / capacity``;
* while some pool has ``u > target_util`` and its GPU type can host one more vGPU at the
  pool's level under the plan's GPU rule, the pool with the highest ``u`` (ties: plan
  order) gets one more vGPU.

"Can host" is the planner's constraint (2) with the new count: under physical packing,
``sum_v ceil(n_{k,v} / v) <= N_k``; under the paper's rule, ``sum_{m,d} ceil(sum g/v) <=
N_k`` (so a free share of an already rounded-up GPU is used first). A pool whose type
is exhausted never becomes growable again (counts only grow), so it leaves the queue.

The default target 0.8 leaves the remaining GPUs idle: in the simulator
(``scripts/reproduce_fig6.py``) lower targets, down to growing until no GPU is left, served
no more load.
"""

from __future__ import annotations

import heapq
import math
from dataclasses import dataclass
from fractions import Fraction

from ppipe.spec.cluster import ClusterSpec
from ppipe.spec.plan import ModelPlan

DEFAULT_TARGET_UTIL = 0.8


@dataclass
class _Pool:
    order: int  # position in plan order (ties)
    model: int
    pipeline: int
    partition: int
    gpu: str
    level: int
    count: int
    per_vgpu_rps: float
    load_rps: float
    added: int = 0

    @property
    def util(self) -> float:
        return self.load_rps / (self.per_vgpu_rps * self.count)


class _GpuUse:
    """Physical GPUs in use per type under a GPU rule, updated one vGPU at a time."""

    def __init__(self, pools: list[_Pool], types: list[str], gpu_rule: str):
        self.rule = gpu_rule
        self.count: dict[tuple, int] = {}  # (k, v) -> vGPUs (physical rule)
        self.share: dict[tuple, Fraction] = {}  # (m, d, k) -> sum g/v (paper rule)
        for p in pools:
            self._add(p, p.count)
        self.used = {k: 0 for k in types}
        if gpu_rule == "physical":
            for (k, v), n in self.count.items():
                self.used[k] += math.ceil(n / v)
        else:
            for (_m, _d, k), s in self.share.items():
                self.used[k] += math.ceil(s)

    def _add(self, p: _Pool, n: int) -> None:
        if self.rule == "physical":
            key = (p.gpu, p.level)
            self.count[key] = self.count.get(key, 0) + n
        else:
            key = (p.model, p.partition, p.gpu)
            self.share[key] = self.share.get(key, Fraction(0)) + Fraction(n, p.level)

    def extra_gpus(self, p: _Pool) -> int:
        """Physical GPUs one more vGPU of ``p`` adds (0 or 1)."""
        if self.rule == "physical":
            n = self.count[(p.gpu, p.level)]
            return math.ceil((n + 1) / p.level) - math.ceil(n / p.level)
        s = self.share[(p.model, p.partition, p.gpu)]
        return math.ceil(s + Fraction(1, p.level)) - math.ceil(s)

    def grow(self, p: _Pool) -> None:
        self.used[p.gpu] += self.extra_gpus(p)
        self._add(p, 1)


def add_headroom(
    models: list[ModelPlan], cluster: ClusterSpec, gpu_rule: str, target_util: float = DEFAULT_TARGET_UTIL
) -> list[ModelPlan]:
    """Give the busiest pools extra vGPUs from the GPUs the plan leaves idle (see the module docstring).

    Args:
        models: per-model plans (the MILP's, or any plan whose pools fit the cluster).
        cluster: the cluster they are planned for.
        gpu_rule: ``"physical"`` or ``"paper"``: how vGPUs occupy GPUs.
        target_util: stop growing a pool once its utilization at the planned load is at or
            below this (0 = use every idle GPU that some pool can take).

    Returns:
        New model plans: pool counts raised, ``headroom`` = the vGPUs added to a pool,
        pool, pipeline and model throughputs recomputed from the new counts. Nothing else
        changes.
    """
    if gpu_rule not in ("physical", "paper"):
        raise ValueError(f"gpu_rule must be 'physical' or 'paper', got {gpu_rule!r}")
    if not 0 <= target_util < 1:
        raise ValueError(f"target_util must be in [0, 1), got {target_util}")
    pools: list[_Pool] = []
    for mi, m in enumerate(models):
        for pi, pipe in enumerate(m.pipelines):
            for di, part in enumerate(pipe.partitions):
                if part.count > 0 and part.throughput_rps > 0:
                    pools.append(_Pool(
                        order=len(pools), model=mi, pipeline=pi, partition=di, gpu=part.gpu, level=part.vgpu,
                        count=part.count, per_vgpu_rps=part.throughput_rps / part.count, load_rps=pipe.throughput_rps,
                    ))
    use = _GpuUse(pools, list(cluster.gpu_counts), gpu_rule)
    capacity = dict(cluster.gpu_counts)
    heap = [(-p.util, p.order) for p in pools if p.load_rps > 0]
    heapq.heapify(heap)
    while heap:
        neg_u, i = heap[0]
        if -neg_u <= target_util:
            break
        p = pools[i]
        if use.used[p.gpu] + use.extra_gpus(p) > capacity.get(p.gpu, 0):
            heapq.heappop(heap)  # its type is full for this pool: counts only grow, so for good
            continue
        use.grow(p)
        p.count += 1
        p.added += 1
        heapq.heapreplace(heap, (-p.util, p.order))
    return _rebuild(models, pools)


def _rebuild(models: list[ModelPlan], pools: list[_Pool]) -> list[ModelPlan]:
    grown = {(p.model, p.pipeline, p.partition): p for p in pools if p.added}
    if not grown:
        return list(models)
    out = []
    for mi, m in enumerate(models):
        pipes = []
        for pi, pipe in enumerate(m.pipelines):
            parts = []
            for di, part in enumerate(pipe.partitions):
                p = grown.get((mi, pi, di))
                if p is None:
                    parts.append(part)
                    continue
                parts.append(part.model_copy(update=dict(
                    count=p.count, headroom=part.headroom + p.added, throughput_rps=p.per_vgpu_rps * p.count,
                )))
            thr = min(x.throughput_rps for x in parts)
            pipes.append(pipe.model_copy(update=dict(partitions=parts, throughput_rps=thr)))
        out.append(m.model_copy(update=dict(pipelines=pipes, throughput_rps=sum(x.throughput_rps for x in pipes))))
    return out
