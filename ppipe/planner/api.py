"""``ppipe.plan(...)``: cluster + model profiles -> an immutable :class:`~ppipe.spec.plan.Plan`.

Defaults, and where they come from:

* SLO of a model (first that applies): ``slo_ms=`` (one value or per model);
  ``slo_scale=`` x its batch-1 latency on the reference GPU; ``slo_ms`` of its model.yaml;
  5 x its batch-1 latency on the reference GPU (the paper's rule). The reference GPU is the
  L4 when the profile has it (the paper's choice), else the cluster's type on which the
  whole model runs fastest at batch 1. The batch-1 latency is ``latency_bs1_us`` of
  model.yaml when present, else the sum of the profiled block latencies.
* ``formulation="ppipe"`` (default): physical GPU packing, several configurations per
  template, margin 0.4, batch-build estimate from the NP plan.
  ``formulation="ppipe-atc25"``: the authors' model (``ilp_v4.py`` of their artifact) all
  at once: paper GPU rule, one configuration per template of theirs, margin 0.4 rounded
  to whole microseconds, a missing NIC side as a 1 us transfer, SLO = 5 x the L4 batch-1
  latency (model.yaml's slo_ms ignored), and the batch-build estimate of their scripts:
  the NP plan for several models, their whole-GPU estimate for one
  (:func:`~ppipe.planner.baselines.whole_gpu_estimate`). Explicit arguments still win.
* The batch-build estimate x_hat (it only sizes beta(b)) is each model's throughput in the
  NP plan; where the plan is made by column generation (max-min, physical packing, a
  MILP of over 5,000 columns), in the NP plan's LP relaxation (:func:`_relaxed_estimate`).
* ``time_limit_s`` is the budget of the whole call. The NP plan behind the batch-build
  estimate may take ESTIMATE_SHARE of it and stops after ESTIMATE_MAX_NODES nodes; the
  plan's own MILP gets the rest (:mod:`ppipe.planner.core` splits it further). A plan found by then is returned with its gap; only where none was found is
  it a :class:`~ppipe.planner.solvers.SolverTimeLimitError` that names the limit.
* A profile must time every GPU type of the cluster (at some level); GPU types the
  cluster lacks are ignored (the PPipe artifact times four types for every model).
* Headroom (:mod:`ppipe.planner.headroom`): GPUs the plan leaves idle become extra vGPUs
  for pools busier than 80 % at the planned load. The result is an optimal solution of the
  paper's MILP (same objective value, every row met; pools may exceed ppipe's tighter
  bounds U, which cut exactly that slack), so it is on by default for the
  ``ppipe`` planner with the max-min or total objective in both formulations
  (``ppipe-atc25`` included: the paper's model does not say which of its optimal plans to
  run); off for the baselines (NP, DART-r as the paper defines them) and for objectives
  that price GPUs (min-cost, custom). ``headroom=`` decides explicitly.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Iterable, Literal, Mapping, Sequence, Union

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from ppipe.errors import InfeasibleError, UserError
from ppipe.planner.baselines import dart_r, np_levels, whole_gpu_estimate
from ppipe.planner.configs import ModelSpec
from ppipe.planner.core import milp_plan, plan_configs
from ppipe.planner.objectives import ObjectiveLike, get_objective
from ppipe.planner.solvers import SolverTimeLimitError, get_solver, time_left
from ppipe.spec.cluster import ClusterSpec, load_cluster, resolve_cluster_path
from ppipe.spec.local_gpu import is_local_gpu
from ppipe.spec.plan import Plan, PlanSettings, SolverReport
from ppipe.spec.profile import ModelProfile, load_profile, load_profile_ref, profile_ref, resolve_model_dir  # noqa: F401 (re-exported)

PLANNERS = ("ppipe", "np", "dart-r")
FORMULATIONS = ("ppipe", "ppipe-atc25")
DEFAULT_SLO_SCALE = 5.0
REFERENCE_GPU = "L4"
# The NP plan behind the batch-gathering estimate x_hat may take this share of the time
# limit, and stops after about ESTIMATE_MAX_NODES branch-and-bound nodes: on 1,000 GPUs
# (scripts/bench_fleet.py) its MILP of 63 columns takes 250,000 nodes without closing a
# 0.1 % gap, and gives the same plan after 500 nodes as after 5,000; every case of
# scripts/bench_planner.py proves it within one node. x_hat only sizes beta(b).
ESTIMATE_SHARE = 0.2
ESTIMATE_MAX_NODES = 1_000

ModelRef = Union[ModelProfile, str, Path]


def _formulation_defaults(formulation: str) -> dict:
    if formulation == "ppipe":
        return dict(gpu_rule="physical", configs_per_template="many", margin=0.4, batch_build=True, paper_slo=False, authors=False)
    if formulation == "ppipe-atc25":
        return dict(gpu_rule="paper", configs_per_template="one", margin=0.4, batch_build=True, paper_slo=True, authors=True)
    raise UserError(f"unknown formulation '{formulation}'", fix=f"use one of: {', '.join(FORMULATIONS)} (option --formulation)")


def resolve_cluster(cluster: ClusterSpec | str | Path) -> tuple[ClusterSpec, str | None]:
    """(spec, file) from a ClusterSpec, a YAML path or a built-in name; no file for
    ``local-gpu``, which ``simulate`` and ``serve`` detect again from the plan's cluster name."""
    if isinstance(cluster, ClusterSpec):
        return cluster, None
    if is_local_gpu(cluster):
        return load_cluster(cluster), None
    return load_cluster(cluster), str(resolve_cluster_path(cluster))


