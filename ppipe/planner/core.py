"""One MILP plan in three steps: build (configurations -> Milp) -> solve (solver passed in) -> extract.

:func:`milp_plan` is what the ``ppipe`` and ``np`` planners run; the DART-r baseline
(:mod:`ppipe.planner.baselines`) builds on its NP result.

Helpers around the solve, all for the max-min objective, none changing the optimum: a
first plan for the solver (the split search of :mod:`ppipe.planner.split_search` for
several models, the distinct-type restriction for one model under the paper's rule, the
optimum over the LP relaxation's configurations under physical packing), and
a bound that proves HiGHS's incumbents optimal where branch and bound is slow to (the
framework of :mod:`ppipe.planner.bounds`: its cover bound under physical packing, the
price bound of :mod:`ppipe.planner.price_bound` under the paper's rule).

Where the MILP over every configuration would be large (more than
:data:`~ppipe.planner.colgen.CG_MIN_COLUMNS` columns, e.g. 1,000 GPUs of six types), the
max-min plan under physical packing is made by column generation instead
(:mod:`ppipe.planner.colgen`): the LP bound of the whole configuration space from a few
columns, and the MILP over those.

The same inputs give the same plan: every choice follows the solvers' search (HiGHS's
incumbents and interrupt checks, the price bound's batches merged in order, node limits),
never the clock or the threads' timing. The time limit only stops a search; a plan that a
stopped search shaped reports ``time_limit`` with its proven gap.

The time limit is one budget: the split search may take START_SHARE of it, the LP-support
start LP_SUPPORT_SHARE of what is left, and the solve of the whole MILP the rest. A plan
found on the way (a start) is never lost: where the last solve finds none, it is the
result, with status ``time_limit`` and its gap to the bound that came with it.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, replace
from typing import Callable

import numpy as np

from ppipe.errors import InfeasibleError, SolverError
from ppipe.planner.colgen import CG_MIN_COLUMNS, column_generation_plan, pool_columns
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


def plan_configs(
    specs: list[ModelSpec],
    cluster: ClusterSpec,
    levels: list[dict[str, list[int]]],
    *,
    max_partitions: int,
    margin: float,
    gpu_rule: str,
    one_config_per_template: bool,
    authors_arithmetic: bool = False,
    files: list[str | None] | None = None,
) -> list[ConfigSet]:
    """The configurations of every model with the dominance pruning that is exact for the
    formulation: across templates of one multiset of (type, level) under physical packing
    with several configurations per template (resources do not depend on the slot there),
    across vGPU levels under the paper's rule (a pool's resources are its share g/v)."""
    return model_configs(
        specs,
        cluster,
        levels,
        max_partitions=max_partitions,
        margin=margin,
        group_by_multiset=(gpu_rule == "physical" and not one_config_per_template),
        across_levels=(gpu_rule == "paper"),
        authors_arithmetic=authors_arithmetic,
        files=files,
    )


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


# HiGHS's interrupt checks before the cover bound is first asked: models HiGHS proves at
# once (the easy cases of the artifact end within this many) pay nothing. Where the price
# bound serves (many types, many models), the prover is asked from the root on.
PROVER_AFTER_POLLS = 8
# Where the requested gap is not proven, the prover tries this looser one once: a plan that
# ends at the time limit then reports the gap that was proven rather than branch and
# bound's (the benchmarks' "proven within 0.1 %").
FALLBACK_GAP = 1e-3
# ... and, where that is not proven either, these with the cover bound alone (a check costs
# it tens of ms, the price bound seconds): where branch and bound's own bound stays near the
# LP relaxation's, a plan that a time limit stops reports the tighter gap the cover bound proves.
COVER_FALLBACK_GAPS = (1e-2, 3e-2, 1e-1)
# Share of the time limit that the split search, or the distinct-type start, may take.
START_SHARE = 0.25
# Share of the time left that the LP-support start (relaxation and restricted MILP) may
# take: the solve of the whole MILP keeps the rest.
LP_SUPPORT_SHARE = 0.5
# The distinct-type start serves plans of at most this many models (with several, the
# restriction's solve costs more than it saves: scripts/bench_planner.py --suite main).
DISTINCT_START_MAX_MODELS = 1


class Prover:
    """``prover(T, bound)`` for :meth:`HighsSolver.solve`: the cover bound of :mod:`ppipe.planner.bounds`
    (unless ``cover`` is False), then, where it fails and is given, the price bound of
    :mod:`ppipe.planner.price_bound`.

    The cover bound is built on first use, with its throughput bins spanning HiGHS's upper
    bound at that time. The price bound is tried once per level; ``method`` names the bound
    that gave the last proof. Where the price bound finds instead that known plans of the
    models reach the level together, that plan (``columns`` turns it into column values,
    or None if it is not a solution of the MILP) waits in ``solution`` for the solver to
    take as its new incumbent. Where the deadline stopped the price bound, ``timed_out``
    is set and the solver stops: the wall clock ends the search, it never picks a plan.

    Given the solve's ``gap``, a level ``T = incumbent (1 + gap)`` that neither bound
    refutes is followed, once, by ``incumbent (1 + FALLBACK_GAP)``, then where that is not
    refuted either by the levels of ``COVER_FALLBACK_GAPS`` with the cover bound alone: the
    first refuted is kept in ``weak = (level, method)`` (no plan reaches ``level``) while the
    search goes on for the requested gap.
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
        cover: bool = True,
    ):
        self._args = (configs, specs, cluster)
        self._cover = cover
        self._columns = columns
        self.solution: np.ndarray | None = None
        self._offered = -math.inf  # objective of the best plan offered so far
        self.bound: CoverBound | None = None
        self.price_bound = price_bound
        self.deadline = deadline
        self.gap = gap
        self.weak: tuple[float, str] | None = None
        self.timed_out = False
        self._priced: set[float] = set()

    def __call__(self, T: float, upper_bound: float, fallback: bool = True) -> bool:
        """Whether no plan reaches ``T``; ``fallback`` False: the looser level is not tried."""
        if self.bound is None and self._cover:
            configs, specs, cluster = self._args
            counts = np.array([cluster.gpu_counts[g.name] for g in cluster.gpu_types], dtype=float)
            self.bound = CoverBound(configs, [s.weight for s in specs], counts, z_max=upper_bound)
        fallback = fallback and self.weak is None and self.gap is not None and self.gap < FALLBACK_GAP
        # While the looser level is still to be tried, the requested one gets one round of
        # exact solves, so that room is left for the looser one.
        if self._refutes(T, max_rounds=1 if fallback else MAX_ITERATIONS):
            return True
        if fallback and not self.timed_out:
            self.weak = self._looser_refuted(T / (1.0 + self.gap), upper_bound)
        return False

    def _looser_refuted(self, incumbent: float, upper_bound: float) -> tuple[float, str] | None:
        """(The first level of the fallback ladder above ``incumbent`` that is refuted, its
        method), or None; levels at or above ``upper_bound`` need no proof and end the ladder."""
        looser = incumbent * (1.0 + FALLBACK_GAP)
        if looser >= upper_bound:
            return None
        if self._refutes(looser):
            return looser, self.method
        for g in COVER_FALLBACK_GAPS:
            looser = incumbent * (1.0 + g)
            if looser >= upper_bound or self.bound is None:
                return None
            if self.bound.refutes(looser):
                self.method = "cover bound"
                return looser, self.method
        return None

    def _refutes(self, T: float, max_rounds: int = MAX_ITERATIONS) -> bool:
        if self.bound is not None and self.bound.refutes(T):
            self.method = "cover bound"
            return True
        if self.price_bound is None or T in self._priced:
            return False
        self._priced.add(T)
        if self.price_bound.refutes(T, deadline=self.deadline, max_rounds=max_rounds):
            self.method = "price bound"
            return True
        if self.deadline is not None and time.perf_counter() >= self.deadline:
            self.timed_out = True
            return False
        if self.price_bound.found and self._columns is not None:
            models, specs = self.price_bound.found, self._args[1]
            z = min(m.throughput_rps / s.weight for m, s in zip(models, specs))
            x = self._columns(models) if z > self._offered else None
            if x is not None:
                self.solution, self._offered = x, z
        return False


