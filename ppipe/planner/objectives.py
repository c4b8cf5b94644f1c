"""Objectives of the planner: each sets the MILP's objective and adds its rows (3).

An objective is any object with ``name`` and ``apply(milp, variables)``, or a plain
function ``fn(milp, variables)``. It sees the MILP (:class:`~ppipe.planner.milp.Milp`:
``add_col``, ``add_row``, ``set_objective``) and the documented columns
(:class:`~ppipe.planner.formulation.PlanVariables`: ``x_model[m]`` throughput of model m
in req/s, ``gpus[k]`` physical GPUs of type k in use, ``g`` / ``x_config`` per
configuration). ``examples/custom_objective.py`` writes one.

Built in (by name, as ``objective=`` or ``--objective``):

* ``max-min`` (default): maximize z with w_m z <= x_m (max-min normalized throughput).
* ``total``: maximize sum_m x_m.
* ``min-cost``: minimize sum_k price_k gpus_k subject to x_m >= the required rate.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Protocol, Union

from ppipe.errors import UserError
from ppipe.planner.formulation import PlanVariables
from ppipe.planner.milp import Milp


class Objective(Protocol):
    name: str

    def apply(self, milp: Milp, v: PlanVariables) -> None: ...


ObjectiveLike = Union[str, Objective, Callable[[Milp, PlanVariables], None]]


@dataclass(frozen=True)
class MaxMinNormalized:
    """maximize z subject to w_m z <= x_m for every model (constraint 3, "c3_maxmin")."""

    name: str = "max-min"

    def apply(self, milp: Milp, v: PlanVariables) -> None:
        z = milp.add_col(lb=0.0, name="z")
        v.extra["z"] = z
        for m in v.models:
            milp.add_row({z: v.weight[m], v.x_model[m]: -1.0}, ub=0.0, name="c3_maxmin")
        milp.set_objective({z: 1.0}, "max")


@dataclass(frozen=True)
class TotalThroughput:
    """maximize sum_m x_m (all models' requests per second, unweighted)."""

    name: str = "total"

    def apply(self, milp: Milp, v: PlanVariables) -> None:
        milp.set_objective({v.x_model[m]: 1.0 for m in v.models}, "max")


@dataclass(frozen=True)
class MinCost:
    """minimize sum_k price_k gpus_k subject to x_m >= required_rps[m] ("c3_required_rate").

    Args:
        required_rps: a rate per model name, or one rate for every model.
    """

    required_rps: Union[float, dict[str, float]] = field(default_factory=dict)
    name: str = "min-cost"

    def rate(self, model: str) -> float:
        if isinstance(self.required_rps, (int, float)):
            return float(self.required_rps)
        if model not in self.required_rps:
            raise UserError(
                f"objective min-cost: no required rate for model '{model}'",
                fix=f"give required_rps={{'{model}': <req/s>, ...}} (CLI: --required-rps {model}=<req/s>)",
            )
        return float(self.required_rps[model])

    def apply(self, milp: Milp, v: PlanVariables) -> None:
        if isinstance(self.required_rps, dict):
            unknown = sorted(set(self.required_rps) - set(v.models))
            if unknown:
                raise UserError(f"objective min-cost: required_rps names unknown model(s) {unknown}", fix=f"use model names from {v.models}")
        for m in v.models:
            milp.add_row({v.x_model[m]: 1.0}, lb=self.rate(m), name="c3_required_rate")
        milp.set_objective({v.gpus[k]: v.price[k] for k in v.types}, "min")


@dataclass(frozen=True)
class _Callable:
    fn: Callable[[Milp, PlanVariables], None]

    @property
    def name(self) -> str:
        return getattr(self.fn, "__name__", "custom")

    def apply(self, milp: Milp, v: PlanVariables) -> None:
        self.fn(milp, v)


OBJECTIVES = {"max-min": MaxMinNormalized, "total": TotalThroughput, "min-cost": MinCost}


def get_objective(obj: ObjectiveLike | None, required_rps=None) -> Objective:
    """An objective from a name, an object with ``apply``, or a function."""
    if obj is None:
        obj = "min-cost" if required_rps else "max-min"
    if isinstance(obj, str):
        key = obj.lower().replace("_", "-")
        if key not in OBJECTIVES:
            raise UserError(f"unknown objective '{obj}'", fix=f"use one of: {', '.join(OBJECTIVES)} (option --objective)")
        if key == "min-cost":
            if not required_rps:
                raise UserError(
                    "objective min-cost needs the rate each model must carry",
                    fix="give required_rps= (CLI: --required-rps MODEL=RPS or --required-rps RPS)",
                )
            return MinCost(required_rps=required_rps)
        return OBJECTIVES[key]()
    if hasattr(obj, "apply"):
        return obj  # type: ignore[return-value]
    if callable(obj):
        return _Callable(obj)
    raise UserError(f"objective {obj!r} is neither a name, an Objective nor a function", fix="see ppipe.planner.objectives")