def resolve_models(models: Iterable[ModelRef] | None) -> list[ModelProfile]:
    """Profiles from profiles, folders or built-in names; None = every built-in model."""
    if models is None:
        from ppipe.spec.cluster import builtin_dirs

        found = sorted({m.parent for d in builtin_dirs("models") for m in d.glob("*/model.yaml")}, key=lambda p: p.name)
        if not found:
            raise UserError(
                "no models given and no built-in models found (the repository's models/ folder is empty)",
                fix="name model folders (made by `ppipe profile` or `ppipe import-ppipe`) after the cluster",
            )
        models = found
    out: list[ModelProfile] = []
    for ref in models:
        out.append(ref if isinstance(ref, ModelProfile) else load_profile(resolve_model_dir(ref)))
    if not out:
        raise UserError("no models to plan", fix="give at least one model profile")
    names = [p.name for p in out]
    dup = sorted({n for n in names if names.count(n) > 1})
    if dup:
        raise UserError(f"model(s) {dup} given more than once", fix="give each model once")
    return out


def _model_file(p: ModelProfile) -> str | None:
    return str(Path(p.directory) / "model.yaml") if p.directory is not None else None


def usable_levels(profile: ModelProfile, cluster: ClusterSpec) -> dict[str, list[int]]:
    """Per cluster GPU type, the vGPU levels both the cluster allows and the profile times.

    Raises:
        UserError: a cluster type the profile does not time at any allowed level.
    """
    have = set(profile.gpus())
    out: dict[str, list[int]] = {}
    for g in cluster.gpu_types:
        if g.name not in have:
            raise UserError(
                f"model '{profile.name}' has no timings for GPU type '{g.name}' of cluster '{cluster.name}' "
                f"(profile.csv, column 'gpu', has: {', '.join(sorted(have)) or 'nothing'})",
                fix=f"profile the model on {g.name} (`ppipe profile`), or plan on a cluster without {g.name}",
                file=_model_file(profile),
            )
        lv = [v for v in g.vgpu_levels if profile.batches(g.name, v)]
        if not lv:
            raise UserError(
                f"model '{profile.name}' times GPU type '{g.name}' only at vGPU level(s) {profile.levels(g.name)}, "
                f"but cluster '{cluster.name}' allows {g.vgpu_levels}",
                fix=f"profile the model on {g.name} at one of levels {g.vgpu_levels}, or change vgpu_levels of {g.name} in the cluster file",
                file=_model_file(profile),
            )
        out[g.name] = lv
    return out