# The split search runs for max-min plans of >= 2 models. Under the paper's GPU rule its
# tables seed the price bound, which proves the plans of two-type clusters too; under
# physical packing it is only a start, and on two types HiGHS finds the optimum at the root
# itself (a start there only changes its path). scripts/bench_planner.py measures both.
SPLIT_SEARCH_MIN_TYPES = {"paper": 2, "physical": 3}
SPLIT_SEARCH_MIN_MODELS = 2


def wants_split_start(objective, solver, specs, cluster, gpu_rule: str) -> bool:
    """Whether :func:`milp_plan` hands the solver a split-search start (see the constants above)."""
    return (
        isinstance(objective, MaxMinNormalized)
        and getattr(solver, "accepts_start", False)
        and len(specs) >= SPLIT_SEARCH_MIN_MODELS
        and len(cluster.gpu_types) >= SPLIT_SEARCH_MIN_TYPES[gpu_rule]
    )


@dataclass(frozen=True)
class Start:
    """A MIP start: column values (None: no start), the split search's plan (or None),
    whether the wall clock stopped the search that made it (the plan then says time_limit),
    and a bound on the optimum known with it."""

    x: np.ndarray | None = None
    restricted: SplitPlan | None = None
    timed_out: bool = False
    bound: float = math.inf  # an upper bound on the MILP's optimum that came with it (the LP relaxation's)


