r"""Split search: the best plan in which no two pools share a GPU, found exactly and fast.

Why it exists: on clusters with three or more GPU types, branch and bound needs minutes
to find good max-min plans, while this search finds a plan as good or better in seconds
(``scripts/bench_planner.py --suite four`` prints both). What makes the search hard is the split of every type's GPUs
among the models, and each model's rough value as a function of its GPUs (one
configuration per template). This module searches the split exactly, over a restriction
of the MILP that keeps that structure and drops the rest. Its plan is handed to the MILP
solver as a start; it proves nothing about the MILP's optimum. Its tables (below) also
seed the prices of the price bound (:mod:`ppipe.planner.price_bound`), which does prove.

The restriction R (dedicated GPUs): every pool owns whole GPUs. Slot d of model m's
pipeline of template t gets u_{t,d} in Z+ GPUs of type k_{t,d}, hence up to v u vGPUs of
its level v. A plan of R is a plan of the MILP under either GPU rule (constraint 2): both
round up sums of g / v, and ceil(sum) <= sum of ceils.

Sets and parameters (as in :mod:`ppipe.planner.formulation`)
    K, N_k      GPU types and their counts; grid R = prod_k {0..N_k} of GPU vectors.
    M, w_m      models and weights.
    T_m, C_t    templates of model m; configurations of template t.
    Y_{c,d}     X_{c,d} v_{c,d}: req/s of slot d of c per whole GPU.

Tables
    h_t(u)      = max_{c in C_t} min_{d < n_c} Y_{c,d} u_d: template t's throughput with u_d GPUs
                in slot d (one configuration: the paper's rule (6)), kept as a function of
                the GPUs per *type* of t (slots of one type add up).
    L_m(r)      = max sum_t h_t(u_t) s.t. sum_t (GPUs of u_t per type) <= r, for every r in
                the grid: a group knapsack, solved by dynamic programming over templates;
                each step is a max-plus convolution with the staircase corners of h_t.

Master (exact for R)
    z_R = max z  s.t.  exists r_m in grid:  sum_m r_m <= N,  L_m(r_m) >= z w_m.
    For a level z the sets B_m = {r : L_m(r) >= z w_m} are upward closed; z is reachable
    iff N lies in B_1 + ... + B_M (Minkowski sums of their minimal points, clipped to the
    grid), which bisection on z decides. z_R <= the MILP's optimum.

Cost: grid size G = prod (N_k + 1) (457 k for 4 types of 25) times the staircase corners
of all templates (a few thousand per model) for the tables, plus the bisection's
Minkowski sums; :func:`split_search` gives up (returns None) past a size budget, or a time
budget that ends before it has a plan (one that ends during the bisection leaves the best
plan found so far).
"""

from __future__ import annotations

import itertools
import os
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import numpy as np

from ppipe.planner.configs import ConfigSet
from ppipe.planner.formulation import pipeline_columns

MAX_GRID = 2_000_000  # GPU vectors per model table (memory: one float32 table per template)
MAX_PAIRS = 40_000_000  # minimal-point pairs per Minkowski sum
NARROW = 1e-3  # bracket width (share of its top) below which the bisection tries the next level


@dataclass(frozen=True)
class DedicatedPipeline:
    """One pipeline of the restricted plan: configuration ``config`` with ``gpus[d]`` whole
    GPUs in slot d (``vgpus`` = the fewest vGPUs that carry ``throughput_rps``)."""

    config: int
    gpus: tuple[int, ...]
    vgpus: tuple[int, ...]
    throughput_rps: float


@dataclass(frozen=True)
class SplitPlan:
    """The restricted plan: the objective z_R, each model's GPU vector and pipelines.

    ``tables`` keeps each model's L_m on the grid (req/s, float32): the price bound
    (:mod:`ppipe.planner.price_bound`) reads GPU vectors of restricted plans from them.
    """

    objective: float
    gpus: list[tuple[int, ...]]
    pipelines: list[list[DedicatedPipeline]]
    seconds: float
    tables: list[np.ndarray] = field(default_factory=list, repr=False, compare=False)


