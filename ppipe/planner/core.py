"""One MILP plan in three steps: build (configurations -> Milp) -> solve (solver passed in) -> extract.

:func:`milp_plan` is what the ``ppipe`` and ``np`` planners run; the DART-r baseline
(:mod:`ppipe.planner.baselines`) builds on its NP result.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np

from ppipe.errors import InfeasibleError, SolverError
from ppipe.planner.configs import ConfigSet, ModelSpec, enumerate_configs
from ppipe.planner.formulation import build, extract
from ppipe.planner.bounds import CoverBound
from ppipe.planner.objectives import MaxMinNormalized, Objective
from ppipe.planner.solvers import SolveResult, Solver
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
PROVER_AFTER_S = 0.2


class CoverProver:
    """``prover(T, bound)`` for :meth:`HighsSolver.solve`: the cover bound of :mod:`ppipe.planner.bounds`.

    Built on first use (the pipeline patterns are listed once), with its throughput bins
    spanning HiGHS's upper bound at that time; GPU prices start at 1 / N_k.
    """

    method = "cover bound"

    def __init__(self, configs: list[ConfigSet], specs: list[ModelSpec], cluster: ClusterSpec):
        self._args = (configs, specs, cluster)
        self.bound: CoverBound | None = None

    def __call__(self, T: float, upper_bound: float) -> bool:
        if self.bound is None:
            configs, specs, cluster = self._args
            counts = np.array([cluster.gpu_counts[g.name] for g in cluster.gpu_types], dtype=float)
            self.bound = CoverBound(configs, [s.weight for s in specs], counts, z_max=upper_bound)
        return self.bound.refutes(T)


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
) -> MilpOutcome:
    """Build, solve and extract one MILP plan (no placement)."""
    t0 = time.perf_counter()
    configs = model_configs(
        specs,
        cluster,
        levels,
        max_partitions=max_partitions,
        margin=margin,
        # Comparing across templates is exact only when resources do not depend on the slot.
        group_by_multiset=(gpu_rule == "physical" and not one_config_per_template),
        files=files,
    )
    milp, variables = build(specs, configs, cluster, gpu_rule=gpu_rule, one_config_per_template=one_config_per_template)
    objective.apply(milp, variables)
    if isinstance(objective, MaxMinNormalized) and getattr(solver, "accepts_prover", False):
        # The cover bound proves HiGHS's incumbents optimal where branch and bound is slow
        # (it is only asked after prover_after_s, so easy models pay nothing). Gurobi takes it
        # only to hand it to HiGHS when its licence refuses the model.
        prover = CoverProver(configs, specs, cluster)
        result = solver.solve(milp, time_limit_s=time_limit_s, gap=gap, prover=prover, prover_after_s=PROVER_AFTER_S)
    else:
        result = solver.solve(milp, time_limit_s=time_limit_s, gap=gap)
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