def split_start(configs, specs, cluster, milp, variables, time_limit_s, paper_templates: bool = False) -> Start:
    """A MIP start from :func:`~ppipe.planner.split_search.split_search` (max-min).

    ``paper_templates``: the MILP has constraint (6), so the restriction keeps it too. The
    search may take ``START_SHARE`` of the time limit. The start is checked against every
    row and bound of ``milp`` before it is handed over, so that a wrong start can never
    reach the solver.
    """
    counts = np.array([cluster.gpu_counts[g.name] for g in cluster.gpu_types])
    budget = None if time_limit_s is None else START_SHARE * time_limit_s
    t0 = time.perf_counter()
    plan = split_search(configs, [s.weight for s in specs], counts, time_budget_s=budget, paper_templates=paper_templates)
    # The search checks the clock only against its budget: past it, it may have stopped.
    timed_out = budget is not None and time.perf_counter() - t0 > budget
    if plan is None:
        return Start(timed_out=timed_out)
    x = start_vector(plan, variables, milp.num_cols, variables.extra.get("z"))
    return Start(x if is_feasible(milp, x) else None, plan, timed_out)


def distinct_types_start(specs, configs, cluster, milp, variables, solver, *, gpu_rule, deadline, gap) -> Start:
    """A MIP start for the paper's formulation (max-min): the optimum over the configurations
    whose consecutive slots have different GPU types.

    Why: the authors' templates let one type fill consecutive slots, which about triples
    the configurations of two-type clusters, and HiGHS then often finds its first plan only
    late. The distinct-type configurations with at most one per type tuple are a much
    smaller restriction of the same MILP (the same rows over fewer columns, plus rows of
    their own), so their optimum is a plan of it. It is checked against every row before
    use. The restriction may take ``START_SHARE`` of the time left; one stopped by it gives
    no start and says so.
    """
    keep = []
    for cs in configs:
        distinct = [all(cs.gpu[c, d] != cs.gpu[c, d + 1] for d in range(int(cs.nparts[c]) - 1)) for c in range(len(cs))]
        keep.append(np.array(distinct, dtype=bool))
    if all(k.all() for k in keep) or not all(k.any() for k in keep):
        return Start()
    sub = [subset(cs, k) for cs, k in zip(configs, keep)]
    # At most one configuration per type tuple: within (6a), as the distinct-type tuples
    # that start with a prefix of length l number sum_{j <= D - l} (K - 1)^j <= K^(D - l).
    rmilp, rv = build(specs, sub, cluster, gpu_rule=gpu_rule, one_config_per_template=True, one_per_type_tuple=True)
    MaxMinNormalized().apply(rmilp, rv)
    left = time_left(deadline)
    try:
        res = solver.solve(rmilp, time_limit_s=None if left is None else START_SHARE * left, gap=gap)
    except SolverTimeLimitError:
        return Start(timed_out=True)
    if res.status != "optimal" or res.x is None:
        return Start(timed_out=res.status == "time_limit")
    x = solution_vector(extract(res.x, rv, specs), variables, milp.num_cols)
    return Start(x if is_feasible(milp, x) else None)