class _Template:
    """h_t of one template: its types, staircase corners and, per corner, how to build it.

    ``rows`` are the configurations the template may take. Under the authors' templates
    (``paper_templates`` of :func:`split_search`) they include shorter configurations whose
    types start the template's: those leave its last slots empty (no GPUs).
    """

    def __init__(self, cs: ConfigSet, rows: np.ndarray, counts: np.ndarray):
        n = int(cs.nparts[rows].max())
        slot_type = [int(k) for k in cs.gpu[rows[np.argmax(cs.nparts[rows])], :n]]
        self.types = list(dict.fromkeys(slot_type))  # distinct, in slot order
        self.slot_axis = [self.types.index(k) for k in slot_type]
        dims = [int(counts[k]) + 1 for k in slot_type]
        Y = cs.X[rows, :n] * cs.level[rows, :n]  # (C, n) req/s per whole GPU
        used = np.arange(n)[None, :] < cs.nparts[rows][:, None]
        # H[u_0, ..., u_{n-1}] = max_c min_{d < n_c} Y_{c,d} u_d and the configuration attaining it.
        H = np.zeros(dims)
        arg = np.full(dims, -1, dtype=np.int64)
        grids = np.meshgrid(*[np.arange(s, dtype=float) for s in dims], indexing="ij")
        for lo in range(0, rows.size, 64):
            chunk = Y[lo : lo + 64]
            val = np.full((chunk.shape[0],) + tuple(dims), np.inf)
            for d in range(n):
                term = chunk[:, d].reshape((-1,) + (1,) * n) * grids[d][None]
                on = used[lo : lo + 64, d].reshape((-1,) + (1,) * n)
                np.minimum(val, np.where(on, term, np.inf), out=val)
            best = val.argmax(axis=0)
            bval = np.take_along_axis(val, best[None], axis=0)[0]
            better = bval > H
            H = np.where(better, bval, H)
            arg = np.where(better, rows[lo + best], arg)
        # Per type of the template: slots of one type add their GPUs (templates like (a, b, a)).
        tdims = [int(counts[k]) + 1 for k in self.types]
        idx = np.indices(dims).reshape(n, -1)
        tidx = np.zeros((len(self.types), idx.shape[1]), dtype=np.int64)
        for d in range(n):
            tidx[self.slot_axis[d]] += idx[d]
        fits = (tidx < np.array(tdims)[:, None]).all(axis=0)
        flat_h = H.reshape(-1)[fits]
        tflat = np.ravel_multi_index(tuple(tidx[:, fits]), tdims)
        h = np.zeros(int(np.prod(tdims)))
        np.maximum.at(h, tflat, flat_h)
        h = h.reshape(tdims)
        for ax in range(len(tdims)):
            h = np.maximum.accumulate(h, axis=ax)
        # Corners: points that beat every point with one GPU less of one type.
        corner = h > 0
        for ax in range(len(tdims)):
            prev = np.zeros_like(h)
            dst = [slice(None)] * len(tdims)
            src = [slice(None)] * len(tdims)
            dst[ax] = slice(1, None)
            src[ax] = slice(0, -1)
            prev[tuple(dst)] = h[tuple(src)]
            corner &= h > prev
        self.points = np.argwhere(corner)  # (P, len(types)) GPUs per type
        self.values = h[corner].astype(np.float32)
        self._H, self._arg, self._tidx, self._fits, self._dims = H, arg, tidx, fits, dims
        self._n = n

    def realize(self, p: np.ndarray, value: float, cs: ConfigSet) -> DedicatedPipeline:
        """A pipeline of this template with at most ``p`` GPUs per type and throughput >= value."""
        ok = self._fits & (self._tidx <= p[:, None]).all(axis=0) & (self._H.reshape(-1) >= np.float32(value) * (1 - 1e-6))
        flat = int(np.nonzero(ok)[0][np.argmin(self._tidx[:, ok].sum(axis=0))])
        c = int(self._arg.reshape(-1)[flat])
        n = int(cs.nparts[c])  # the fewest GPUs leave the slots c does not use empty
        u = np.unravel_index(flat, self._dims)[:n]
        X = cs.X[c, :n]
        thr = float((X * cs.level[c, :n] * np.array(u)).min())
        vg = np.ceil(thr / X - 1e-9).astype(int)
        return DedicatedPipeline(config=c, gpus=tuple(int(a) for a in u), vgpus=tuple(int(a) for a in vg), throughput_rps=float((X * vg).min()))


