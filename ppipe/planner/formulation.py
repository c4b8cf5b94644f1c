r"""The planner's MILP: build it from configurations, and read a plan back from a solution.

This is the model of docs/planning-model.md in column form (one column group per SLO-feasible
pipeline configuration, :mod:`ppipe.planner.configs`). Names in the code follow the math.

Sets
    K           GPU types of the cluster (k), with vGPU levels V_k.
    M           models (m).
    T_m         templates of model m: ordered tuples of GPU types, length 1..D (a type may
                fill consecutive slots).
    C_m         configurations of model m (c): a template t(c), cut points, a level v_{c,d}
                and a type k_{c,d} per partition slot d = 1..n_c, and one batch b_c.

Parameters
    N_k         GPUs of type k.
    X_{c,d}     throughput (req/s) of ONE vGPU running slot d of c at batch b_c, with the
                NIC caps: min(1e6 b / C, 1e6 / (tau_in v s_k), 1e6 / (tau_out v s_k)).
    U_{c,d}     upper bound on g_{c,d}: min(N_k v, ceil(xmax_c / X_{c,d})), where
                xmax_c = min_d N_{k_{c,d}} v_{c,d} X_{c,d} bounds c's throughput; more vGPUs
                than that can never raise it.
    w_m         workload weight; p_k price per GPU (cheapest-GPUs objective).

Variables (these are what a custom objective sees, :class:`PlanVariables`)
    g_{c,d} in Z+      vGPUs in the pool of slot d of configuration c          ("g")
    x_c >= 0           throughput of the pipeline of c, for n_c >= 2           ("x_config")
                       (for n_c = 1 it is X_{c,1} g_{c,1} and needs no column)
    x_m >= 0           throughput of model m                                   ("x_model")
    gpus_k in Z+       physical GPUs of type k in use, <= N_k                  ("gpus")
    P_{k,v} in Z+      GPUs of type k at level v (physical rule)               ("P")
    n_{m,d,k} in Z+    GPUs of type k for slot d of model m (paper rule)       ("n")
    y_c in {0,1}       configuration c is its template's one (one-config only) ("y")
    z >= 0             normalized throughput (max-min objective)               ("z")

Objective (default, :class:`~ppipe.planner.objectives.MaxMinNormalized`)
    maximize z

Constraints
    (1)  latency: sum_d (C_{c,d} + n_{c,d}) + beta(b_c) + margin_m <= T_m.
         It concerns one configuration alone, so it is enforced by generating only the
         configurations that satisfy it (no row).
    (2)  GPUs, one of two rules:
         (2a) physical packing:  v P_{k,v} >= sum_{(c,d): k_{c,d}=k, v_{c,d}=v} g_{c,d}   "c2a_level_gpus"
              gpus_k = sum_v P_{k,v}                                              "c2c_type_gpus"
         (2b) paper rule:  12 n_{m,d,k} >= sum_{c in C_m: k_{c,d}=k} (12 / v_{c,d}) g_{c,d}
              (sum of g/v rounded up; scaled by 12 = lcm(1..4) to keep integer data)
                                                                                   "c2b_paper_gpus"
              gpus_k = sum_{m,d} n_{m,d,k}                                        "c2c_type_gpus"
         gpus_k <= N_k is the column's bound.
    (3)  objective rows, e.g. max-min: w_m z - x_m <= 0                           "c3_maxmin"
    (4)  pipeline throughput is its slowest pool's:  x_c <= X_{c,d} g_{c,d}       "c4_pipeline"
    (5)  model throughput:  x_m = sum_{c: n_c>=2} x_c + sum_{c: n_c=1} X_{c,1} g_{c,1}   "c5_model"
    (6)  one configuration per template (the paper's formulation only). The authors'
         templates (``ilp_v4.py``) are the K^D tuples of exactly D types, each with one
         pipeline that uses its first n_c <= D slots; so c may take any of the K^(D-n_c)
         templates that start with its types, and the chosen set fits iff every prefix q
         (length l = 1..D) starts the types of at most K^(D-l) chosen configurations
         (:func:`~ppipe.planner.configs.paper_template_rows`, Hall's condition):
         (6a) sum_{c in C_m: types of c start with q} y_c <= K^(D-l)              "c6a_one_config"
         (6b) g_{c,d} <= U_{c,d} y_c                                              "c6b_link"
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np

from ppipe.planner.configs import ConfigSet, ModelSpec, paper_template_rows
from ppipe.planner.milp import Milp
from ppipe.spec.cluster import ClusterSpec
from ppipe.spec.plan import ModelPlan, PartitionPlan, PipelinePlan

PAPER_SCALE = 12  # lcm(1, 2, 3, 4): g/v with integer coefficients


@dataclass
class PlanVariables:
    """The MILP's documented columns, by name, for objectives (built-in or the user's).

    Attributes:
        models: model names, in plan order.
        types: GPU types, in cluster order.
        x_model: model name -> column of x_m, its planned throughput in req/s.
        gpus: GPU type -> column of gpus_k, physical GPUs of that type in use.
        price: GPU type -> price per GPU (from the cluster file).
        weight: model name -> w_m.
        g: per model, a (C, D) array of the columns g_{c,d} (-1 for unused slots).
        x_config: per model, a (C,) array of the columns x_c (-1 where n_c = 1).
        configs: per model, the :class:`~ppipe.planner.configs.ConfigSet`.
        extra: columns objectives add (e.g. ``"z"``).
        y: per model, a (C,) array of the columns y_c (-1 without constraint 6).
        agg: key of a GPU row -> column of its count: (k, v) -> P_{k,v} (physical rule),
            (m, d, k) -> n_{m,d,k} (paper rule).
        gpu_rule: ``"physical"`` or ``"paper"``.
    """

    models: list[str]
    types: list[str]
    x_model: dict[str, int]
    gpus: dict[str, int]
    price: dict[str, float]
    weight: dict[str, float]
    g: list[np.ndarray] = field(default_factory=list)
    x_config: list[np.ndarray] = field(default_factory=list)
    configs: list[ConfigSet] = field(default_factory=list)
    extra: dict[str, int] = field(default_factory=dict)
    y: list[np.ndarray] = field(default_factory=list)
    agg: dict[tuple, int] = field(default_factory=dict)
    gpu_rule: str = "physical"


def build(
    models: list[ModelSpec],
    configs: list[ConfigSet],
    cluster: ClusterSpec,
    *,
    gpu_rule: str = "physical",
    one_config_per_template: bool = False,
    tight_bounds: bool = True,
    rate_cap: list[float] | None = None,
    one_per_type_tuple: bool = False,
) -> tuple[Milp, PlanVariables]:
    """Build constraints (2), (4), (5) and (6) over the given configurations.

    The objective and its rows (3) are added by an objective object afterwards.
    ``tight_bounds=False`` bounds g_{c,d} by N_k v (the paper's model) instead of U_{c,d}:
    the same optimum, and every plan with more vGPUs in a pool than its pipeline can use
    (the headroom pass's) stays a solution. ``one_per_type_tuple`` (with
    ``one_config_per_template``) replaces the authors' rows (6a) by at most one
    configuration per type tuple: a restriction where no tuple repeats a type in
    consecutive slots (:func:`ppipe.planner.core.distinct_types_start`).
    """
    if gpu_rule not in ("physical", "paper"):
        raise ValueError(f"gpu_rule must be 'physical' or 'paper', got {gpu_rule!r}")
    types = [g.name for g in cluster.gpu_types]
    N = np.array([cluster.gpu_counts[k] for k in types], dtype=float)
    milp = Milp()
    gpus = milp.add_cols(len(types), lb=0, ub=N, integer=True, name="gpus")
    x_model = milp.add_cols(len(models), lb=0, name="x_model")
    v = PlanVariables(
        models=[s.name for s in models],
        types=types,
        x_model={s.name: int(x_model[i]) for i, s in enumerate(models)},
        gpus={k: int(gpus[i]) for i, k in enumerate(types)},
        price={g.name: g.price_per_gpu for g in cluster.gpu_types},
        weight={s.name: s.weight for s in models},
        configs=list(configs),
        gpu_rule=gpu_rule,
    )
    # Terms of the GPU rows, collected over all models: key -> (cols, coefs).
    gpu_terms: dict[tuple, tuple[list[np.ndarray], list[np.ndarray]]] = {}
    for mi, cs in enumerate(configs):
        xmax, U = _pool_bounds(cs, N, None if rate_cap is None else rate_cap[mi], tight_bounds)
        mask = cs.gpu >= 0
        gidx = np.full(mask.shape, -1, int)
        gidx[mask] = milp.add_cols(int(mask.sum()), lb=0, ub=U[mask], integer=True, name="g")
        multi = cs.nparts >= 2
        xidx = np.full(len(cs), -1, int)
        xidx[multi] = milp.add_cols(int(multi.sum()), lb=0, ub=xmax[multi], name="x_config")
        v.g.append(gidx)
        v.x_config.append(xidx)
        _add_throughput_rows(milp, cs, int(x_model[mi]), gidx, xidx)
        v.y.append(np.full(len(cs), -1, int))
        if one_config_per_template and len(cs):
            v.y[-1] = _add_template_rows(milp, cs, gidx, U, len(types), one_per_type_tuple)
        _collect_gpu_terms(gpu_terms, cs, mi, gidx, gpu_rule)
    v.agg = _add_gpu_rows(milp, gpu_terms, gpus, N, gpu_rule)
    return milp, v


def _pool_bounds(cs: ConfigSet, N: np.ndarray, rate_cap: float | None, tight: bool) -> tuple[np.ndarray, np.ndarray]:
    """(x_max per configuration, U per slot): the most a configuration carries with every
    GPU of each slot's type (capped at ``rate_cap``), and ``U_{c,d} = min(N_k v,
    ceil(x_max / X_{c,d}))`` (``tight``; else ``N_k v``, the paper's bound)."""
    mask = cs.gpu >= 0
    Nk = np.where(mask, N[np.maximum(cs.gpu, 0)], 0.0)
    with np.errstate(divide="ignore", invalid="ignore"):
        cap = np.where(mask, Nk * cs.level * cs.X, np.inf)
        xmax = cap.min(axis=1) if len(cs) else np.zeros(0)
        if rate_cap is not None:
            xmax = np.minimum(xmax, rate_cap)
        U = np.where(mask, np.minimum(Nk * cs.level, np.ceil(xmax[:, None] / np.where(mask, cs.X, 1.0) - 1e-9)), 0.0)
    if not tight:
        U = np.where(mask, Nk * cs.level, 0.0)
    return xmax, np.maximum(U, 0.0)


def _add_throughput_rows(milp: Milp, cs: ConfigSet, x_model: int, gidx: np.ndarray, xidx: np.ndarray) -> None:
    """Rows (4) x_c <= X_{c,d} g_{c,d} per used slot of a multi-partition configuration, and
    (5) x_m = sum x_c + sum X g over the single-partition ones."""
    mask, multi = cs.gpu >= 0, cs.nparts >= 2
    pc, pd = np.nonzero(mask & multi[:, None])
    P = pc.size
    if P:
        r = np.arange(P)
        milp.add_rows(P, np.concatenate([r, r]), np.concatenate([xidx[pc], gidx[pc, pd]]),
                      np.concatenate([np.ones(P), -cs.X[pc, pd]]), ub=0.0, name="c4_pipeline")
    single = np.nonzero(~multi)[0]
    xcols = xidx[multi]
    cols = np.concatenate([[x_model], xcols, gidx[single, 0]])
    vals = np.concatenate([[1.0], -np.ones(xcols.size), -cs.X[single, 0]])
    milp.add_rows(1, np.zeros(cols.size, int), cols, vals, lb=0.0, ub=0.0, name="c5_model")


def _add_template_rows(milp: Milp, cs: ConfigSet, gidx: np.ndarray, U: np.ndarray, num_types: int, one_per_type_tuple: bool) -> np.ndarray:
    """The paper's (6): a binary y_c per configuration, (6a) the authors' rows on them (or
    at most one per type tuple), (6b) g_{c,d} <= U_{c,d} y_c. Returns the y columns."""
    y = milp.add_cols(len(cs), lb=0, ub=1, integer=True, name="y")
    if one_per_type_tuple:
        rows6 = [(np.nonzero(cs.template == t)[0], 1) for t in np.unique(cs.template)]
    else:
        rows6 = paper_template_rows(cs, num_types)
    if rows6:
        milp.add_rows(
            len(rows6),
            np.concatenate([np.full(m.size, i) for i, (m, _cap) in enumerate(rows6)]),
            np.concatenate([y[m] for m, _cap in rows6]),
            np.ones(sum(m.size for m, _cap in rows6)),
            ub=np.array([float(cap) for _m, cap in rows6]),
            name="c6a_one_config",
        )
    lc, ld = np.nonzero(cs.gpu >= 0)
    L = lc.size
    r = np.arange(L)
    milp.add_rows(L, np.concatenate([r, r]), np.concatenate([gidx[lc, ld], y[lc]]),
                  np.concatenate([np.ones(L), -U[lc, ld]]), ub=0.0, name="c6b_link")
    return y


def _collect_gpu_terms(gpu_terms: dict, cs: ConfigSet, mi: int, gidx: np.ndarray, gpu_rule: str) -> None:
    """Add one model's terms of (2): per (k, v) for the physical rule (vGPUs), per
    (m, d, k) for the paper's rule (shares g / v, scaled by PAPER_SCALE)."""
    lc, ld = np.nonzero(cs.gpu >= 0)
    if not lc.size:
        return
    if gpu_rule == "physical":
        keys = np.stack([cs.gpu[lc, ld], cs.level[lc, ld]], axis=1)
        coef = np.ones(lc.size)
    else:
        keys = np.stack([np.full(lc.size, mi), ld, cs.gpu[lc, ld]], axis=1)
        coef = PAPER_SCALE / cs.level[lc, ld]
    uk, inv = np.unique(keys, axis=0, return_inverse=True)
    inv = inv.reshape(-1)
    for j, key in enumerate(map(tuple, uk)):
        sel = inv == j
        cols_l, coefs_l = gpu_terms.setdefault(tuple(int(a) for a in key), ([], []))
        cols_l.append(gidx[lc[sel], ld[sel]])
        coefs_l.append(coef[sel])


def _add_gpu_rows(milp: Milp, gpu_terms: dict, gpus: np.ndarray, N: np.ndarray, gpu_rule: str) -> dict:
    """(2a)/(2b): one integer column per key (GPUs of a (type, level), or of a (model, slot,
    type)) and its row; (2c) gpus_k = the sum of type k's. Returns key -> column."""
    keys = sorted(gpu_terms)
    key_type = np.array([k[0] if gpu_rule == "physical" else k[2] for k in keys], dtype=int)
    agg = milp.add_cols(len(keys), lb=0, ub=N[key_type], integer=True, name="P" if gpu_rule == "physical" else "n") if keys else np.zeros(0, int)
    if keys:
        rows, cols, vals = [], [], []
        for i, key in enumerate(keys):
            cl, co = gpu_terms[key]
            c_all = np.concatenate(cl)
            scale = key[1] if gpu_rule == "physical" else PAPER_SCALE
            rows.append(np.full(c_all.size + 1, i))
            cols.append(np.concatenate([[agg[i]], c_all]))
            vals.append(np.concatenate([[float(scale)], -np.concatenate(co)]))
        milp.add_rows(len(keys), np.concatenate(rows), np.concatenate(cols), np.concatenate(vals), lb=0.0,
                      name="c2a_level_gpus" if gpu_rule == "physical" else "c2b_paper_gpus")
    T = gpus.size
    rows = np.concatenate([np.arange(T), key_type])
    cols = np.concatenate([gpus, agg])
    vals = np.concatenate([np.ones(T), -np.ones(len(keys))])
    milp.add_rows(T, rows, cols, vals, lb=0.0, ub=0.0, name="c2c_type_gpus")
    return {key: int(col) for key, col in zip(keys, agg)}


def extract(x: np.ndarray, v: PlanVariables, models: list[ModelSpec]) -> list[ModelPlan]:
    """Read the pipelines of each model from a solution.

    vGPU counts are rounded; a pipeline's throughput is recomputed as min_d X g (the
    solver may leave it below that in a model that is not the bottleneck), and pools
    with more vGPUs than that throughput needs are trimmed (this only frees GPUs).
    """
    out = []
    for mi, spec in enumerate(models):
        cs = v.configs[mi]
        gidx = v.g[mi]
        pipes: list[PipelinePlan] = []
        for c in range(len(cs)):
            n = int(cs.nparts[c])
            g = np.array([round(float(x[gidx[c, d]])) for d in range(n)], dtype=float)
            if (g < 1).any():
                continue
            X = cs.X[c, :n]
            thr = float((X * g).min())
            if thr <= 1e-9:
                continue
            g = np.minimum(g, np.ceil(thr / X - 1e-9))
            parts = []
            for d in range(n):
                parts.append(
                    PartitionPlan(
                        first_block=int(cs.first[c, d]),
                        last_block=int(cs.last[c, d]),
                        gpu=cs.types[int(cs.gpu[c, d])],
                        vgpu=int(cs.level[c, d]),
                        count=int(g[d]),
                        infer_us=float(cs.infer_us[c, d]),
                        transfer_us=float(cs.transfer_us[c, d]),
                        throughput_rps=float(X[d] * g[d]),
                    )
                )
            pipes.append(
                PipelinePlan(
                    batch=int(cs.batch[c]),
                    throughput_rps=thr,
                    latency_us=float(cs.latency_us[c]),
                    template=[cs.types[int(k)] for k in cs.gpu[c, :n]],
                    partitions=parts,
                )
            )
        pipes.sort(key=lambda p: (len(p.partitions), -p.throughput_rps))
        out.append(
            ModelPlan(
                name=spec.name,
                profile=spec.profile_ref or "",
                slo_ms=spec.slo_ms,
                weight=spec.weight,
                throughput_rps=float(sum(p.throughput_rps for p in pipes)),
                pipelines=pipes,
            )
        )
    return out


def pipeline_columns(v: PlanVariables, num_cols: int, chosen: list[list[tuple[int, list, float]]]) -> np.ndarray:
    """Column values of chosen pipelines: per model, (configuration c, vGPUs per slot, throughput).

    ``g`` takes the counts, ``x_c``/``x_m`` the throughputs, ``y_c`` 1, and the GPU columns
    the counts that constraint (2) needs. Objective columns (``z``) are left at 0.
    """
    x = np.zeros(num_cols)
    share: dict[tuple, float] = {}
    for mi, pipes in enumerate(chosen):
        cs = v.configs[mi]
        xm = 0.0
        for c, counts, thr in pipes:
            for d in range(int(cs.nparts[c])):
                x[v.g[mi][c, d]] += counts[d]
                k, lvl = int(cs.gpu[c, d]), int(cs.level[c, d])
                key = (k, lvl) if v.gpu_rule == "physical" else (mi, d, k)
                share[key] = share.get(key, 0.0) + counts[d] / lvl
            if v.x_config[mi][c] >= 0:
                x[v.x_config[mi][c]] += thr
            if v.y and v.y[mi][c] >= 0:
                x[v.y[mi][c]] = 1.0
            xm += thr
        x[v.x_model[v.models[mi]]] = xm
    per_type = np.zeros(len(v.types))
    for key, s in share.items():
        n = math.ceil(s - 1e-9)
        x[v.agg[key]] = n
        per_type[key[0] if v.gpu_rule == "physical" else key[2]] += n
    for i, k in enumerate(v.types):
        x[v.gpus[k]] = per_type[i]
    return x


def solution_vector(models: list[ModelPlan], v: PlanVariables, num_cols: int) -> np.ndarray:
    """The column values of a plan in a MILP built by :func:`build`: :func:`extract` inverted.

    Each pipeline is matched to the configuration with its block ranges, GPU types, levels
    and batch (then :func:`pipeline_columns`), and ``z`` (when the max-min objective added
    it) is ``min_m x_m / w_m``. With :func:`ppipe.planner.core.is_feasible` it tells whether
    a plan changed after the solve (the headroom pass) is still a solution of a MILP.

    Raises:
        ValueError: a pipeline whose configuration is not among the MILP's columns.
    """
    chosen = []
    for mi, m in enumerate(models):
        cs = v.configs[mi]
        pipes = []
        for pi, pipe in enumerate(m.pipelines):
            c = _config_of(cs, pipe)
            if c is None:
                raise ValueError(f"model '{m.name}' pipeline {pi}: its configuration is not a column of this MILP")
            pipes.append((c, [p.count for p in pipe.partitions], pipe.throughput_rps))
        chosen.append(pipes)
    x = pipeline_columns(v, num_cols, chosen)
    if "z" in v.extra:
        x[v.extra["z"]] = min(x[v.x_model[m.name]] / v.weight[m.name] for m in models)
    return x


def _config_of(cs: ConfigSet, pipe: PipelinePlan) -> int | None:
    """The configuration with the pipeline's block ranges, GPU types, levels and batch, or None."""
    n = len(pipe.partitions)
    if n > cs.gpu.shape[1]:
        return None
    match = (cs.nparts == n) & (cs.batch == pipe.batch)
    for d, part in enumerate(pipe.partitions):
        if part.gpu not in cs.types:
            return None
        match &= (cs.first[:, d] == part.first_block) & (cs.last[:, d] == part.last_block)
        match &= (cs.gpu[:, d] == cs.types.index(part.gpu)) & (cs.level[:, d] == part.vgpu)
    found = np.nonzero(match)[0]
    return int(found[-1]) if found.size else None


def gpus_needed(models: list[ModelPlan], types: list[str], gpu_rule: str) -> dict[str, int]:
    """Physical GPUs per type that the pools need under a GPU rule (constraint 2)."""
    used = {k: 0 for k in types}
    if gpu_rule == "physical":
        per_level: dict[tuple[str, int], int] = {}
        for m in models:
            for p in m.pipelines:
                for part in p.partitions:
                    per_level[(part.gpu, part.vgpu)] = per_level.get((part.gpu, part.vgpu), 0) + part.count
        for (k, lv), cnt in per_level.items():
            used[k] += math.ceil(cnt / lv)
    else:
        from fractions import Fraction

        for m in models:
            share: dict[tuple[int, str], Fraction] = {}
            for p in m.pipelines:
                for d, part in enumerate(p.partitions):
                    share[(d, part.gpu)] = share.get((d, part.gpu), Fraction(0)) + Fraction(part.count, part.vgpu)
            for (_d, k), s in share.items():
                used[k] += math.ceil(s)
    return used