def lp_support_start(specs, configs, cluster, milp, variables, solver, *, gpu_rule, deadline, gap) -> tuple[Start, float, dict, list]:
    """(A MIP start, an upper bound on the optimum, the solves' work, the configurations
    used) from the LP relaxation (max-min, several configurations per template).

    The start is the optimum over the configurations that the relaxation's solution uses
    (a few per model): a restriction of the same MILP, so its plan is one of the MILP's,
    checked against every row before use. The bound is the relaxation's value. Why: on the
    default plan the relaxation's configurations hold the optimum, which HiGHS finds only
    after its root heuristics; with a start and a bound, the prover can end the solve at
    once. No start (and an infinite bound) where either solve ends otherwise; one that the
    time limit stopped says so (``timed_out``). ``work``: nodes and LP iterations in all.
    The last item is, per model, the mask of the configurations used (None where the
    relaxation did not end optimal).
    """
    relaxed = solver.relaxation(milp, time_limit_s=time_left(deadline))
    work = dict(nodes=0, lp_iterations=max(relaxed.lp_iterations, 0))
    if relaxed.status != "optimal":
        return Start(timed_out=relaxed.status == "time_limit"), math.inf, work, None
    used = [(relaxed.x[np.maximum(g, 0)] * (g >= 0) > 1e-9).any(axis=1) for g in variables.g]
    if not all(u.any() for u in used):
        return Start(), relaxed.objective, work, used
    start = restricted_start(specs, configs, used, cluster, milp, variables, solver, gpu_rule=gpu_rule,
                             deadline=deadline, gap=gap, work=work)
    return start, relaxed.objective, work, used


def restricted_start(specs, configs, masks, cluster, milp, variables, solver, *, gpu_rule, deadline, gap, work: dict) -> Start:
    """The max-min optimum over the configurations ``masks`` keep (per model), as a start of
    the whole MILP (checked against its every row). Adds the solve's nodes and LP
    iterations to ``work``. A solve the clock stopped still leaves its plan, which then
    says ``timed_out``; none where it found no plan. No MIP start: a narrower restriction's
    plan as a start can lead HiGHS's search astray (docs/benchmarks.md, "Weighted plans of
    the default case")."""
    rmilp, rv = build(specs, [subset(cs, u) for cs, u in zip(configs, masks)], cluster, gpu_rule=gpu_rule)
    MaxMinNormalized().apply(rmilp, rv)
    try:
        res = solver.solve(rmilp, time_limit_s=time_left(deadline), gap=gap)
    except SolverTimeLimitError:
        return Start(timed_out=True)
    work["nodes"] += max(res.nodes, 0)
    work["lp_iterations"] += max(res.lp_iterations, 0)
    if res.x is None:
        return Start(timed_out=res.status == "time_limit")
    x = solution_vector(extract(res.x, rv, specs), variables, milp.num_cols)
    return Start(x if is_feasible(milp, x) else None, timed_out=res.status == "time_limit")


