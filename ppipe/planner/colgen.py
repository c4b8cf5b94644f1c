r"""Columns on demand: the max-min plan under physical packing by column generation.

Why. At fleet scale (1,000 GPUs of six types, ten models, three partitions) the MILP of
:mod:`ppipe.planner.formulation` over every kept configuration has over 100,000 columns;
HiGHS then spends minutes without even a bound. Its LP relaxation, though, depends on a
configuration only through one vector per configuration, and at its optimum uses a few
configurations per model. This module finds those by pricing against the LP's duals, so
that only a few hundred columns ever enter an LP or a MILP.

Sets and parameters (as in :mod:`ppipe.planner.formulation`)
    K, N_k      GPU types and their counts.
    M, w_m      models and weights.
    C_m         the configurations of model m (:func:`~ppipe.planner.configs.enumerate_configs`).
    a_{c,k}     = sum_{d: k_{c,d} = k} 1 / (v_{c,d} X_{c,d}): GPUs of type k that one req/s
                of c's pipeline occupies (a slot at level v with per-vGPU rate X needs
                1 / X vGPUs per req/s, i.e. 1 / (v X) GPUs).

Master LP over column sets S_m subset of C_m
    maximize z
    (3)   w_m z - sum_{c in S_m} x_c <= 0                 for every model m   (dual alpha_m >= 0)
    (2')  sum_m sum_{c in S_m} a_{c,k} x_c <= N_k         for every type k    (dual mu_k >= 0)
          x_c >= 0
    With S_m = C_m this is the LP relaxation of the whole MILP: with g and P continuous,
    rows (4) and (2a) are met at least cost by g_{c,d} = x_c / X_{c,d} and
    P_{k,v} = sum g / v, and the pool bounds U_{c,d} >= x_max,c / X_{c,d} never cut that.
    The dominance pruning of :mod:`ppipe.planner.configs` only drops configurations with a
    cost vector a no smaller in any component, so it leaves this LP's value unchanged too.

Pricing. A column c of model m raises the master's value iff its reduced cost
alpha_m - mu . a_c is positive; per model the pool's cost vectors are one (C_m, K)
array, so a round prices every configuration by one matrix-vector product and adds the
:data:`PRICE_COLUMNS` best. Generation ends when no configuration of any model prices
positive (relative tolerance :data:`PRICE_TOL`).

Bound (Farley's, valid at every round). For any mu >= 0, a plan of value z gives model m
at least z w_m req/s, each costing at least pi_m(mu) = min_{c in C_m} mu . a_c GPUs at
prices mu, within mu . N in all; hence

    z <= mu . N / sum_m w_m pi_m(mu).

The smallest value over the rounds bounds the MILP's optimum even where the clock stops
the generation; at convergence it equals the master's value (strong duality).

Integer plan. The MILP of :mod:`ppipe.planner.formulation` over some of the generated
columns, a restriction of the whole MILP (so each of its plans is one of the whole
MILP's), in two steps that stop at the same point on every machine (node limits, never the
clock): first over the configurations of the master's solution and, per model,
:data:`SUPPORT_NEAR_COLUMNS` more of largest reduced cost (a few dozen columns, whose root
HiGHS solves in a fraction of a second), to the gap or :data:`SUPPORT_MAX_NODES` nodes;
where that plan is not proven within the gap by the bound above, then over every
generated column, to the gap or :data:`RESTRICTED_MAX_NODES` nodes, and the better of
the two plans is the result (the second solve starts as if the first had not run, so the
first can only add a plan). Each starts from the better of a rounding of the master's
solution (:func:`rounded_start`) and the served plan of a warm start. The gap is reported against the bound above: status ``optimal``
when it is within the requested one, ``feasible`` when the node limit or the restriction
leaves more, ``time_limit`` when the clock stopped the generation or a solve. The gap measures the
plan against the LP relaxation of every configuration, so it also holds the granularity of
integer pools (about one vGPU of a bottleneck pool per model), which no plan can close.

Warm start (a re-plan from a served plan). The generation runs as for a cold plan (it
takes milliseconds); the served plan's configurations that are still in the pool join the
generated ones in the restricted MILP, which so holds every plan of the cold restricted
MILP and the served plan too; the served plan (headroom taken off) is the solver's start
where it is a plan of that MILP and better than the rounding. The same served plan and
inputs give the same plan.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass

import numpy as np

from ppipe.errors import SolverError
from ppipe.planner.configs import ConfigSet, ModelSpec, subset
from ppipe.planner.formulation import PlanVariables, build, extract, pipeline_columns, solution_vector
from ppipe.planner.highs_util import new_highs
from ppipe.planner.objectives import MaxMinNormalized
from ppipe.planner.solvers import HighsSolver, SolveResult, Solver, SolverTimeLimitError, time_left
from ppipe.spec.cluster import ClusterSpec
from ppipe.spec.plan import ModelPlan

# Where the whole MILP would have more g and x_c columns than this, the planner generates
# its columns instead (every case of scripts/bench_planner.py has at most 2,269).
CG_MIN_COLUMNS = 5_000
PRICE_COLUMNS = 5  # columns added per model and round: the best by reduced cost
PRICE_TOL = 1e-7  # a column enters only where alpha_m - mu . a_c > PRICE_TOL * alpha_m
MAX_ROUNDS = 500  # pricing rounds at most (the fleet case converges in under ten)
RESTRICTED_MAX_NODES = 2_000  # branch-and-bound nodes of the restricted MILP at most
# The first, small restricted MILP: the LP solution's configurations and, per model, this
# many more generated ones of largest reduced cost (see "Integer plan" above).
SUPPORT_NEAR_COLUMNS = 1
SUPPORT_MAX_NODES = 50
# HiGHS's RINS sub-MIPs on the restricted MILP: on the 1,000-GPU case (scripts/bench_fleet.py)
# 2,000 nodes reach a 0.57 % gap with them and 0.73 % without (8,000 nodes without: 0.59 %).
RESTRICTED_HIGHS_OPTIONS: dict[str, object] = {"mip_heuristic_run_rins": True}
_BISECTION_STEPS = 50


def lp_costs(cs: ConfigSet, num_types: int) -> np.ndarray:
    """a_{c,k} of every configuration of ``cs``: GPUs of type k per req/s, shape (C, K)."""
    a = np.zeros((len(cs), num_types))
    for d in range(cs.gpu.shape[1]):
        used = np.nonzero(cs.gpu[:, d] >= 0)[0]
        np.add.at(a, (used, cs.gpu[used, d]), 1.0 / (cs.level[used, d] * cs.X[used, d]))
    return a


def pool_columns(configs: list[ConfigSet]) -> int:
    """The g_{c,d} and x_c columns the whole MILP would have over ``configs``."""
    return int(sum((cs.gpu >= 0).sum() + (cs.nparts >= 2).sum() for cs in configs))


class _MasterLp:
    """The master LP in HiGHS, grown one column at a time (each solve starts from the last basis)."""

    def __init__(self, weights: np.ndarray, counts: np.ndarray):
        import highspy

        self.M, self.K = len(weights), len(counts)
        self.h = new_highs()
        inf = highspy.kHighsInf
        self.h.addVars(1, np.zeros(1), np.full(1, inf))  # z
        self.h.changeColsCost(1, np.zeros(1, np.int32), np.ones(1))
        self.h.changeObjectiveSense(highspy.ObjSense.kMaximize)
        M, K = self.M, self.K
        self.h.addRows(M, np.full(M, -inf), np.zeros(M), M, np.arange(M, dtype=np.int32), np.zeros(M, np.int32),
                       np.asarray(weights, float))  # (3)
        self.h.addRows(K, np.full(K, -inf), np.asarray(counts, float), 0, np.zeros(K, np.int32),
                       np.zeros(0, np.int32), np.zeros(0))  # (2')
        self.owner: list[tuple[int, int]] = []  # per x column: (model, configuration)

    def add(self, m: int, c: int, a: np.ndarray) -> None:
        nz = np.nonzero(a)[0]
        idx = np.r_[m, self.M + nz].astype(np.int32)
        self.h.addCol(0.0, 0.0, np.inf, idx.size, idx, np.r_[-1.0, a[nz]])
        self.owner.append((m, c))

    def solve(self) -> tuple[float, np.ndarray, np.ndarray, np.ndarray]:
        """(z, x per added column, alpha, mu) at the master's optimum."""
        import highspy

        self.h.run()
        if self.h.getModelStatus() != highspy.HighsModelStatus.kOptimal:
            # Every master is feasible (z = 0) and bounded (each x_c uses GPUs): a solver fault.
            raise SolverError(f"HiGHS: the column-generation master LP ended as '{self.h.modelStatusToString(self.h.getModelStatus())}'")
        sol = self.h.getSolution()
        dual = np.maximum(np.array(sol.row_dual), 0.0)  # >= 0 for rows <= of a maximization
        return float(self.h.getInfo().objective_function_value), np.array(sol.col_value)[1:], dual[: self.M], dual[self.M :]


