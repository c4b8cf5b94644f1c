"""The LP-support start (ppipe.planner.core._lp_support_attempt): the relaxation's
configurations first, then every configuration of their templates where the first is not proven."""

from __future__ import annotations

import pytest

import ppipe
import ppipe.planner.core as core


class _Stop(Exception):
    pass


def _starts(monkeypatch, weights):
    """(The narrow restriction's objective, the attempt's start objective, its proof or None,
    whether the clock stopped it, the restricted MILPs it solved) on the built-in default
    instance (HC2-S, three models) with these weights."""
    seen = {}
    narrow, attempt, restricted = core.lp_support_start, core._lp_support_attempt, core.restricted_start
    solved = []

    def record_restricted(*a, **k):
        solved.append(a[2])
        return restricted(*a, **k)

    def record_narrow(*a, **k):
        out = narrow(*a, **k)
        seen["narrow"] = out[0]
        return out

    def record_attempt(milp, variables, specs, configs, *a, **k):
        solved.clear()
        start, ended = attempt(milp, variables, specs, configs, *a, **k)
        if max(int(cs.nparts.max()) for cs in configs) == 1:
            return start, ended  # the plan without partitions behind the batch-build estimate
        z = variables.extra["z"]
        seen["out"] = (float(seen["narrow"].x[z]), float(start.x[z]), ended, start.timed_out, list(solved))
        raise _Stop

    monkeypatch.setattr(core, "lp_support_start", record_narrow)
    monkeypatch.setattr(core, "restricted_start", record_restricted)
    monkeypatch.setattr(core, "_lp_support_attempt", record_attempt)
    with pytest.raises(_Stop):
        ppipe.plan(weights=weights, place=False, time_limit_s=120.0)
    return seen["out"]


def test_the_templates_of_the_relaxation_widen_a_start_that_is_not_proven(monkeypatch):
    # Weights 1,1,2: the relaxation's few configurations hold a plan far below the optimum
    # (735 against 831 on HC2-S); the templates they belong to hold a better one.
    narrow_z, start_z, ended, timed_out, solved = _starts(monkeypatch, [1.0, 1.0, 2.0])
    assert not timed_out and len(solved) == 2
    assert all((wide >= used).all() and wide.sum() > used.sum() for used, wide in zip(*solved))
    assert ended is None  # not proven: the whole MILP's solve follows, from the wider start
    assert start_z > 1.05 * narrow_z


def test_a_proven_narrow_start_is_not_widened(monkeypatch):
    # Equal weights: the relaxation's configurations hold the optimum, proven at once.
    narrow_z, start_z, ended, _, solved = _starts(monkeypatch, [1.0, 1.0, 1.0])
    assert ended is not None and ended.method.startswith("LP-support incumbent")
    assert start_z == narrow_z and len(solved) == 1