def batch1_latency_us(profile: ModelProfile, gpu: str) -> float:
    if gpu in profile.manifest.latency_bs1_us:
        return float(profile.manifest.latency_bs1_us[gpu])
    return profile.model_latency_us(gpu, 1, 1)


def reference_gpu(profile: ModelProfile, cluster: ClusterSpec) -> str:
    """L4 when the profile has it, else the cluster's type with the fastest batch-1 model latency."""
    if REFERENCE_GPU in profile.manifest.latency_bs1_us or profile.batches(REFERENCE_GPU, 1):
        return REFERENCE_GPU
    cands = [k for k in cluster.gpu_counts if profile.batches(k, 1)]
    if not cands:
        raise UserError(
            f"model '{profile.name}': no batch-1 timing at vGPU level 1 on any type of cluster '{cluster.name}', "
            "so no default SLO can be derived",
            fix="give the SLO (--slo-ms / slo_ms=) or profile batch 1 at level 1",
            file=_model_file(profile),
        )
    return min(cands, key=lambda k: batch1_latency_us(profile, k))


def _per_model(value, names: list[str], what: str, flag: str):
    """A scalar, a sequence in model order, or a mapping by model name -> {name: value or None}."""
    if value is None:
        return {n: None for n in names}
    if isinstance(value, Mapping):
        unknown = sorted(set(value) - set(names))
        if unknown:
            raise UserError(f"{what}: unknown model(s) {unknown}", fix=f"use model names from: {', '.join(names)} ({flag})")
        return {n: (float(value[n]) if n in value else None) for n in names}
    if isinstance(value, (int, float)):
        return {n: float(value) for n in names}
    vals = list(value)
    if len(vals) != len(names):
        raise UserError(f"{what}: {len(vals)} value(s) for {len(names)} model(s)", fix=f"give one value per model, in order ({flag})")
    return {n: float(v) for n, v in zip(names, vals)}


def resolve_slos(profiles: list[ModelProfile], cluster: ClusterSpec, slo_ms, slo_scale, paper_slo: bool) -> dict[str, float]:
    names = [p.name for p in profiles]
    explicit = _per_model(slo_ms, names, "slo_ms", "--slo-ms")
    out = {}
    for p in profiles:
        if explicit[p.name] is not None:
            out[p.name] = explicit[p.name]
            continue
        if slo_scale is None and not paper_slo and p.manifest.slo_ms is not None:
            out[p.name] = float(p.manifest.slo_ms)
            continue
        scale = DEFAULT_SLO_SCALE if slo_scale is None else float(slo_scale)
        if scale <= 0:
            raise UserError(f"slo_scale must be positive, got {scale}", fix="pass e.g. --slo-scale 5")
        ref = REFERENCE_GPU if paper_slo and REFERENCE_GPU in p.manifest.latency_bs1_us else reference_gpu(p, cluster)
        out[p.name] = scale * batch1_latency_us(p, ref) / 1000.0
    for n, v in out.items():
        if not v > 0:
            raise UserError(f"SLO of model '{n}' must be positive, got {v} ms", fix="pass a positive --slo-ms")
    return out


