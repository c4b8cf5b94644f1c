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

Prices: Kelley's cutting planes on the dual function, seeded with the split search's
restriction (:mod:`ppipe.planner.split_search`, every pool on whole GPUs of its own). Its
tables L_m give, for free, the GPU vector of every minimal restricted plan of model m that
reaches ``T w_m``; each is a plan of the MILP, hence a cut ``P_m(mu) <= mu . r``. Kelley's
LP over all of them is the restriction's own Lagrangian dual, an upper bound on this
one's: if it cannot refute ``T``, no price can, and the bound says so at once without a
single MILP solve. Otherwise its best price is where the exact solves go first; each
solve adds its plan's GPU vector as a cut, and the LP picks the next price. Where no model
plan is cheaper than the restricted ones at that price (sharing a GPU between pools does
not pay), one round of three solves proves ``T``.

Where it proves and where not (2026-11-26, the four-type case, ``T`` = incumbent + 0.1 %):
it refutes ``T`` for G2, G5 and G6 (so their split-search plans are optimal within
0.1 %), each with one round of exact solves at the restriction's best price. It cannot
for G3 and G4, where the restriction's dual already stays below the capacity (G4: 0.9995
of it): the best prices leave a fractional mix of per-model GPU vectors that fits the
cluster (e.g. G4: model 3 half at (17 L4, 14 T4, 18 P4), half at (22 L4, 1 T4)), which
no price can separate -- a branch on per-model GPU counts would be next. Nor for G1,
where sharing pays at that price (two V100 pools of 22 + 5 vGPUs at level 3 fit 9 GPUs,
the restriction needs 10): the exact solves sum to 0.996 of the capacity. At
incumbent + 0.01 % (the planner's default gap) it refutes only G5. An exact solve takes
0.3-6 s (HiGHS's LP bound of the single-model MILP sits about 1.3 % low and only the
finished tree closes it), so the planner asks this bound only on the many-type,
many-model, paper-rule cases that the split search serves, after the cover bound has
failed, with at least ``PRICE_BOUND_MIN_S`` of the budget left. Measured (``python
scripts/bench_planner.py --suite four --time-limit-s 10 --gap 1e-3``, 2026-11-26, three
runs): G2 5.3-6.8 s, G5 7.4-9.0 s, G6 6.0-7.0 s proven within 0.1 % (16-21 s with
unseeded prices, which needed 5-7 rounds); G1, G3, G4 stop at 10 s with 1.7, 0.9 and
1.0 %. With the default gap (1e-4) G5 is proven in 5.6-6.1 s.

Each round stops early where it cannot prove: a model's solve stops at the first plan
priced below what the round needs from it (HiGHS's ``objective_target``), and the round
stops there; the new cut moves the next price.
"""

from __future__ import annotations

import time

import numpy as np

from ppipe.planner.bounds import kelley_lp
from ppipe.planner.configs import ConfigSet, ModelSpec
from ppipe.planner.solvers import HIGHS_MIP_OPTIONS, HighsSolver, time_left
from ppipe.planner.split_search import minimal_points
from ppipe.spec.cluster import ClusterSpec

MAX_ITERATIONS = 30
PRICE_SCALE = 1000.0  # mu . N: keeps each P_m well above 1, where HiGHS's relative gap is exact
SOLVE_GAP = 1e-7  # relative gap of each subproblem solve (its dual bound is what counts)
_REL_TOL = 1e-6  # a proof needs the priced demand to exceed the priced capacity by this share


class PriceBound:
    """The price bound for one max-min planning problem (see the module docstring).

    Args:
        specs: the models (their weights are w_m).
        configs: per model, its configurations (the MILP's columns).
        cluster: the cluster (N_k and the GPU rule's data).
        build_kw: the keyword arguments the planner gave
            :func:`ppipe.planner.formulation.build` (GPU rule, one configuration per template).
        tables: per model, the split search's L_m on the GPU grid
            (:attr:`ppipe.planner.split_search.SplitPlan.tables`): the GPU vectors of
            restricted plans, which seed the price search (module docstring).
    """

    def __init__(
        self,
        specs: list[ModelSpec],
        configs: list[ConfigSet],
        cluster: ClusterSpec,
        build_kw: dict,
        tables: list[np.ndarray],
    ):
        self.specs, self.configs, self.cluster = specs, configs, cluster
        self.build_kw = dict(build_kw)
        self.tables = list(tables)
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

    def _price(self, sub, mu: np.ndarray, deadline: float | None, target: float = -np.inf) -> tuple[float, np.ndarray | None]:
        """(a lower bound on P_m(mu), the GPU vector of the best plan found or None).

        The solve stops early at a plan priced ``target`` or less (then P_m <= target).
        """
        milp, v = sub
        milp.set_objective({v.gpus[k]: float(mu[i]) for i, k in enumerate(self.types)}, "min")
        t0 = time.perf_counter()
        try:
            solver = HighsSolver({**HIGHS_MIP_OPTIONS, "objective_target": float(target)})
            res = solver.solve(milp, time_limit_s=time_left(deadline), gap=SOLVE_GAP)
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

    def refutes(self, T: float, deadline: float | None = None, max_rounds: int = MAX_ITERATIONS) -> bool:
        """True if it is proven that no plan reaches objective ``T`` (False: not proven).

        Args:
            T: the level to refute.
            deadline: ``time.perf_counter()`` value after which the search gives up.
            max_rounds: most rounds of exact solves (one per price).
        """
        K = self.N.size
        cuts = [list(minimal_points(t >= np.float32(T * s.weight)).astype(float)) for t, s in zip(self.tables, self.specs)]
        subs = None
        if not all(cuts):
            # A model the restriction cannot serve at T alone: one exact solve at uniform
            # prices either proves that no plan of it can, or gives its first cut.
            subs = self._subproblems(T)
            for m in (m for m, c in enumerate(cuts) if not c):
                lb, u = self._price(subs[m], PRICE_SCALE / (K * self.N), deadline)
                if not np.isfinite(lb):
                    return True
                if u is None:
                    return False
                cuts[m].append(u)
        for _ in range(max_rounds):
            value, x = kelley_lp(self.N, cuts)  # prices with mu . N = 1
            if x is None or value <= 1.0 + _REL_TOL:
                return False  # no price refutes T against these cuts, so none does against P_m
            mu = np.maximum(x[:K], 0.0) * PRICE_SCALE
            subs = subs or self._subproblems(T)
            need = float(mu @ self.N) * (1.0 + _REL_TOL)
            # The cuts price each model's cheapest known plan: theta_m >= P_m(mu). The round
            # proves T if the solves' lower bounds sum above ``need``; it cannot once a model
            # has a plan cheaper than need minus what the others can give at most, so each
            # solve stops at such a plan, and the round at the first that falls short.
            best = np.array([float(np.min(np.asarray(c) @ mu)) for c in cuts])
            for m, sub in enumerate(subs):
                if deadline is not None and time.perf_counter() > deadline:
                    return False
                target = need - (best.sum() - best[m])
                lb, u = self._price(sub, mu, deadline, target=target)
                if not np.isfinite(lb):
                    return True
                if u is None:
                    return False  # a solve without a plan in time: no proof, and no cut to steer by
                cuts[m].append(u)
                best[m] = lb
                if best.sum() <= need:
                    break  # this price cannot refute T: on to the next, with the new cut
            else:
                return True
        return False
