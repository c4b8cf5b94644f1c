"""Placement: every vGPU of a plan gets a physical GPU slot on a named server.

The planner decides *how many* vGPUs of which type and level each partition pool has;
the data plane needs to know *where* they are, because NIC reservations are per server.
This module turns pool sizes into :class:`~ppipe.spec.plan.VgpuPlacement` rows.

Rules (the same two GPU rules as the planner, docs/planning-model.md, 'Constraints', constraint 2):

* ``physical`` (default): a GPU at level v hosts exactly v vGPUs of level v. vGPUs are
  grouped by (GPU type, level) over all models, and each group of v consecutive vGPUs
  (in model, pipeline, partition, replica order, so a pool's replicas share GPUs first)
  fills one GPU. Needs ``sum_v ceil(g_v / v) <= N_k`` GPUs per type, which is what the
  planner's constraint guarantees.
* ``paper``: for each (model, partition index, GPU type) the shares 1/v of its vGPUs are
  packed into ``ceil(sum g/v)`` GPUs (levels may mix on one GPU, as MPS allows): whole
  same-level groups first, then the few leftovers exhaustively, which always reaches that
  bound for shares of 1, 1/2, 1/3 and 1/4.

GPUs of a type are handed out interleaved across servers (server 0 GPU 0, server 1 GPU 0,
..., server 0 GPU 1, ...), so that a plan that does not fill the cluster spreads its
feature-map traffic over as many NICs as it can.
"""

from __future__ import annotations

import math
from collections import defaultdict
from fractions import Fraction

from ppipe.errors import InfeasibleError
from ppipe.spec.cluster import ClusterSpec
from ppipe.spec.plan import ModelPlan, Plan, VgpuPlacement

GPU_RULES = ("physical", "paper")


def physical_gpus(cluster: ClusterSpec, gpu_type: str) -> list[tuple[str, int]]:
    """The physical GPUs of a type as (server, gpu index), interleaved across servers."""
    servers = [(name, group.gpus_per_server) for name, group in cluster.server_names() if group.gpu_type == gpu_type]
    out: list[tuple[str, int]] = []
    for idx in range(max((n for _s, n in servers), default=0)):
        out.extend((name, idx) for name, n in servers if idx < n)
    return out


def _vgpus(models: list[ModelPlan]):
    """Every vGPU of the plan as (model, pipeline, partition, replica, gpu type, level)."""
    for m in models:
        for pi, pipe in enumerate(m.pipelines):
            for di, part in enumerate(pipe.partitions):
                for r in range(part.count):
                    yield (m.name, pi, di, r, part.gpu, part.vgpu)


