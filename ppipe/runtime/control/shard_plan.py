"""Which models each frontend shard serves: pure functions of a plan.

``ppipe serve --shards N`` runs N frontend processes (:mod:`ppipe.runtime.launch.shards`),
each with its own scheduler over some of the plan's models. A model's scheduling state is
independent of another's except for the NICs of the servers both send feature maps
through. Shards are therefore built from *NIC components* (:func:`nic_components`): models
are joined when a server hosts vGPUs of both in pipelines of two or more partitions (the
only pipelines that transfer). Shards never share a vGPU or a NIC, so the scheduler of the
whole plan, the one ``ppipe simulate`` runs, makes the same reservations as the shards'
schedulers each over its part: the simulator still predicts the sharded server, with no
rule for sharing a NIC at all. The components are packed into at most N shards by their
planned load (largest first, each to the least loaded shard).

A model whose planned rate needs more than one scheduler's core is spread with
``--shard-by servers`` (:func:`split_layout`): the plan's *servers* go into N disjoint groups
(:func:`ppipe.dataplane.split.split_servers`) and each shard serves its group's sub-plan, so
a model may live on several shards, each with its share of the model's capacity. Groups
share no vGPU and no server, hence no NIC, so the shards' schedulers are again
independent; the simulator runs the same split (``ppipe simulate --schedulers N``). A split
that keeps too little of a model, or loads one shard well above the others, is refused.
:class:`ShardLayout` is what either way gives each shard and the routers.

A live plan switch keeps each model on its shard (:func:`shard_owners`) and hands GPUs and
NICs from the shards that give them up to those that take them over
(:func:`incoming_resources`; :class:`ppipe.runtime.control.switch.ShardedSwitcher` runs it).
A server whose shards split the servers does not switch plans (it is restarted instead).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from ppipe.errors import UserError
from ppipe.spec.plan import Plan

# Frontend CPU per request used to size the default shard count (scripts/bench_serve.py
# measures it; a shard is sized to stay below TARGET_BUSY of its core at the planned rate).
FRONTEND_CPU_S_PER_REQUEST = 1.5e-3
# ... and of a scheduler behind ingress processes (``--ingress N``), which decides on metadata
# only (scripts/bench_scheduler_host.py --ingress K: 0.3-0.5 ms per request on a 2-core host)
SCHEDULER_CPU_S_PER_REQUEST = 0.5e-3
TARGET_BUSY = 0.7

SHARD_BY = ("models", "servers")  # --shard-by
MIN_KEPT = 0.99  # --shard-by servers: a model must keep this share of its capacity


def nic_components(plan: Plan) -> list[list[str]]:
    """The plan's models grouped so that no two groups share a vGPU or a transferring NIC.

    Two models are in one group when some server hosts vGPUs of both in pipelines of two
    or more partitions. Groups are sorted, and each group's models in plan order.
    """
    order = [m.name for m in plan.models]
    parent = {m: m for m in order}

    def find(x: str) -> str:
        while parent[x] != x:
            parent[x] = parent[parent[x]]
            x = parent[x]
        return x

    multi = {(m.name, i) for m in plan.models for i, pl in enumerate(m.pipelines) if len(pl.partitions) > 1}
    first_on: dict[str, str] = {}
    for p in plan.placement:
        if (p.model, p.pipeline) not in multi:
            continue
        other = first_on.setdefault(p.server, p.model)
        parent[find(p.model)] = find(other)
    groups: dict[str, list[str]] = {}
    for m in order:
        groups.setdefault(find(m), []).append(m)
    return sorted(groups.values(), key=lambda g: order.index(g[0]))


def model_load(plan: Plan, model: str) -> float:
    """A model's frontend work at its planned rate: requests plus stage reports per second."""
    mp = plan.model(model)
    total = sum(pl.throughput_rps for pl in mp.pipelines) or mp.throughput_rps
    stages = sum(pl.throughput_rps * len(pl.partitions) for pl in mp.pipelines) / total if total else 1.0
    return mp.throughput_rps * (1.0 + stages / max(1, min(pl.batch for pl in mp.pipelines)))


