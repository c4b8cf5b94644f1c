"""Loading a plan for simulation, rates from load factors, single runs and load sweeps.

Load factor
-----------
Load factor 1.0 is the throughput in the output of the planner's MILP (the paper, §7.1),
shared among the models by weight: for a plan made with the max-min objective (maximize
z subject to ``w_m z <= x_m``), model m's base rate is ``w_m * z`` with z the solver's
objective value (``plan.solver.objective``) -- i.e. the plan's throughput times the
model's weight share (:attr:`RateBasis.SHARE`, the default). ``x_m``
(``ModelPlan.throughput_rps``, the capacity of the model's pools) can exceed ``w_m z``:
for a model that does not bind the objective the solver leaves such slack where GPUs
come in whole units, and the headroom pass (:mod:`ppipe.planner.headroom`) adds vGPUs
from idle GPUs; neither is part of the objective (in the paper's MILP a pipeline's
throughput is a variable bounded *above* by its pools' capacity, so only ``w_m z`` is
what the plan promises). Without headroom, for the binding model the two are equal.
``RateBasis.PLANNED`` uses each model's own ``x_m`` instead (stricter on models with
slack); plans made with another objective always use ``x_m``.

A run at load ``f`` offers ``f x base rate`` per model. To drive several systems at the
same absolute rates (the paper drives NP and DART-r at PPipe's rates), pass the base
rates of the reference plan (:func:`base_rates` of it, or ``--rates-from``).

Sweeps
------
``search="scan"`` (the paper): load 1.0, 0.95, ... 0.05; a model's maximum load factor is
the first (highest) load at which its attainment is >= the target (99 %). The scan stops
once every model has one. ``bisect_steps`` then halves the 0.05 interval above each
model's answer that many times (one run per model and step).

``search="bisect"`` (faster, same grid): assumes attainment falls as load rises, and
finds each model's highest passing grid point by bisection over the grid, each run
informing every model. It agrees with the scan whenever attainment is monotone in the
load; it needs ~5 runs instead of up to 20.

``search="guided"`` is the bisection with a better next guess: a failing run at load
``f`` where a model met a share ``a`` of its requests says its capacity is about ``a x f``,
so the next run is at the grid point just below that (then one step up, to confirm).
Same answer as ``bisect`` under the same assumption, usually in 3-4 runs.

Early stop (``early_stop=True``, the default): every run of a sweep stops as soon as
every model is certain to miss the target (:class:`~ppipe.sim.simulator.SimConfig`
``stop_below``), which is what a failing point of an overloaded plan costs most of its
time on. Pass/fail at each point is the full run's; such a point's attainment covers the
requests that arrived before the stop (``SimResult.stopped_at_s``), and the guided
search reads its capacity from the requests already decided there (served on time out
of served, dropped or late).
"""

from __future__ import annotations

import dataclasses
import enum
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Mapping

import numpy as np

from ppipe.errors import UserError
from ppipe.sim.arrivals import ArrivalKind, make_arrivals
from ppipe.sim.metrics import SimResult
from ppipe.sim.simulator import SchedulerFactory, SimConfig, simulate
from ppipe.spec.cluster import ClusterSpec, load_cluster
from ppipe.spec.plan import Plan, load_plan
from ppipe.spec.profile import ModelProfile, load_profile_ref

GRID_STEP = 0.05
DEFAULT_TARGET = 0.99


class Search(str, enum.Enum):
    SCAN = "scan"
    BISECT = "bisect"
    GUIDED = "guided"


def load_inputs(plan_path: str | Path, cluster: str | Path | None = None) -> tuple[Plan, dict[str, ModelProfile], ClusterSpec]:
    """Read plan.yaml, its models' profiles and its cluster.

    Profiles are reloaded from each ``ModelPlan.profile`` (relative to plan.yaml, or
    absolute, or a built-in model name). The cluster is ``cluster`` if given, else the
    plan's ``cluster_file`` (relative to plan.yaml), else the built-in cluster named by
    ``plan.cluster``.

    Raises:
        UserError: a missing/malformed file, or a profile whose model name differs from the plan's.
    """
    plan_path = Path(plan_path)
    if not plan_path.is_file():
        raise UserError("plan file not found", fix="give the plan.yaml written by `ppipe plan`", file=str(plan_path))
    plan = load_plan(plan_path)
    base = plan_path.parent
    profiles: dict[str, ModelProfile] = {}
    for m in plan.models:
        prof = load_profile_ref(m.profile, base)
        if prof.name != m.name:
            raise UserError(
                f"models[{m.name}].profile '{m.profile}' holds model '{prof.name}', not '{m.name}'",
                fix="point 'profile' at the folder of that model's profile",
                file=str(plan_path),
            )
        profiles[m.name] = prof
    if cluster is not None:
        spec = load_cluster(cluster)
    elif plan.cluster_file:
        ref = Path(plan.cluster_file)
        cand = ref if ref.is_absolute() else base / ref
        spec = load_cluster(cand if cand.exists() else plan.cluster_file)
    else:
        spec = load_cluster(plan.cluster)
    return plan, profiles, spec


