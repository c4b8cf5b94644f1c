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

Branching: where no price refutes ``T`` (the LP's optimum is a mix of plans per model
whose GPU vectors, mixed, fit the cluster), the search splits a model's GPU count of one
type: ``u_{m,k} <= c`` or ``>= c + 1`` below a fractional mixed count, or between two
plans of a mix that differ. Of those splits it takes the one whose weaker box comes
closest to a refutation by the known plans alone (Kelley's value, strong branching,
:func:`_branching`). Each box is bounded the same way -- known plans
padded with idle GPUs up to its lower corner, exact solves with the model's GPU columns
bounded to it -- and the level is refuted when every box is. A box whose LP mix is one
plan per model gives up: those plans reach ``T`` together. So does a search where a newly
solved plan completes a combination of known plans that fits the cluster. Either way the
combination is kept in ``found`` (per model, an exact solve's plan or the restriction's,
rebuilt from its table), and the planner hands it to HiGHS as a better incumbent: on the
four-type case G4, HiGHS still holds the split search's plan (4993.09) after 10 s, while the
bound, asked about 4993.09 + 0.1 %, finds the 5000.28 plan in about 4 s and then proves it
within 0.1 % in about 4 s more.

Where it proves and where not (2026-11-26, the four-type case, ``T`` = incumbent + 0.1 %,
the bound alone, one worker): at the root it refutes ``T`` for G2, G5 and G6 (their
split-search plans are optimal within 0.1 %) with one round of exact solves at the
restriction's best price, in 1.4-2.4 s. For G3 and G4 the restriction's dual already stays below the capacity (G4:
0.9995 of it): the best prices leave a fractional mix of per-model GPU vectors (e.g. G4:
model 3 half at (17 L4, 14 T4, 18 P4), half at (22 L4, 1 T4)); branching proves G4 in 3.6 s
(6 solves, 3 boxes) from its best known plan (5000.28, 0.14 % above the split search's,
where sharing GPUs between pools pays; from the split search's plan ``T`` is reachable:
a solved plan completes a fitting combination, which is that better plan, in 4 s), and
G3 in 9.1-9.4 s (9 solves, 5 boxes; 4-5 s of it one solve of model 2 with at least 18
P4: a lower bound on a model's GPUs makes its MILP several times harder, 0.8 s without
it). G1: sharing pays at the root's price (two V100 pools of 22 + 5 vGPUs at level 3 fit
9 GPUs, the restriction needs 10) and the search takes 6 s (7 solves). An exact solve
takes 0.02-5 s (HiGHS's LP bound of the single-model MILP sits about 1-1.4 % low and only
the finished tree closes it), so the planner asks this bound only on the many-type,
many-model, paper-rule cases that the split search serves, after the cover bound has
failed, with at least ``PRICE_BOUND_MIN_S`` of the budget left. With two workers (below)
the bound alone takes G1 4.0-4.7 s, G3 8.4-8.8 s, G4 2.6-2.9 s (before the feasibility
tolerance of :data:`SUBPROBLEM_OPTIONS`, which takes about 15 % off). In the planner
(``python scripts/bench_planner.py --suite four --time-limit-s 10 --gap 1e-3``) all six
groups are proven within 0.1 % in 10 s, the slowest, G3 and G4, in 7.2-9.3 s.