def assign_shards(plan: Plan, n: int) -> list[list[str]]:
    """Split the plan's models into at most ``n`` shards of whole NIC components, balancing
    their planned load (largest component first, to the least loaded shard; ties by index)."""
    if n < 1:
        raise ValueError(f"n must be >= 1, got {n}")
    comps = nic_components(plan)
    comps.sort(key=lambda g: -sum(model_load(plan, m) for m in g))
    shards: list[list[str]] = [[] for _ in range(min(n, len(comps)))]
    load = [0.0] * len(shards)
    for g in comps:
        k = min(range(len(shards)), key=lambda i: (load[i], i))
        shards[k].extend(g)
        load[k] += sum(model_load(plan, m) for m in g)
    order = [m.name for m in plan.models]
    for s in shards:
        s.sort(key=order.index)
    return sorted(shards, key=lambda s: order.index(s[0]))


def auto_shards(plan: Plan, cores: int, cost_s: float = FRONTEND_CPU_S_PER_REQUEST) -> int:
    """The default shard count: what the planned rate needs at ``cost_s`` of CPU per request
    (``FRONTEND_CPU_S_PER_REQUEST``, or a scheduler's behind ingresses; each shard at most
    ``TARGET_BUSY`` busy), no more than the NIC components, and no more than the cores but
    one (the workers, and Ray's daemons where Ray runs, need CPU too)."""
    rate = sum(m.throughput_rps for m in plan.models)
    need = math.ceil(rate * cost_s / TARGET_BUSY)
    return max(1, min(need, len(nic_components(plan)), cores - 1))


def sub_plan(plan: Plan, models: list[str]) -> Plan:
    """The plan restricted to ``models`` (their pipelines and their vGPUs' placement)."""
    keep = set(models)
    return plan.model_copy(update={
        "models": [m for m in plan.models if m.name in keep],
        "placement": [p for p in plan.placement if p.model in keep],
    })


def shard_owners(old: Plan, owner: dict[str, int], new: Plan, n: int, source: str = "the new plan") -> dict[str, int]:
    """Which shard serves each model of ``new`` when a server of ``n`` shards switches to it.

    A model keeps its shard; a new model joins the shard of the models it shares NICs with
    (:func:`nic_components` of ``new``), else the least loaded shard (planned load; ties by
    index), larger components first.

    Raises:
        UserError: ``new`` joins models of two shards through a NIC, or leaves a shard
            with no model: the server cannot switch to it live.
    """
    load = [0.0] * n
    for m in new.models:
        if m.name in owner:
            load[owner[m.name]] += model_load(new, m.name)
    out: dict[str, int] = {}
    for comp in sorted(nic_components(new), key=lambda g: -sum(model_load(new, m) for m in g)):
        shards = sorted({owner[m] for m in comp if m in owner})
        if len(shards) > 1:
            raise UserError(f"{source}: the plan sends feature maps of {', '.join(comp)} through the NICs of one server, "
                            f"but shards {', '.join(map(str, shards))} of this server serve them and keep their models",
                            fix="restart `ppipe serve` with the new plan (its shards are cut anew), or serve with --shards 1")
        k = shards[0] if shards else min(range(n), key=lambda i: (load[i], i))
        for m in comp:
            if m not in owner:
                load[k] += model_load(new, m)
            out[m] = k
    idle = sorted(set(range(n)) - set(out.values()))
    if idle:
        raise UserError(f"{source}: the plan leaves shard{'s' if len(idle) > 1 else ''} {', '.join(map(str, idle))} of this "
                        "server with no model to serve (a shard keeps its models across a switch)",
                        fix="restart `ppipe serve` with the new plan, or serve with --shards 1")
    return out


def shard_resources(plan: Plan, owner: dict[str, int]) -> dict[str, set[int]]:
    """The shards that use each physical GPU (``"<server>/gpu<i>"``) and each NIC (a
    server's uplink or downlink, where it sends or receives feature maps) under ``plan``."""
    from ppipe.dataplane.api import downlink, uplink
    from ppipe.dataplane.handover import physical_gpu

    multi = {(m.name, i) for m in plan.models for i, pl in enumerate(m.pipelines) if len(pl.partitions) > 1}
    out: dict[str, set[int]] = {}
    for p in plan.placement:
        k = owner[p.model]
        out.setdefault(physical_gpu(p.vgpu_id), set()).add(k)
        if (p.model, p.pipeline) in multi:
            for res in (uplink(p.server), downlink(p.server)):
                out.setdefault(res, set()).add(k)
    return out


