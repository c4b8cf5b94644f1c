r"""Upper bounds on the max-min objective that see integer pools: one Lagrangian framework.

HiGHS often finds the optimal plan early, but the MILP's LP relaxation lets pools hold
fractions of vGPUs and sits 1-6 % above the optimum, so branch and bound is slow to prove
it. The planner proves incumbents instead (:func:`ppipe.planner.core.milp_plan`): when
HiGHS holds a plan of objective ``z_inc``, it asks whether ``T = z_inc (1 + gap)`` is out of
reach; if so, the incumbent is optimal within the gap and the search stops.

The bound. A plan with ``z >= T`` gives every model m a throughput ``x_m >= T w_m`` and uses
at most ``N_k`` GPUs of each type k. For prices ``mu >= 0`` on the GPU types, relaxing the
GPU rows gives::

    sum_m B_m(mu, T w_m) <= mu . N,
    B_m(mu, t) = a lower bound on min { mu . (GPUs model m uses) : model m alone reaches t }.

A price for which the left side exceeds the right refutes ``T``. The prices are searched
by Kelley's cutting planes on this concave dual (:func:`kelley_lp`): the cuts are the GPU
vectors (or shares) of each model's cheapest plans found so far; the LP's value bounds
every price's left side from above, so where it is at most 1 (``mu . N = 1``) no price can
refute ``T`` with those plans and the search ends.

Two subproblems ``B_m``, from cheap to exact:

* **cover bound** (this module, :class:`CoverBound`): a model's GPU *shares*
  ``sum_d g_d / v_d`` per type, over *efficient pipeline patterns* (per configuration and
  bottleneck pool size g of one slot, the other slots get the fewest vGPUs that keep up,
  ``ceil(X_d g / X_d')``), relaxed to a covering knapsack: patterns may repeat and
  configurations of one template mix (both only lower the minimum), and their throughputs
  are rounded *up* to bins of width ``T w_m / BINS``. Dynamic programming solves it
  exactly; coarse bins first (a weaker bound, any proof there holds), then fine ones from
  the best coarse price. It holds under either GPU rule. It cannot see that pools round up
  to whole GPUs per (slot, type) under the paper's rule, nor that a template takes one
  configuration: on many-type clusters it stays about 1-3 % above the optimum.
* **price bound** (:mod:`ppipe.planner.price_bound`): the model's own MILP with the
  objective "fewest priced GPUs", solved by HiGHS, inside a branch and bound over the
  models' GPU vectors. Exact for the paper's GPU rule (each model's GPUs are its own
  integer vector), and seconds per solve: used only where the split search serves.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ppipe.planner.configs import ConfigSet
from ppipe.planner.highs_util import new_highs

BINS = 50_000  # throughput bins per model: the rounding-up costs < 2e-5 of the target per pattern
COARSE_BINS = 5_000  # bins of the first price search (10x cheaper tables, a weaker but valid bound)
MAX_KELLEY_ITERATIONS = 40
_REL_TOL = 1e-7  # a proof needs the priced demand to exceed the priced capacity by this share


def pipeline_patterns(cs: ConfigSet, counts: np.ndarray, num_types: int) -> tuple[np.ndarray, np.ndarray]:
    """Efficient single-pipeline patterns of one model's configurations.

    Args:
        cs: the model's configurations.
        counts: N_k, GPUs per type (cluster order).
        num_types: K.

    Returns:
        (value, share): throughput in req/s of every pattern, shape (I,), and the GPUs of
        each type it occupies, shape (I, K).
    """
    values: list[np.ndarray] = []
    shares: list[np.ndarray] = []
    for n in np.unique(cs.nparts):
        sel = np.nonzero(cs.nparts == n)[0]
        n = int(n)
        X = cs.X[sel, :n]
        k = cs.gpu[sel, :n]
        v = cs.level[sel, :n].astype(float)
        U = counts[k] * v  # most vGPUs a pool of that slot can have
        g = np.arange(1, int(U.max()) + 1, dtype=float)
        for d in range(n):
            x = X[:, d, None] * g[None, :]  # (C, G): the bottleneck slot d sets the throughput
            with np.errstate(divide="ignore", invalid="ignore"):
                G = np.ceil(x[:, :, None] / X[:, None, :] - 1e-9)  # (C, G, n) fewest vGPUs per slot
            G[:, :, d] = g[None, :]
            ok = (G <= U[:, None, :]).all(axis=2) & np.isfinite(G).all(axis=2)
            if not ok.any():
                continue
            val = (G * X[:, None, :]).min(axis=2)
            sh = np.zeros(x.shape + (num_types,))
            for d2 in range(n):
                frac = G[:, :, d2] / v[:, d2, None]
                for kk in np.unique(k[:, d2]):
                    rows = k[:, d2] == kk
                    sh[rows, :, kk] += frac[rows]
            values.append(val[ok])
            shares.append(sh[ok])
    if not values:
        return np.zeros(0), np.zeros((0, num_types))
    return np.concatenate(values), np.concatenate(shares)


def cover_table(bins: np.ndarray, cost: np.ndarray, num_bins: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Min cost to cover every number of throughput bins, with unlimited use of each pattern.

    Args:
        bins: throughput of each pattern in bins (>= 1, capped at ``num_bins``).
        cost: price of each pattern.
        num_bins: J.

    Returns:
        (C, choice, kept): ``C[j]`` = least cost of patterns whose bins sum to >= j
        (j = 0..J); ``choice[j]`` = index into ``kept`` of the last pattern of that cover;
        ``kept`` = indices (into ``bins``) of the patterns the table uses.
    """
    # Cheapest pattern per bin count, then only those that no larger pattern undercuts.
    order = np.lexsort((cost, bins))
    b, c = bins[order], cost[order]
    first = np.r_[True, b[1:] != b[:-1]]
    b, c, kept = b[first], c[first], order[first]
    later_min = np.r_[np.minimum.accumulate(c[::-1])[::-1][1:], np.inf]
    useful = c < later_min
    b, c, kept = b[useful], c[useful], kept[useful]
    C = np.zeros(num_bins + 1)
    choice = np.full(num_bins + 1, -1, dtype=np.int64)
    if b.size == 0:
        C[1:] = np.inf
        return C, choice, kept
    # Every pattern covers >= b.min() bins, so a block of that many targets depends only on
    # smaller, finished targets: one vectorized step per block.
    step = int(max(1, min(b.min(), 4096)))
    j = 1
    while j <= num_bins:
        e = min(num_bins + 1, j + step)
        idx = np.arange(j, e)[None, :] - b[:, None]
        np.maximum(idx, 0, out=idx)
        cand = C[idx] + c[:, None]
        a = cand.argmin(axis=0)
        C[j:e] = cand[a, np.arange(e - j)]
        choice[j:e] = a
        j = e
    return C, choice, kept