class PlanOptions(BaseModel):
    """The planner's settings from :func:`plan`'s arguments, validated (None: the formulation's default)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    planner: Literal["ppipe", "np", "dart-r"] = "ppipe"
    formulation: Literal["ppipe", "ppipe-atc25"] = "ppipe"
    gpu_rule: Literal["physical", "paper"] | None = None
    configs_per_template: Literal["many", "one"] | None = None
    margin: float | None = Field(default=None, ge=0, lt=1)
    max_partitions: int | None = Field(default=None, ge=1)
    batch_build: bool | None = None
    time_limit_s: float | None = Field(default=None, gt=0)
    gap: float = Field(default=1e-4, ge=0)
    headroom: bool | float | None = None
    column_generation: bool | None = None

    @field_validator("planner", mode="before")
    @classmethod
    def _lower(cls, v):
        return v.lower() if isinstance(v, str) else v

    @field_validator("headroom")
    @classmethod
    def _headroom_target(cls, v):
        if v is not None and not isinstance(v, bool) and not 0 <= v < 1:
            raise ValueError(f"headroom utilization target must be in [0, 1), got {v}")
        return v


# How to correct each option (named by its keyword and its CLI flag).
_OPTION_FIXES = {
    "planner": f"use one of: {', '.join(PLANNERS)} (option --planner)",
    "formulation": f"use one of: {', '.join(FORMULATIONS)} (option --formulation)",
    "gpu_rule": "use 'physical' or 'paper' (option --gpu-rule)",
    "configs_per_template": "use 'many' or 'one' (option --configs-per-template)",
    "margin": "pass a share in [0, 1), e.g. --margin 0.4",
    "max_partitions": "pass e.g. --max-partitions 2",
    "batch_build": "pass True or False (option --batch-build/--no-batch-build)",
    "time_limit_s": "pass a positive number of seconds, or None for no limit (option --time-limit-s)",
    "gap": "pass a relative gap >= 0, e.g. --gap 1e-4",
    "headroom": "pass True, False or a utilization in [0, 1), e.g. --headroom-util 0.8, or --no-headroom",
    "column_generation": "pass True, False or None (option --column-generation/--no-column-generation)",
}


def plan_options(**kw) -> PlanOptions:
    """:class:`PlanOptions` from keyword arguments; a bad one is a UserError naming it and its fix."""
    try:
        return PlanOptions(**kw)
    except ValidationError as err:
        first = err.errors()[0]
        name = str(first["loc"][0]) if first.get("loc") else "?"
        msg = first.get("msg", "invalid value").removeprefix("Value error, ")
        raise UserError(f"{name}: {msg} (got {first.get('input')!r})", fix=_OPTION_FIXES.get(name, "see ppipe.plan's arguments")) from None


@dataclass(frozen=True)
class _Settings:
    """What one planning call runs with: the options, the formulation's defaults filled in."""

    planner: str
    formulation: str
    gpu_rule: str
    one_config_per_template: bool
    margin: float
    max_partitions: int
    batch_build: bool
    paper_slo: bool
    authors: bool
    column_generation: bool | None = None


def _settings(opts: PlanOptions) -> _Settings:
    fd = _formulation_defaults(opts.formulation)
    return _Settings(
        column_generation=opts.column_generation,
        planner=opts.planner,
        formulation=opts.formulation,
        gpu_rule=opts.gpu_rule or fd["gpu_rule"],
        one_config_per_template=(opts.configs_per_template or fd["configs_per_template"]) == "one",
        margin=fd["margin"] if opts.margin is None else opts.margin,
        max_partitions=3 if opts.max_partitions is None else opts.max_partitions,
        batch_build=fd["batch_build"] if opts.batch_build is None else opts.batch_build,
        paper_slo=fd["paper_slo"],
        authors=fd["authors"],
    )


