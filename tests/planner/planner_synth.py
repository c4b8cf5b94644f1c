"""Small synthetic clusters and profiles for the planner tests, and a brute-force planner.

The brute force shares no code with ppipe.planner: it lists configurations with plain
loops from the profile table and searches vGPU counts exhaustively.
"""

from __future__ import annotations

import itertools
import math
from functools import lru_cache

import numpy as np

from ppipe.spec.cluster import ClusterSpec, GpuType, ServerGroup
from ppipe.spec.profile import BlockSpec, ModelManifest, ModelProfile, SourceSpec


def cluster(counts: dict[str, int], levels: dict[str, list[int]], gbps: float = 10.0, per_server: int = 1) -> ClusterSpec:
    return ClusterSpec(
        name="synthetic",
        gpu_types=[GpuType(name=k, vgpu_levels=levels[k]) for k in counts],
        servers=[
            ServerGroup(name=k.lower(), gpu_type=k, gpus_per_server=per_server, count=n // per_server, nic_bandwidth_gbps=gbps)
            for k, n in counts.items()
        ],
    )


def profile(name: str, lat: dict[str, list[float]], cut_bytes: list[int], levels: dict[str, list[int]], batches=(1, 2), slo_ms=None) -> ModelProfile:
    """Block latencies lat[gpu][i] at level 1 batch 1; level v is v times slower per
    sample share, batch b costs (0.6 + 0.4 b) x batch-1 (batching helps)."""
    table = {}
    for g, row in lat.items():
        for v in levels[g]:
            for b in batches:
                for i, l in enumerate(row):
                    table[(g, v, b, i)] = l * (0.6 + 0.4 * b) * (1 + 0.7 * (v - 1))
    blocks = [BlockSpec(index=i, out_bytes_per_sample=(cut_bytes[i] if i < len(cut_bytes) else 0)) for i in range(len(next(iter(lat.values()))))]
    man = ModelManifest(name=name, source=SourceSpec(kind="synthetic"), blocks=blocks, slo_ms=slo_ms)
    return ModelProfile(manifest=man, table=table)


def plain_configs(prof: ModelProfile, cl: ClusterSpec, slo_ms: float, margin: float, D: int, levels: dict[str, list[int]]):
    """[(template types, ((type, level, X), ...))] of every SLO-feasible configuration (no beta).

    Templates are all tuples of 1..D types, consecutive slots of one type included."""
    M = prof.num_blocks
    types = [g.name for g in cl.gpu_types]
    out = []
    for n in range(1, D + 1):
        for tmpl in itertools.product(types, repeat=n):
            for cuts in itertools.combinations(range(1, M), n - 1):
                bnd = (0,) + cuts + (M,)
                for lv in itertools.product(*[levels[k] for k in tmpl]):
                    for b in sorted({b for (g, v, b, _i) in prof.table}):
                        if any((k, v, b, 0) not in prof.table for k, v in zip(tmpl, lv)):
                            continue
                        total = 0.0
                        slots = []
                        for d, (k, v) in enumerate(zip(tmpl, lv)):
                            c = sum(max(prof.table[(k, v, b, i)], 1.0) for i in range(bnd[d], bnd[d + 1]))
                            x = 1e6 * b / c
                            s = cl.gpus_per_server(k)
                            bw = cl.effective_bandwidth_gbps(k) * 1e9
                            if d > 0:
                                x = min(x, 1e6 / (prof.cut_bytes(bnd[d] - 1) * 8 / bw * 1e6 * v * s))
                            if d < n - 1:
                                bw2 = min(bw, cl.effective_bandwidth_gbps(tmpl[d + 1]) * 1e9)
                                total += b * prof.cut_bytes(bnd[d + 1] - 1) * 8 / bw2 * 1e6
                                x = min(x, 1e6 / (prof.cut_bytes(bnd[d + 1] - 1) * 8 / bw * 1e6 * v * s))
                            total += c
                            slots.append((k, v, x))
                        if total <= slo_ms * 1000 * (1 - margin):
                            out.append((tmpl, tuple(slots)))
    return out


def best_physical(configs, capacity: dict[tuple[str, int], int]) -> dict[tuple, float]:
    """f(u) for every vGPU budget u <= capacity per (type, level): the best throughput of one
    model with at most u vGPUs per (type, level), several configurations allowed."""
    keys = sorted(capacity)

    @lru_cache(maxsize=None)
    def f(i: int, u: tuple) -> float:
        if i == len(configs):
            return 0.0
        best = f(i + 1, u)
        _t, slots = configs[i]
        idx = [keys.index((k, v)) for k, v, _x in slots]
        for g in itertools.product(*[range(1, u[j] + 1) for j in idx]):
            used = list(u)
            ok = True
            for j, gj in zip(idx, g):
                used[j] -= gj
                ok &= used[j] >= 0
            if not ok:
                continue
            thr = min(x * gj for (_k, _v, x), gj in zip(slots, g))
            best = max(best, thr + f(i + 1, tuple(used)))
        return best

    return f


def level_splits(counts: dict[str, int], levels: dict[str, list[int]]):
    """Every way to set the GPUs of each type to levels: {(type, level): vGPUs}."""
    per_type = []
    for k, n in counts.items():
        opts = []
        for split in itertools.product(range(n + 1), repeat=len(levels[k])):
            if sum(split) <= n:
                opts.append({(k, v): p * v for v, p in zip(levels[k], split)})
        per_type.append(opts)
    for combo in itertools.product(*per_type):
        cap = {}
        for d in combo:
            cap.update(d)
        yield cap


def brute_force_physical(models_configs, weights, counts, levels) -> float:
    """max-min normalized throughput under physical packing, by exhaustive search."""
    best = 0.0
    keys = sorted((k, v) for k in counts for v in levels[k])
    for cap in level_splits(counts, levels):
        capv = tuple(cap.get(key, 0) for key in keys)
        if len(models_configs) == 1:
            f = best_physical(models_configs[0], dict(zip(keys, capv)))
            best = max(best, f(0, capv) / weights[0])
            continue
        # Two models: split each (type, level) budget between them.
        f1 = best_physical(models_configs[0], dict(zip(keys, capv)))
        f2 = best_physical(models_configs[1], dict(zip(keys, capv)))
        for u1 in itertools.product(*[range(c + 1) for c in capv]):
            u2 = tuple(c - a for c, a in zip(capv, u1))
            best = max(best, min(f1(0, u1) / weights[0], f2(0, u2) / weights[1]))
    return best


def brute_force_paper(configs, counts, D: int) -> float:
    """Best throughput of ONE model under the authors' formulation (ilp_v4.py), exhaustively.

    Their templates are the tuples of exactly D types; each holds one pipeline (or none),
    a configuration whose types are the template's first n <= D; per (slot, type) the GPUs
    are ceil(sum g / v). Templates are taken one by one, keeping for every reachable vector
    of shares per (slot, type) (in twelfths of a GPU: levels 1..4) the best throughput.
    """
    types = list(counts)
    keys = [(d, k) for d in range(D) for k in types]

    def fits(share) -> bool:
        return all(sum(-(-share[keys.index((d, k))] // 12) for d in range(D)) <= counts[k] for k in types)

    states = {tuple([0] * len(keys)): 0.0}
    for tmpl in itertools.product(types, repeat=D):
        options = [slots for t, slots in configs if tuple(tmpl[: len(t)]) == tuple(t)]
        new = dict(states)  # the template left empty
        for share, thr0 in states.items():
            for slots in options:
                for g in itertools.product(*[range(1, counts[k] * v + 1) for k, v, _x in slots]):
                    s = list(share)
                    for d, ((k, v, _x), gd) in enumerate(zip(slots, g)):
                        s[keys.index((d, k))] += gd * 12 // v
                    if not fits(s):
                        continue
                    thr = thr0 + min(x * gd for (_k, _v, x), gd in zip(slots, g))
                    if thr > new.get(tuple(s), -1.0):
                        new[tuple(s)] = thr
        states = new
    return max(states.values())


def unrefuted_root_weights(cuts) -> list[np.ndarray]:
    """Kelley weights that tell the price bound's root "no price refutes": a mix of two of
    model 0's plans (so the search must branch), the first plan of every other model."""
    plans = np.asarray(cuts[0])
    j = next(i for i in range(1, len(plans)) if (plans[i] != plans[0]).any())
    w = [np.zeros(len(c)) for c in cuts]
    w[0][[0, j]] = 0.5
    for m in range(1, len(cuts)):
        w[m][0] = 1.0
    return w
