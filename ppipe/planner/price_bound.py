r"""The price bound: the Lagrangian bound of :mod:`ppipe.planner.bounds` with an exact subproblem.

For GPU prices ``mu >= 0`` and a level ``T`` of the max-min objective, every plan with
``z >= T`` satisfies::

    sum_m P_m(mu, T w_m) <= mu . N,
    P_m(mu, t) = min { mu . u_m : model m alone reaches throughput t on GPU vector u_m },

because under the paper's GPU rule each model uses its own integer GPU vector u_m and
``sum_m u_m <= N``. ``P_m`` is the planner's MILP for model m alone (same configurations,
rows and GPU rule) with the objective "fewest priced GPUs" and the row ``x_m >= t``, solved
by HiGHS; its dual bound is what counts, so a stopped solve still gives a valid bound. A
price with ``sum_m P_m > mu . N`` refutes ``T``. Unlike the cover bound this sees that
pools round up to whole GPUs per (slot, type) and that a template takes one configuration.

Prices: Kelley's cutting planes on the dual function. The cuts are the GPU vectors of
known plans of each model (``P_m(mu) <= mu . u`` for each): first the split search's
restriction (:mod:`ppipe.planner.split_search`, whose tables L_m list them), then every
exact solve's plan. Kelley's LP over the known plans is an upper bound on the dual: where
it cannot refute ``T`` with the plans known, the search does not solve at all.

Branch and bound over the models' GPU vectors: a box ``lo_m <= u_m <= hi_m`` is bounded
as above with each solve's GPU columns bounded to it and known plans padded with idle GPUs
up to ``lo``. Where Kelley's LP says no price can refute the box, its optimal mix of
plans is split on one model's count of one GPU type (:func:`_branching`); a box whose mix
is one plan per model, or a new plan that completes a combination of known plans that
fits ``N``, shows that ``T`` is reachable: the search stops and leaves that plan in
``found`` for the planner to hand to HiGHS as a better incumbent.

Determinism: the search takes :data:`BATCH` boxes at a time from a depth-first stack;
each box is bounded from a copy of what the search knew when the batch began, and the
batch's results (new plans, work counts, children) are merged in box order. The outcome
therefore does not depend on :data:`WORKERS` (the threads that run a batch) nor on their
timing. The wall clock only stops a search (``deadline``), which then proves nothing.
"""

from __future__ import annotations

import os
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import numpy as np

from ppipe.planner.bounds import kelley_lp
from ppipe.planner.configs import ConfigSet, ModelSpec
from ppipe.planner.formulation import build, extract, pipeline_columns
from ppipe.planner.solvers import HIGHS_MIP_OPTIONS, HighsSolver, time_left
from ppipe.planner.split_search import minimal_points, restricted_pipelines
from ppipe.spec.cluster import ClusterSpec
from ppipe.spec.plan import ModelPlan

MAX_ITERATIONS = 30  # rounds of exact solves (one per price) in one search
MAX_NODES = 200  # boxes in one search
PRICE_SCALE = 1000.0  # mu . N: keeps each P_m well above 1, where HiGHS's relative gap is exact
SOLVE_GAP = 1e-7  # relative gap of each subproblem solve (its dual bound is what counts)
# A solve prunes from the start what is priced this share above the best known plan of
# its box (HiGHS's objective_bound), as if it held that plan as its incumbent.
CUTOFF_SLACK = 1e-6
_REL_TOL = 1e-6  # a proof needs the priced demand to exceed the priced capacity by this share
# Presolve pays on the single-model subproblems (unlike on the planner's MILP). A looser
# MIP feasibility tolerance can only weaken a bound (more points count as plans, so the
# minimum is lower), never make it claim too much.
SUBPROBLEM_OPTIONS: dict[str, object] = {"presolve": "on", "mip_feasibility_tolerance": 1e-5}
BATCH = 2  # boxes bounded from the same knowledge, then merged in order (part of the search's definition)
WORKERS = 2  # threads that bound a batch's boxes (HiGHS releases the GIL); never changes the outcome


def _past(deadline: float | None) -> bool:
    return deadline is not None and time.perf_counter() > deadline