def place(models: list[ModelPlan], cluster: ClusterSpec, gpu_rule: str = "physical") -> list[VgpuPlacement]:
    """Assign every vGPU of ``models`` to a GPU slot of ``cluster``.

    Args:
        models: the per-model plans (pools with their counts and levels).
        cluster: the cluster the plan is for.
        gpu_rule: ``"physical"`` or ``"paper"`` (see the module docstring).

    Returns:
        One :class:`VgpuPlacement` per vGPU, in model, pipeline, partition, replica order.

    Raises:
        InfeasibleError: the vGPUs need more GPUs of a type than the cluster has.
    """
    if gpu_rule not in GPU_RULES:
        raise ValueError(f"gpu_rule must be one of {GPU_RULES}, got {gpu_rule!r}")
    vgpus = list(_vgpus(models))
    for gpu_type in sorted({v[4] for v in vgpus}):
        if gpu_type not in cluster.gpu_counts:
            raise InfeasibleError(
                f"the plan uses GPU type '{gpu_type}', which cluster '{cluster.name}' does not have",
                fix="plan again for this cluster",
            )
    # Group the vGPUs that may share GPUs, in first-appearance order.
    groups: dict[tuple, list[tuple]] = defaultdict(list)
    for v in vgpus:
        key = (v[4], v[5]) if gpu_rule == "physical" else (v[4], v[0], v[2])
        groups[key].append(v)

    free_gpus = {t: physical_gpus(cluster, t) for t in cluster.gpu_counts}
    next_gpu = {t: 0 for t in cluster.gpu_counts}
    rows: dict[tuple, VgpuPlacement] = {}

    def take_gpus(gpu_type: str, n: int) -> list[tuple[str, int]]:
        start = next_gpu[gpu_type]
        if start + n > len(free_gpus[gpu_type]):
            raise InfeasibleError(
                f"the plan needs more than the {len(free_gpus[gpu_type])} {gpu_type} GPUs of cluster '{cluster.name}'",
                fix="plan again for this cluster (the planner's GPU constraint should prevent this)",
            )
        next_gpu[gpu_type] = start + n
        return free_gpus[gpu_type][start : start + n]

    for key, members in groups.items():
        gpu_type = key[0]
        if gpu_rule == "physical":
            level = key[1]
            gpus = take_gpus(gpu_type, math.ceil(len(members) / level))
            for i, v in enumerate(members):
                server, gpu_index = gpus[i // level]
                rows[v[:4]] = VgpuPlacement(
                    model=v[0], pipeline=v[1], partition=v[2], replica=v[3],
                    server=server, gpu_index=gpu_index, vgpu=v[5], slot=i % level,
                )
        else:
            bins = _pack_shares(members)
            gpus = take_gpus(gpu_type, len(bins))
            for (server, gpu_index), members_on_gpu in zip(gpus, bins):
                for slot, v in enumerate(members_on_gpu):
                    rows[v[:4]] = VgpuPlacement(
                        model=v[0], pipeline=v[1], partition=v[2], replica=v[3],
                        server=server, gpu_index=gpu_index, vgpu=v[5], slot=slot,
                    )
    return [rows[v[:4]] for v in vgpus]


def _pack_shares(members: list[tuple]) -> list[list[tuple]]:
    """Pack vGPUs with shares 1/v (v in 1..4) into the fewest GPUs.

    Same-level vGPUs fill whole GPUs v at a time; what is left (at most one half, two
    thirds and three quarters) is packed exhaustively. Whole groups are exactly full, so
    the result uses ceil(sum of shares) GPUs whenever the leftovers fit in
    ceil(their sum), which holds for every combination of leftovers (see the tests).
    """
    by_level: dict[int, list[tuple]] = defaultdict(list)
    for v in members:
        by_level[v[5]].append(v)
    bins: list[list[tuple]] = []
    leftovers: list[tuple] = []
    for level in sorted(by_level):
        items = by_level[level]
        full = len(items) - len(items) % level
        bins.extend(items[i : i + level] for i in range(0, full, level))
        leftovers.extend(items[full:])
    if leftovers:
        bins.extend(_pack_exhaustive(leftovers))
    return bins


def _pack_exhaustive(items: list[tuple]) -> list[list[tuple]]:
    """Fewest bins of capacity 1 for a handful of items with shares 1/v (brute force)."""
    shares = [Fraction(1, v[5]) for v in items]
    for n_bins in range(math.ceil(sum(shares)), len(items) + 1):
        assignment = [0] * len(items)

        def fill(i: int, loads: list[Fraction]) -> bool:
            if i == len(items):
                return True
            for b in range(n_bins):
                if loads[b] + shares[i] <= 1:
                    loads[b] += shares[i]
                    assignment[i] = b
                    if fill(i + 1, loads):
                        return True
                    loads[b] -= shares[i]
                if loads[b] == 0:
                    break  # empty bins are interchangeable
            return False

        if fill(0, [Fraction(0)] * n_bins):
            out: list[list[tuple]] = [[] for _ in range(n_bins)]
            for item, b in zip(items, assignment):
                out[b].append(item)
            return out
    raise AssertionError("unreachable: one item per bin always fits")


def keep_live(new: list[VgpuPlacement], new_models: list[ModelPlan], live: list[VgpuPlacement], live_models: list[ModelPlan],
              cluster: ClusterSpec) -> list[VgpuPlacement]:
    """``new`` with its physical GPUs renamed so that as many vGPUs as possible stay where
    ``live`` (the running plan's placement) has them.

    A vGPU stays when the live placement has, at the same (server, GPU, slot), a vGPU of
    the same model, blocks, GPU type and level: a running server then keeps its worker
    through a plan switch (:func:`ppipe.dataplane.handover.kept_vgpus`) instead of loading
    a new one. Renaming the GPUs of one server group among themselves (and the slots of
    one GPU) changes nothing else the plan says: the GPU type, the NIC, the pools, levels
    and how many vGPUs share a GPU are the same. Each group is a maximum-weight matching of the new plan's GPUs to the
    cluster's GPUs (``scipy.optimize.linear_sum_assignment``); the weight of (new GPU g,
    GPU h) is the number of g's vGPUs whose shape h holds in the live plan, and among
    equally good matchings the one closest to ``new`` wins, so the result is deterministic.
    """
    from collections import Counter

    import numpy as np
    from scipy.optimize import linear_sum_assignment

    def shapes(rows: list[VgpuPlacement], models: list[ModelPlan]) -> dict[tuple[str, int], list[tuple]]:
        parts = {(m.name, i, j): part for m in models for i, pl in enumerate(m.pipelines) for j, part in enumerate(pl.partitions)}
        on_gpu: dict[tuple[str, int], list[tuple]] = defaultdict(list)
        for r in rows:
            part = parts[(r.model, r.pipeline, r.partition)]
            on_gpu[(r.server, r.gpu_index)].append((r.slot, (r.model, part.first_block, part.last_block, part.gpu, r.vgpu)))
        return on_gpu

    new_on, live_on = shapes(new, new_models), shapes(live, live_models)
    group_of = {name: group for name, group in cluster.server_names()}
    rename: dict[tuple[str, int], tuple[str, int]] = {}
    for group in sorted({group_of[g[0]].name for g in new_on}):
        mine = sorted(g for g in new_on if group_of[g[0]].name == group)
        gpu_type = group_of[mine[0][0]].gpu_type
        targets = [h for h in physical_gpus(cluster, gpu_type) if group_of[h[0]].name == group]
        weight = np.zeros((len(mine), len(targets)), dtype=np.int64)
        for i, g in enumerate(mine):
            want = Counter(s for _, s in new_on[g])
            for j, h in enumerate(targets):
                have = Counter(s for _, s in live_on.get(h, []))
                weight[i, j] = 2 * sum((want & have).values()) + (g == h)  # ties: keep new's own GPU
        rows, cols = linear_sum_assignment(weight, maximize=True)
        rename.update({mine[i]: targets[j] for i, j in zip(rows, cols)})
    slot_of = _kept_slots(new_on, live_on, rename)
    return [r.model_copy(update={"server": rename[(r.server, r.gpu_index)][0], "gpu_index": rename[(r.server, r.gpu_index)][1],
                                 "slot": slot_of[(r.server, r.gpu_index, r.slot)]}) for r in new]


def keep_live_plan(plan: Plan, live: Plan, cluster: ClusterSpec) -> Plan:
    """``plan`` with its placement renamed by :func:`keep_live` to keep ``live``'s workers.

    The rule a re-plan's switch follows wherever it runs: ``ppipe serve``'s plan switches
    and :func:`ppipe.control.replan.planner_replan`, which ``ppipe simulate --replan auto``
    runs too, so both keep the same vGPUs. A plan for another cluster, without a
    placement, or placed on GPUs the cluster lacks comes back as it is (its switch is
    refused elsewhere, with its reason). Renaming a plan :func:`keep_live` has renamed
    already changes nothing.
    """
    if not getattr(plan, "placement", None) or not getattr(live, "placement", None) or plan.cluster != live.cluster:
        return plan
    gpus = {name: group.gpus_per_server for name, group in cluster.server_names()}
    if any(p.gpu_index >= gpus.get(p.server, 0) for p in plan.placement):
        return plan
    placement = keep_live(plan.placement, plan.models, live.placement, live.models, cluster)
    return plan.model_copy(update={"placement": placement})


def _kept_slots(new_on: dict, live_on: dict, rename: dict) -> dict[tuple[str, int, int], int]:
    """The slot of each new vGPU on its renamed GPU: the live slot of the same shape where
    there is one, else the free slots in order (the GPU's slots stay 0..n-1)."""
    out: dict[tuple[str, int, int], int] = {}
    for g, members in new_on.items():
        n = len(members)
        live = list(live_on.get(rename[g], []))
        free = set(range(n))
        placed = []
        for slot, shape in sorted(members):
            match = next((ls for ls, lshape in live if lshape == shape and ls in free), None)
            if match is not None:
                free.discard(match)
                live = [x for x in live if x[0] != match]
                out[(g[0], g[1], slot)] = match
            else:
                placed.append(slot)
        for slot, target in zip(placed, sorted(free)):
            out[(g[0], g[1], slot)] = target
    return out


def gpus_used(placement: list[VgpuPlacement], cluster: ClusterSpec) -> dict[str, int]:
    """Physical GPUs that hold at least one vGPU, per GPU type."""
    type_of = {name: group.gpu_type for name, group in cluster.server_names()}
    used: dict[str, set[tuple[str, int]]] = {t: set() for t in cluster.gpu_counts}
    for p in placement:
        used[type_of[p.server]].add((p.server, p.gpu_index))
    return {t: len(g) for t, g in used.items()}