def plan(
    cluster: ClusterSpec | str | Path = "HC2-S",
    models: Sequence[ModelRef] | None = None,
    *,
    objective: ObjectiveLike | None = None,
    planner: str = "ppipe",
    formulation: str = "ppipe",
    solver: str = "highs",
    slo_ms: float | Mapping[str, float] | Sequence[float] | None = None,
    slo_scale: float | None = None,
    weights: Mapping[str, float] | Sequence[float] | None = None,
    margin: float | None = None,
    max_partitions: int | None = None,
    gpu_rule: str | None = None,
    configs_per_template: str | None = None,
    batch_build: bool | None = None,
    required_rps: float | Mapping[str, float] | None = None,
    time_limit_s: float | None = 60.0,
    gap: float = 1e-4,
    place: bool = True,
    headroom: bool | float | None = None,
    column_generation: bool | None = None,
    warm_start: Plan | None = None,
) -> Plan:
    """Plan pooled pipelines for models on a cluster.

    Args:
        cluster: a ClusterSpec, a cluster YAML path, or a built-in name (``"HC2-S"``).
        models: ModelProfiles, model folders or built-in model names; None = all built-in models.
        objective: ``"max-min"`` (default), ``"total"``, ``"min-cost"`` (needs
            ``required_rps``), an Objective object, or ``fn(milp, variables)``.
        planner: ``"ppipe"`` (MILP), ``"np"`` (no partitioning, no MPS) or ``"dart-r"``.
        formulation: ``"ppipe"`` or ``"ppipe-atc25"`` (every paper choice; see module docstring).
        solver: ``"highs"`` (default), ``"cbc"`` or ``"gurobi"``.
        slo_ms: SLO in ms: one value, one per model (in order), or {model: ms}.
        slo_scale: SLO = this x the batch-1 latency on the reference GPU.
        weights: workload weights w_m (one per model, or {model: w}); default 1 each.
        margin: share of the SLO the planner keeps free (default 0.4).
        max_partitions: D, at most this many partitions per pipeline (default 3).
        gpu_rule: ``"physical"`` or ``"paper"`` (default from the formulation).
        configs_per_template: ``"many"`` or ``"one"`` (default from the formulation).
        batch_build: apply beta(b) with x_hat from the NP plan (default True).
        required_rps: rate per model for the min-cost objective.
        time_limit_s: wall-clock budget of the whole call in s (the NP plan for the
            batch-build estimate, the split search and the solver share it; the best plan
            found by then is returned with its gap). None = none. The limit only stops
            searches: a plan it shaped says ``time_limit``; otherwise the same inputs give
            the same plan on any machine.
        gap: relative MIP gap at which the solver stops (1e-4 = 0.01 %).
        place: assign vGPUs to servers (``Plan.placement``).
        headroom: give the pools that are busier than a target utilization at the planned
            load extra vGPUs from the GPUs the plan leaves idle (:mod:`ppipe.planner.headroom`):
            True = target 0.8, a number in [0, 1) = that target, False = off; None = the
            default (see the module docstring). The objective value does not change.
        column_generation: price configurations against the LP's duals and solve the MILP
            over the generated ones (:mod:`ppipe.planner.colgen`; max-min, physical packing,
            several configurations per template) instead of the MILP over all of them.
            None = where the whole MILP would exceed 5,000 columns. The gap reported is
            then to the LP bound of the whole configuration space.
        warm_start: the served plan of a re-plan: with column generation, its
            configurations join the generated ones in the restricted MILP and its pools
            (headroom taken off) start the solve where they are still a plan and better
            than the rounded LP solution (:mod:`ppipe.planner.colgen`); unused otherwise.
            Its models are matched by name.

    Returns:
        The immutable plan.

    Raises:
        UserError: bad input (unknown names, profiles that do not cover the cluster, ...).
        InfeasibleError: a model meets its SLO on no GPU type (the message gives the
            smallest feasible SLO), or the objective's rates cannot be carried.
        SolverTimeLimitError: the time limit struck before any plan was found.
    """
    t0 = time.perf_counter()
    opts = plan_options(
        planner=planner, formulation=formulation, gpu_rule=gpu_rule, configs_per_template=configs_per_template,
        margin=margin, max_partitions=max_partitions, batch_build=batch_build, time_limit_s=time_limit_s, gap=gap,
        headroom=headroom, column_generation=column_generation,
    )
    st = _settings(opts)
    obj = get_objective(objective, required_rps)
    _check_column_generation(st, obj)
    spec, cluster_file = resolve_cluster(cluster)
    profiles = resolve_models(models)
    levels = [usable_levels(p, spec) for p in profiles]
    specs = _model_specs(profiles, spec, slo_ms, slo_scale, weights, st.paper_slo)
    run = _Run(st, spec, levels, get_solver(solver), gap, [_model_file(p) for p in profiles],
               None if time_limit_s is None else t0 + time_limit_s, None if warm_start is None else list(warm_start.models))
    try:
        specs, np_out, estimate_clocked, configs = _with_batch_build(run, specs, obj)
        models_out, report = _solve(run, specs, np_out, obj, configs)
    except SolverTimeLimitError as err:
        raise SolverTimeLimitError(
            f"no plan found within the time limit of {time_limit_s} s (time_limit_s, --time-limit-s): {err.message}",
            fix="raise --time-limit-s (or time_limit_s=); or plan less at once: fewer models, --max-partitions 2",
        ) from None
    if estimate_clocked and report.status in ("optimal", "feasible"):
        report = report.model_copy(update={"status": "time_limit"})  # the clock stopped the estimate's NP plan
    report = report.model_copy(update={"seconds": time.perf_counter() - t0})
    target_util = _headroom_target(opts.headroom, st.planner, st.formulation, obj.name)
    if target_util is not None:
        from ppipe.planner.headroom import add_headroom

        models_out = add_headroom(models_out, spec, st.gpu_rule, target_util)
    placement, used = _placed(models_out, spec, st.gpu_rule, place)
    return Plan(cluster=spec.name, cluster_file=cluster_file, settings=_plan_settings(st, obj, specs, target_util),
                solver=report, models=models_out, gpus_used=used, placement=placement)