@dataclass
class _Knowledge:
    """What a search has learned: per model the GPU vectors of its known plans (``known``),
    the exact solves' (vector, plan) pairs (``exact``), the grid cells a known plan fits
    (``reach``, upward closed), the simplex work of its last solve (``work``, NaN: not
    solved), plus the rounds of exact solves left and the solve counters.

    Each box of a batch works on its own copy; :meth:`merge` adds what a box learned."""

    known: list[np.ndarray]
    exact: list[list[tuple[np.ndarray, ModelPlan]]]
    reach: list[np.ndarray]
    work: np.ndarray
    rounds_left: int
    work_log: list[tuple[int, float, bool]] = field(default_factory=list)
    solves: int = 0
    found: list[ModelPlan] | None = None

    def copy(self) -> "_Knowledge":
        return _Knowledge(
            known=list(self.known),
            exact=[list(e) for e in self.exact],
            reach=[r.copy() for r in self.reach],
            work=self.work.copy(),
            rounds_left=self.rounds_left,
            work_log=list(self.work_log),
            solves=self.solves,
        )

    def note_work(self, m: int, work: float, finished: bool) -> None:
        """Record a solve's simplex iterations; one stopped early at its target measured
        only part of a proof, so it can raise the model's work but not lower it."""
        old = self.work[m]
        self.work[m] = work if finished or not np.isfinite(old) else max(work, old)
        self.work_log.append((m, work, finished))

    def merge(self, box: "_Knowledge", base: "_Knowledge") -> None:
        """Add what ``box`` learned since ``base`` (the copy it started from)."""
        for m in range(len(self.known)):
            new = box.known[m][len(base.known[m]) :]
            if len(new):
                self.known[m] = np.vstack([self.known[m], new]) if len(self.known[m]) else new
            self.exact[m] += box.exact[m][len(base.exact[m]) :]
            self.reach[m] |= box.reach[m]
        for m, work, finished in box.work_log[len(base.work_log) :]:
            self.note_work(m, work, finished)
        self.rounds_left -= base.rounds_left - box.rounds_left
        self.solves += box.solves - base.solves


