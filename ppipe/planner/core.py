"""One MILP plan in three steps: build (configurations -> Milp) -> solve (solver passed in) -> extract.

:func:`milp_plan` is what the ``ppipe`` and ``np`` planners run; the DART-r baseline
(:mod:`ppipe.planner.baselines`) builds on its NP result.

Two helpers around the solve, both for the max-min objective: the split search
(:mod:`ppipe.planner.split_search`) hands the solver a strong first plan on clusters of
three or more GPU types, and the cover bound (:mod:`ppipe.planner.bounds`) proves HiGHS's
incumbents optimal where branch and bound is slow to. Neither changes the optimum.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, replace
from typing import Callable

import numpy as np

from ppipe.errors import InfeasibleError, SolverError
from ppipe.planner.configs import ConfigSet, ModelSpec, enumerate_configs, subset
from ppipe.planner.formulation import build, extract, solution_vector
from ppipe.planner.bounds import CoverBound
from ppipe.planner.objectives import MaxMinNormalized, Objective
from ppipe.planner.price_bound import MAX_ITERATIONS, PriceBound
from ppipe.planner.solvers import SolveResult, Solver, SolverTimeLimitError, time_left
from ppipe.planner.split_search import SplitPlan, split_search, start_vector
from ppipe.spec.cluster import ClusterSpec
from ppipe.spec.plan import ModelPlan


@dataclass(frozen=True)
class MilpOutcome:
    """A solved MILP plan before placement.

    Attributes:
        models: per-model plans.
        result: the solver's result.
        columns: MILP columns.
        configurations: configurations kept (columns groups) over all models.
        seconds: building + solving + extracting, in s.
    """

    models: list[ModelPlan]
    result: SolveResult
    columns: int
    configurations: int
    seconds: float


def model_configs(
    specs: list[ModelSpec],
    cluster: ClusterSpec,
    levels: list[dict[str, list[int]]],
    *,
    max_partitions: int,
    margin: float,
    group_by_multiset: bool,
    across_levels: bool = False,
    authors_arithmetic: bool = False,
    files: list[str | None] | None = None,
) -> list[ConfigSet]:
    """Configurations of every model; a model with none is an InfeasibleError naming the smallest SLO."""
    out = []
    for mi, spec in enumerate(specs):
        cs = enumerate_configs(
            mi,
            spec,
            cluster,
            max_partitions=max_partitions,
            margin=margin,
            levels=levels[mi],
            group_by_multiset=group_by_multiset,
            across_levels=across_levels,
            authors_arithmetic=authors_arithmetic,
        )
        if len(cs) == 0:
            raise infeasible_slo(spec, cs, margin, cluster, (files or [None] * len(specs))[mi])
        out.append(cs)
    return out


def infeasible_slo(spec: ModelSpec, cs: ConfigSet, margin: float, cluster: ClusterSpec, file: str | None) -> InfeasibleError:
    budget = spec.slo_ms * (1 - margin)
    if np.isfinite(cs.min_latency_b1_us):
        need_ms = cs.min_latency_b1_us / 1000.0 / (1 - margin)
        fix = (
            f"the smallest feasible SLO is {need_ms:.2f} ms (fastest pipeline at batch 1: "
            f"{cs.min_latency_b1_us / 1000.0:.2f} ms, plus the {margin:.0%} margin): "
            f"pass --slo-ms {spec.name}={need_ms:.2f} (or slo_ms= / field 'slo_ms' of model.yaml), or lower --margin"
        )
    else:
        fix = "profile batch 1 for the cluster's GPU types (`ppipe profile`)"
    return InfeasibleError(
        f"model '{spec.name}': no GPU type of cluster '{cluster.name}' ({', '.join(cluster.gpu_counts)}) meets "
        f"the SLO of {spec.slo_ms:.2f} ms even at batch 1 (planning budget {budget:.2f} ms after the {margin:.0%} margin)",
        fix=fix,
        file=file,
    )


# Solve time (s) before the cover bound is first asked: models HiGHS proves faster pay nothing.
# Where the price bound serves (many types, many models, paper rule: branch and bound does
# not close the gap within seconds), the prover is asked as soon as HiGHS's root bound exists.
PROVER_AFTER_S = 0.2
# Most seconds the split search may take before the solver starts (it gives up past it).
SPLIT_SEARCH_BUDGET_S = 4.0
# The price bound (a round of one single-model MILP solve of 0.3-6 s per model on the
# 4-type case, where the restriction's dual does not rule it out at once) is not started
# with less than this left of the time budget.
PRICE_BOUND_MIN_S = 3.0
# Where the requested gap is not proven, the prover tries this looser one once (the
# benchmarks' "proven optimal"): a plan that ends at the time limit then reports the gap
# that was proven rather than branch and bound's, e.g. 0.1 % instead of 1 % on the 4-type
# case.
FALLBACK_GAP = 1e-3


class CoverProver:
    """``prover(T, bound)`` for :meth:`HighsSolver.solve`: the cover bound of :mod:`ppipe.planner.bounds`,
    then, where it fails and is given, the price bound of :mod:`ppipe.planner.price_bound`.

    The cover bound is built on first use (the pipeline patterns are listed once), with its
    throughput bins spanning HiGHS's upper bound at that time; GPU prices start at 1 / N_k.
    The price bound is tried once per level and only while at least ``PRICE_BOUND_MIN_S``
    of the time budget is left; ``method`` names the bound that gave the last proof. Where
    it finds instead that known plans of the models reach the level together, that plan
    (``columns`` turns it into column values, or None if it is not a solution of the MILP)
    waits in ``solution`` for the solver to take as its new incumbent.

    Given the solve's ``gap``, a level ``T = incumbent (1 + gap)`` that neither bound
    refutes is followed, once, by ``incumbent (1 + FALLBACK_GAP)``: if that is refuted,
    ``weak = (level, method)`` keeps it (no plan reaches ``level``) while the search goes
    on for the requested gap.
    """

    method = "cover bound"

    def __init__(
        self,
        configs: list[ConfigSet],
        specs: list[ModelSpec],
        cluster: ClusterSpec,
        price_bound: PriceBound | None = None,
        deadline: float | None = None,
        gap: float | None = None,
        columns: Callable[[list[ModelPlan]], np.ndarray | None] | None = None,
    ):
        self._args = (configs, specs, cluster)
        self._columns = columns
        self.solution: np.ndarray | None = None
        self._offered = -math.inf  # objective of the best plan offered so far
        self.bound: CoverBound | None = None
        self.price_bound = price_bound
        self.deadline = deadline
        self.gap = gap
        self.weak: tuple[float, str] | None = None
        self._priced: set[float] = set()

    def __call__(self, T: float, upper_bound: float) -> bool:
        if self.bound is None:
            configs, specs, cluster = self._args
            counts = np.array([cluster.gpu_counts[g.name] for g in cluster.gpu_types], dtype=float)
            self.bound = CoverBound(configs, [s.weight for s in specs], counts, z_max=upper_bound)
        fallback = self.weak is None and self.gap is not None and self.gap < FALLBACK_GAP
        # While the looser level is still to be tried, the requested one gets one round of
        # exact solves (a proof there takes one, 4-type case), so that time is left for it.
        if self._refutes(T, max_rounds=1 if fallback else MAX_ITERATIONS):
            return True
        if fallback:
            looser = T / (1.0 + self.gap) * (1.0 + FALLBACK_GAP)
            if looser < upper_bound and self._refutes(looser):
                self.weak = (looser, self.method)
        return False

    def _refutes(self, T: float, max_rounds: int = MAX_ITERATIONS) -> bool:
        if self.bound.refutes(T):
            self.method = "cover bound"
            return True
        left = math.inf if self.deadline is None else self.deadline - time.perf_counter()
        if self.price_bound is None or T in self._priced or left < PRICE_BOUND_MIN_S:
            return False
        self._priced.add(T)
        if self.price_bound.refutes(T, deadline=self.deadline, max_rounds=max_rounds):
            self.method = "price bound"
            return True
        if self.price_bound.found and self._columns is not None:
            models, specs = self.price_bound.found, self._args[1]
            z = min(m.throughput_rps / s.weight for m, s in zip(models, specs))
            x = self._columns(models) if z > self._offered else None
            if x is not None:
                self.solution, self._offered = x, z
        return False


# The split search runs for max-min plans of >= 2 models on >= 3 GPU types. Measured
# (scripts/bench_planner.py): on 4 types, 3 models HiGHS's own plan after 300 s is 0.12 %
# below the split search's after 2 s; on 2 types HiGHS finds the optimum at the root and a
# start only changes its path (G1 HC2-L 0.55 -> 1.04 s, HC3-L 0.62 -> 1.16 s); for one model
# there is no split to search and the 3-partition tables cost 1-2 s (ablation suite).
SPLIT_SEARCH_MIN_TYPES = 3
SPLIT_SEARCH_MIN_MODELS = 2


def wants_split_start(objective, solver, specs, cluster) -> bool:
    """Whether :func:`milp_plan` hands the solver a split-search start (see the constants above)."""
    return (
        isinstance(objective, MaxMinNormalized)
        and getattr(solver, "accepts_start", False)
        and len(specs) >= SPLIT_SEARCH_MIN_MODELS
        and len(cluster.gpu_types) >= SPLIT_SEARCH_MIN_TYPES
    )


def split_start(
    configs, specs, cluster, milp, variables, time_limit_s, paper_templates: bool = False
) -> tuple[np.ndarray | None, SplitPlan | None]:
    """(a MIP start from :func:`~ppipe.planner.split_search.split_search` (max-min) or None, its plan or None).

    ``paper_templates``: the MILP has constraint (6), so the restriction keeps it too.

    The start is checked against every row and bound of ``milp`` before it is handed over,
    so that a wrong start can never reach the solver.
    """
    counts = np.array([cluster.gpu_counts[g.name] for g in cluster.gpu_types])
    budget = SPLIT_SEARCH_BUDGET_S if time_limit_s is None else min(SPLIT_SEARCH_BUDGET_S, 0.25 * time_limit_s)
    plan = split_search(configs, [s.weight for s in specs], counts, time_budget_s=budget, paper_templates=paper_templates)
    if plan is None:
        return None, None
    x = start_vector(plan, variables, milp.num_cols, variables.extra.get("z"))
    return (x if is_feasible(milp, x) else None), plan


# Share of the time left that the MIP start of distinct_types_start may take.
DISTINCT_TYPES_BUDGET = 0.25


def distinct_types_start(specs, configs, cluster, milp, variables, solver, *, gpu_rule, deadline, gap) -> np.ndarray | None:
    """A MIP start for the paper's formulation (max-min): the optimum over the configurations
    whose consecutive slots have different GPU types, or None.

    Why: the authors' templates let one type fill consecutive slots, which about triples
    the configurations of two-type clusters, and HiGHS then often finds its first plan only
    after tens of nodes (on one model with three partitions, only after seconds). The
    distinct-type configurations with at most one per type tuple are a much smaller
    restriction of the same MILP (the same rows over fewer columns, plus rows of their
    own), so their optimum is a plan of it, and on the artifact's cases usually its
    optimum. It is checked against every row before use; a restriction that finds no plan
    within its share of the time gives no start.
    """
    keep = []
    for cs in configs:
        distinct = [all(cs.gpu[c, d] != cs.gpu[c, d + 1] for d in range(int(cs.nparts[c]) - 1)) for c in range(len(cs))]
        keep.append(np.array(distinct, dtype=bool))
    if all(k.all() for k in keep) or not all(k.any() for k in keep):
        return None
    sub = [subset(cs, k) for cs, k in zip(configs, keep)]
    # At most one configuration per type tuple: within (6a), as the distinct-type tuples
    # that start with a prefix of length l number sum_{j <= D - l} (K - 1)^j <= K^(D - l).
    rmilp, rv = build(specs, sub, cluster, gpu_rule=gpu_rule, one_config_per_template=True, one_per_type_tuple=True)
    MaxMinNormalized().apply(rmilp, rv)
    left = time_left(deadline)
    try:
        res = solver.solve(rmilp, time_limit_s=None if left is None else DISTINCT_TYPES_BUDGET * left, gap=gap)
    except SolverTimeLimitError:
        return None
    if res.x is None:
        return None
    x = solution_vector(extract(res.x, rv, specs), variables, milp.num_cols)
    return x if is_feasible(milp, x) else None


def is_feasible(milp, x: np.ndarray, tol: float = 1e-6) -> bool:
    """Whether column values ``x`` meet every bound, row and integrality of ``milp``."""
    lb, ub, integ, row_lb, row_ub, _ = milp.arrays()
    if (x < lb - tol).any() or (x > ub + tol).any() or (np.abs(x[integ] - np.round(x[integ])) > tol).any():
        return False
    r, c, v = milp.coo()
    act = np.zeros(milp.num_rows)
    np.add.at(act, r, v * x[c])
    scale = 1.0 + np.abs(act)
    return not ((act < row_lb - tol * scale).any() or (act > row_ub + tol * scale).any())


def milp_plan(
    specs: list[ModelSpec],
    cluster: ClusterSpec,
    levels: list[dict[str, list[int]]],
    *,
    objective: Objective,
    solver: Solver,
    max_partitions: int,
    margin: float,
    gpu_rule: str,
    one_config_per_template: bool,
    time_limit_s: float | None,
    gap: float,
    files: list[str | None] | None = None,
    authors_arithmetic: bool = False,
) -> MilpOutcome:
    """Build, solve and extract one MILP plan (no placement).

    ``authors_arithmetic``: the margin and NIC-cap arithmetic of the authors' ``ilp_v4.py``
    (:func:`~ppipe.planner.configs.enumerate_configs`).
    """
    t0 = time.perf_counter()
    configs = model_configs(
        specs,
        cluster,
        levels,
        max_partitions=max_partitions,
        margin=margin,
        # Comparing across templates is exact only when resources do not depend on the slot.
        group_by_multiset=(gpu_rule == "physical" and not one_config_per_template),
        # Across vGPU levels only where a pool's resources are its share g/v (paper rule).
        across_levels=(gpu_rule == "paper"),
        authors_arithmetic=authors_arithmetic,
        files=files,
    )
    milp, variables = build(specs, configs, cluster, gpu_rule=gpu_rule, one_config_per_template=one_config_per_template)
    objective.apply(milp, variables)
    # time_limit_s covers building and the split search too: the solver gets the rest.
    deadline = None if time_limit_s is None else t0 + time_limit_s
    solver = solver.tuned_for(gpu_rule, single_model=len(specs) == 1) if hasattr(solver, "tuned_for") else solver

    kw = {}
    restricted = None
    if wants_split_start(objective, solver, specs, cluster):
        kw["start"], restricted = split_start(
            configs, specs, cluster, milp, variables, time_limit_s, paper_templates=one_config_per_template
        )
    elif one_config_per_template and isinstance(objective, MaxMinNormalized) and getattr(solver, "accepts_start", False):
        kw["start"] = distinct_types_start(
            specs, configs, cluster, milp, variables, solver, gpu_rule=gpu_rule, deadline=deadline, gap=gap
        )
    if isinstance(objective, MaxMinNormalized) and getattr(solver, "accepts_prover", False):
        # The cover bound proves HiGHS's incumbents optimal where branch and bound is slow
        # (it is only asked after prover_after_s, so easy models pay nothing). Gurobi takes it
        # only to hand it to HiGHS when its licence refuses the model.
        # The price bound needs per-model integer GPU vectors: the paper's GPU rule (under
        # physical packing models share GPUs of a level, so a model's own count would
        # overstate what it needs), and the split search's tables, which seed it.
        price = (
            PriceBound(
                specs,
                configs,
                cluster,
                dict(gpu_rule=gpu_rule, one_config_per_template=one_config_per_template),
                tables=restricted.tables,
            )
            if gpu_rule == "paper" and restricted is not None
            else None
        )

        def columns(models: list[ModelPlan]) -> np.ndarray | None:
            x = solution_vector(models, variables, milp.num_cols)
            return x if is_feasible(milp, x) else None

        prover = CoverProver(configs, specs, cluster, price_bound=price, deadline=deadline, gap=gap, columns=columns)
        after = 0.0 if price is not None else PROVER_AFTER_S
        result = solver.solve(milp, time_limit_s=time_left(deadline), gap=gap, prover=prover, prover_after_s=after, **kw)
        if result.status == "time_limit" and prover.weak is not None and result.objective > 0:
            # Stopped short of the requested gap, but a looser level was proven out of reach.
            level, how = prover.weak
            proven = max(0.0, level / result.objective - 1.0)
            if proven < result.gap:
                result = replace(result, gap=proven, method=f"highs incumbent + {how}")
    else:
        result = solver.solve(milp, time_limit_s=time_left(deadline), gap=gap, **kw)
    if result.status == "infeasible":
        raise InfeasibleError(
            f"no plan meets objective '{objective.name}' on cluster '{cluster.name}' "
            f"({', '.join(f'{n} {k}' for k, n in cluster.gpu_counts.items())})",
            fix="lower the required rates, or plan on a larger cluster",
        )
    if result.x is None:
        raise SolverError(f"{result.solver} returned status '{result.status}' without a solution")
    models = extract(result.x, variables, specs)
    return MilpOutcome(
        models=models,
        result=result,
        columns=milp.num_cols,
        configurations=sum(len(c) for c in configs),
        seconds=time.perf_counter() - t0,
    )