def _plan_settings(st: _Settings, obj, specs: list[ModelSpec], target_util: float | None) -> PlanSettings:
    """plan.yaml's ``settings``: what the plan was made with (the baselines' fixed partitions,
    whether beta applied to any model)."""
    return PlanSettings(
        planner=st.planner,
        formulation=st.formulation,
        gpu_rule=st.gpu_rule,
        configs_per_template="one" if st.one_config_per_template else "many",
        objective=obj.name,
        margin=st.margin,
        max_partitions={"np": 1, "dart-r": 2}.get(st.planner, st.max_partitions),
        batch_build=any(s.batch_build_rps for s in specs) and st.planner != "np",
        headroom_util=target_util,
    )


def _model_specs(profiles, cluster, slo_ms, slo_scale, weights, paper_slo: bool) -> list[ModelSpec]:
    """Per model, its SLO and weight (validated) as the planner's :class:`ModelSpec`."""
    names = [p.name for p in profiles]
    slos = resolve_slos(profiles, cluster, slo_ms, slo_scale, paper_slo)
    w = {n: (1.0 if v is None else v) for n, v in _per_model(weights, names, "weights", "--weights").items()}
    for n, v in w.items():
        if not v > 0:
            raise UserError(f"weight of model '{n}' must be positive, got {v}", fix="pass positive --weights")
    return [ModelSpec(profile=p, slo_ms=slos[p.name], weight=w[p.name], profile_ref=profile_ref(p)) for p in profiles]


def _check_column_generation(st: _Settings, obj) -> None:
    """Column generation asked for where it cannot plan is a UserError."""
    from ppipe.planner.core import column_generation_applies

    if st.column_generation and st.planner == "ppipe" and not column_generation_applies(obj, st.gpu_rule, st.one_config_per_template):
        raise UserError(
            f"column generation plans the max-min objective under physical packing with several configurations "
            f"per template, not objective '{obj.name}' with gpu_rule '{st.gpu_rule}' and "
            f"configs_per_template '{'one' if st.one_config_per_template else 'many'}'",
            fix="drop --column-generation (column_generation=), or use --objective max-min --gpu-rule physical "
                "--configs-per-template many",
        )