Two boxes are bounded at once, each by a worker thread with its own subproblem MILPs
(:data:`WORKERS`; HiGHS releases the GIL while it solves, and one solve keeps two cores
only about 1.6 busy). The known plans, the order of the models and the plans found are
shared as they come, so with two workers the order in which boxes learn them, hence the
node and solve counts and, where the bound finds a better plan, which one, depend on
timing; whether ``T`` is refuted does not (without a deadline). ``WORKERS = 1`` makes the
search repeat exactly. The first box not proven ends the search: the other worker's solve
is interrupted (HiGHS's interrupt callback), so it does not run on to the deadline.

Each round stops early where it cannot prove: a model's solve stops at the first plan
priced below what the round needs from it (HiGHS's ``objective_target``), and the round
stops there; the new cut moves the next price. Each solve also starts as if it held the
model's cheapest known plan in the box as its incumbent (HiGHS's ``objective_bound``, just
above its price), which prunes from the start what cannot beat it: most solves prove that
plan optimal or find one a little cheaper. The last solve of a round needs only a bound
above what the others left it (its target), so its cutoff sits there: on the slow solves
of the 4-type case, 36.0 -> 27.8 s in all (seven solves, three HiGHS seeds each). A round
solves the quickest models first (by
the simplex iterations of their last solve, which unlike the clock are the same in every
run; before any, by their number of configurations), so that one that falls short ends
it before the slow ones run, and the slow one gets the round's room (G1 at + 0.1 %, with
the first of these: 50 s -> 22 s, 12 solves).
"""

from __future__ import annotations

import os
import threading
import time

import numpy as np

from ppipe.planner.bounds import kelley_lp
from ppipe.planner.configs import ConfigSet, ModelSpec
from ppipe.planner.solvers import HIGHS_MIP_OPTIONS, HighsSolver, time_left
from ppipe.planner.formulation import build, extract, pipeline_columns
from ppipe.planner.split_search import minimal_points, restricted_pipelines
from ppipe.spec.plan import ModelPlan
from ppipe.spec.cluster import ClusterSpec

MAX_ITERATIONS = 30  # rounds of exact solves (one per price) in one search
MAX_NODES = 200  # boxes in one search
PRICE_SCALE = 1000.0  # mu . N: keeps each P_m well above 1, where HiGHS's relative gap is exact
SOLVE_GAP = 1e-7  # relative gap of each subproblem solve (its dual bound is what counts)
# A solve prunes from the start what is priced this share above the known plan's price
# (HiGHS's objective_bound). The 4-type bounds at incumbent + 0.1 % take 23 % less (93 ->
# 71 s over the six groups; simplex iterations G3 413 k -> 209 k, G5 50 k -> 31 k).
CUTOFF_SLACK = 1e-6
_REL_TOL = 1e-6  # a proof needs the priced demand to exceed the priced capacity by this share
# HiGHS's presolve, off for the planner's MILP (solvers.HIGHS_MIP_OPTIONS), pays on the
# single-model ones: the 4-type case's bounds at incumbent + 0.1 % take 10-45 % less (G1
# 22.3 -> 18.7 s, G3 31.4 -> 28.5 s, G6 3.8 -> 2.1 s; G5 5.1 s either way).
#
# A MIP feasibility tolerance of 1e-5 (HiGHS's default 1e-6) takes the 22 solves of the
# 4-type bounds at incumbent + 0.1 % (captured, three HiGHS seeds) from 21.7-24.4 s to
# 18.5-18.9 s, with the same outcome for every one. It can only weaken a bound, never
# make it claim too much: a looser tolerance accepts more points as plans (a lower
# incumbent, hence a lower bound) and rounds propagated integer bounds less eagerly.
SUBPROBLEM_OPTIONS: dict[str, object] = {"presolve": "on", "mip_feasibility_tolerance": 1e-5}
# Boxes bounded at once, each by its own worker thread (HiGHS releases the GIL while it
# solves). One HiGHS solve keeps 2 cores only about 1.6 busy, so two at once finish
# sooner: the 4-type bounds at incumbent + 0.1 % (the bound alone, 2 cores) G1 6.4 -> 4.6 s,
# G3 9.7 -> 8.5 s, G4 3.6 -> 2.6 s. Capped by the machine's cores.
WORKERS = 2


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
        self.nodes = 0
        # Per model, the work of its last exact solve that ran to its end (HiGHS's simplex
        # iterations: a measure of time that, unlike the clock, is the same in every run): a
        # round solves the quick models first, so that one that falls short ends it before
        # the slow ones run.
        self._work = np.full(len(configs), np.nan)  # NaN: not solved yet (see _order)
        # Per model, (GPU vector, plan) of every exact solve's plan; and the plans of the
        # last fitting combination found (a plan of the whole MILP that reaches the level).
        self._exact: list[list[tuple[np.ndarray, ModelPlan]]] = [[] for _ in specs]
        self.found: list[ModelPlan] | None = None
        # Boxes searched at once (module docstring); what they learn is shared under the lock.
        self.workers = max(1, min(WORKERS, os.cpu_count() or 1))
        self._lock = threading.RLock()

    def _subproblems(self, T: float) -> list:
        """Per model, its MILP alone with ``x_m >= T w_m`` (pools capped at that rate)."""
        out = []
        for spec, cs in zip(self.specs, self.configs):
            t = T * spec.weight
            # No pipeline needs more than t: the cap only removes pools no cheapest plan has.
            milp, v = build([spec], [cs], self.cluster, rate_cap=[t], **self.build_kw)
            milp.add_row({v.x_model[spec.name]: 1.0}, lb=t, name="price_bound_rate")
            out.append((milp, v, len(out)))
        return out

    def _price(
        self,
        sub,
        mu: np.ndarray,
        deadline: float | None,
        box: tuple[np.ndarray, np.ndarray],
        target: float = -np.inf,
        known: float = np.inf,
        enough: float = np.inf,
        stopped=None,
    ) -> tuple[float | None, np.ndarray | None]:
        """(a lower bound on P_m(mu) over plans whose GPU vector lies in ``box`` = (lo, hi),
        or None where the solve found no plan in time (no proof); the GPU vector of the best
        plan found, or None).

        The solve stops early at a plan priced ``target`` or less (then P_m <= target).
        ``known`` is the price of a plan known to lie in the box: from the start, HiGHS
        prunes what cannot come below it (its ``objective_bound``, set just above it, so
        that a plan as cheap is still found), as if it held that plan as its incumbent.
        ``enough`` is a lower bound that is all the caller needs: the solve prunes from the
        start what cannot come below it, and where nothing does, it is the bound returned.
        ``stopped() -> bool``, if given, interrupts the solve once True (the search ended in
        another worker): it then proves only what a time-limited solve does.
        """
        milp, v, m = sub
        cols = [v.gpus[k] for k in self.types]
        milp.set_objective({c: float(mu[i]) for i, c in enumerate(cols)}, "min")
        milp.set_col_bounds(cols, box[0], box[1])  # GPUs beyond a pool's need may idle: lo is reachable
        options = {**HIGHS_MIP_OPTIONS, **SUBPROBLEM_OPTIONS, "objective_target": float(target)}
        floor = min(known, enough)  # every plan of the box is priced at least this, if none is below the cutoff
        cutoff = floor * (1 + CUTOFF_SLACK) + CUTOFF_SLACK
        if np.isfinite(cutoff):
            options["objective_bound"] = float(cutoff)
        t0 = time.perf_counter()
        try:
            res = HighsSolver(options).solve(milp, time_limit_s=time_left(deadline), gap=SOLVE_GAP, stop=stopped)
        except Exception:  # noqa: BLE001 - a subproblem without a plan in time proves nothing
            return None, None
        finally:
            milp.set_col_bounds(cols, 0.0, self.N)
            with self._lock:
                self.solves += 1
                self.seconds += time.perf_counter() - t0
        with self._lock:
            # A solve stopped early at its target measures only part of a proof: it can
            # raise the model's work, not lower it (4-type G4: a model whose proofs take
            # 1.5-2.2 s looked quick after a 0.4 s solve that found a cheaper plan).
            work = max(res.lp_iterations, 1)
            finished = res.status in ("optimal", "infeasible")
            self._work[m] = work if finished or not np.isfinite(self._work[m]) else max(work, self._work[m])
        if res.status == "infeasible":
            # The model alone cannot reach its share of T in the box, or nothing lies below
            # the cutoff (the known plan's price, or ``enough``): either way P_m >= floor.
            return (np.inf if not np.isfinite(cutoff) else floor), None
        if res.x is None:
            return None, None
        gap = res.gap if np.isfinite(res.gap) else 1.0
        # HiGHS's gap is |primal - dual| / max(1, |primal|) at most: the dual bound is at least this.
        lb = max(0.0, res.objective - gap * max(1.0, abs(res.objective)))
        if res.objective >= cutoff:
            # No plan below the cutoff was found (HiGHS keeps plans above it that it met
            # before pruning). A finished search proves there is none: every plan of the box
            # is priced at least ``floor``. A search its time limit stopped proves only its
            # dual bound.
            return (max(min(lb, known), floor) if res.status == "optimal" else min(lb, known)), None
        u = np.array([round(float(res.x[c])) for c in cols], dtype=float)
        plan = extract(res.x, v, [self.specs[m]])[0]
        with self._lock:
            self._exact[m].append((u, plan))
        return lb, u

    def _order(self) -> np.ndarray:
        """The models of a round, quickest first: by the work of their last solve; a model
        not solved yet counts as its configurations times the solved models' median work per
        configuration (before any solve: by size). Measured work and sizes are never mixed
        raw: a round of the 4-type case G3 whose quickest model (0.02 s) had been solved and
        the others not put it last, where the slow one had to prove its plan exactly."""
        with self._lock:
            work = self._work.copy()
        size = np.array([len(cs) for cs in self.configs], dtype=float)
        seen = np.isfinite(work)
        per_config = float(np.median(work[seen] / np.maximum(size[seen], 1.0))) if seen.any() else 1.0
        return np.argsort(np.where(seen, work, size * per_config), kind="stable")

    def refutes(self, T: float, deadline: float | None = None, max_rounds: int = MAX_ITERATIONS) -> bool:
        """True if it is proven that no plan reaches objective ``T`` (False: not proven).

        Branch and bound over the models' GPU vectors (module docstring): a node bounds
        each model's vector to a box and is closed when the bound refutes ``T`` in it.
        ``workers`` boxes are bounded at once (:data:`WORKERS`), each in its own thread;
        the first box not proven ends the search and interrupts the other's solve.

        Args:
            T: the level to refute.
            deadline: ``time.perf_counter()`` value after which the search gives up.
            max_rounds: most rounds of exact solves (one per price) over the whole search.
        """
        M, K = len(self.specs), self.N.size
        # GPU vectors of known plans per model: the restriction's minimal ones, then every
        # exact solve's. Each is a plan anywhere it fits a box (idle GPUs pad it up to lo).
        reach = [t >= np.float32(T * s.weight) for t, s in zip(self.tables, self.specs)]
        known = [minimal_points(r).astype(float) for r in reach]
        self._reach = reach  # per model, the GPU vectors (upward closed) a known plan of it fits
        self._exact = [[] for _ in self.specs]  # plans of an earlier level may not reach this one
        self.found = None
        self._rounds_left = max_rounds
        tree = _Tree((np.zeros((M, K)), np.tile(self.N, (M, 1))))
        if self.workers <= 1:
            self._search(tree, T, known, deadline)
        else:
            threads = [
                threading.Thread(target=self._search, args=(tree, T, known, deadline), name=f"price-bound-{i}", daemon=True)
                for i in range(self.workers)
            ]
            for th in threads:
                th.start()
            try:
                for th in threads:
                    th.join()
            except BaseException as e:  # e.g. Ctrl-C while waiting: the workers' solves stop too
                tree.fail(e)
                for th in threads:
                    th.join()
                raise
        if tree.error is not None:
            raise tree.error
        return bool(tree.result)

    def _search(self, tree: "_Tree", T: float, known: list[np.ndarray], deadline: float | None) -> None:
        """One worker of :meth:`refutes`: takes boxes from ``tree`` until the search ends
        (each worker has its own subproblem MILPs, which a solve changes in place)."""
        subs: list = []
        try:
            while (box := tree.take()) is not None:
                lo, hi = box
                branch = None  # the boxes' least GPUs do not fit the cluster: refuted
                if not (lo.sum(axis=0) > self.N).any():
                    subs = subs or self._subproblems(T)
                    branch = self._node(lo, hi, known, subs, deadline, tree.stopped)
                with self._lock:
                    self.nodes += 1
                tree.done(lo, hi, branch)
        except BaseException as e:  # noqa: BLE001 - raised again by refutes, in the caller's thread
            tree.fail(e)

    def _node(self, lo, hi, known, subs, deadline, stopped=lambda: False):
        """None if ``T`` is refuted in the boxes, False if not proven (give up), else a branch (m, k, cut)."""
        M = len(self.specs)
        while True:
            if stopped() or (deadline is not None and time.perf_counter() > deadline):
                return False
            with self._lock:
                cuts = _box_cuts(known, lo, hi)
            empty = [m for m in range(M) if len(cuts[m]) == 0]
            if empty:
                # No known plan in a box: one exact solve at uniform prices proves it holds
                # none, or gives the first.
                m = empty[0]
                lb, u = self._price(subs[m], PRICE_SCALE / (len(self.N) * self.N), deadline, (lo[m], hi[m]), stopped=stopped)
                if lb is not None and not np.isfinite(lb):
                    return None
                if u is None or self._learned(known, m, u, subs):
                    return False
                continue
            value, x, weights = kelley_lp(self.N, [list(c) for c in cuts], weights=True)
            if x is None:
                return False
            if value <= 1.0 + _REL_TOL:
                branch = _branching(cuts, weights, lo, hi, known, self.N, np.maximum(x[: self.N.size], 0.0))
                if branch is None:  # the mix is one plan per model: together they reach T
                    with self._lock:
                        self._found([cuts[m][int(np.argmax(weights[m]))] for m in range(M)], subs)
                return branch or False
            with self._lock:
                if self._rounds_left <= 0:
                    return False
                self._rounds_left -= 1
            mu = np.maximum(x[: self.N.size], 0.0) * PRICE_SCALE
            need = float(mu @ self.N) * (1.0 + _REL_TOL)
            # The cuts price each model's cheapest known plan: best_m >= P_m(mu). The round
            # refutes the node if the solves' lower bounds sum above ``need``; it cannot once
            # a model has a plan cheaper than need minus what the others can give at most, so
            # each solve stops at such a plan, and the round at the first that falls short.
            best = np.array([float(np.min(c @ mu)) for c in cuts])
            order = self._order()
            for m in order:
                target = need - (best.sum() - best[m])
                # The last solve of the round refutes the node as soon as P_m > target: a
                # bound just above the target is enough, the known plan's price is not needed.
                enough = target + 2 * CUTOFF_SLACK * max(1.0, abs(target)) if m == order[-1] else np.inf
                lb, u = self._price(
                    subs[m], mu, deadline, (lo[m], hi[m]), target=target, known=best[m], enough=enough, stopped=stopped
                )
                if lb is None:
                    return False  # a solve without a plan in time: no proof, and no cut to steer by
                if not np.isfinite(lb):
                    return None
                if u is not None and self._learned(known, m, u, subs):
                    return False
                best[m] = lb
                if best.sum() <= need:
                    break  # this price cannot refute the node: on to the next, with the new cut
            else:
                return None

    def _learned(self, known: list[np.ndarray], m: int, u: np.ndarray, subs: list) -> bool:
        """Add model m's new plan (GPU vector u) to ``known``; :meth:`_learn`, and where known
        plans now reach T together, their plans in ``found`` (True)."""
        with self._lock:
            known[m] = np.vstack([known[m], u]) if len(known[m]) else u[None, :]
            return self._fits(m, u, subs)

    def _fits(self, m: int, u: np.ndarray, subs: list) -> bool:
        """:meth:`_learn`, and where known plans now reach T together, their plans in ``found``."""
        budgets = self._learn(m, u)
        if budgets is not None:
            self._found(budgets, subs)
        return budgets is not None

    def _learn(self, m: int, u: np.ndarray) -> list[np.ndarray] | None:
        """Record model m's new plan (GPU vector u); if known plans now reach T together,
        per model a GPU vector that holds one of them (their sum fits N), else None.

        A combination that fits and was not there before has u in it: checked as u with
        one known plan of each other model (for up to three models; beyond, the search
        finds out by branching). Then ``T`` is reachable and the search can stop.
        """
        reach = self._reach
        ui = u.astype(np.int64)
        reach[m][tuple(slice(int(a), None) for a in ui)] = True
        rest = self.N.astype(np.int64) - ui
        others = [j for j in range(len(reach)) if j != m]
        if (rest < 0).any() or len(others) > 2:
            return None
        budget = {m: ui}
        if len(others) == 1:
            if not reach[others[0]][tuple(rest)]:
                return None
            budget[others[0]] = rest
        elif others:
            a = minimal_points(reach[others[0]])
            a = a[(a <= rest).all(axis=1)]
            hit = np.nonzero(reach[others[1]][tuple((rest - a).T)])[0] if a.size else []
            if len(hit) == 0:
                return None
            budget[others[0]], budget[others[1]] = a[hit[0]], rest - a[hit[0]]
        return [budget[j] for j in range(len(reach))]

    def _found(self, budgets: list[np.ndarray], subs: list) -> None:
        """Record in ``found`` a plan of each model within its GPU vector in ``budgets``
        (each holds a known plan: an exact solve's, else the restriction's, from its table)."""
        plans = []
        for m, r in enumerate(budgets):
            r = np.asarray(r, dtype=np.int64)
            plan = next((p for u, p in self._exact[m] if (u <= r).all()), None)
            if plan is None:
                cs, (milp, v, _) = self.configs[m], subs[m]
                pipes = restricted_pipelines(cs, self.N.astype(np.int64), r, bool(self.build_kw.get("one_config_per_template")))
                x = pipeline_columns(v, milp.num_cols, [[(q.config, q.vgpus, q.throughput_rps) for q in pipes]])
                plan = extract(x, v, [self.specs[m]])[0]
            plans.append(plan)
        self.found = plans


def _box_cuts(known: list[np.ndarray], lo: np.ndarray, hi: np.ndarray, unique: bool = True) -> list[np.ndarray]:
    """Per model, the known GPU vectors that fit its box [lo, hi] once padded with idle GPUs
    up to lo (``unique``: each once, sorted; else as they come, which is cheaper)."""
    cuts = []
    for m, K in enumerate(known):
        P = np.maximum(K, lo[m]) if len(K) else K
        P = P[(P <= hi[m]).all(axis=1)] if len(P) else P
        cuts.append(np.unique(P, axis=0) if unique and len(P) else P)
    return cuts


def _branching(cuts, weights, lo, hi, known, N, mu):
    """(model, type, cut) splitting the LP's mix of plans, or None if every model's mix is one plan.

    Candidates: per model whose mix holds several plans, each type on which its mixed GPU
    count is fractional (cut below it) or its plans differ (cut between them). Each is
    scored by the smaller Kelley value of its two boxes over the known plans (strong
    branching): the split whose weaker box comes closest to a refutation wins. Measured on
    the 4-type case at incumbent + 0.1 % (price bound alone, against the most fractional
    count): G4 15.1 -> 5.4 s (24 -> 6 solves), G1 9.1 -> 7.0 s, G3 11.5 -> 12.1 s.
    """
    cands = []
    for m, (c, w) in enumerate(zip(cuts, weights)):
        used = c[w > 1e-9]
        if len(used) < 2:
            continue
        mean = w @ c
        for k in range(c.shape[1]):
            at = set()
            if abs(mean[k] - np.round(mean[k])) > 1e-6:
                at.add(float(np.floor(mean[k])))
            if used[:, k].max() > used[:, k].min():
                at.add(float(np.floor((used[:, k].max() + used[:, k].min()) / 2)))
            cands += [(m, k, cut) for cut in sorted(at) if lo[m, k] <= cut < hi[m, k]]
    if len(cands) <= 1:
        return cands[0] if cands else None
    best, score = cands[0], -np.inf
    for m, k, cut in cands:
        below, above = hi.copy(), lo.copy()
        below[m, k], above[m, k] = cut, cut + 1
        s = min(_box_value(known, lo, below, N, mu), _box_value(known, above, hi, N, mu))
        if s > score:
            best, score = (m, k, cut), s
    return best


STRONG_CUTS = 64  # per model, the known plans (cheapest at the node's price) that score a box


def _box_value(known, lo, hi, N, mu) -> float:
    """Kelley's value over the known plans in a box (inf where a model has none): a score only,
    so each model keeps its STRONG_CUTS cheapest plans at the node's price ``mu``."""
    cuts = _box_cuts(known, lo, hi, unique=False)
    if any(len(P) == 0 for P in cuts):
        return np.inf
    cheapest = [P[np.argpartition(P @ mu, STRONG_CUTS)[:STRONG_CUTS]] if len(P) > STRONG_CUTS else P for P in cuts]
    return kelley_lp(N, cheapest)[0]