@dataclass(frozen=True)
class Generated:
    """What column generation found.

    Attributes:
        columns: per model, the generated configurations (indices into its ConfigSet, ascending).
        flows: per model, the master's x_c of those columns at its last solve.
        value: the master's last value (the LP relaxation's where ``converged``).
        bound: the smallest Farley bound of the rounds, >= the whole MILP's optimum.
        rounds: master solves.
        converged: no configuration priced positive at the end.
        timed_out: the deadline stopped the generation.
        alpha: the master's duals of rows (3) at its last solve, per model.
        mu: the master's duals of rows (2'), GPU prices per type.
    """

    columns: list[np.ndarray]
    flows: list[np.ndarray]
    value: float
    bound: float
    rounds: int
    converged: bool
    timed_out: bool = False
    alpha: np.ndarray | None = None
    mu: np.ndarray | None = None


def generate_columns(configs: list[ConfigSet], weights, counts, *, deadline: float | None = None) -> Generated:
    """Column generation for the master LP over ``configs`` (see the module docstring).

    Args:
        configs: per model, the pool of configurations that pricing scans.
        weights: w_m per model.
        counts: N_k per GPU type (cluster order).
        deadline: ``time.perf_counter()`` value after which no round starts (None: none).

    The master starts from each model's PRICE_COLUMNS cheapest configurations at prices
    1 / N_k.
    """
    w, N = np.asarray(weights, float), np.asarray(counts, float)
    costs = [lp_costs(cs, N.size) for cs in configs]
    master = _MasterLp(w, N)
    chosen: list[set[int]] = [set() for _ in configs]
    mu0 = np.where(N > 0, 1.0 / np.maximum(N, 1.0), 0.0)
    for m, a in enumerate(costs):
        for c in (int(c) for c in np.argsort(a @ mu0, kind="stable")[:PRICE_COLUMNS]):
            if c not in chosen[m]:
                chosen[m].add(c)
                master.add(m, c, a[c])
    bound, rounds, converged, timed_out = math.inf, 0, False, False
    while True:
        z, x, alpha, mu = master.solve()
        rounds += 1
        priced = [a @ mu for a in costs]
        bound = min(bound, _farley_bound(mu, N, w, priced))
        added = _price(costs, priced, alpha, chosen, master)
        if not added:
            converged = True
            break
        if rounds >= MAX_ROUNDS:
            break
        if deadline is not None and time.perf_counter() >= deadline:
            timed_out = True
            break
    if not converged:
        z, x, alpha, mu = master.solve()
    flows = _flows(master.owner, x, len(configs))
    columns = [np.array(sorted(s), dtype=int) for s in chosen]
    ordered = [np.array([flows[m].get(int(c), 0.0) for c in columns[m]]) for m in range(len(configs))]
    return Generated(columns, ordered, z, max(bound, z), rounds, converged, timed_out, alpha, mu)