@dataclass(frozen=True)
class _Run:
    """What every MILP of one planning call shares: settings, cluster, levels, solver,
    deadline, and the served plan of a re-plan (or None)."""

    settings: _Settings
    cluster: ClusterSpec
    levels: list[dict[str, list[int]]]
    solver: object
    gap: float
    files: list[str | None]
    deadline: float | None
    warm: list | None = None

    def configs(self, specs, *, no_partitioning: bool = False):
        """:func:`plan_configs` with this call's settings (``no_partitioning``: the NP plan's)."""
        st = self.settings
        return plan_configs(specs, self.cluster, np_levels(self.levels) if no_partitioning else self.levels,
                            max_partitions=1 if no_partitioning else st.max_partitions, margin=st.margin,
                            gpu_rule=st.gpu_rule, one_config_per_template=st.one_config_per_template,
                            authors_arithmetic=st.authors, files=self.files)

    def milp(self, specs, objective, *, no_partitioning: bool = False, estimate: bool = False, configs=None):
        """:func:`milp_plan` with this call's settings; ``no_partitioning``: the NP plan
        (one partition, level 1 only); ``estimate``: the NP plan behind x_hat, within
        ESTIMATE_SHARE of the time left and ESTIMATE_MAX_NODES nodes; ``configs``: the
        plan's configurations where :meth:`configs` made them already."""
        st = self.settings
        deadline = self.deadline
        if estimate and deadline is not None:
            now = time.perf_counter()
            deadline = now + ESTIMATE_SHARE * max(0.0, deadline - now)
        return milp_plan(
            specs,
            self.cluster,
            np_levels(self.levels) if no_partitioning else self.levels,
            objective=objective,
            max_partitions=1 if no_partitioning else st.max_partitions,
            gpu_rule=st.gpu_rule,
            one_config_per_template=st.one_config_per_template,
            time_limit_s=time_left(deadline),
            solver=self.solver,
            margin=st.margin,
            gap=self.gap,
            files=self.files,
            authors_arithmetic=st.authors,
            column_generation=None if estimate else st.column_generation,
            node_limit=ESTIMATE_MAX_NODES if estimate else None,
            warm=None if estimate or no_partitioning else self.warm,
            configs=configs,
        )


def _with_batch_build(run: _Run, specs: list[ModelSpec], obj):
    """(specs with the batch-gathering estimate's x_hat where it applies, the NP plan or
    None, whether the clock shaped the estimate, the plan's configurations where they were
    made on the way or None).

    The NP plan gives x_hat (and is DART-r's start); the authors' single-model runs take
    their whole-GPU estimate instead, and a plan made by column generation the NP plan's
    LP relaxation (:func:`_relaxed_estimate`). NP's own plan has no estimate (NP is its
    source). The NP plan may take ESTIMATE_SHARE of the time left and ESTIMATE_MAX_NODES
    nodes; one the clock stopped makes the plan say time_limit, and where it found no
    plan at all, beta is off (``settings.batch_build`` then says false).
    """
    st = run.settings
    if st.planner == "ppipe" and st.batch_build and st.authors and len(specs) == 1:
        xhat1 = whole_gpu_estimate(specs[0], run.cluster, st.margin)
        return [replace(specs[0], batch_build_rps=xhat1 if xhat1 > 0 else None)], None, False, None
    if not (st.planner == "dart-r" or (st.planner == "ppipe" and st.batch_build)):
        return specs, None, False, None
    relaxed = _relaxed_estimate(run, specs, obj) if st.planner == "ppipe" else None
    if relaxed is not None:
        return relaxed[0], None, False, relaxed[1]
    estimate = st.planner == "ppipe"  # DART-r's NP plan is its own start: the whole budget
    try:
        np_out = run.milp(specs, get_objective("max-min"), no_partitioning=True, estimate=estimate)
    except InfeasibleError:
        return specs, None, False, None  # no whole-model GPU meets some SLO: no estimate, beta off
    except SolverTimeLimitError:
        if not estimate:
            raise
        return specs, None, True, None
    xhat = {m.name: m.throughput_rps for m in np_out.models}
    specs = [replace(s, batch_build_rps=xhat[s.name] if st.batch_build and xhat[s.name] > 0 else None) for s in specs]
    return specs, np_out, estimate and np_out.result.status == "time_limit", None


