"""One plan decided by K schedulers: its servers in K disjoint groups, a scheduler per group.

One scheduler decides for every request of the models it holds, so its CPU per request
bounds the rate one core can decide for. Past that rate, a plan's servers are split into K
groups (:func:`split_servers`) and each group gets the plan restricted to its servers
(:func:`sub_plan`: every pool keeps the vGPUs it has there; a pipeline that loses a whole
pool is not in that group) and a scheduler of its own. Groups share no vGPU and no server,
hence no NIC: each scheduler's reservation tables are the whole truth about its resources,
and the K schedulers never need to agree on anything.

What it costs: a request can only go to the pipelines of the group it was routed to. A
model's arrivals are dealt to its groups in proportion to their capacity for it
(:func:`group_capacity`: the sum over the group's pipelines of their slowest pool's
throughput, counted by the vGPUs the group holds), by smooth weighted round robin
(deterministic: the k-th arrival of a model goes to the same group in every run). The
simulator measures the loss (``scripts/bench_split.py``): pools split into parts lose the
statistical multiplexing of one queue, and a pool whose vGPUs all sit on one server cannot
be split at all.

:func:`split_servers` chooses the groups for what they keep: no group above its share of
the capacity by more than :data:`MAX_GROUP_SHARE`, and as little capacity lost as a split
along server lines allows (a pipeline whose pools fall into different groups is lost).

:class:`SplitScheduler` drives the K schedulers as one (the driver contract of
:mod:`ppipe.dataplane.api`): batch ids are ``local id x K + group``, pipelines keep the
plan's indices, ``wake`` wakes every group. The simulator runs it as it runs any
scheduler; the runtime's counterpart (``ppipe serve --shards K --shard-by servers``) runs
each group's scheduler in a frontend shard of its own, dealing with the same :class:`Dealer`.
Pure logic, no I/O.
"""

from __future__ import annotations

import numbers
from typing import Any, Mapping, Sequence

from ppipe.dataplane.api import Clock, Decision, Dispatch, Request, StageReport
from ppipe.errors import UserError
from ppipe.spec.cluster import ClusterSpec
from ppipe.spec.plan import ModelPlan, PartitionPlan, PipelinePlan, Plan
from ppipe.spec.profile import ModelProfile

Pool = tuple[str, int, int]  # (model, pipeline, partition)


MAX_GROUP_SHARE = 1.2
"""A group may carry at most this many times its even share (1 / K) of the plan's capacity."""


def split_servers(plan: Plan, k: int) -> list[set[str]]:
    """The plan's servers (those holding vGPUs) in ``k`` groups (see the module docstring).

    Two starts (the greedy spread: servers holding the most vGPUs first, each to the group
    with the smallest share so far of that server's pools; and all servers in one group but
    K - 1), then single-server moves while they raise the score (:meth:`_Capacity.score`:
    the capacity each model keeps, a pipeline whose pools fall into different groups lost,
    a group above :data:`MAX_GROUP_SHARE` of an even share counted at that share).

    Raises:
        UserError: ``k`` < 1 or more than the servers the plan uses.
    """
    cap = _Capacity(plan)
    servers = sorted(cap.hosted, key=lambda s: (-sum(cap.hosted[s].values()), s))
    if not 1 <= k <= len(servers):
        raise UserError(f"cannot split a plan on {len(servers)} servers into {k} scheduler groups",
                        fix=f"use 1 to {len(servers)} groups (schedulers, shards)")
    # two starts: the greedy spread, and all in group 0 but the k - 1 smallest servers
    starts = [_greedy(cap, servers, k), {s: max(0, i - (len(servers) - k)) for i, s in enumerate(servers)}]
    group, _ = max((_improve(cap, servers, k, g) for g in starts), key=lambda gs: gs[1])
    return [{s for s in servers if group[s] == g} for g in range(k)]