def relaxation_rates(configs: list[ConfigSet], weights, counts) -> list[float] | None:
    """Per model, its throughput sum_c x_c in an optimal solution of the master LP over
    every configuration of ``configs``, i.e. of the LP relaxation of their max-min MILP
    (see the module docstring); None where the generation did not converge."""
    gen = generate_columns(configs, weights, counts)
    return [float(f.sum()) for f in gen.flows] if gen.converged else None


def _farley_bound(mu: np.ndarray, counts: np.ndarray, weights: np.ndarray, priced: list[np.ndarray]) -> float:
    """mu . N / sum_m w_m min_c mu . a_c: an upper bound on every plan's value (inf where uninformative)."""
    need = float(sum(wm * (p.min() if p.size else math.inf) for wm, p in zip(weights, priced)))
    return float(mu @ counts) / need if need > 0 else math.inf


def _price(costs, priced, alpha, chosen: list[set[int]], master: _MasterLp) -> int:
    """Add per model up to PRICE_COLUMNS new configurations of largest positive reduced
    cost alpha_m - mu . a_c (ties in pool order); returns how many were added."""
    added = 0
    for m, (a, p) in enumerate(zip(costs, priced)):
        rc = alpha[m] - p
        here = 0
        for c in np.argsort(-rc, kind="stable"):
            if here >= PRICE_COLUMNS or rc[c] <= PRICE_TOL * max(alpha[m], 1e-12):
                break
            if int(c) not in chosen[m]:
                chosen[m].add(int(c))
                master.add(m, int(c), a[c])
                here += 1
        added += here
    return added