def template_masks(configs: list[ConfigSet], used: list[np.ndarray]) -> list[np.ndarray]:
    """Per model, every configuration of the templates (GPU types and partitions) that the
    ``used`` configurations belong to: the wider restriction of :func:`_lp_support_attempt`."""
    return [np.isin(cs.template, np.unique(cs.template[u])) for cs, u in zip(configs, used)]


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


def share_deadline(deadline: float | None, share: float) -> float | None:
    """The deadline of a step that may take ``share`` of the time left before ``deadline``."""
    if deadline is None:
        return None
    now = time.perf_counter()
    return now + share * max(0.0, deadline - now)


def start_result(solver, start: Start, variables) -> SolveResult:
    """The start as the solve's result where the solver found no plan before the deadline:
    status time_limit, its gap to the start's bound (inf where none is known).

    Raises:
        SolverTimeLimitError: there is no start either, so no plan at all.
    """
    if start.x is None:
        raise SolverTimeLimitError(
            "the solver found no plan before the time limit",
            fix="raise --time-limit-s (or time_limit_s=), or simplify: fewer models, --max-partitions 2",
        )
    z = float(start.x[variables.extra["z"]]) if "z" in variables.extra else math.nan
    gap = max(0.0, start.bound / z - 1.0) if z > 0 and math.isfinite(start.bound) else math.inf
    return SolveResult(getattr(solver, "name", "highs"), "time_limit", start.x, z, gap, 0.0, method="start (no solver plan)")


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
    column_generation: bool | None = None,
    node_limit: int | None = None,
    warm: list[ModelPlan] | None = None,
    configs: list[ConfigSet] | None = None,
) -> MilpOutcome:
    """Build, solve and extract one MILP plan (no placement).

    ``authors_arithmetic``: the margin and NIC-cap arithmetic of the authors' ``ilp_v4.py``
    (:func:`~ppipe.planner.configs.enumerate_configs`). ``column_generation``: plan by
    :mod:`ppipe.planner.colgen` instead of the MILP over every configuration (True),
    never (False), or where :func:`wants_column_generation` says (None). ``node_limit``:
    the solver stops after about that many branch-and-bound nodes (status ``feasible``,
    the same on every machine). ``warm``: a served plan of these models, whose
    configurations and pools start column generation's restricted MILP (unused on the
    other path).
    ``configs``: the models' configurations where the caller made them already
    (:func:`plan_configs` with the same arguments), else None.
    """
    t0 = time.perf_counter()
    if configs is None:
        configs = plan_configs(specs, cluster, levels, max_partitions=max_partitions, margin=margin, gpu_rule=gpu_rule,
                               one_config_per_template=one_config_per_template, authors_arithmetic=authors_arithmetic,
                               files=files)
    # time_limit_s covers building and the split search too: the solver gets the rest.
    deadline = None if time_limit_s is None else t0 + time_limit_s
    solver = solver.tuned_for(gpu_rule, single_model=len(specs) == 1) if hasattr(solver, "tuned_for") else solver
    solver = solver.with_node_limit(node_limit) if hasattr(solver, "with_node_limit") else solver
    if wants_column_generation(column_generation, objective, gpu_rule, one_config_per_template, configs):
        cg = column_generation_plan(specs, configs, cluster, solver, deadline=deadline, gap=gap, warm=warm)
        return MilpOutcome(models=cg.models, result=cg.result, columns=cg.columns, configurations=cg.configurations,
                           seconds=time.perf_counter() - t0)
    milp, variables = build(specs, configs, cluster, gpu_rule=gpu_rule, one_config_per_template=one_config_per_template)
    objective.apply(milp, variables)

    start = _first_start(specs, configs, cluster, milp, variables, solver, objective, gpu_rule=gpu_rule,
                         one_config_per_template=one_config_per_template, time_limit_s=time_limit_s, deadline=deadline, gap=gap)
    if isinstance(objective, MaxMinNormalized) and getattr(solver, "accepts_prover", False) and _has_prover(gpu_rule, start):
        result = _proven_solve(milp, variables, specs, configs, cluster, solver, start, deadline=deadline, gap=gap,
                               gpu_rule=gpu_rule, one_config_per_template=one_config_per_template)
    else:
        try:
            result = solver.solve(milp, time_limit_s=time_left(deadline), gap=gap, **({} if start.x is None else {"start": start.x}))
        except SolverTimeLimitError:
            result = start_result(solver, start, variables)
    if start.timed_out and result.status == "optimal":
        # The clock stopped the start's search, so another run may start elsewhere and end
        # at another plan: the plan says that a time limit shaped it, with its proven gap.
        result = replace(result, status="time_limit")
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


