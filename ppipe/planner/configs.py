"""Column generation for the planner: every SLO-feasible pipeline configuration.

A *template* is an ordered tuple of GPU types, one per partition slot (length 1..D; one
type may fill consecutive slots, see :func:`templates_for`). A
*configuration* of a template fixes the cut points (contiguous block ranges covering
all blocks), the vGPU level of every partition and the pipeline's unified batch size.
Constraint (1) of the MILP (the latency SLO, see :mod:`ppipe.planner.milp`) involves a
configuration alone, so it is enforced here, before the MILP exists: only configurations
whose latency fits the SLO become columns.

Everything is computed with numpy over all types x levels x batches x cut points of a block
of templates at once (prefix sums of block latencies give every partition latency by one
subtraction), and the dominance pruning runs over all groups of configurations at once.

Two configurations with the same template and the same level per slot use the same
resources per vGPU; if one's per-vGPU throughput is at least the other's in every slot it
*dominates*: any plan using the weaker one stays feasible, with no less throughput, when
it uses the stronger one with the same vGPU counts (where the plan holds both, under one
configuration per template, the two pipelines merge into one of the stronger configuration
with the summed pools: min_d X_d g_d + min_d X_d h_d <= min_d X_d (g_d + h_d), and one
template fewer). Dominated configurations are dropped (exactly, so the optimum is
unchanged). Under the physical GPU rule resources depend only on the multiset of (type,
level) of the partitions, not their order, so the comparison then runs across templates
with the same multiset, and two more rules hold there (with several configurations per
template): i dominates j if i's slots map one-to-one into j's, each onto a slot of its
type with either the same level and X_i >= X_j, or level 1 in j, level r in i and
r X_i >= X_j. A plan then gives i's slot the pool of j's (r times as many vGPUs where j's
is level 1: one GPU at level 1 is r vGPUs at level r, so the GPUs per type do not grow)
and frees j's unmatched pools. Such an i has fewer slots or a higher level somewhere, so
no two configurations dominate each other this way.

Under the paper's GPU rule a pool's resources are its *share* g/v of its (model, slot,
type), whatever its level, so the comparison also runs across levels: a pool of g vGPUs
at level v and one of r g vGPUs at level r v hold the same share. A configuration whose
level in every slot is a multiple r_d of another's, with r_d X'_d >= X_d, dominates it (the
same shares give at least the throughput).
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass, field

import numpy as np

from ppipe.spec.cluster import ClusterSpec
from ppipe.spec.profile import MIN_BLOCK_LATENCY_US, ModelProfile

LEVEL_CODES = 5  # vGPU levels are 1..4 (ppipe.spec.cluster.GpuType): a slot's code is (type + 1) * 5 + level
# Templates' configurations are pruned together once this many are pending: fewer, larger
# numpy steps than one per template, while the unpruned rows stay a few MB.
PRUNE_BATCH_ROWS = 1 << 17
# (type, level, batch, cut) combinations of one block of templates whose latencies are
# computed at once (a few tens of MB of float64 temporaries).
BLOCK_ELEMENTS = 1 << 22
BATCH_BUILD_FACTOR = 1.3  # docs/planning-model.md, 'Derived quantities': beta(b) = 1.3 * 1e6 * (b - 1) / x_hat


@dataclass(frozen=True)
class ModelSpec:
    """One model as the planner sees it.

    Attributes:
        profile: the latency interface.
        slo_ms: end-to-end SLO (the runtime deadline).
        weight: workload weight w_m.
        batch_build_rps: x_hat_m for the batch-gathering estimate beta(b); None = off.
        profile_ref: what plan.yaml records in ``profile``.
    """

    profile: ModelProfile
    slo_ms: float
    weight: float = 1.0
    batch_build_rps: float | None = None
    profile_ref: str = ""

    @property
    def name(self) -> str:
        return self.profile.name


@dataclass
class ConfigSet:
    """The columns of one model: arrays indexed by configuration c (and slot d < D).

    Unused slots (d >= nparts[c]) hold gpu = -1, level = 0, X = 0.
    """

    model: int
    types: list[str]  # cluster GPU types; gpu[c, d] indexes this list
    nparts: np.ndarray  # (C,) partitions of the configuration
    template: np.ndarray  # (C,) template index into `templates`
    templates: list[tuple[int, ...]]
    batch: np.ndarray  # (C,)
    gpu: np.ndarray  # (C, D) type index
    level: np.ndarray  # (C, D) vGPU level
    first: np.ndarray  # (C, D) first block
    last: np.ndarray  # (C, D) last block (inclusive)
    infer_us: np.ndarray  # (C, D)
    transfer_us: np.ndarray  # (C, D) batch transfer after the partition (0 for the last)
    X: np.ndarray  # (C, D) per-vGPU throughput in req/s
    latency_us: np.ndarray  # (C,) inference + transfer (without beta)
    enumerated: int = 0  # before SLO filtering and pruning
    min_latency_b1_us: float = float("inf")  # smallest pipeline latency at batch 1 (for error messages)
    stats: dict = field(default_factory=dict)

    def __len__(self) -> int:
        return int(self.nparts.shape[0])


def templates_for(num_types: int, max_partitions: int) -> list[tuple[int, ...]]:
    """Every ordered tuple of type indices of length 1..D: the GPU types of a pipeline's slots.

    Consecutive slots of one type are kept: such a pipeline can mix vGPU levels of that
    type (googlenet-v3 on HC2-L carries 41 % of its optimum on T4 level 1 -> T4 level 2
    pipelines), and the authors' model (``ilp_v4.py``, ``itertools.product`` over all types)
    has them. Where they cannot help (physical packing, the same level in both slots),
    :func:`enumerate_configs` drops their configurations instead.
    """
    out: list[tuple[int, ...]] = []
    for n in range(1, max_partitions + 1):
        out.extend(itertools.product(range(num_types), repeat=n))
    return out


def paper_template_rows(cs: "ConfigSet", num_types: int) -> list[tuple[np.ndarray, int]]:
    """Rows of constraint (6a), the authors' one configuration per template, as (configurations, cap).

    The authors' templates are the K^D tuples of D GPU types; a template's one pipeline
    uses its first n <= D slots (the rest are left empty at the end). So an n-partition
    configuration of types p can take any template that starts with p, and a set of
    configurations fits (one per template) iff, for every prefix q of length l = 1..D,
    at most K^(D - l) of them have types that start with q: the templates starting with
    q form a subtree of K^(D - l) leaves, subtrees are nested or disjoint, and for such
    (laminar) neighbourhoods Hall's condition on the subtrees alone is sufficient.
    Rows that no choice can break (fewer configurations than the cap) are left out.
    """
    D = cs.gpu.shape[1]
    rows: dict[tuple[int, ...], list[int]] = {}
    for c in range(len(cs)):
        types = tuple(int(k) for k in cs.gpu[c, : int(cs.nparts[c])])
        for length in range(1, len(types) + 1):
            rows.setdefault(types[:length], []).append(c)
    out = []
    for q in sorted(rows):
        cap = num_types ** (D - len(q))
        if len(rows[q]) > cap:
            out.append((np.array(rows[q], dtype=int), cap))
    return out


def _prefix_tables(profile: ModelProfile, types: list[str], levels: dict[str, list[int]], batches: list[int]):
    """(PT, LV): PT[k, l, b, j] the prefix sums of max(L, 1 us) over blocks < j at the l-th
    level of type k (``levels[k][l]``, whose value is LV[k, l]), shape (K, L, B, M + 1)
    with L the most levels of any type; NaN where unprofiled or where type k has fewer
    levels (LV 0 there)."""
    M = profile.num_blocks
    L = max(len(levels[k]) for k in types)
    arr = np.full((len(types), L, len(batches), M + 1), np.nan)
    lv = np.zeros((len(types), L), dtype=int)
    for ki, k in enumerate(types):
        for vi, v in enumerate(levels[k]):
            lv[ki, vi] = v
            have = set(profile.batches(k, v))
            for bi, b in enumerate(batches):
                if b not in have:
                    continue
                lat = np.array([profile.table[(k, v, b, i)] for i in range(M)], dtype=float)
                arr[ki, vi, bi, 0] = 0.0
                arr[ki, vi, bi, 1:] = np.cumsum(np.maximum(lat, MIN_BLOCK_LATENCY_US))
    return arr, lv


def enumerate_configs(
    m: int,
    spec: ModelSpec,
    cluster: ClusterSpec,
    *,
    max_partitions: int,
    margin: float,
    levels: dict[str, list[int]],
    group_by_multiset: bool,
    prune: bool = True,
    across_levels: bool = False,
    authors_arithmetic: bool = False,
) -> ConfigSet:
    """All SLO-feasible configurations of one model (constraint 1), dominated ones pruned.

    Args:
        m: index of the model in the plan.
        spec: the model, its SLO and batch-build estimate.
        cluster: GPU types, GPUs per server and NIC bandwidths.
        max_partitions: D.
        margin: share of the SLO kept free.
        levels: usable vGPU levels per GPU type (cluster levels that the profile has).
        group_by_multiset: compare configurations across templates and multisets of
            (type, level) (see the module docstring), and (with ``prune``) drop those
            with two consecutive slots of one (type, level) (both exact under the
            physical GPU rule with several configurations per template only, see below).
        prune: drop dominated configurations.
        across_levels: compare configurations of one template across vGPU levels, a
            level r v standing for r vGPUs of level v (exact under the paper's GPU rule only).
        authors_arithmetic: the arithmetic of the authors' ``ilp_v4.py`` where it differs
            from docs/planning-model.md: the margin is rounded to whole microseconds
            (``round(margin * T)``), and a partition's missing NIC side (the first one's
            input, the last one's output) counts as a 1 us transfer, capping X at
            1e6 / (v s_k) instead of not at all.

    Two consecutive slots of one type at one level, with pools g_1, g_2, carry at most
    min(g_1 b / C_1, g_2 b / C_2) <= (g_1 + g_2) b / (C_1 + C_2) (the mediant), which one
    slot running both block ranges on g_1 + g_2 vGPUs of that (type, level) carries, with
    no transfer between them, hence a smaller latency and no NIC cap at the removed cut;
    under physical packing it uses the same vGPUs. So those configurations are dominated.
    """
    times = _ModelTimes.of(spec, cluster, levels, margin, authors_arithmetic)
    D = max_partitions
    templates = templates_for(len(times.types), D)
    parts: list[dict[str, np.ndarray]] = []
    pending: list[dict[str, np.ndarray]] = []  # configurations not yet pruned
    pending_rows = 0
    enumerated, feasible, min_lat_b1 = 0, 0, float("inf")
    for n, prefix in _template_blocks(times, D):
        blk = _block_latency(times, n, prefix)
        enumerated += int(np.isfinite(blk.latency).sum())
        min_lat_b1 = min(min_lat_b1, blk.least_batch1_latency(times))
        beta = times.beta.reshape([1] * (2 * n) + [-1, 1])
        with np.errstate(invalid="ignore"):
            ok = np.isfinite(blk.latency) & (blk.latency + beta <= times.budget_us)
        if prune and group_by_multiset:
            ok &= blk.no_repeated_slot_level()
        if ok.any():
            part = _configurations(times, blk, ok, D)
            feasible += part["n"].size
            pending.append(part)
            pending_rows += part["n"].size
        if prune and pending_rows >= PRUNE_BATCH_ROWS:
            parts.append(_undominated_part(_joined(pending), group_by_multiset))
            pending, pending_rows = [], 0
    if pending:
        parts.append(_undominated_part(_joined(pending), group_by_multiset) if prune else _joined(pending))
    cs = _config_set(m, times.types, templates, parts, D, enumerated, min_lat_b1)
    cs.stats["feasible"] = feasible
    if prune and len(cs):
        cs = subset(cs, pareto_keep(cs, group_by_multiset, across_levels))
    cs.stats["kept"] = len(cs)
    return cs


@dataclass(frozen=True)
class _ModelTimes:
    """What the configurations of one model are computed from: prefix sums of block
    latencies (``prefix_all``: type x level index x batch x block boundary, the level
    index l of type k standing for level ``level_values[k, l]``), cut sizes, NICs, the
    planning budget and the batch-gathering estimate per batch (``beta``)."""

    types: list[str]
    levels: dict[str, list[int]]
    blocks: int
    batches: np.ndarray
    prefix_all: np.ndarray
    level_values: np.ndarray
    cut_bits: np.ndarray  # bits per sample over the cut after block j
    bandwidth: np.ndarray  # bit/s per GPU type's NIC
    gpus_per_server: np.ndarray
    budget_us: float
    no_cut_us: float  # a partition's missing NIC side: no cap (inf) or the authors' 1 us
    beta: np.ndarray

    @classmethod
    def of(cls, spec: ModelSpec, cluster: ClusterSpec, levels, margin: float, authors_arithmetic: bool) -> "_ModelTimes":
        prof = spec.profile
        types = [g.name for g in cluster.gpu_types]
        batches = sorted({b for k in types for v in levels[k] for b in prof.batches(k, v)})
        bvec = np.array(batches, dtype=float)
        slo_us = spec.slo_ms * 1000.0
        beta = np.zeros(len(batches))
        if spec.batch_build_rps:
            beta = BATCH_BUILD_FACTOR * 1e6 * (bvec - 1.0) / spec.batch_build_rps
        prefix_all, level_values = _prefix_tables(prof, types, levels, batches)
        return cls(
            types=types,
            levels=levels,
            blocks=prof.num_blocks,
            batches=bvec,
            prefix_all=prefix_all,
            level_values=level_values,
            cut_bits=np.array([prof.cut_bytes(j) * 8.0 for j in range(prof.num_blocks)], dtype=float),
            bandwidth=np.array([cluster.effective_bandwidth_gbps(k) for k in types]) * 1e9,
            gpus_per_server=np.array([cluster.gpus_per_server(k) for k in types], dtype=float),
            budget_us=slo_us - round(margin * slo_us) if authors_arithmetic else slo_us * (1.0 - margin),
            # ilp_v4.py: a missing NIC side is a transfer of 1 us (1e6 / 1 / v / s_k req/s).
            no_cut_us=1.0 if authors_arithmetic else np.inf,
            beta=beta,
        )


def _template_blocks(times: _ModelTimes, max_partitions: int):
    """(n, prefix) per block of templates: those of length n (1..D, at most the model's
    blocks) whose first types are ``prefix``, the shortest prefix whose block has at most
    BLOCK_ELEMENTS (type, level, batch, cut) combinations. In the order of
    :func:`templates_for`, so that the configurations come out in its template order."""
    K, M = len(times.types), times.blocks
    L = max(len(lv) for lv in times.levels.values())
    for n in range(1, min(max_partitions, M) + 1):
        Q = math.comb(M - 1, n - 1)
        p = 0
        while p < n and K ** (n - p) * L**n * times.batches.size * Q > BLOCK_ELEMENTS:
            p += 1
        yield from ((n, prefix) for prefix in itertools.product(range(K), repeat=p))


@dataclass(frozen=True)
class _Block:
    """The latencies of one block of templates (:func:`_template_blocks`) over the axes
    (type of slot 1..n, level index of slot 1..n, batch, cut points): in all, and per slot
    its inference and outgoing transfer, before broadcasting. A slot's type axis has
    length 1 (a type of the prefix) or K; level indices run over the most levels any
    type has (NaN latency where a type lacks one). ``bounds[q]``: the block boundaries."""

    n: int
    types: list[np.ndarray]  # per slot, the type of each index of its type axis
    bounds: np.ndarray  # (Q, n + 1)
    latency: np.ndarray  # (T_1, ..., T_n, L, ..., L, B, Q)
    infer: list[np.ndarray]  # per slot: (T_d, L, B, Q)
    transfer: list[np.ndarray]  # per slot: (T_d, T_{d+1}, B, Q); the last slot's is 0

    def least_batch1_latency(self, times: _ModelTimes) -> float:
        b1 = np.nonzero(times.batches == 1)[0]
        if not b1.size:
            return float("inf")
        lb1 = self.latency[..., int(b1[0]), :]
        return float(np.nanmin(lb1)) if np.isfinite(lb1).any() else float("inf")

    def no_repeated_slot_level(self) -> np.ndarray:
        """Mask (broadcast over ``latency``) that drops two consecutive slots of one type
        at one level: dominated under physical packing (see :func:`enumerate_configs`)."""
        n, shape = self.n, self.latency.shape
        keep = np.ones([1] * len(shape), bool)
        for d in range(n - 1):
            view = [1] * len(shape)
            view[d], view[d + 1], view[n + d], view[n + d + 1] = shape[d], shape[d + 1], shape[n + d], shape[n + d + 1]
            same_type = np.equal.outer(self.types[d], self.types[d + 1])
            same_level = np.eye(shape[n + d], dtype=bool)
            keep = keep & ~(same_type[:, :, None, None] & same_level[None, None]).reshape(view)
        return keep


def _block_latency(times: _ModelTimes, n: int, prefix: tuple[int, ...]) -> _Block:
    """The latencies of the templates of length ``n`` that start with ``prefix``, every
    (type, level, batch, cut) combination at once, summed in slot order (inference, then
    the transfer to the next slot) as for each template alone."""
    M, Bn, K = times.blocks, times.batches.size, len(times.types)
    combos = list(itertools.combinations(range(1, M), n - 1))
    cuts = np.array(combos, dtype=int).reshape(len(combos), n - 1)
    Q = cuts.shape[0]
    bnd = np.concatenate([np.zeros((Q, 1), int), cuts, np.full((Q, 1), M, int)], axis=1)
    types = [np.array([prefix[d]]) if d < len(prefix) else np.arange(K) for d in range(n)]
    L = times.prefix_all.shape[1]
    shape = [t.size for t in types] + [L] * n + [Bn, Q]
    lat = np.zeros(shape)
    infer, trans = [], []
    for d in range(n):
        s, e = bnd[:, d], bnd[:, d + 1]
        pt = times.prefix_all[types[d]]  # (T_d, L, B, M + 1)
        inf_d = pt[:, :, :, e] - pt[:, :, :, s]  # (T_d, L, B, Q)
        infer.append(inf_d)
        view = [1] * (2 * n) + [Bn, Q]
        view[d], view[n + d] = types[d].size, L
        np.add(lat, inf_d.reshape(view), out=lat)
        if d < n - 1:
            # The batch crosses the slower of the two NICs.
            bw = np.minimum.outer(times.bandwidth[types[d]], times.bandwidth[types[d + 1]])  # (T_d, T_{d+1})
            tau = times.cut_bits[e - 1][None, None, :] / bw[:, :, None] * 1e6  # (T_d, T_{d+1}, Q)
            tr_d = times.batches[None, None, :, None] * tau[:, :, None, :]  # (T_d, T_{d+1}, B, Q)
            trans.append(tr_d)
            view = [1] * (2 * n) + [Bn, Q]
            view[d], view[d + 1] = types[d].size, types[d + 1].size
            np.add(lat, tr_d.reshape(view), out=lat)
        else:
            trans.append(np.zeros((types[d].size, 1, Bn, Q)))
    return _Block(n, types, bnd, lat, infer, trans)


def _configurations(times: _ModelTimes, blk: _Block, ok: np.ndarray, D: int) -> dict:
    """The columns of the feasible configurations ``ok`` of a block of templates: per slot
    its type, level, blocks, inference and transfer times and X (req/s per vGPU, NIC caps
    in), and each configuration's template index in :func:`templates_for`'s order."""
    n = blk.n
    idx = np.nonzero(ok)
    C = idx[0].size
    ti, li, bi, qi = idx[:n], idx[n : 2 * n], idx[2 * n], idx[2 * n + 1]
    bnd = blk.bounds
    out = dict(gpu=np.full((C, D), -1, int), lvl=np.zeros((C, D), int), first=np.full((C, D), -1, int),
               last=np.full((C, D), -1, int), inf=np.zeros((C, D)), tr=np.zeros((C, D)), X=np.zeros((C, D)))
    bsz = times.batches[bi]
    K = len(times.types)
    template = np.full(C, sum(K**j for j in range(1, n)))  # the first template of length n
    for d in range(n):
        k = blk.types[d][ti[d]]
        template += k * K ** (n - 1 - d)
        v = times.level_values[k, li[d]]
        out["gpu"][:, d] = k
        out["lvl"][:, d] = v
        out["first"][:, d] = bnd[qi, d]
        out["last"][:, d] = bnd[qi, d + 1] - 1
        out["inf"][:, d] = blk.infer[d][ti[d], li[d], bi, qi]
        if d < n - 1:
            out["tr"][:, d] = blk.transfer[d][ti[d], ti[d + 1], bi, qi]
        x = 1e6 * bsz / out["inf"][:, d]
        # NIC caps: a server's link is shared by its s_k GPUs and their v vGPUs.
        share = v * times.gpus_per_server[k]
        bw = times.bandwidth[k]
        t_in = times.cut_bits[bnd[qi, d] - 1] / bw * 1e6 if d > 0 else np.full(C, times.no_cut_us)
        t_out = times.cut_bits[bnd[qi, d + 1] - 1] / bw * 1e6 if d < n - 1 else np.full(C, times.no_cut_us)
        with np.errstate(divide="ignore"):
            for t in (t_in, t_out):  # no cap where nothing is sent (t = 0 or inf)
                x = np.minimum(x, np.where(np.isfinite(t) & (t > 0), 1e6 / (t * share), np.inf))
        out["X"][:, d] = x
    out.update(tmpl=template, n=np.full(C, n), b=bsz.astype(int), lat=blk.latency[ok])
    return out


def _joined(parts: list[dict]) -> dict:
    """One part of the configurations of several (in order)."""
    return parts[0] if len(parts) == 1 else {key: np.concatenate([p[key] for p in parts]) for key in parts[0]}


def _undominated_part(part: dict, group_by_multiset: bool) -> dict:
    """The configurations of a few consecutive templates that no other one of them
    dominates by the first rule of :func:`pareto_keep` (same multiset of (type, level), or
    same template and levels).

    Why: the SLO-feasible configurations of all templates (e.g. 257,000 for one model on six
    GPU types with three partitions) never need to exist at once; pruning the templates in
    batches of about PRUNE_BATCH_ROWS configurations as they are made keeps only their
    survivors. It changes nothing: a configuration dropped here is dominated in the whole
    set too, and one it dominated is dominated by what dominated it (the relation is
    transitive), with ties broken the same way (latency, then order).
    """
    if group_by_multiset:
        codes, X = _sorted_slots(part["gpu"], part["lvl"], part["X"])
        keep = _undominated(X, part["lat"], _row_codes(codes))
    else:
        levels = np.where(part["gpu"] >= 0, part["lvl"], 0)
        keep = _undominated(part["X"], part["lat"], _row_codes(np.concatenate([part["tmpl"][:, None], levels], axis=1)))
    return {key: val[keep] for key, val in part.items()}


def _config_set(m, types, templates, parts: list[dict], D: int, enumerated: int, min_lat_b1: float) -> ConfigSet:
    """One ConfigSet from the templates' configuration columns."""

    def cat(key, shape):
        return np.concatenate([p[key] for p in parts]) if parts else np.zeros(shape)

    return ConfigSet(
        model=m,
        types=types,
        nparts=cat("n", (0,)).astype(int),
        template=cat("tmpl", (0,)).astype(int),
        templates=templates,
        batch=cat("b", (0,)).astype(int),
        gpu=cat("gpu", (0, D)).astype(int),
        level=cat("lvl", (0, D)).astype(int),
        first=cat("first", (0, D)).astype(int),
        last=cat("last", (0, D)).astype(int),
        infer_us=cat("inf", (0, D)),
        transfer_us=cat("tr", (0, D)),
        X=cat("X", (0, D)),
        latency_us=cat("lat", (0,)),
        enumerated=enumerated,
        min_latency_b1_us=min_lat_b1,
    )


def subset(cs: ConfigSet, keep: np.ndarray) -> ConfigSet:
    """The configurations of ``cs`` selected by a boolean mask or index array."""
    out = ConfigSet(
        model=cs.model,
        types=cs.types,
        nparts=cs.nparts[keep],
        template=cs.template[keep],
        templates=cs.templates,
        batch=cs.batch[keep],
        gpu=cs.gpu[keep],
        level=cs.level[keep],
        first=cs.first[keep],
        last=cs.last[keep],
        infer_us=cs.infer_us[keep],
        transfer_us=cs.transfer_us[keep],
        X=cs.X[keep],
        latency_us=cs.latency_us[keep],
        enumerated=cs.enumerated,
        min_latency_b1_us=cs.min_latency_b1_us,
        stats=dict(cs.stats),
    )
    return out


def pareto_keep(cs: ConfigSet, group_by_multiset: bool, across_levels: bool = False) -> np.ndarray:
    """Boolean mask of the configurations that no other one dominates (see module docstring).

    ``across_levels`` (paper GPU rule only): within a template, i also dominates j where
    each of i's levels is a multiple r_d of j's and r_d X_i >= X_j in every slot. Those
    comparisons run among the same-level survivors only (dominance is transitive, so that
    is exact), which keeps the pairs few. ``group_by_multiset`` (physical rule): likewise,
    the comparison across multisets runs among the survivors of the same-multiset one.
    """
    if group_by_multiset and across_levels:
        raise ValueError("across_levels compares within a template (paper GPU rule), not across multisets")
    if group_by_multiset:
        codes, X = _sorted_slots(cs.gpu, cs.level, cs.X)
        keep = _undominated(X, cs.latency_us, _row_codes(codes))
        idx = np.nonzero(keep)[0]
        keep[idx] = ~_dominated_across_multisets(cs.gpu[idx], cs.level[idx], cs.X[idx])
        return keep
    levels = np.where(cs.gpu >= 0, cs.level, 0)
    keep = _undominated(cs.X, cs.latency_us, _row_codes(np.concatenate([cs.template[:, None], levels], axis=1)))
    if across_levels:
        idx = np.nonzero(keep)[0]
        keep[idx] = _undominated(cs.X[idx], cs.latency_us[idx], cs.template[idx], cs.level[idx])
    return keep


def _sorted_slots(gpu: np.ndarray, level: np.ndarray, X: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Each row's slots sorted by (type, level, -X), unused ones last: (resource code per
    slot, 0 where unused; X). Equal (type, level) slots then align strongest first, so
    that between rows of equal codes componentwise >= holds iff a matching of the slots
    with >= exists."""
    used = gpu >= 0
    code = np.where(used, (gpu + 1) * LEVEL_CODES + level, 0)  # increases with (type, level): level < LEVEL_CODES
    key = np.where(used, code, np.iinfo(np.int64).max).astype(np.int64)  # unused slots last
    # Odd-even transposition sort of the D slots of every row at once (D rounds of
    # compare-and-swap on neighbours), column by column: rows of a few slots need no
    # per-row sort. Slots of equal key and X are interchangeable, so the result is each
    # row's (code, X) in sorted order.
    cols = [[key[:, d], code[:, d], X[:, d]] for d in range(key.shape[1])]
    D = len(cols)
    for r in range(D):
        for i in range(r % 2, D - 1, 2):
            a, b = cols[i], cols[i + 1]
            swap = (b[0] < a[0]) | ((b[0] == a[0]) & (b[2] > a[2]))
            cols[i] = [np.where(swap, q, p) for p, q in zip(a, b)]
            cols[i + 1] = [np.where(swap, p, q) for p, q in zip(a, b)]
    if not D:
        return code, np.array(X, dtype=float)
    return np.stack([c[1] for c in cols], axis=1), np.stack([c[2] for c in cols], axis=1).astype(float)


def _dominated_across_multisets(gpu: np.ndarray, level: np.ndarray, X: np.ndarray) -> np.ndarray:
    """Mask of the configurations that another one dominates under physical packing with a
    different multiset of (type, level): with fewer slots, or at level r > 1 where the
    other is at level 1 (see the module docstring).

    A dominator is matched by its *shadows* (some level-r slots read as level 1 with r X)
    and a dominated configuration by its *reductions* (some slots dropped), which turns
    both cases into the same-multiset comparison. Configurations that dominate each other
    do not occur here: the same-multiset pruning ran first.
    """
    owner = np.arange(len(gpu))
    shadow = _shadows(gpu, level, X, owner)
    reduction = _reductions(gpu, level, X, owner)
    dominated = np.zeros(len(gpu), bool)
    dominated[_covered((gpu, level, X, owner), shadow)] = True
    dominated[_covered(reduction, tuple(np.concatenate(p) for p in zip((gpu, level, X, owner), shadow)))] = True
    return dominated


def _shadows(gpu, level, X, owner):
    """Rows of the configurations with some slots at level r > 1 read as level 1 with r X:
    one level-1 vGPU is a whole GPU, which holds r vGPUs of level r."""
    rows = []
    for read in itertools.product((False, True), repeat=gpu.shape[1]):
        m = np.array(read)
        if m.any():
            sel = np.nonzero((level[:, m] > 1).all(axis=1))[0]
            lv, x = level[sel], X[sel].copy()
            x[:, m] *= lv[:, m]
            rows.append((gpu[sel], np.where(m, 1, lv), x, owner[sel]))
    return tuple(np.concatenate(p) for p in zip(*rows))


def _reductions(gpu, level, X, owner):
    """Rows of the configurations with some used slots dropped, at least one kept."""
    used, rows = gpu >= 0, []
    for drop in itertools.product((False, True), repeat=gpu.shape[1]):
        m = np.array(drop)
        if m.any():
            sel = np.nonzero(used[:, m].all(axis=1) & (used[:, ~m]).any(axis=1))[0]
            rows.append((np.where(m, -1, gpu[sel]), np.where(m, 0, level[sel]), np.where(m, 0.0, X[sel]), owner[sel]))
    return tuple(np.concatenate(p) for p in zip(*rows))


def _covered(rows, by, max_pairs: int = 1 << 20) -> np.ndarray:
    """Owners of the ``rows`` (gpu, level, X, owner) that a row of ``by`` with the same
    multiset of (type, level) is componentwise >= to, after sorting the slots.

    Each row is compared with the rows of ``by`` of its group, all pairs at once, at most
    ``max_pairs`` per step (on the 1,000-GPU fleet a few million pairs per model).
    """
    codes_r, x_r = _sorted_slots(*rows[:3])
    codes_b, x_b = _sorted_slots(*by[:3])
    group = _row_codes(np.concatenate([codes_r, codes_b]))
    g_r, g_b = group[: len(codes_r)], group[len(codes_r) :]
    front = np.argsort(g_b, kind="stable")
    fx, fg = x_b[front], g_b[front]
    first, count = np.searchsorted(fg, g_r, "left"), np.searchsorted(fg, g_r, "right")
    count -= first
    hit = np.zeros(len(codes_r), bool)
    ends = np.cumsum(count)
    a = 0
    while a < len(codes_r):
        # The rows a..b-1 and their pairs, at most max_pairs (one row at least).
        base = ends[a - 1] if a else 0
        b = max(a + 1, int(np.searchsorted(ends, base + max_pairs, "right")))
        q = np.repeat(np.arange(a, b), count[a:b])
        f = first[q] + np.arange(q.size) - np.repeat(ends[a:b] - count[a:b] - base, count[a:b])
        ge = np.ones(q.size, bool)
        for d in range(x_r.shape[1]):
            ge &= fx[f, d] >= x_r[q, d]
        hit[q[ge]] = True
        a = b
    return np.unique(rows[3][hit])


def _row_codes(rows: np.ndarray) -> np.ndarray:
    """One integer per row of small non-negative integers, equal for equal rows (a group key)."""
    base = int(rows.max(initial=0)) + 1
    if base ** rows.shape[1] >= 2**62:
        return np.unique(rows, axis=0, return_inverse=True)[1].reshape(-1)
    return rows.astype(np.int64) @ (base ** np.arange(rows.shape[1], dtype=np.int64))


def _group_slices(group: np.ndarray) -> list[np.ndarray]:
    """Indices of each group's members, in ascending order."""
    order = np.argsort(group, kind="stable")
    return np.split(order, np.nonzero(np.diff(group[order]))[0] + 1) if len(order) else []


def _undominated(X: np.ndarray, latency_us: np.ndarray, group: np.ndarray, level: np.ndarray | None = None) -> np.ndarray:
    """Mask of the rows of X that no row of the same group dominates; with ``level``, a row
    i stands for r = level_i / level_j rows of j's level where that is a whole number.

    Without ``level``, row i dominates row j when X_i >= X_j componentwise and i ranks
    before j in the order (X descending lexicographically, then latency ascending, then
    row index): among equal X vectors the lowest-latency one is kept.
    """
    if level is None:
        return _undominated_by_rank(X, latency_us, group)
    keep = np.zeros(len(group), bool)
    for idx in _group_slices(group):
        x = X[idx]
        rank = np.lexsort((latency_us[idx],) + tuple(-x[:, d] for d in reversed(range(x.shape[1]))))
        idx, x = idx[rank], x[rank]
        # Unused slots (level 0) compare as level 1 with X = 0.
        li, lj = np.maximum(level[idx][:, None, :], 1), np.maximum(level[idx][None, :, :], 1)
        r, divides = li / lj, li % lj == 0
        xi = r * x[:, None, :]
        ge = (divides & (xi >= x[None, :, :])).all(axis=2)  # ge[i, j]: i does at least j's work everywhere
        gt = ((xi > x[None, :, :]) | (r > 1)).any(axis=2)
        ar = np.arange(len(idx))
        # j is dominated by i != j if i >= j everywhere and (> somewhere, or equal and ranked earlier).
        dom = (ge & (gt | (ar[:, None] < ar[None, :])) & (ar[:, None] != ar[None, :])).any(axis=0)
        keep[idx[~dom]] = True
    return keep


def _undominated_by_rank(X: np.ndarray, latency_us: np.ndarray, group: np.ndarray) -> np.ndarray:
    """The same-level case of :func:`_undominated`, every group at once.

    Each round keeps, in every group, the undecided row that ranks first (X largest
    lexicographically, then the lowest latency, then the lowest index: found by segmented
    maxima over the rows sorted by group), and drops the undecided rows of that group that
    it dominates. The kept row is undominated: no undecided row ranks before it, and each
    decided one was kept (and dropped what it dominates) or dropped (and then whatever
    dominated it dominates this row too, by transitivity, so this row would have been
    dropped). The rounds number the most rows one group keeps; each is a few numpy
    operations over the undecided rows of all groups.
    """
    n, D = X.shape
    keep = np.zeros(n, bool)
    order = np.argsort(group, kind="stable")  # by group, then index
    g, lat = group[order], latency_us[order]
    cols = [np.ascontiguousarray(X[order, d]) for d in range(D)]
    undecided = np.arange(n)
    while undecided.size:
        gu = g[undecided]
        new = np.empty(gu.size, bool)
        new[0] = True
        np.not_equal(gu[1:], gu[:-1], out=new[1:])
        starts = np.flatnonzero(new)
        seg = np.cumsum(new) - 1  # each undecided row's group, numbered in this round
        first = np.ones(gu.size, bool)  # ranks first in its group, so far
        for c in cols:
            v = np.where(first, c[undecided], -np.inf)
            first &= v == np.maximum.reduceat(v, starts)[seg]
        v = np.where(first, lat[undecided], np.inf)
        first &= v == np.minimum.reduceat(v, starts)[seg]
        count = np.cumsum(first)
        first &= count - (count[starts] - first[starts])[seg] == 1  # the lowest index among ties
        heads = undecided[first]
        keep[order[heads]] = True
        rest = undecided[~first]
        by = heads[seg[~first]]  # each remaining row's group head
        dominated = np.ones(rest.size, bool)
        for c in cols:
            dominated &= c[by] >= c[rest]
        undecided = rest[~dominated]
    return keep