def _flows(owner: list[tuple[int, int]], x: np.ndarray, num_models: int) -> list[dict[int, float]]:
    out: list[dict[int, float]] = [{} for _ in range(num_models)]
    for (m, c), v in zip(owner, x):
        out[m][c] = out[m].get(c, 0.0) + float(v)
    return out


def rounded_start(configs: list[ConfigSet], flows: list[np.ndarray], counts) -> list[list[tuple[int, list[int], float]]]:
    """Integer pipelines from the master's solution: every pipeline scaled by the largest
    common theta in [0, 1] whose rounded-up pools fit the GPUs.

    With t_c = theta x_c, pool d gets g_{c,d} = ceil(t_c / X_{c,d}) vGPUs, so the pipeline
    carries at least t_c; the pools grow with theta, so bisection finds the largest theta
    that meets (2a) (sum_v ceil(vGPUs at (k, v) / v) <= N_k). Returns, per model,
    (configuration, vGPUs per slot, throughput) of the pipelines that get every pool.
    """
    N = np.asarray(counts, float)

    def pools(theta: float):
        out = []
        for cs, x in zip(configs, flows):
            n = cs.nparts
            with np.errstate(divide="ignore", invalid="ignore"):
                g = np.where(cs.gpu >= 0, np.ceil(theta * x[:, None] / np.where(cs.gpu >= 0, cs.X, 1.0) - 1e-9), 0.0)
            out.append(np.where(np.arange(cs.gpu.shape[1])[None, :] < n[:, None], np.maximum(g, 0.0), 0.0))
        return out

    def fits(theta: float) -> bool:
        use: dict[tuple[int, int], float] = {}
        for cs, g in zip(configs, pools(theta)):
            for c, d in zip(*np.nonzero(g > 0)):
                key = (int(cs.gpu[c, d]), int(cs.level[c, d]))
                use[key] = use.get(key, 0.0) + g[c, d]
        per_type = np.zeros(N.size)
        for (k, v), n in use.items():
            per_type[k] += math.ceil(n / v - 1e-9)
        return bool((per_type <= N + 1e-9).all())

    lo, hi = 0.0, 1.0
    if fits(hi):
        lo = hi
    else:
        for _ in range(_BISECTION_STEPS):
            mid = 0.5 * (lo + hi)
            lo, hi = (mid, hi) if fits(mid) else (lo, mid)
    chosen = []
    for cs, g in zip(configs, pools(lo)):
        pipes = []
        for c in range(len(cs)):
            n = int(cs.nparts[c])
            if (g[c, :n] >= 1).all():
                # x_c's bound: what the pipeline carries with every GPU of each slot's type.
                cap = float((N[cs.gpu[c, :n]] * cs.level[c, :n] * cs.X[c, :n]).min())
                pipes.append((c, [int(a) for a in g[c, :n]], min(cap, float((cs.X[c, :n] * g[c, :n]).min()))))
        chosen.append(pipes)
    return chosen


@dataclass(frozen=True)
class ColumnPlan:
    """A column-generation plan: per-model plans, the solve's result (status and gap
    against the LP bound), the restricted MILP's columns and configurations."""

    models: list[ModelPlan]
    result: SolveResult
    columns: int
    configurations: int