class _ModelTable:
    """L_m on the grid, and the tables after each template (to read a plan back).

    Templates are the configurations' type tuples, or with ``paper_templates`` the
    authors' K^D tuples of D types, each open to the configurations whose types start it.
    """

    def __init__(self, cs: ConfigSet, counts: np.ndarray, paper_templates: bool = False):
        self.counts = counts
        dims = tuple(int(n) + 1 for n in counts)
        if paper_templates:
            D = cs.gpu.shape[1]
            types = [tuple(int(k) for k in cs.gpu[c, : int(cs.nparts[c])]) for c in range(len(cs))]
            groups = []
            for t in itertools.product(range(len(counts)), repeat=D):
                rows = np.array([c for c, p in enumerate(types) if t[: len(p)] == p], dtype=np.int64)
                if rows.size:
                    groups.append(rows)
        else:
            groups = [np.nonzero(cs.template == t)[0] for t in np.unique(cs.template)]
        self.templates = [_Template(cs, rows, counts) for rows in groups]
        V = np.zeros(dims, dtype=np.float32)
        self.steps = [V]
        K = len(dims)
        for tp in self.templates:
            new = V.copy()
            for p, val in zip(tp.points, tp.values):
                dst = [slice(None)] * K
                src = [slice(None)] * K
                for k, a in zip(tp.types, p):
                    dst[k] = slice(int(a), None)
                    src[k] = slice(0, dims[k] - int(a))
                np.maximum(new[tuple(dst)], V[tuple(src)] + val, out=new[tuple(dst)])
            V = new
            self.steps.append(V)
        self.table = V

    def pipelines(self, r: np.ndarray, cs: ConfigSet) -> list[DedicatedPipeline]:
        """Backtrack the DP: the pipelines of an optimal restricted plan within GPU vector r."""
        r = np.array(r, dtype=np.int64)
        out = []
        for i in range(len(self.templates), 0, -1):
            now, before = self.steps[i][tuple(r)], self.steps[i - 1]
            if now == before[tuple(r)]:
                continue  # template unused at this point
            tp = self.templates[i - 1]
            for p, val in zip(tp.points, tp.values):
                q = r.copy()
                q[tp.types] -= p
                if (q >= 0).all() and before[tuple(q)] + val == now:
                    out.append(tp.realize(p, float(val), cs))
                    r = q
                    break
            else:  # pragma: no cover - the DP's own arithmetic always matches one corner
                raise RuntimeError("split search: backtracking found no corner")
        return out


def restricted_pipelines(cs: ConfigSet, counts: np.ndarray, r: np.ndarray, paper_templates: bool = False) -> list[DedicatedPipeline]:
    """The pipelines of one model's best restricted plan within GPU vector ``r`` (its
    throughput is the model's L_m(r); the model's table is rebuilt)."""
    table = _ModelTable(cs, np.asarray(counts, dtype=np.int64), paper_templates)
    return table.pipelines(np.asarray(r, dtype=np.int64), cs)


def minimal_points(B: np.ndarray) -> np.ndarray:
    """Minimal elements of an upward-closed boolean array."""
    m = B.copy()
    for ax in range(B.ndim):
        prev = np.zeros_like(B)
        dst = [slice(None)] * B.ndim
        src = [slice(None)] * B.ndim
        dst[ax] = slice(1, None)
        src[ax] = slice(0, -1)
        prev[tuple(dst)] = B[tuple(src)]
        m &= ~prev
    return np.argwhere(m)


def _upward_close(A: np.ndarray) -> np.ndarray:
    for ax in range(A.ndim):
        A = np.logical_or.accumulate(A, axis=ax)
    return A


class _Budget(Exception):
    pass