class PriceBound:
    """The price bound for one max-min planning problem (see the module docstring).

    Args:
        specs: the models (their weights are w_m).
        configs: per model, its configurations (the MILP's columns).
        cluster: the cluster (N_k and the GPU rule's data).
        build_kw: the keyword arguments the planner gave
            :func:`ppipe.planner.formulation.build` (GPU rule, one configuration per template).
        tables: per model, the split search's L_m on the GPU grid
            (:attr:`ppipe.planner.split_search.SplitPlan.tables`), the first known plans.
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
        self.nodes = 0
        # Per model, the simplex work of its last solve, kept across levels: a round solves
        # the quick models first (see _quickest_first).
        self.work = np.full(len(configs), np.nan)
        self.found: list[ModelPlan] | None = None
        self.workers = max(1, min(WORKERS, BATCH, os.cpu_count() or 1))

    def _subproblems(self, T: float) -> list:
        """Per model, (its MILP alone with ``x_m >= T w_m``, its variables, m)."""
        out = []
        for spec, cs in zip(self.specs, self.configs):
            t = T * spec.weight
            # No pipeline needs more than t: the cap only removes pools no cheapest plan has.
            milp, v = build([spec], [cs], self.cluster, rate_cap=[t], **self.build_kw)
            milp.add_row({v.x_model[spec.name]: 1.0}, lb=t, name="price_bound_rate")
            out.append((milp, v, len(out)))
        return out

    def knowledge(self, T: float, max_rounds: int = MAX_ITERATIONS) -> _Knowledge:
        """What a search for level ``T`` starts from: the restriction's minimal plans that
        reach ``T w_m`` (plans of an earlier level may not reach this one) and the work
        measured so far."""
        reach = [t >= np.float32(T * s.weight) for t, s in zip(self.tables, self.specs)]
        return _Knowledge(
            known=[minimal_points(r).astype(float) for r in reach],
            exact=[[] for _ in self.specs],
            reach=reach,
            work=self.work.copy(),
            rounds_left=max_rounds,
        )

    def refutes(self, T: float, deadline: float | None = None, max_rounds: int = MAX_ITERATIONS) -> bool:
        """True if it is proven that no plan reaches objective ``T`` (False: not proven).

        Args:
            T: the level to refute.
            deadline: ``time.perf_counter()`` value after which the search gives up.
            max_rounds: most rounds of exact solves (one per price) over the whole search.
        """
        M, K = len(self.specs), self.N.size
        know = self.knowledge(T, max_rounds)
        self.found = None
        stack = [(np.zeros((M, K)), np.tile(self.N, (M, 1)))]
        subs: list[list | None] = [None] * BATCH  # per batch slot: its own subproblem MILPs
        taken = 0
        pool = ThreadPoolExecutor(self.workers, thread_name_prefix="price-bound") if self.workers > 1 else None
        try:
            while stack:
                if taken >= MAX_NODES:
                    return False
                batch = [stack.pop() for _ in range(min(BATCH, len(stack), MAX_NODES - taken))]
                taken += len(batch)
                for i, (lo, _) in enumerate(batch):
                    if subs[i] is None and not (lo.sum(axis=0) > self.N).any():
                        subs[i] = self._subproblems(T)
                outcomes = self._bound_batch(pool, batch, know, subs, deadline)
                base = know.copy()
                for (lo, hi), (branch, learned) in zip(batch, outcomes):
                    know.merge(learned, base)
                    self.nodes += 1
                    if branch is False:
                        self.found = learned.found
                        return False
                    if branch is not None:
                        m, k, cut = branch
                        below, above = hi.copy(), lo.copy()
                        below[m, k], above[m, k] = cut, cut + 1
                        stack += [(lo, below), (above, hi)]
            return True
        finally:
            if pool is not None:
                pool.shutdown(wait=True)
            self.work = know.work
            self.solves += know.solves

    def _bound_batch(self, pool, batch, know: _Knowledge, subs, deadline) -> list[tuple[object, _Knowledge]]:
        """Per box of ``batch``, (its outcome, its copy of ``know`` with what it learned).

        Outcome: None (refuted), False (not proven: the search ends) or a branch (m, k, cut).
        Once a box is not proven, the boxes after it are told to stop: their outcomes are
        never read, so the interrupted solves change nothing.
        """
        stops = [threading.Event() for _ in batch]
        copies = [know.copy() for _ in batch]

        def run(i: int):
            lo, hi = batch[i]
            if (lo.sum(axis=0) > self.N).any():
                return None  # the boxes' least GPUs do not fit the cluster
            out = self._bound_box(copies[i], lo, hi, subs[i], deadline, stops[i].is_set)
            if out is False:
                for s in stops[i + 1 :]:
                    s.set()
            return out

        if pool is None:
            outcomes = [run(i) for i in range(len(batch))]
        else:
            futures = [pool.submit(run, i) for i in range(len(batch))]
            try:
                outcomes = [f.result() for f in futures]
            except BaseException:  # e.g. Ctrl-C while waiting: the other solves stop too
                for s in stops:
                    s.set()
                raise
        return list(zip(outcomes, copies))

    def _bound_box(self, know: _Knowledge, lo, hi, subs, deadline, stopped):
        """None if ``T`` is refuted in the box [lo, hi], False if not proven (give up), else a branch (m, k, cut)."""
        M = len(self.specs)
        while True:
            if stopped() or _past(deadline):
                return False
            cuts = _box_cuts(know.known, lo, hi)
            empty = [m for m in range(M) if len(cuts[m]) == 0]
            if empty:
                # No known plan in a box: one exact solve at uniform prices proves it holds
                # none, or gives the first.
                m = empty[0]
                uniform = PRICE_SCALE / (len(self.N) * self.N)
                lb, u = self._solve_model(know, subs[m], uniform, deadline, (lo[m], hi[m]), stopped=stopped)
                if lb is not None and not np.isfinite(lb):
                    return None
                if u is None or self._add_plan(know, m, u, subs):
                    return False
                continue
            value, x, weights = kelley_lp(self.N, [list(c) for c in cuts], weights=True)
            if x is None:
                return False
            if value <= 1.0 + _REL_TOL:
                branch = _branching(cuts, weights, lo, hi, know.known, self.N, np.maximum(x[: self.N.size], 0.0))
                if branch is None:  # the mix is one plan per model: together they reach T
                    self._record_found(know, [cuts[m][int(np.argmax(weights[m]))] for m in range(M)], subs)
                return branch or False
            if know.rounds_left <= 0:
                return False
            know.rounds_left -= 1
            proof = self._round(know, lo, hi, subs, np.maximum(x[: self.N.size], 0.0) * PRICE_SCALE, cuts, deadline, stopped)
            if proof is not True:
                return proof  # None: refuted; False: give up

    def _round(self, know: _Knowledge, lo, hi, subs, mu, cuts, deadline, stopped):
        """One round of exact solves at prices ``mu``: None if they refute the box, False
        to give up, True to go on with the next price (the new plans are new cuts).

        The cuts price each model's cheapest known plan: ``best_m >= P_m(mu)``. The round
        refutes the box if the solves' lower bounds sum above ``need``; it cannot once a
        model has a plan cheaper than need minus what the others can give at most, so each
        solve stops at such a plan, and the round at the first that falls short.
        """
        need = float(mu @ self.N) * (1.0 + _REL_TOL)
        best = np.array([float(np.min(c @ mu)) for c in cuts])
        order = _quickest_first(know.work, self.configs)
        for m in order:
            target = need - (best.sum() - best[m])
            # The last solve refutes the box as soon as P_m > target: a bound just above the
            # target is enough.
            enough = target + 2 * CUTOFF_SLACK * max(1.0, abs(target)) if m == order[-1] else np.inf
            lb, u = self._solve_model(
                know, subs[m], mu, deadline, (lo[m], hi[m]), target=target, known=best[m], enough=enough, stopped=stopped
            )
            if lb is None:
                return False  # a solve without a plan in time: no proof, and no cut to steer by
            if not np.isfinite(lb):
                return None
            if u is not None and self._add_plan(know, m, u, subs):
                return False
            best[m] = lb
            if best.sum() <= need:
                return True  # this price cannot refute the box: on to the next, with the new cut
        return None

    def _solve_model(
        self,
        know: _Knowledge,
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
        ``stopped() -> bool``, if given, interrupts the solve once True: it then proves only
        what a time-limited solve does.
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
        try:
            res = HighsSolver(options).solve(milp, time_limit_s=time_left(deadline), gap=SOLVE_GAP, stop=stopped)
        except Exception:  # noqa: BLE001 - a subproblem without a plan in time proves nothing
            return None, None
        finally:
            milp.set_col_bounds(cols, 0.0, self.N)
            know.solves += 1
        know.note_work(m, max(res.lp_iterations, 1), res.status in ("optimal", "infeasible"))
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
        know.exact[m].append((u, extract(res.x, v, [self.specs[m]])[0]))
        return lb, u

    def _add_plan(self, know: _Knowledge, m: int, u: np.ndarray, subs: list) -> bool:
        """Add model m's new plan (GPU vector u) to ``know``; True where known plans now
        reach T together (their plans are then in ``know.found``)."""
        know.known[m] = np.vstack([know.known[m], u]) if len(know.known[m]) else u[None, :]
        vectors = _fitting_combination(know.reach, self.N, m, u)
        if vectors is not None:
            self._record_found(know, vectors, subs)
        return vectors is not None

    def _record_found(self, know: _Knowledge, vectors: list[np.ndarray], subs: list) -> None:
        """Put in ``know.found`` a plan of each model within its GPU vector in ``vectors``
        (each holds a known plan: an exact solve's, else the restriction's, from its table)."""
        plans = []
        for m, r in enumerate(vectors):
            r = np.asarray(r, dtype=np.int64)
            plan = next((p for u, p in know.exact[m] if (u <= r).all()), None)
            if plan is None:
                cs, (milp, v, _) = self.configs[m], subs[m]
                pipes = restricted_pipelines(cs, self.N.astype(np.int64), r, bool(self.build_kw.get("one_config_per_template")))
                x = pipeline_columns(v, milp.num_cols, [[(q.config, q.vgpus, q.throughput_rps) for q in pipes]])
                plan = extract(x, v, [self.specs[m]])[0]
            plans.append(plan)
        know.found = plans


def _quickest_first(work: np.ndarray, configs: list[ConfigSet]) -> np.ndarray:
    """The models of a round, quickest first, so that one that falls short ends the round
    before the slow ones run: by the simplex work of their last solve (unlike the clock,
    the same in every run); a model not solved yet counts as its configurations times the
    solved models' median work per configuration (before any solve: by size)."""
    size = np.array([len(cs) for cs in configs], dtype=float)
    seen = np.isfinite(work)
    per_config = float(np.median(work[seen] / np.maximum(size[seen], 1.0))) if seen.any() else 1.0
    return np.argsort(np.where(seen, work, size * per_config), kind="stable")