def column_generation_plan(specs: list[ModelSpec], configs: list[ConfigSet], cluster: ClusterSpec, solver: Solver, *,
                           deadline: float | None, gap: float, warm: list[ModelPlan] | None = None) -> ColumnPlan:
    """The max-min plan under physical packing by column generation (see the module docstring).

    Args:
        specs: the models.
        configs: per model, every kept configuration (the pool that pricing scans).
        cluster: the cluster.
        solver: the MILP backend of the restricted MILPs.
        deadline: ``time.perf_counter()`` value at which searches stop (None: none).
        gap: the requested relative gap.
        warm: a served plan of the same models: its configurations join the generated
            ones in the restricted MILPs (which then hold every plan the cold ones hold, and
            the served plan), and where it is still a plan, it is a start of the solves.

    Raises:
        SolverTimeLimitError: no plan at all before the deadline.
    """
    t0 = time.perf_counter()
    counts = np.array([cluster.gpu_counts[g.name] for g in cluster.gpu_types], dtype=float)
    gen = generate_columns(configs, [s.weight for s in specs], counts, deadline=deadline)
    served = warm_columns(configs, specs, warm) if warm else None
    small = _Restricted.solve(specs, configs, _support_columns(configs, gen, served), cluster, counts, solver, warm,
                              deadline=deadline, gap=gap, max_nodes=SUPPORT_MAX_NODES)
    out, work = small, [small.res]
    if not (small.proven(gen.bound) <= gap * (1 + 1e-9) or small.res.status == "time_limit"):
        full = _Restricted.solve(specs, configs, _with_served(gen, served), cluster, counts, solver, warm, deadline=deadline,
                                 gap=gap, max_nodes=RESTRICTED_MAX_NODES)
        work.append(full.res)
        out = full if full.res.objective >= small.res.objective else small
    res, z = out.res, float(out.res.objective)
    proven = out.proven(gen.bound)
    clocked = gen.timed_out or any(r.status == "time_limit" for r in work)
    status = "time_limit" if clocked else ("optimal" if proven <= gap * (1 + 1e-9) else "feasible")
    method = (f"column generation ({sum(len(c) for c in gen.columns)} of {sum(len(cs) for cs in configs)} configurations, "
              f"{gen.rounds} LP rounds, MILP over {out.configurations}) + LP bound")
    result = SolveResult(res.solver, status, res.x, z, proven, time.perf_counter() - t0, method=method,
                         nodes=sum(max(r.nodes, 0) for r in work), lp_iterations=sum(max(r.lp_iterations, 0) for r in work))
    return ColumnPlan(out.models, result, out.columns, out.configurations)


@dataclass(frozen=True)
class _Restricted:
    """One restricted MILP (the MILP over some configurations of each model) and its solve."""

    res: SolveResult
    models: list[ModelPlan]
    columns: int
    configurations: int

    def proven(self, bound: float) -> float:
        """Its plan's gap to ``bound`` (inf without a plan of positive value)."""
        z = float(self.res.objective)
        return max(0.0, bound / z - 1.0) if z > 0 else math.inf

    @classmethod
    def solve(cls, specs, configs, columns_flows, cluster, counts, solver, warm, *, deadline, gap, max_nodes) -> "_Restricted":
        """The MILP over ``columns_flows`` = (per model the configurations, their master
        flows), started from the better of the rounded flows and the served plan ``warm``
        (where it is a plan of this MILP), to ``gap`` or ``max_nodes`` nodes."""
        columns, flows = columns_flows
        sub = [subset(cs, cols) for cs, cols in zip(configs, columns)]
        milp, v = build(specs, sub, cluster, gpu_rule="physical")
        MaxMinNormalized().apply(milp, v)
        x0 = _best_start(milp, v, specs, sub, flows, counts, [warm] if warm else [])
        res = _restricted_solve(milp, solver, x0, deadline=deadline, gap=gap, max_nodes=max_nodes)
        return cls(res, extract(res.x, v, specs), milp.num_cols, sum(len(c) for c in sub))


def _support_columns(configs: list[ConfigSet], gen: Generated, served: list[list[int]] | None):
    """(columns, flows) of the small restricted MILP: per model the configurations of
    positive master flow and the SUPPORT_NEAR_COLUMNS other generated ones of largest
    reduced cost alpha_m - mu . a_c (ties in pool order), and the served plan's."""
    columns, flows = [], []
    for m, (cs, cols, f) in enumerate(zip(configs, gen.columns, gen.flows)):
        pick = f > 1e-9
        if gen.mu is not None and SUPPORT_NEAR_COLUMNS > 0:
            rc = gen.alpha[m] - lp_costs(subset(cs, cols), len(gen.mu)) @ gen.mu
            rest = [i for i in np.argsort(-rc, kind="stable") if not pick[i]]
            pick[rest[:SUPPORT_NEAR_COLUMNS]] = True
        columns.append(cols[pick])
        flows.append(f[pick])
    return _with_served(Generated(columns, flows, gen.value, gen.bound, gen.rounds, gen.converged), served)