def _improve(cap: "_Capacity", servers: list[str], k: int, group: dict[str, int]) -> tuple[dict[str, int], tuple]:
    """Single-server moves from ``group`` while the score rises; (groups, score)."""
    best = cap.score(group, k)
    improved = True
    while improved:
        improved = False
        for s in servers:
            here = group[s]
            if sum(1 for v in group.values() if v == here) == 1:
                continue
            for h in range(k):
                if h == here:
                    continue
                group[s] = h
                score = cap.score(group, k)
                if score > best:
                    best, here, improved = score, h, True
                else:
                    group[s] = here
    return group, best


def _greedy(cap: "_Capacity", servers: list[str], k: int) -> dict[str, int]:
    group: dict[str, int] = {}
    share: list[dict[Pool, float]] = [{} for _ in range(k)]
    sizes = [0] * k
    for server in servers:
        pools = cap.hosted[server]
        g = min(range(k), key=lambda i: (sum(share[i].get(p, 0.0) for p in pools), sizes[i], i))
        group[server] = g
        sizes[g] += 1
        for p, n in pools.items():
            share[g][p] = share[g].get(p, 0.0) + n / cap.pool_size[p]
    return group


class _Capacity:
    """What a split of the servers leaves each model: per group, the sum over its pipelines
    of their slowest pool's throughput, each pool counted by the vGPUs the group holds."""

    def __init__(self, plan: Plan):
        self.hosted: dict[str, dict[Pool, int]] = {}
        self.pool_size: dict[Pool, int] = {}
        for pl in plan.placement:
            key = (pl.model, pl.pipeline, pl.partition)
            self.hosted.setdefault(pl.server, {}).setdefault(key, 0)
            self.hosted[pl.server][key] += 1
            self.pool_size[key] = self.pool_size.get(key, 0) + 1
        self.pipelines = [(m.name, pi, [part.throughput_rps for part in pp.partitions])
                          for m in plan.models for pi, pp in enumerate(m.pipelines)]
        self.total = {m.name: 0.0 for m in plan.models}
        for name, _, thr in self.pipelines:
            self.total[name] += min(thr)

    def per_group(self, group: dict[str, int], k: int) -> list[dict[str, float]]:
        counts: list[dict[Pool, int]] = [{} for _ in range(k)]
        for server, g in group.items():
            for p, n in self.hosted[server].items():
                counts[g][p] = counts[g].get(p, 0) + n
        out = [{m: 0.0 for m in self.total} for _ in range(k)]
        for g in range(k):
            for name, pi, thr in self.pipelines:
                out[g][name] += min(t * counts[g].get((name, pi, di), 0) / self.pool_size[(name, pi, di)] for di, t in enumerate(thr))
        return out

    def score(self, group: dict[str, int], k: int) -> tuple[float, float]:
        """How much of its capacity each model keeps when no group's scheduler decides for
        more than :data:`MAX_GROUP_SHARE` of an even share of the plan's capacity (a group
        over it counts at that rate, its models alike): (the least share any model keeps,
        their sum). Larger is better."""
        caps = self.per_group(group, k)
        limit = MAX_GROUP_SHARE * sum(self.total.values()) / k
        factor = [min(1.0, limit / t) if (t := sum(c.values())) > 0 else 1.0 for c in caps]
        kept = [sum(f * c[m] for f, c in zip(factor, caps)) / t for m, t in self.total.items() if t > 0]
        return min(kept, default=1.0), sum(kept)

    def kept(self, group: dict[str, int], k: int) -> dict[str, float]:
        """Per model (with capacity): the share of its capacity the groups keep together."""
        caps = self.per_group(group, k)
        return {m: sum(c[m] for c in caps) / t for m, t in self.total.items() if t > 0}


def split_report(plan: Plan, groups: Sequence[set[str]]) -> dict[str, Any]:
    """What a split keeps: per model the share of its capacity (``kept``), per group its
    share of what is kept (``shares``), and whether the split is ``balanced`` (no group
    above :data:`MAX_GROUP_SHARE` of an even share)."""
    cap = _Capacity(plan)
    group = {s: g for g, servers in enumerate(groups) for s in servers}
    caps = [sum(c.values()) for c in cap.per_group(group, len(groups))]
    shares = [c / (sum(caps) or 1.0) for c in caps]
    return {"kept": cap.kept(group, len(groups)), "shares": shares, "balanced": max(shares) <= MAX_GROUP_SHARE / len(groups) + 1e-9}