@dataclass
class _Model:
    weight: float
    value: np.ndarray
    share: np.ndarray
    delta: float
    bins: np.ndarray
    coarse_delta: float
    coarse_bins: np.ndarray


class CoverBound:
    """The cover bound for one max-min planning problem (see the module docstring).

    Args:
        configs: per model, its configurations (the MILP's columns).
        weights: per model, w_m.
        counts: N_k per GPU type, cluster order.
        z_max: an upper bound on the objective (the LP relaxation's value); the bins span
            ``[0, z_max w_m]``.
        mu0: starting GPU prices (e.g. the LP relaxation's), or None for 1 / N_k.
        num_bins: throughput bins per model.
    """

    def __init__(
        self,
        configs: list[ConfigSet],
        weights: list[float],
        counts: np.ndarray,
        z_max: float,
        mu0: np.ndarray | None = None,
        num_bins: int = BINS,
    ):
        self.counts = np.asarray(counts, dtype=float)
        self.K = self.counts.size
        self.z_max = float(z_max)
        self.J = int(num_bins)
        self.Jc = min(COARSE_BINS, self.J)
        self.models: list[_Model] = []
        for cs, w in zip(configs, weights):
            val, sh = pipeline_patterns(cs, self.counts, self.K)
            delta, cdelta = (max(self.z_max * w, 1e-12) / J for J in (self.J, self.Jc))
            bins = np.clip(np.ceil(val / delta - 1e-12), 1, self.J).astype(np.int64)
            cbins = np.clip(np.ceil(val / cdelta - 1e-12), 1, self.Jc).astype(np.int64)
            self.models.append(_Model(float(w), val, sh, delta, bins, cdelta, cbins))
        mu = np.full(self.K, 1.0) if mu0 is None else np.maximum(np.asarray(mu0, dtype=float), 0.0)
        if not (mu @ self.counts > 0):
            mu = np.full(self.K, 1.0)
        self.mu0 = mu / (mu @ self.counts)

    def _priced(self, mu: np.ndarray, T: float, coarse: bool = False) -> tuple[float, list[np.ndarray]]:
        """sum_m LB_m(mu, T w_m) and, per model, the GPU shares of its cheapest cover.

        ``coarse``: on COARSE_BINS bins, which rounds pattern throughputs up further: a
        lower (still valid) bound, 10x cheaper.
        """
        total = 0.0
        plans = []
        for m in self.models:
            delta, bins, J = (m.coarse_delta, m.coarse_bins, self.Jc) if coarse else (m.delta, m.bins, self.J)
            target = int(np.floor(T * m.weight / delta + 1e-9))
            if target <= 0:
                plans.append(np.zeros(self.K))
                continue
            C, choice, kept = cover_table(bins, m.share @ mu, min(target, J))
            total += C[min(target, J)]
            if not np.isfinite(total):
                return np.inf, plans
            plan = np.zeros(self.K)
            j = min(target, J)
            while j > 0:
                i = kept[choice[j]]
                plan += m.share[i]
                j -= int(bins[i])
            plans.append(plan)
        return total, plans

    def refutes(self, T: float) -> bool:
        """True if it is proven that no plan reaches objective ``T`` (False: not proven).

        Args:
            T: the objective level to refute.
        """
        if T > self.z_max * (1 + 1e-9):
            return True  # above the LP relaxation's bound
        # Prices first on the coarse tables (any proof there is a proof), then on the fine
        # ones from the best coarse price, which is close to the best fine one.
        mu = self.mu0.copy()
        cuts: list[list[np.ndarray]] = [[] for _ in self.models]
        for coarse in (True, False):
            proven, mu = self._kelley(T, mu, coarse, cuts)
            if proven:
                return True
        return False

    def _kelley(
        self, T: float, mu: np.ndarray, coarse: bool, cuts: list[list[np.ndarray]]
    ) -> tuple[bool, np.ndarray]:
        """Kelley's cutting planes from ``mu``, adding to ``cuts``: (proven, the price that
        proved it or, if none did, the one whose priced demand came closest to the priced
        capacity)."""
        best_mu, best_ratio = mu, -np.inf
        for _it in range(MAX_KELLEY_ITERATIONS):
            priced, plans = self._priced(mu, T, coarse)
            cap = float(mu @ self.counts)
            if priced > cap * (1 + _REL_TOL) + 1e-12:
                return True, mu
            if cap > 0 and priced / cap > best_ratio:
                best_mu, best_ratio = mu, priced / cap
            for m, p in enumerate(plans):
                cuts[m].append(p)
            # Kelley: max sum_m theta_m  s.t. theta_m <= mu . share_p (collected covers),
            # mu . N = 1, mu >= 0. Its value bounds every price's sum_m LB_m from above.
            value, x = kelley_lp(self.counts, cuts)
            if x is None or value <= 1.0 + _REL_TOL:
                break  # no price refutes T, even priced against the collected covers only
            mu = np.maximum(x[: self.K], 0.0)
        return False, best_mu