def _first_start(specs, configs, cluster, milp, variables, solver, objective, *, gpu_rule, one_config_per_template,
                 time_limit_s, deadline, gap) -> Start:
    """The MIP start :func:`milp_plan` hands the solver: the split search's plan where
    :func:`wants_split_start` says so, the distinct-type restriction's for one model of the
    paper's formulation, else none."""
    if wants_split_start(objective, solver, specs, cluster, gpu_rule):
        return split_start(configs, specs, cluster, milp, variables, time_limit_s, paper_templates=one_config_per_template)
    if (one_config_per_template and len(specs) <= DISTINCT_START_MAX_MODELS and isinstance(objective, MaxMinNormalized)
            and getattr(solver, "accepts_start", False)):
        return distinct_types_start(specs, configs, cluster, milp, variables, solver, gpu_rule=gpu_rule, deadline=deadline, gap=gap)
    return Start()


def column_generation_applies(objective, gpu_rule: str, one_config_per_template: bool) -> bool:
    """Whether :mod:`ppipe.planner.colgen` can plan: the max-min objective under physical
    packing with several configurations per template (its master LP is that MILP's relaxation)."""
    return isinstance(objective, MaxMinNormalized) and gpu_rule == "physical" and not one_config_per_template


def wants_column_generation(choice: bool | None, objective, gpu_rule: str, one_config_per_template: bool,
                            configs: list[ConfigSet]) -> bool:
    """Column generation where asked (``choice`` True) or, by default (None), where it
    applies and the whole MILP would exceed :data:`~ppipe.planner.colgen.CG_MIN_COLUMNS`
    columns: a rule on the inputs alone, so the same inputs take the same path."""
    if choice is False or not column_generation_applies(objective, gpu_rule, one_config_per_template):
        return False
    return choice is True or pool_columns(configs) > CG_MIN_COLUMNS


def _lp_support_attempt(milp, variables, specs, configs, cluster, solver, prover, *, deadline, gap) -> tuple[Start, SolveResult | None]:
    """(The best start of :func:`lp_support_start` and its template-wide widening, with the
    relaxation's bound, and the solve's result where that bound or ``prover`` proves it
    optimal within ``gap``, else None).

    Two restrictions, narrow first: the configurations the relaxation uses (on the default
    plan they hold the optimum, proven at once), then, where that is not proven, every
    configuration of their templates. Why: under unequal weights the relaxation's few
    configurations can miss the optimum by far, while their templates' hold plans that
    HiGHS on the whole MILP finds only after minutes, if at all (docs/benchmarks.md,
    "Weighted plans of the default case")."""
    t0 = time.perf_counter()
    start, bound, work, used = lp_support_start(specs, configs, cluster, milp, variables, solver, gpu_rule="physical",
                                                deadline=deadline, gap=gap)
    start = replace(start, bound=bound)
    ended = _proven(start, variables, solver, prover, gap, work, t0)
    if ended is not None or used is None or start.x is None:
        return start, ended
    wide = template_masks(configs, used)
    if all(w.sum() == u.sum() for w, u in zip(wide, used)):
        return start, None
    wider = restricted_start(specs, configs, wide, cluster, milp, variables, solver, gpu_rule="physical",
                             deadline=deadline, gap=gap, work=work)
    if wider.x is None or float(wider.x[variables.extra["z"]]) <= float(start.x[variables.extra["z"]]):
        return replace(start, timed_out=start.timed_out or wider.timed_out), None
    start = replace(wider, bound=bound)
    return start, _proven(start, variables, solver, prover, gap, work, t0)


