"""Small synthetic clusters and profiles for the planner tests, and a brute-force planner.

The brute force shares no code with ppipe.planner: it lists configurations with plain
loops from the profile table and searches vGPU counts exhaustively.
"""

from __future__ import annotations

import itertools
import math
from functools import lru_cache

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
    """[(template types, ((type, level, X), ...))] of every SLO-feasible configuration (no beta)."""
    M = prof.num_blocks
    types = [g.name for g in cl.gpu_types]
    out = []
    for n in range(1, D + 1):
        for tmpl in itertools.product(types, repeat=n):
            if any(a == b for a, b in zip(tmpl, tmpl[1:])):
                continue
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


def brute_force_paper(configs, counts) -> float:
    """Best throughput of ONE model under the paper's formulation: one configuration (or
    none) per template, and per (slot, type) ceil(sum g / v) GPUs."""
    by_t: dict[tuple, list] = {}
    for t, slots in configs:
        by_t.setdefault(t, []).append(slots)
    templates = sorted(by_t)
    best = 0.0
    choices = [[None] + by_t[t] for t in templates]
    for pick in itertools.product(*choices):
        chosen = [s for s in pick if s is not None]
        ranges = []
        for slots in chosen:
            ranges.append(list(itertools.product(*[range(1, counts[k] * v + 1) for k, v, _x in slots])))
        for gs in itertools.product(*ranges):
            share: dict[tuple[int, str], float] = {}
            for slots, g in zip(chosen, gs):
                for d, ((k, v, _x), gd) in enumerate(zip(slots, g)):
                    share[(d, k)] = share.get((d, k), 0.0) + gd / v
            need: dict[str, int] = {}
            for (d, k), s in share.items():
                need[k] = need.get(k, 0) + math.ceil(s - 1e-9)
            if any(need[k] > counts[k] for k in need):
                continue
            thr = sum(min(x * gd for (_k, _v, x), gd in zip(slots, g)) for slots, g in zip(chosen, gs))
            best = max(best, thr)
    return best