class RateBasis(str, enum.Enum):
    """What load factor 1.0 means per model (see the module docstring)."""

    SHARE = "share"
    PLANNED = "planned"


def base_rates(plan: Plan, basis: RateBasis | str = RateBasis.SHARE) -> dict[str, float]:
    """Load factor 1.0 per model, req/s.

    Args:
        plan: the (reference) plan.
        basis: ``share`` (default): ``w_m * min_m'(x_m' / w_m')`` for a max-min plan, the
            plan's max-min throughput times the model's weight; ``planned``: each model's
            planned throughput ``x_m``. Plans with another objective always give ``x_m``.
    """
    try:
        basis = RateBasis(basis)
    except ValueError:
        raise UserError(f"unknown rate basis {basis!r}", fix="use 'share' (default) or 'planned'") from None
    planned = {m.name: float(m.throughput_rps) for m in plan.models}
    if basis is RateBasis.PLANNED or plan.settings.objective != "max-min" or not plan.models:
        return planned
    # The solver's max-min value: the pools' capacities may exceed it (headroom, integer
    # pool sizes), the objective is what the plan promises every model.
    z = float(plan.solver.objective)
    return {m.name: float(m.weight * z) for m in plan.models}


def check_rates(plan: Plan, rates_rps: Mapping[str, float], source: str = "rates") -> dict[str, float]:
    missing = [m.name for m in plan.models if m.name not in rates_rps]
    if missing:
        raise UserError(
            f"{source}: no rate for model(s) {missing} of the plan",
            fix="give a reference plan that serves the same models (same names)",
        )
    return {m.name: float(rates_rps[m.name]) for m in plan.models}


@dataclass(frozen=True)
class Workload:
    """How requests arrive. ``trace_s`` is a trace read by :func:`ppipe.sim.arrivals.read_trace`."""

    kind: ArrivalKind = ArrivalKind.POISSON
    cv: float = 2.0
    trace_s: np.ndarray | None = field(default=None, compare=False)
    period_s: float = 600.0  # of the shifting mix (ArrivalKind.SHIFTING)


def run_point(
    plan: Plan,
    profiles: Mapping[str, ModelProfile],
    cluster: ClusterSpec,
    load: float,
    *,
    rates_rps: Mapping[str, float] | None = None,
    workload: Workload = Workload(),
    config: SimConfig = SimConfig(),
    scheduler_factory: SchedulerFactory | None = None,
) -> SimResult:
    """Simulate one load factor (rates = load x base rates; base = the plan's own by default)."""
    if not (load > 0 and math.isfinite(load)):
        raise UserError(f"load factor must be > 0, got {load}", fix="give e.g. --load 0.9")
    base = check_rates(plan, rates_rps) if rates_rps is not None else base_rates(plan)
    rates = {m: load * r for m, r in base.items()}
    arrivals = make_arrivals(
        workload.kind, rates, config.duration_s * 1e6, config.seed, cv=workload.cv, trace_s=workload.trace_s,
        period_s=workload.period_s,
        models=[m.name for m in plan.models],
    )
    return simulate(plan, profiles, cluster, arrivals, config, scheduler_factory)


@dataclass
class SweepResult:
    """Attainment per load per model, and each model's maximum load factor at the target."""

    target: float
    points: dict[float, SimResult]
    max_load: dict[str, float | None]

    @property
    def mean_max_load(self) -> float:
        vals = [v if v is not None else 0.0 for v in self.max_load.values()]
        return sum(vals) / len(vals) if vals else 0.0

    def attainment(self, model: str) -> list[tuple[float, float]]:
        return [(load, r.models[model].attainment) for load, r in sorted(self.points.items())]

    def to_dict(self) -> dict[str, Any]:
        return {
            "target": self.target,
            "max_load": self.max_load,
            "mean_max_load": self.mean_max_load,
            "points": {f"{load:.4f}": r.to_dict() for load, r in sorted(self.points.items())},
        }