def _minkowski(A: np.ndarray, B: np.ndarray, counts: np.ndarray) -> np.ndarray:
    """Upward closure of {a + b <= N : a in A, b in B} for upward-closed A, B on the grid."""
    P, Q = minimal_points(A), minimal_points(B)
    out = np.zeros_like(A)
    if P.size == 0 or Q.size == 0:
        return out
    if P.shape[0] * Q.shape[0] > MAX_PAIRS:
        raise _Budget
    step = max(1, 2_000_000 // Q.shape[0])
    for i in range(0, P.shape[0], step):
        S = (P[i : i + step, None, :] + Q[None, :, :]).reshape(-1, P.shape[1])
        S = S[(S <= counts).all(axis=1)]
        out[tuple(S.T)] = True
    return _upward_close(out)


def _last_pair(A: np.ndarray, B: np.ndarray, C: np.ndarray, counts: np.ndarray):
    """A minimal b in B and c in C with N - b - c in A (upward closed), or None."""
    P, Q = minimal_points(B), minimal_points(C)
    if P.size == 0 or Q.size == 0:
        return None
    if P.shape[0] * Q.shape[0] > MAX_PAIRS:
        raise _Budget
    # The pairs' leftovers (N - c) - b lie in [-max N, max N]: the narrowest integer type that
    # holds them makes the scan 2-5x faster than int64 (4-type case, 25 GPUs a type: int8).
    top = int(counts.max())
    small = np.int8 if top <= 127 else np.int16 if top <= 32767 else np.int64
    rest = (counts[None, :] - Q).astype(small)  # N - c
    Ps = P.astype(small)
    step = max(1, 1_000_000 // Q.shape[0])
    for i in range(0, P.shape[0], step):
        left = rest[None, :, :] - Ps[i : i + step, None, :]
        ii, jj = np.nonzero((left >= 0).all(axis=2))
        if ii.size == 0:
            continue
        hit = A[tuple(left[ii, jj].T.astype(np.intp))]
        if hit.any():
            a = int(np.argmax(hit))
            return P[i + ii[a]], Q[jj[a]]
    return None


def _reachable(tables: list[np.ndarray], weights: np.ndarray, counts: np.ndarray, z: float, keep: bool = False):
    """Whether sum_m r_m <= N with L_m(r_m) >= z w_m for some r_m; with ``keep``, also a split.

    The first M - 2 sets are summed on the grid; the last two are searched as pairs of
    minimal points, which stops at the first pair that fits.
    """
    sets = [t >= np.float32(z * w) for t, w in zip(tables, weights)]
    M = len(sets)
    if M == 1:
        ok = bool(sets[0][tuple(counts)])
        return (ok, [counts.copy()] if ok else None) if keep else ok
    acc = [sets[0]]
    for B in sets[1 : max(1, M - 2)]:
        acc.append(_minkowski(acc[-1], B, counts))
    # acc[-1] sums sets[0..M-3]; for M == 2 it is sets[0] and the "pair" is (sets[1], nothing).
    if M == 2:
        pair = None
        for b in minimal_points(sets[1]):
            left = counts - b
            if (left >= 0).all() and sets[0][tuple(left)]:
                pair = (b,)
                break
    else:
        pair = _last_pair(acc[-1], sets[M - 2], sets[M - 1], counts)
    ok = pair is not None
    if not keep:
        return ok
    if not ok:
        return False, None
    # Read the split back: the last one or two from the pair, the others from the sums.
    split: list[np.ndarray] = [None] * M  # type: ignore[list-item]
    rest = counts.copy()
    for j, r in zip(range(M - 1, M - 1 - len(pair), -1), reversed(pair)):
        split[j] = np.asarray(r)
        rest = rest - split[j]
    for m in range(M - 1 - len(pair), 0, -1):
        for r in minimal_points(sets[m]):
            left = rest - r
            if (left >= 0).all() and acc[m - 1][tuple(left)]:
                split[m] = r
                rest = left
                break
    split[0] = rest
    return True, split


def split_search(
    configs: list[ConfigSet],
    weights: list[float],
    counts: np.ndarray,
    *,
    time_budget_s: float | None = None,
    paper_templates: bool = False,
) -> SplitPlan | None:
    """The best max-min plan of the restriction R (module docstring), or None.

    None when the grid is too large, a Minkowski sum too big, the time budget runs out
    before the tables are built or before any level above 0 is found reachable, or some
    model has no configuration. When the budget runs out during the bisection, the plan of
    the best level found so far is returned (below R's optimum by less than the
    bisection's remaining interval).

    Args:
        configs: per model, its configurations (the MILP's columns).
        weights: per model, w_m.
        counts: N_k per GPU type, cluster order.
        time_budget_s: give up after about this many seconds (None: no limit; the size
            budgets MAX_GRID and MAX_PAIRS always hold).
        paper_templates: one configuration per template of the authors (constraint 6 of
            :mod:`ppipe.planner.formulation`), so that R's plans are the MILP's; else
            one per type tuple (a restriction of the MILP without constraint 6).
    """
    t0 = time.perf_counter()
    budget = np.inf if time_budget_s is None else time_budget_s
    counts = np.asarray(counts, dtype=np.int64)
    grid = int(np.prod(counts + 1))
    if grid > MAX_GRID or any(len(cs) == 0 for cs in configs):
        return None
    w = np.asarray(weights, dtype=float)
    # numpy releases the GIL in the tables' array work, so two threads build them sooner;
    # each table is built alone, so they do not depend on the threads.
    with ThreadPoolExecutor(max_workers=max(1, min(2, os.cpu_count() or 1, len(configs)))) as pool:
        models = list(pool.map(lambda cs: _ModelTable(cs, counts, paper_templates), configs))
    if time.perf_counter() - t0 > budget:
        return None
    tables = [m.table for m in models]
    try:
        lo, split = _best_level(tables, w, counts, deadline=t0 + budget)
    except _Budget:
        return None
    if split is None or lo <= 0:
        return None
    pipelines = [models[m].pipelines(split[m], configs[m]) for m in range(len(tables))]
    thr = [sum(p.throughput_rps for p in pl) for pl in pipelines]
    z = float(min(x / wm for x, wm in zip(thr, w)))
    return SplitPlan(
        objective=z,
        gpus=[tuple(int(a) for a in r) for r in split],
        pipelines=pipelines,
        seconds=time.perf_counter() - t0,
        tables=tables,
    )


def _best_level(tables: list[np.ndarray], w: np.ndarray, counts: np.ndarray, deadline: float = np.inf):
    """(z_R, a split that reaches it) for the tables L_m: the highest level z at which
    sum_m r_m <= N with L_m(r_m) >= z w_m; (lo, its split) if the deadline
    (``time.perf_counter()``) ends the search first; (0, None) if no level above 0 is
    reachable. Raises _Budget where a Minkowski sum is too big."""
    # Bisection on z between 0 (always reachable: empty plans) and the best any model
    # reaches with the whole cluster.
    lo, hi = 0.0, float(min(float(t[tuple(counts)]) / wm for t, wm in zip(tables, w)))
    split, reached = None, 0.0  # the split of the best reachable level found, and its level
    if hi > 0:
        ok, found = _reachable(tables, w, counts, hi, keep=True)
        if ok:
            lo, split, reached = hi, found, _level(tables, w, found)
    # Reachability only changes where a threshold z w_m passes a table value: once no
    # value lies strictly between the bracket's ends, lo is the optimum's level. A
    # reachable level's split reaches the level of its own values, min_m L_m(r_m) / w_m,
    # often the optimum's: the bracket's low end jumps there. Near the end, the next
    # level above it is tried first: unreachable there, the split is optimal.
    while hi - lo > 1e-7 * max(hi, 1e-12) and _values_between(tables, w, lo, hi):
        if time.perf_counter() > deadline:
            break  # anytime: lo is reachable, its plan is as good a start as we have
        mid, greedy = 0.5 * (lo + hi), False
        if split is not None and hi - lo <= NARROW * hi:
            # Just below that level, for the float32 thresholds.
            z = _next_level(tables, w, reached * (1 + 1e-7)) * (1 - 1e-7)
            if lo < z < mid:
                mid, greedy = z, True
        ok, found = _reachable(tables, w, counts, mid, keep=True)
        if ok:
            split, reached = found, _level(tables, w, found)
            lo = max(mid, reached * (1 - 1e-9))
        else:
            hi = mid
            if greedy:
                break  # no split reaches past `reached` (by more than 1e-7): it is optimal
    return lo, split


def _level(tables: list[np.ndarray], weights: np.ndarray, split: list[np.ndarray]) -> float:
    """The level a split reaches: min_m L_m(r_m) / w_m."""
    return min(float(t[tuple(np.asarray(r, dtype=np.int64))]) / wm for t, wm, r in zip(tables, weights, split))


def _next_level(tables: list[np.ndarray], weights: np.ndarray, z: float) -> float:
    """The least level above ``z`` at which some model's threshold z w_m meets a table value."""
    out = np.inf
    for t, wm in zip(tables, weights):
        above = t[t > np.float32(z * wm)]
        if above.size:
            out = min(out, float(above.min()) / wm)
    return out


def _values_between(tables: list[np.ndarray], weights: np.ndarray, lo: float, hi: float) -> bool:
    """Whether some L_m value lies strictly between the thresholds of levels lo and hi
    (the comparisons of :func:`_reachable`, in float32)."""
    return any(
        bool(np.any((t > np.float32(lo * wm)) & (t < np.float32(hi * wm)))) for t, wm in zip(tables, weights)
    )


def start_vector(plan: SplitPlan, v, num_cols: int, objective_col: int | None) -> np.ndarray:
    """The MILP column values of a restricted plan (a MIP start).

    Args:
        plan: from :func:`split_search`.
        v: the MILP's :class:`~ppipe.planner.formulation.PlanVariables`.
        num_cols: the MILP's column count.
        objective_col: the column of z (max-min), or None.
    """
    x = pipeline_columns(v, num_cols, [[(p.config, p.vgpus, p.throughput_rps) for p in pls] for pls in plan.pipelines])
    if objective_col is not None:
        x[objective_col] = plan.objective
    return x