def _with_served(gen: Generated, served: list[list[int]] | None) -> tuple[list[np.ndarray], list[np.ndarray]]:
    """(columns, flows) of the restricted MILP: per model the generated configurations and
    the served plan's (ascending), with the master's x_c (0 for a served one it lacks)."""
    if not served:
        return gen.columns, gen.flows
    columns, flows = [], []
    for cols, x, extra in zip(gen.columns, gen.flows, served):
        both = np.union1d(cols, np.asarray(extra, dtype=int))
        f = np.zeros(both.size)
        f[np.searchsorted(both, cols)] = x
        columns.append(both)
        flows.append(f)
    return columns, flows


def _best_start(milp, v: PlanVariables, specs, sub, flows: list[np.ndarray], counts, plans: list[list[ModelPlan]]) -> np.ndarray | None:
    """The best of the rounded master solution and ``plans`` (a served plan, an earlier
    restricted MILP's), each where it is a plan of this MILP."""
    from ppipe.planner.core import is_feasible

    cands = [pipeline_columns(v, milp.num_cols, rounded_start(sub, flows, counts))]
    for plan in plans:
        try:
            cands.append(solution_vector(_by_name(plan, specs), v, milp.num_cols))
        except ValueError:
            pass  # a pipeline's configuration is no column here (the served plan's inputs changed)
    best, best_z = None, -math.inf
    for x in cands:
        zs = min(x[v.x_model[s.name]] / s.weight for s in specs)
        x[v.extra["z"]] = zs
        if is_feasible(milp, x) and zs > best_z:
            best, best_z = x, zs
    return best


def _restricted_solve(milp, solver: Solver, start: np.ndarray | None, *, deadline, gap, max_nodes: int) -> SolveResult:
    """A restricted MILP to ``gap`` or ``max_nodes`` nodes; the start where the solver finds nothing."""
    kw = {"start": start} if start is not None and getattr(solver, "accepts_start", False) else {}
    if isinstance(solver, HighsSolver):
        solver = HighsSolver({**solver.options, **RESTRICTED_HIGHS_OPTIONS})
    try:
        res = solver.with_node_limit(max_nodes).solve(milp, time_limit_s=time_left(deadline), gap=gap, **kw)
    except SolverTimeLimitError:
        if start is None:
            raise
        return SolveResult(solver.name, "time_limit", start, milp_objective(milp, start), math.inf, 0.0)
    if start is not None and res.x is not None and milp_objective(milp, start) > res.objective + 1e-9:
        res = SolveResult(res.solver, res.status, start, milp_objective(milp, start), res.gap, res.seconds,
                          res.nodes, res.lp_iterations)
    return res


def milp_objective(milp, x: np.ndarray) -> float:
    """The objective value of column values ``x``."""
    return float(sum(coef * x[c] for c, coef in milp.objective.items()))


def warm_columns(configs: list[ConfigSet], specs: list[ModelSpec], warm: list[ModelPlan]) -> list[list[int]]:
    """Per model, the pool configurations of a served plan's pipelines (those still in the pool)."""
    from ppipe.planner.formulation import _config_of

    by_name = {m.name: m for m in warm}
    out = []
    for cs, s in zip(configs, specs):
        served = by_name.get(s.name)
        found = [_config_of(cs, p) for p in (served.pipelines if served else [])]
        out.append([c for c in found if c is not None])
    return out


def _by_name(warm: list[ModelPlan], specs: list[ModelSpec]) -> list[ModelPlan]:
    """The served plan's models in the order of ``specs``, the headroom pass's vGPUs taken
    off (they exceed the pool bounds U by design); a model it lacks has no pipeline."""
    by_name = {m.name: m for m in warm}
    out = []
    for s in specs:
        m = by_name.get(s.name)
        if m is None:
            m = ModelPlan(name=s.name, profile=s.profile_ref or "", slo_ms=s.slo_ms, weight=s.weight, throughput_rps=0.0, pipelines=[])
        out.append(_without_headroom(m))
    return out


def _without_headroom(m: ModelPlan) -> ModelPlan:
    pipes = []
    for p in m.pipelines:
        parts = [q.model_copy(update=dict(count=q.count - q.headroom, headroom=0,
                                          throughput_rps=q.throughput_rps / q.count * (q.count - q.headroom)))
                 for q in p.partitions]
        pipes.append(p.model_copy(update=dict(partitions=parts, throughput_rps=min(q.throughput_rps for q in parts))))
    return m.model_copy(update=dict(pipelines=pipes, throughput_rps=sum(p.throughput_rps for p in pipes)))