def kelley_lp(counts: np.ndarray, cuts: list[list[np.ndarray]], weights: bool = False):
    """max sum_m theta_m s.t. theta_m <= mu . p for p in cuts[m], mu . N = 1, mu >= 0 (HiGHS).

    Kelley's cutting-plane model of a Lagrangian dual whose cuts are GPU vectors (or
    shares) of plans; the price bound (:mod:`ppipe.planner.price_bound`) uses it too, with
    ``weights=True`` for the mix of plans (per model, one weight per cut) it branches on.

    Returns (value, [mu, theta]) or (-inf, None) if HiGHS does not solve it; with
    ``weights``, a third item: per model, the weights of its cuts (None if unsolved).
    """
    import highspy

    K, M = counts.size, len(cuts)
    # One row per cut, theta_m - mu . p <= 0, then mu . N = 1 (built as arrays: the price
    # bound asks this with thousands of cuts at every node).
    P = [np.asarray(plans, dtype=float).reshape(-1, K) for plans in cuts]
    sizes = np.array([len(p) for p in P], dtype=np.int64)
    allp = np.concatenate(P) if sizes.sum() else np.zeros((0, K))
    r = int(sizes.sum())
    pr, pc = np.nonzero(allp)
    nz = np.nonzero(counts)[0]
    rows = np.concatenate([pr, np.arange(r), np.full(nz.size, r)])
    cols = np.concatenate([pc, K + np.repeat(np.arange(M), sizes), nz])
    vals = np.concatenate([-allp[pr, pc], np.ones(r), np.asarray(counts, dtype=float)[nz]])
    n_rows = r + 1
    inf = highspy.kHighsInf
    h = new_highs()
    h.addVars(K + M, np.r_[np.zeros(K), np.full(M, -inf)], np.full(K + M, inf))
    h.changeColsCost(K + M, np.arange(K + M, dtype=np.int32), np.r_[np.zeros(K), np.ones(M)])
    h.changeObjectiveSense(highspy.ObjSense.kMaximize)
    order = np.lexsort((np.array(cols), np.array(rows)))
    rows_a, cols_a, vals_a = np.array(rows)[order], np.array(cols, dtype=np.int32)[order], np.array(vals)[order]
    starts = np.searchsorted(rows_a, np.arange(n_rows)).astype(np.int32)
    lower = np.r_[np.full(n_rows - 1, -inf), 1.0]
    upper = np.r_[np.zeros(n_rows - 1), 1.0]
    h.addRows(n_rows, lower, upper, len(vals_a), starts, cols_a, vals_a)
    h.run()
    if h.getModelStatus() != highspy.HighsModelStatus.kOptimal:
        return (-np.inf, None, None) if weights else (-np.inf, None)
    value, x = float(h.getInfo().objective_function_value), np.array(h.getSolution().col_value)
    if not weights:
        return value, x
    # The cut rows' duals are the LP dual's weights on the cuts: per model they sum to 1
    # (theta_m is free), a convex mix of its plans whose GPU vectors, summed, fit N.
    dual = np.abs(np.array(h.getSolution().row_dual)[: n_rows - 1])
    out, i = [], 0
    for plans in cuts:
        w = dual[i : i + len(plans)]
        out.append(w / w.sum() if w.sum() > 0 else w)
        i += len(plans)
    return value, x, out