def _fitting_combination(reach: list[np.ndarray], N: np.ndarray, m: int, u: np.ndarray) -> list[np.ndarray] | None:
    """Record model m's new plan (GPU vector u) in ``reach``; if known plans now reach T
    together, per model a GPU vector that holds one of them (their sum fits N), else None.

    A combination that fits and was not there before has u in it: checked as u with one
    known plan of each other model (for up to three models; beyond, the search finds out
    by branching).
    """
    ui = u.astype(np.int64)
    reach[m][tuple(slice(int(a), None) for a in ui)] = True
    rest = N.astype(np.int64) - ui
    others = [j for j in range(len(reach)) if j != m]
    if (rest < 0).any() or len(others) > 2:
        return None
    vectors = {m: ui}
    if len(others) == 1:
        if not reach[others[0]][tuple(rest)]:
            return None
        vectors[others[0]] = rest
    elif others:
        a = minimal_points(reach[others[0]])
        a = a[(a <= rest).all(axis=1)]
        hit = np.nonzero(reach[others[1]][tuple((rest - a).T)])[0] if a.size else []
        if len(hit) == 0:
            return None
        vectors[others[0]], vectors[others[1]] = a[hit[0]], rest - a[hit[0]]
    return [vectors[j] for j in range(len(reach))]


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
    branching): the split whose weaker box comes closest to a refutation wins.
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