def sub_plan(plan: Plan, servers: set[str]) -> Plan:
    """``plan`` restricted to ``servers``: each pool with its vGPUs there (renumbered), its
    throughput scaled by the share it keeps; pipelines that lose a whole pool left out (the
    others renumbered in order), models kept with the pipelines they have left (maybe none)."""
    models: list[ModelPlan] = []
    placement = []
    for m in plan.models:
        pipes: list[PipelinePlan] = []
        for pi, pp in enumerate(m.pipelines):
            parts = [[pl for pl in plan.placements_of(m.name, pi, di) if pl.server in servers] for di in range(len(pp.partitions))]
            if not all(parts):
                continue
            new_pi = len(pipes)
            pipes.append(_scaled_pipeline(pp, [len(p) for p in parts]))
            for di, places in enumerate(parts):
                placement += [pl.model_copy(update={"pipeline": new_pi, "replica": r}) for r, pl in enumerate(places)]
        models.append(m.model_copy(update={"pipelines": pipes, "throughput_rps": sum(p.throughput_rps for p in pipes)}))
    return plan.model_copy(update={"models": models, "placement": placement})


def _scaled_pipeline(pp: PipelinePlan, counts: list[int]) -> PipelinePlan:
    parts: list[PartitionPlan] = [
        part.model_copy(update={"count": n, "throughput_rps": part.throughput_rps * n / part.count, "headroom": 0})
        for part, n in zip(pp.partitions, counts)
    ]
    return pp.model_copy(update={"partitions": parts, "throughput_rps": min(p.throughput_rps for p in parts)})


def group_capacity(plan: Plan) -> dict[str, float]:
    """Per model: the requests per second its pipelines in ``plan`` carry (each pipeline's
    slowest pool)."""
    return {m.name: sum(min(part.throughput_rps for part in p.partitions) for p in m.pipelines) for m in plan.models}


def owner_table(owner: Mapping[str, Any]) -> dict[str, tuple[tuple[int, float], ...]]:
    """Where each model's arrivals go, ``owner`` (model -> its group, or [(group, weight)]
    where several take it), as model -> ((group, weight), ...), groups of weight 0 left out
    and models left with none dropped: the table a :class:`Dealer` per model deals by."""
    table = {}
    for model, where in owner.items():
        entries = ((int(where), 1.0),) if isinstance(where, numbers.Integral) else tuple(
            (int(k), float(w)) for k, w in where if w > 0)
        if entries:
            table[model] = entries
    return table


class Dealer:
    """Smooth weighted round robin over groups: each turn every group gains its weight, the
    one with the most credit is chosen and pays the total (so over any run the choices
    follow the weights as closely as whole requests can)."""

    def __init__(self, weights: Sequence[float]):
        self.weights = list(weights)
        self.total = sum(self.weights)
        self.credit = [0.0] * len(self.weights)

    def next(self) -> int:
        for i, w in enumerate(self.weights):
            self.credit[i] += w
        g = max(range(len(self.credit)), key=lambda i: (self.credit[i], -i))
        self.credit[g] -= self.total
        return g