def incoming_resources(old: Plan, old_owner: dict[str, int], new: Plan, new_owner: dict[str, int],
                       switching: set[int]) -> dict[int, dict[str, set[int]]]:
    """For each shard, the GPUs and NICs it uses under ``new`` that other shards of
    ``switching`` (those whose part of the plan changes) used under ``old``: shard ->
    resource -> those shards. A shard that does not switch keeps its resources as they are."""
    before, after = shard_resources(old, old_owner), shard_resources(new, new_owner)
    out: dict[int, dict[str, set[int]]] = {}
    for res, takers in sorted(after.items()):
        for k in sorted(takers):
            givers = (before.get(res, set()) & switching) - {k}
            if givers:
                out.setdefault(k, {})[res] = givers
    return out


def parse_shards(value: str, plan: Plan, cores: int, by: str = "models", ingress: int = 0) -> int:
    """``--shards``: ``auto`` (:func:`auto_shards`, or :func:`auto_split_shards` with
    ``by="servers"``) or a count >= 1 (capped by the plan's NIC components when it is packed
    by models). With ``ingress`` processes (``--ingress N``) a shard is a scheduler only:
    ``auto`` sizes it at ``SCHEDULER_CPU_S_PER_REQUEST``, on the cores the ingresses leave."""
    if value == "auto":
        cost, cores = (SCHEDULER_CPU_S_PER_REQUEST, cores - ingress) if ingress else (FRONTEND_CPU_S_PER_REQUEST, cores)
        return auto_split_shards(plan, cores, cost) if by == "servers" else auto_shards(plan, cores, cost)
    try:
        n = int(value)
    except ValueError:
        n = 0
    if n < 1:
        raise UserError(f"--shards must be 'auto' or a count >= 1, got '{value}'", fix="e.g. --shards 2, or leave it at auto")
    return n


@dataclass(frozen=True)
class ShardLayout:
    """What each frontend shard serves, and where the routers send each model's requests.

    Attributes:
        by: ``models`` (whole NIC components per shard) or ``servers`` (a group of servers per shard).
        plans: per shard, the plan its models come from: the whole plan (``models``) or its
            servers' sub-plan (``servers``; :func:`ppipe.dataplane.split.sub_plan`).
        parts: per shard, the models it serves (those with capacity in its plan).
        routes: model -> [(shard, weight)]: the shards that serve it, weighted by the
            capacity each has for it (one entry where a model lives on one shard).
        servers: per shard, the servers its vGPUs are on.
        shares: per shard, its share of the plan's capacity.
        kept: per model, the share of its capacity the shards keep together (1.0 by models).
    """

    by: str
    plans: list[Plan]
    parts: list[list[str]]
    routes: dict[str, list[tuple[int, float]]]
    servers: list[list[str]]
    shares: list[float]
    kept: dict[str, float]

    def owner(self) -> dict[str, int]:
        """model -> its one shard (``models`` layouts; a plan switch's owner map)."""
        return {m: r[0][0] for m, r in self.routes.items()}

    def describe(self) -> list[str]:
        """One line per shard: its models (with their share of each model's capacity), servers, share of the plan."""
        out = []
        for i, (models, servers) in enumerate(zip(self.parts, self.servers)):
            held = []
            for m in models:
                total = sum(w for _, w in self.routes[m])
                mine = sum(w for k, w in self.routes[m] if k == i)
                held.append(m if len(self.routes[m]) == 1 else f"{m} {mine / total:.0%}")
            out.append(f"shard {i}: {', '.join(held)} on {len(servers)} server{'s' if len(servers) != 1 else ''} "
                       f"({', '.join(servers)}), {self.shares[i]:.0%} of the plan's capacity")
        return out


def _capacity(plan: Plan) -> dict[str, float]:
    from ppipe.dataplane.split import group_capacity

    return group_capacity(plan)


def model_layout(plan: Plan, n: int) -> ShardLayout:
    """``--shard-by models``: :func:`assign_shards`, each shard with the whole plan (and its models)."""
    parts = assign_shards(plan, n)
    cap = _capacity(plan)
    total = sum(cap.values()) or 1.0
    return ShardLayout(
        by="models", plans=[plan] * len(parts), parts=parts,
        routes={m: [(i, cap.get(m, 0.0))] for i, ms in enumerate(parts) for m in ms},
        servers=[sorted({p.server for p in plan.placement if p.model in ms}) for ms in parts],
        shares=[sum(cap.get(m, 0.0) for m in ms) / total for ms in parts],
        kept={m.name: 1.0 for m in plan.models})