def _relaxed_estimate(run: _Run, specs: list[ModelSpec], obj):
    """(specs with x_hat from the NP plan's LP relaxation, the plan's configurations) where
    the plan is then made by column generation (:func:`~ppipe.planner.core.wants_column_generation`
    on those configurations), else None.

    Why: at that scale the NP MILP is slow to solve (on 1,000 GPUs, 1,000 nodes take
    seconds and leave a gap), while its LP relaxation, solved exactly in milliseconds,
    gives the same plan value within a fraction of a percent; x_hat only sizes beta(b).
    The relaxation is a function of the inputs alone, so the same inputs take the same
    path. Where column generation does not follow, the NP MILP gives x_hat as before.
    """
    from ppipe.planner.colgen import relaxation_rates
    from ppipe.planner.core import column_generation_applies, wants_column_generation

    st = run.settings
    if st.column_generation is False or not column_generation_applies(obj, st.gpu_rule, st.one_config_per_template):
        return None
    try:
        np_configs = run.configs(specs, no_partitioning=True)
    except InfeasibleError:
        return None  # the NP MILP's path says so (beta off)
    counts = [run.cluster.gpu_counts[g.name] for g in run.cluster.gpu_types]
    rates = relaxation_rates(np_configs, [s.weight for s in specs], counts)
    if rates is None:
        return None
    relaxed = [replace(s, batch_build_rps=r if r > 0 else None) for s, r in zip(specs, rates)]
    configs = run.configs(relaxed)
    if not wants_column_generation(st.column_generation, obj, st.gpu_rule, st.one_config_per_template, configs):
        return None
    return relaxed, configs


def _solve(run: _Run, specs: list[ModelSpec], np_out, obj, configs=None):
    """(per-model plans, the solver report without its time) of the chosen planner
    (``configs``: the ppipe plan's configurations where they were made already)."""
    st = run.settings
    if st.planner == "dart-r":
        if np_out is None:
            np_out = run.milp(specs, get_objective("max-min"), no_partitioning=True)  # raises the InfeasibleError
        models_out = dart_r(specs, run.cluster, run.levels, np_out.models, margin=st.margin)
        z = min(m.throughput_rps / m.weight for m in models_out)
        return models_out, SolverReport(name=np_out.result.solver, status="heuristic", gap=0.0, seconds=0.0, objective=z,
                                        columns=np_out.columns)
    out = run.milp(specs, obj, no_partitioning=st.planner == "np", configs=configs if st.planner == "ppipe" else None)
    r = out.result
    return out.models, SolverReport(name=r.solver, status=r.status, gap=r.gap, seconds=0.0, objective=r.objective,
                                    columns=out.columns, method=r.method, nodes=r.nodes, lp_iterations=r.lp_iterations)


def _placed(models_out, cluster: ClusterSpec, gpu_rule: str, place: bool):
    """(vGPU placement or [], GPUs used per type)."""
    if not place:
        from ppipe.planner.formulation import gpus_needed

        return [], gpus_needed(models_out, list(cluster.gpu_counts), gpu_rule)
    from ppipe.planner.placement import gpus_used, place as place_vgpus

    placement = place_vgpus(models_out, cluster, gpu_rule)
    return placement, gpus_used(placement, cluster)


def _headroom_target(headroom: bool | float | None, planner: str, formulation: str, objective: str) -> float | None:
    """The headroom pass's utilization target, or None for no pass (see the module docstring)."""
    from ppipe.planner.headroom import DEFAULT_TARGET_UTIL

    if headroom is None:
        # Both formulations: the pass only picks another optimal solution of the paper's
        # MILP (ppipe.planner.headroom). The baselines keep the paper's definitions.
        on = planner == "ppipe" and objective in ("max-min", "total")
        return DEFAULT_TARGET_UTIL if on else None
    if headroom is True:
        return DEFAULT_TARGET_UTIL
    if headroom is False:
        return None
    return float(headroom)

