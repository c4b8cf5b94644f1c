"""Policy registry and the public entry point :func:`build_scheduler`.

A policy is a class (or factory) taking ``(topology, clock, options)`` and returning an
object that follows :class:`~ppipe.dataplane.api.Scheduler`. Register one with
``@register_policy("name")``; ``POLICIES`` maps names to factories.
"""

from __future__ import annotations

import difflib
from typing import Any, Callable, Mapping, TypeVar

from ppipe.dataplane.api import Clock, Scheduler
from ppipe.dataplane.options import SchedulerOptions
from ppipe.dataplane.topology import Topology, compile_plan
from ppipe.errors import UserError
from ppipe.spec.cluster import ClusterSpec
from ppipe.spec.plan import Plan
from ppipe.spec.profile import ModelProfile

POLICIES: dict[str, Callable[[Topology, Clock, SchedulerOptions], Scheduler]] = {}

F = TypeVar("F")


def register_policy(name: str) -> Callable[[F], F]:
    """Class decorator: make a scheduler policy available to :func:`build_scheduler`.

    Args:
        name: the policy name users pass (``policy="..."``, ``--policy ...``).
    """

    def deco(factory: F) -> F:
        if name in POLICIES and POLICIES[name] is not factory:
            raise ValueError(f"data-plane policy '{name}' is registered twice")
        POLICIES[name] = factory  # type: ignore[assignment]
        return factory

    return deco


def build_scheduler(
    plan: Plan,
    profiles: Mapping[str, ModelProfile],
    cluster: ClusterSpec,
    clock: Clock,
    policy: str = "reservation",
    **options: Any,
) -> Scheduler:
    """Build the data plane for a plan.

    Args:
        plan: the plan to serve (its models, pooled pipelines and vGPU placement).
        profiles: model name -> profile (latencies and cut bytes).
        cluster: the cluster the plan was made for (servers and NIC bandwidths).
        clock: time source; the simulator's virtual clock or the runtime's wall clock.
        policy: a name in :data:`POLICIES` ("reservation": the paper's; "reactive": the
            per-pool baseline without reservations).
        **options: fields of :class:`~ppipe.dataplane.options.SchedulerOptions`
            (e.g. ``max_queue=64``).

    Returns:
        A scheduler following the :class:`~ppipe.dataplane.api.Scheduler` protocol; it also
        offers ``stats()`` (counters: probes, dispatches, probes per dispatch, drops).

    Raises:
        UserError: an unknown policy or option, or a plan that does not fit its profiles
            or cluster.
    """
    factory = POLICIES.get(policy)
    if factory is None:
        close = difflib.get_close_matches(str(policy), list(POLICIES), n=1)
        hint = f" (did you mean '{close[0]}'?)" if close else ""
        raise UserError(f"unknown data-plane policy '{policy}'{hint}", fix=f"use one of: {', '.join(sorted(POLICIES))}")
    opts = SchedulerOptions.from_kwargs(options)
    topo = compile_plan(plan, profiles, cluster)
    return factory(topo, clock, opts)