class _Tree:
    """The open boxes of one search, shared by its workers (:meth:`PriceBound.refutes`):
    a stack (depth first), the boxes being bounded, and the outcome. ``result`` is True once
    every box is refuted, False once one is not (or a worker failed, ``error``, or
    ``MAX_NODES`` boxes were taken)."""

    def __init__(self, root: tuple[np.ndarray, np.ndarray]):
        self._stack = [root]
        self._busy = 0
        self._taken = 0
        self.result: bool | None = None
        self.error: BaseException | None = None
        self._cv = threading.Condition()

    def take(self) -> tuple[np.ndarray, np.ndarray] | None:
        """The next box (lo, hi), or None once the search is over: waits while the stack is
        empty and another worker may still push a box's children."""
        with self._cv:
            while not self._stack and self._busy and self.result is None:
                self._cv.wait()
            if self.result is not None:
                return None
            if not self._stack:
                self.result = True  # every box refuted
            elif self._taken >= MAX_NODES:
                self.result = False
            if self.result is not None:
                self._cv.notify_all()
                return None
            self._taken += 1
            self._busy += 1
            return self._stack.pop()

    def done(self, lo: np.ndarray, hi: np.ndarray, branch) -> None:
        """Record a box's outcome (:meth:`PriceBound._node`): refuted, not proven, or split."""
        with self._cv:
            self._busy -= 1
            if branch is False:
                self.result = False
            elif branch is not None and self.result is None:
                m, k, cut = branch
                below, above = hi.copy(), lo.copy()
                below[m, k], above[m, k] = cut, cut + 1
                self._stack += [(lo, below), (above, hi)]
            self._cv.notify_all()

    def fail(self, error: BaseException) -> None:
        """A worker's error ends the search (raised again in the caller's thread)."""
        with self._cv:
            self.error = self.error or error
            self.result = False
            self._cv.notify_all()

    def stopped(self) -> bool:
        """Whether the search has ended without a proof (a solve in progress may stop)."""
        return self.result is False
