r"""The price bound: a Lagrangian bound for max-min whose per-model subproblem is exact.

Why it exists: the cover bound (:mod:`ppipe.planner.bounds`) prices each model's GPU
*shares* and relaxes its plan to repeated pipeline patterns, so it cannot see that a
model's pools round up to whole GPUs per (slot, type) under the paper's rule, nor that a
template takes one configuration. On the 4-GPU-type case of ``scripts/bench_planner.py
--suite four`` that leaves it 0.7-2.7 % above the optimum, and branch and bound stalls
at about 1 %. This bound keeps both: for GPU prices ``mu >= 0`` and a level ``T``::

    sum_m P_m(mu, T w_m) <= mu . N   for every plan with z >= T,
    P_m(mu, t) = min { mu . u_m  :  model m alone reaches throughput t using u_m GPUs },

because the models of a plan use GPU vectors u_m with sum_m u_m <= N (the paper's rule
counts GPUs per model, so each model's u_m is an integer vector). ``P_m`` is the
planner's own MILP for model m alone (the same configurations, rows and GPU rule) with
the objective "fewest priced GPUs" and the row ``x_m >= t`` -- solved exactly by HiGHS,
its dual bound used, so a time-limited solve still gives a valid bound. If some ``mu``
gives ``sum_m P_m > mu . N``, no plan reaches ``T``.

Prices: Kelley's cutting planes on the dual function (each solve returns a plan, whose
GPU vector is a cut), inside a box around the best price so far (without it Kelley's
prices jump to the corners and every jump costs three MILP solves), started from the
cover bound's last prices. When the cutting-plane model says that no price in the box
can refute ``T``, the box grows; over all prices, the search ends (not proven).

Where it proves and where not (2026-11-26, the four-type case, ``T`` = incumbent + 0.1 %):
it refutes ``T`` for G2, G5 and G6 (so their split-search plans are optimal within
0.1 %), and cannot for G1, G3 and G4: there the best prices leave a fractional mix of
per-model GPU vectors that fits the cluster (e.g. G4: model 3 half at (17 L4, 14 T4, 18
P4), half at (22 L4, 1 T4)), which no price can separate, and no integer choice among
the plans the solves produced fits -- a branch on per-model GPU counts would be next.
At incumbent + 0.01 % (the planner's default gap) it refutes only G5. Each proof costs
8-25 single-model MILP solves of 0.3-3 s (HiGHS already uses both cores: solving the
models in threads saved 8 %), so the planner asks it only on the many-type, many-model,
paper-rule cases that the split search serves, after the cover bound has failed, with
at least ``PRICE_BOUND_MIN_S`` of the budget left. Measured (``python
scripts/bench_planner.py --suite four --time-limit-s 60 --gap 1e-3``): G2 20.6 s, G5
15.9 s, G6 16.2 s proven within 0.1 %; G1, G3, G4 stop at 60 s with 1.13, 0.75 and
0.83 % (before: no case proven in 60 s, G2 0.85 %, G6 0.33 %).
"""

from __future__ import annotations

import time

import numpy as np

from ppipe.planner.configs import ConfigSet, ModelSpec
from ppipe.planner.solvers import HighsSolver, time_left
from ppipe.spec.cluster import ClusterSpec

MAX_ITERATIONS = 30
PRICE_SCALE = 1000.0  # mu . N: keeps each P_m well above 1, where HiGHS's relative gap is exact
SOLVE_GAP = 1e-7  # relative gap of each subproblem solve (its dual bound is what counts)
BOX = 0.15  # half-width of the price box, as a share of the largest price
_REL_TOL = 1e-6  # a proof needs the priced demand to exceed the priced capacity by this share