def split_layout(plan: Plan, n: int) -> ShardLayout:
    """``--shard-by servers``: the plan's servers in ``n`` groups
    (:func:`ppipe.dataplane.split.split_servers`), shard i serving group i's sub-plan.

    Raises:
        UserError: ``n`` is more than the servers the plan uses, or the split is not one the
            plan takes well: a shard above :data:`ppipe.dataplane.split.MAX_GROUP_SHARE` of
            an even share of the capacity, a model keeping less than :data:`MIN_KEPT` of its
            capacity (its pools sit on too few servers), or a shard with no whole pipeline.
            The message says what the split keeps.
    """
    from ppipe.dataplane.split import split_report, split_servers, sub_plan as servers_sub_plan

    used = sorted({p.server for p in plan.placement})
    if n > len(used):
        raise UserError(f"--shards {n} --shard-by servers: the plan's vGPUs are on {len(used)} server"
                        f"{'s' if len(used) != 1 else ''} ({', '.join(used)}), and each shard needs servers of its own",
                        fix=f"use --shards {len(used)} or fewer, or --shard-by models")
    if n == 1:
        return model_layout(plan, 1)
    groups = split_servers(plan, n)
    report = split_report(plan, groups)
    plans = [servers_sub_plan(plan, g) for g in groups]
    caps = [_capacity(p) for p in plans]
    order = [m.name for m in plan.models]
    parts = [[m for m in order if c.get(m, 0.0) > 0] for c in caps]
    kept = dict(report["kept"])
    low = {m: k for m, k in kept.items() if k < MIN_KEPT}
    empty = [i for i, ms in enumerate(parts) if not ms]
    if not report["balanced"] or low or empty:
        why = []
        if not report["balanced"]:
            why.append(f"its shards carry {', '.join(f'{s:.0%}' for s in report['shares'])} of the capacity "
                       f"(at most {_max_share():.2f} x an even share each)")
        if low:
            why.append("it keeps " + ", ".join(f"{k:.0%} of {m}'s capacity" for m, k in low.items())
                       + " (a pipeline whose pools fall on two shards is lost)")
        if empty:
            why.append(f"shard{'s' if len(empty) > 1 else ''} {', '.join(map(str, empty))} would hold no whole pipeline")
        groups_text = "; ".join(f"shard {i}: {', '.join(sorted(g))}" for i, g in enumerate(groups))
        raise UserError(f"--shards {n} --shard-by servers: the plan's servers do not split well into {n} shards: "
                        f"{'; '.join(why)} (split: {groups_text}; kept: "
                        + ", ".join(f"{m} {k:.0%}" for m, k in kept.items()) + ")",
                        fix=f"use fewer shards (--shards {n - 1}), or --shard-by models")
    routes: dict[str, list[tuple[int, float]]] = {m: [(i, c[m]) for i, c in enumerate(caps) if c.get(m, 0.0) > 0] for m in order}
    return ShardLayout(by="servers", plans=plans, parts=parts, routes={m: r for m, r in routes.items() if r},
                       servers=[sorted(g) for g in groups], shares=list(report["shares"]), kept=kept)


def _max_share() -> float:
    from ppipe.dataplane.split import MAX_GROUP_SHARE

    return MAX_GROUP_SHARE


def shard_layout(plan: Plan, n: int, by: str = "models") -> ShardLayout:
    """The layout of ``n`` shards by ``by`` (:data:`SHARD_BY`): :func:`model_layout` or :func:`split_layout`."""
    if by not in SHARD_BY:
        raise UserError(f"--shard-by must be one of {', '.join(SHARD_BY)}, got '{by}'", fix="use --shard-by models or servers")
    return split_layout(plan, n) if by == "servers" else model_layout(plan, n)


def auto_split_shards(plan: Plan, cores: int, cost_s: float = FRONTEND_CPU_S_PER_REQUEST) -> int:
    """``--shards auto --shard-by servers``: what the planned rate needs (as :func:`auto_shards`),
    at most the servers the plan uses and the cores but one, lowered until the split is one
    :func:`split_layout` takes."""
    rate = sum(m.throughput_rps for m in plan.models)
    need = math.ceil(rate * cost_s / TARGET_BUSY)
    n = max(1, min(need, len({p.server for p in plan.placement}), cores - 1))
    while n > 1:
        try:
            split_layout(plan, n)
            return n
        except UserError:
            n -= 1
    return 1