class SplitScheduler:
    """K schedulers, one per server group, driven as one scheduler (module docstring).

    Args:
        schedulers: the groups' schedulers, each built on its :func:`sub_plan`.
        plans: the groups' sub-plans (for the capacity weights and the pipeline indices).
        plan: the whole plan.
    """

    partial_dispatches = False

    def __init__(self, schedulers: Sequence[Any], plans: Sequence[Plan], plan: Plan):
        self.subs, self.k = list(schedulers), len(schedulers)
        self.executes_as_planned = all(getattr(s, "executes_as_planned", False) is True for s in self.subs)
        caps = [group_capacity(p) for p in plans]
        self._dealers = {m.name: Dealer([c.get(m.name, 0.0) for c in caps]) for m in plan.models}
        self._owner = {pl.vgpu_id: g for g, p in enumerate(plans) for pl in p.placement}
        # group -> model -> local pipeline index -> the plan's index
        self._pipeline = [{m.name: self._global_indices(plan, sub, m.name) for m in sub.models} for sub in plans]

    @staticmethod
    def _global_indices(plan: Plan, sub: Plan, model: str) -> list[int]:
        """The plan's index of each pipeline of ``sub``'s ``model`` (found by a vGPU of its first pool)."""
        where = {pl.vgpu_id: pl.pipeline for pl in plan.placement if pl.model == model and pl.partition == 0}
        firsts = {pl.pipeline: pl.vgpu_id for pl in sub.placement if pl.model == model and pl.partition == 0}
        return [where[firsts[pi]] for pi in range(len(sub.model(model).pipelines))]

    def submit(self, request: Request) -> list[Decision]:
        dealer = self._dealers.get(request.model)
        g = dealer.next() if dealer is not None and dealer.total > 0 else 0
        return self._out(g, self.subs[g].submit(request))

    def wake(self) -> list[Decision]:
        return [d for g, s in enumerate(self.subs) for d in self._out(g, s.wake())]

    def report(self, report: StageReport) -> list[Decision]:
        g, local = report.batch_id % self.k, report.batch_id // self.k
        return self._out(g, self.subs[g].report(StageReport(local, report.partition, report.vgpu_id, report.start_us, report.end_us,
                                                            report.transfer_start_us, report.transfer_end_us)))

    def mark_failed(self, vgpu_id: str) -> list[Decision]:
        g = self._owner.get(vgpu_id)
        return [] if g is None else self._out(g, self.subs[g].mark_failed(vgpu_id))

    def mark_recovered(self, vgpu_id: str) -> list[Decision]:
        g = self._owner.get(vgpu_id)
        return [] if g is None else self._out(g, self.subs[g].mark_recovered(vgpu_id))

    def withdraw(self, request_ids) -> list[Decision]:
        ids = list(request_ids)
        return [d for g, s in enumerate(self.subs) for d in self._out(g, s.withdraw(ids))]

    def stats(self) -> dict:
        """The groups' counters summed (drops per reason merged); ``groups``: their own."""
        per = [s.stats() for s in self.subs]
        out: dict[str, Any] = {"groups": per}
        for key in ("probes", "dispatches", "dispatched_requests", "waits", "corrections", "cascaded", "expired_inflight"):
            out[key] = sum(p.get(key, 0) for p in per)
        out["probes_per_dispatch"] = out["probes"] / out["dispatches"] if out["dispatches"] else float("nan")
        drops: dict[str, int] = {}
        for p in per:
            for reason, n in p.get("drops", {}).items():
                drops[reason] = drops.get(reason, 0) + n
        out["drops"] = dict(sorted(drops.items()))
        return out

    def _out(self, g: int, decisions: list[Decision]) -> list[Decision]:
        """Group ``g``'s decisions with the plan's batch ids and pipeline indices."""
        out = []
        for d in decisions:
            if isinstance(d, Dispatch):
                d = Dispatch(d.batch_id * self.k + g, d.model, self._pipeline[g][d.model][d.pipeline], d.requests, d.stages,
                             d.reservations)
            out.append(d)
        return out


def build_split_scheduler(plan: Plan, profiles: Mapping[str, ModelProfile], cluster: ClusterSpec, clock: Clock, k: int,
                          policy: str = "reservation", **options: Any) -> SplitScheduler:
    """A :class:`SplitScheduler` of ``k`` groups, each group's scheduler built by
    :func:`ppipe.dataplane.build_scheduler` with ``policy`` and ``options``."""
    from ppipe.dataplane.registry import build_scheduler

    plans = [sub_plan(plan, servers) for servers in split_servers(plan, k)]
    subs = [build_scheduler(p, profiles, cluster, clock, policy=policy, **options) for p in plans]
    return SplitScheduler(subs, plans, plan)
