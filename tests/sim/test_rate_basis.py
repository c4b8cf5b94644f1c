"""Load factor 1.0 per model: the plan's max-min throughput shared by weight, or each model's capacity."""

from __future__ import annotations

import pytest

from ppipe.errors import UserError
from ppipe.sim.sweep import RateBasis, base_rates


def _three_models(plan, caps: dict[str, tuple[float, float]], z: float | None = None):
    """The tiny plan with models renamed; caps: name -> (throughput_rps, weight); z: the
    solver's max-min value (default min x/w, what the MILP reports)."""
    m0 = plan.models[0]
    models = [m0.model_copy(update={"name": n, "throughput_rps": x, "weight": w}) for n, (x, w) in caps.items()]
    z = min(x / w for x, w in caps.values()) if z is None else z
    return plan.model_copy(update={"models": models, "solver": plan.solver.model_copy(update={"objective": z})})


def test_share_gives_each_model_its_weight_times_the_max_min_throughput(tiny):
    plan, _, _ = tiny
    # z = min(300/0.3, 400/0.33, 370/0.37) = 1000: 'b' has slack above its share, 'a' and 'c' bind
    p = _three_models(plan, {"a": (300.0, 0.30), "b": (400.0, 0.33), "c": (370.0, 0.37)})
    rates = base_rates(p)
    assert rates == pytest.approx({"a": 300.0, "b": 330.0, "c": 370.0})
    assert base_rates(p, RateBasis.PLANNED) == {"a": 300.0, "b": 400.0, "c": 370.0}
    assert base_rates(p, "planned") == base_rates(p, RateBasis.PLANNED)


def test_share_is_the_objective_not_the_capacity(tiny):
    # Headroom vGPUs raise every model's capacity above w_m z; the rates stay w_m z.
    plan, _, _ = tiny
    p = _three_models(plan, {"a": (330.0, 0.30), "b": (400.0, 0.33), "c": (420.0, 0.37)}, z=1000.0)
    assert base_rates(p) == pytest.approx({"a": 300.0, "b": 330.0, "c": 370.0})


def test_share_equals_planned_for_one_model_and_for_other_objectives(tiny):
    plan, _, _ = tiny
    assert base_rates(plan) == base_rates(plan, "planned")
    p = _three_models(plan, {"a": (300.0, 0.30), "b": (400.0, 0.33)})
    total = p.model_copy(update={"settings": p.settings.model_copy(update={"objective": "total"})})
    assert base_rates(total) == {"a": 300.0, "b": 400.0}


def test_unknown_basis_is_rejected(tiny):
    plan, _, _ = tiny
    with pytest.raises(UserError, match="bogus"):
        base_rates(plan, "bogus")