def _served_share(res: SimResult, model: str) -> float:
    """The share of the model's requests served on time: its attainment, or for a run that
    stopped early, on time out of those already decided (not still queued or in flight)."""
    mm = res.models[model]
    if res.stopped_at_s is None:
        return mm.attainment
    decided = mm.ok + mm.late + mm.dropped
    return mm.ok / decided if decided else mm.attainment


def _grid() -> list[float]:
    return [round(GRID_STEP * i, 4) for i in range(1, int(round(1 / GRID_STEP)) + 1)]


def sweep(
    plan: Plan,
    profiles: Mapping[str, ModelProfile],
    cluster: ClusterSpec,
    *,
    rates_rps: Mapping[str, float] | None = None,
    workload: Workload = Workload(),
    config: SimConfig = SimConfig(),
    scheduler_factory: SchedulerFactory | None = None,
    target: float = DEFAULT_TARGET,
    search: Search | str = Search.SCAN,
    bisect_steps: int = 0,
    progress: Callable[[float, SimResult], None] | None = None,
    early_stop: bool = True,
) -> SweepResult:
    """Find each model's largest load factor with attainment >= ``target`` (see the module docstring)."""
    search = Search(search)
    if early_stop and config.stop_below is None:
        config = dataclasses.replace(config, stop_below=target)
    names = [m.name for m in plan.models]
    points: dict[float, SimResult] = {}

    def at(load: float) -> SimResult:
        load = round(load, 6)
        if load not in points:
            points[load] = run_point(
                plan, profiles, cluster, load, rates_rps=rates_rps, workload=workload, config=config,
                scheduler_factory=scheduler_factory,
            )
            if progress:
                progress(load, points[load])
        return points[load]

    def ok(res: SimResult, m: str) -> bool:
        return res.models[m].attainment >= target

    grid = _grid()
    best: dict[str, float | None] = {m: None for m in names}
    if search is Search.SCAN:
        for load in reversed(grid):
            res = at(load)
            for m in names:
                if best[m] is None and ok(res, m):
                    best[m] = load
            if all(v is not None for v in best.values()):
                break
    else:
        # per model: lo = index of the highest known pass (-1: none), hi = lowest known fail (len: none)
        lo = {m: -1 for m in names}
        hi = {m: len(grid) for m in names}
        while True:
            open_ = [m for m in names if hi[m] - lo[m] > 1]
            if not open_:
                break
            # test 1.0 first (a plan that holds at full load resolves at once), then inside
            # the widest open interval
            if grid[-1] not in points:
                i = len(grid) - 1
            else:
                m = max(open_, key=lambda m: (hi[m] - lo[m], -names.index(m)))
                i = (lo[m] + hi[m]) // 2
                if search is Search.GUIDED and hi[m] < len(grid):
                    f_fail = grid[hi[m]]
                    capacity = _served_share(points[round(f_fail, 6)], m) * f_fail
                    guess = int(math.floor(capacity / GRID_STEP + 1e-9)) - 1  # grid[i] = (i + 1) * step
                    i = min(max(guess, lo[m] + 1), hi[m] - 1)
                    if round(grid[i], 6) in points:
                        i = (lo[m] + hi[m]) // 2
            res = at(grid[i])
            for m in names:
                if ok(res, m):
                    lo[m] = max(lo[m], i) if i < hi[m] else lo[m]
                else:
                    hi[m] = min(hi[m], i) if i > lo[m] else hi[m]
        best = {m: (grid[lo[m]] if lo[m] >= 0 else None) for m in names}
    if bisect_steps > 0:
        for m in names:
            if best[m] is None or best[m] >= grid[-1]:
                continue
            lo_v, hi_v = best[m], round(best[m] + GRID_STEP, 6)
            for _ in range(bisect_steps):
                mid = round((lo_v + hi_v) / 2, 6)
                if ok(at(mid), m):
                    lo_v = mid
                else:
                    hi_v = mid
            best[m] = lo_v
    return SweepResult(target=target, points=points, max_load=best)