class PriceBound:
    """The price bound for one max-min planning problem (see the module docstring).

    Args:
        specs: the models (their weights are w_m).
        configs: per model, its configurations (the MILP's columns).
        cluster: the cluster (N_k and the GPU rule's data).
        build_kw: the keyword arguments the planner gave
            :func:`ppipe.planner.formulation.build` (GPU rule, one configuration per template).
    """

    def __init__(self, specs: list[ModelSpec], configs: list[ConfigSet], cluster: ClusterSpec, build_kw: dict):
        self.specs, self.configs, self.cluster = specs, configs, cluster
        self.build_kw = dict(build_kw)
        self.types = [g.name for g in cluster.gpu_types]
        self.N = np.array([cluster.gpu_counts[k] for k in self.types], dtype=float)
        self.solves = 0
        self.seconds = 0.0

    def _subproblems(self, T: float) -> list:
        """Per model, its MILP alone with ``x_m >= T w_m`` (pools capped at that rate)."""
        from ppipe.planner.formulation import build

        out = []
        for spec, cs in zip(self.specs, self.configs):
            t = T * spec.weight
            # No pipeline needs more than t: the cap only removes pools no cheapest plan has.
            milp, v = build([spec], [cs], self.cluster, rate_cap=[t], **self.build_kw)
            milp.add_row({v.x_model[spec.name]: 1.0}, lb=t, name="price_bound_rate")
            out.append((milp, v))
        return out

    def _price(self, sub, mu: np.ndarray, deadline: float | None) -> tuple[float, np.ndarray | None]:
        """(a lower bound on P_m(mu), the GPU vector of the best plan found or None)."""
        milp, v = sub
        milp.set_objective({v.gpus[k]: float(mu[i]) for i, k in enumerate(self.types)}, "min")
        t0 = time.perf_counter()
        try:
            res = HighsSolver().solve(milp, time_limit_s=time_left(deadline), gap=SOLVE_GAP)
        except Exception:  # noqa: BLE001 - a subproblem without a plan in time proves nothing
            return 0.0, None
        finally:
            self.solves += 1
            self.seconds += time.perf_counter() - t0
        if res.status == "infeasible":
            return np.inf, None  # the model alone cannot reach its share of T
        if res.x is None:
            return 0.0, None
        u = np.array([round(float(res.x[v.gpus[k]])) for k in self.types], dtype=float)
        gap = res.gap if np.isfinite(res.gap) else 1.0
        # HiGHS's gap is |primal - dual| / max(1, |primal|) at most: the dual bound is at least this.
        return max(0.0, res.objective - gap * max(1.0, abs(res.objective))), u

    def refutes(self, T: float, mu0: np.ndarray | None = None, deadline: float | None = None) -> bool:
        """True if it is proven that no plan reaches objective ``T`` (False: not proven).

        Args:
            T: the level to refute.
            mu0: starting GPU prices (e.g. the cover bound's last), or None for 1 / N_k.
            deadline: ``time.perf_counter()`` value after which the search gives up.
        """
        K = self.N.size
        subs = self._subproblems(T)
        mu = np.ones(K) if mu0 is None or not (np.asarray(mu0) @ self.N > 0) else np.maximum(np.asarray(mu0, float), 0.0)
        mu = mu * (PRICE_SCALE / (mu @ self.N))
        cuts: list[list[np.ndarray]] = [[] for _ in subs]
        best_mu, best_ratio, box = mu, -np.inf, BOX
        for _ in range(MAX_ITERATIONS):
            priced = 0.0
            for m, sub in enumerate(subs):
                lb, u = self._price(sub, mu, deadline)
                priced += lb
                if u is not None:
                    cuts[m].append(u)
                if not np.isfinite(priced):
                    return True
            cap = float(mu @ self.N)
            if priced > cap * (1.0 + _REL_TOL):
                return True
            if priced / cap > best_ratio:
                best_ratio, best_mu = priced / cap, mu
            if deadline is not None and time.perf_counter() > deadline:
                return False
            if any(not c for c in cuts):
                return False  # a subproblem found no plan in time: no cut to steer by
            full = PRICE_SCALE / self.N  # mu . N = PRICE_SCALE, mu >= 0 keeps every mu_k below this
            while True:
                if box >= 1.0:
                    lo_b, hi_b = np.zeros(K), full
                else:
                    lo_b = np.maximum(best_mu - box * best_mu.max(), 0.0)
                    hi_b = np.minimum(best_mu + box * best_mu.max(), full)
                value, new_mu = _kelley_box(self.N, cuts, lo_b, hi_b)
                if new_mu is not None and value > PRICE_SCALE * (1.0 + _REL_TOL):
                    mu = new_mu
                    break
                if box >= 1.0:
                    return False  # no price at all can refute T against these cuts
                box = box * 4.0
        return False


def _kelley_box(N: np.ndarray, cuts: list[list[np.ndarray]], lo: np.ndarray, hi: np.ndarray):
    """max sum_m theta_m s.t. theta_m <= mu . u (u in cuts[m]), mu . N = PRICE_SCALE, lo <= mu <= hi.

    Returns (value, mu), or (-inf, None) when the box holds no price with ``mu . N = PRICE_SCALE``.
    """
    from scipy.optimize import linprog

    K, M = N.size, len(cuts)
    rows = []
    for m, us in enumerate(cuts):
        for u in us:
            r = np.zeros(K + M)
            r[:K] = -u
            r[K + m] = 1.0
            rows.append(r)
    res = linprog(
        np.r_[np.zeros(K), -np.ones(M)],
        A_ub=np.array(rows), b_ub=np.zeros(len(rows)),
        A_eq=np.r_[N, np.zeros(M)][None, :], b_eq=[PRICE_SCALE],
        bounds=[(float(a), float(b)) for a, b in zip(lo, hi)] + [(None, None)] * M,
        method="highs",
    )
    if res.status != 0:
        return -np.inf, None
    return float(-res.fun), np.maximum(res.x[:K], 0.0)