def _proven(start: Start, variables, solver, prover, gap: float, work: dict, t0: float) -> SolveResult | None:
    """The start as the solve's result where the relaxation's bound or ``prover`` proves it
    optimal within ``gap``, else None."""
    z = 0.0 if start.x is None else float(start.x[variables.extra["z"]])
    if z <= 0:
        return None
    if start.bound <= z * (1.0 + gap):
        proven_gap, method = max(0.0, start.bound / z - 1.0), "LP bound"
    elif prover(z * (1.0 + gap), start.bound, fallback=False):
        proven_gap, method = gap, prover.method
    else:
        return None
    status = "time_limit" if start.timed_out else "optimal"  # a stopped solve's plan: the clock chose it
    return SolveResult(solver.name, status, start.x, z, proven_gap, time.perf_counter() - t0,
                       method="LP-support incumbent + " + method, **work)


def _has_prover(gpu_rule: str, start: Start) -> bool:
    """Whether a bound serves this solve: the cover bound under physical packing, the price
    bound under the paper's rule where the split search ran. (Under the paper's rule the
    cover bound, which cannot see the per-model rounding to whole GPUs, proved no case of
    scripts/bench_planner.py and only cost time.)"""
    return gpu_rule == "physical" or start.restricted is not None


def _proven_solve(milp, variables, specs, configs, cluster, solver, start: Start, *, deadline, gap, gpu_rule,
                  one_config_per_template) -> SolveResult:
    """The max-min solve with the bound that serves it as prover (see :func:`_has_prover`).

    The bounds prove HiGHS's incumbents optimal where branch and bound is slow to. Gurobi
    takes the prover only to hand it to HiGHS when its licence refuses the model. The price
    bound needs per-model integer GPU vectors: the paper's GPU rule (under physical packing
    models share GPUs of a level, so a model's own count would overstate its need), and the
    split search's tables, which seed it. Under physical packing without a start, the
    plan of :func:`lp_support_start` comes first: where its bound or the prover proves it,
    HiGHS does not run on the whole MILP; else it becomes HiGHS's start.
    """
    price = None
    if gpu_rule == "paper":
        build_kw = dict(gpu_rule=gpu_rule, one_config_per_template=one_config_per_template)
        price = PriceBound(specs, configs, cluster, build_kw, tables=start.restricted.tables)

    def columns(models: list[ModelPlan]) -> np.ndarray | None:
        x = solution_vector(models, variables, milp.num_cols)
        return x if is_feasible(milp, x) else None

    prover = Prover(configs, specs, cluster, price_bound=price, deadline=deadline, gap=gap, columns=columns,
                         cover=gpu_rule == "physical")
    if start.x is None and gpu_rule == "physical" and not one_config_per_template and hasattr(solver, "relaxation"):
        start, ended = _lp_support_attempt(milp, variables, specs, configs, cluster, solver, prover,
                                           deadline=share_deadline(deadline, LP_SUPPORT_SHARE), gap=gap)
        if ended is not None:
            return ended
    after = 0 if price is not None else PROVER_AFTER_POLLS
    kw = {} if start.x is None else {"start": start.x}
    try:
        result = solver.solve(milp, time_limit_s=time_left(deadline), gap=gap, prover=prover, prover_after_polls=after, **kw)
    except SolverTimeLimitError:
        result = start_result(solver, start, variables)
    if start.timed_out and result.status == "optimal":
        result = replace(result, status="time_limit")  # as in milp_plan: the clock shaped the start
    if result.status == "time_limit" and prover.weak is not None and result.objective > 0:
        # Stopped short of the requested gap, but a looser level was proven out of reach.
        level, how = prover.weak
        proven = max(0.0, level / result.objective - 1.0)
        if proven < result.gap:
            result = replace(result, gap=proven, method=f"highs incumbent + {how}")
    return result
