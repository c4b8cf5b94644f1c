"""The time a served request needs outside its reserved path, and whether a plan leaves it.

A request of model ``m`` with SLO ``T_m`` is served in three parts:

* the **dispatch lead** ``L_m``: from the scheduler's decision to the batch's input at its
  first worker. It is a fixed part ``L_0`` (the dispatch message, the worker waking up)
  plus the input's transfer at the model's largest planned batch ``b_m`` over the slowest
  NIC of the model's first pools, ``b_m * bits_in / bw``
  (:func:`~ppipe.dataplane.topology.input_transfer_us`);
* the **reserved path** ``P_m(b)``: transfers and inferences, as the data plane probes it;
* the **answer budget** ``A_m``: from the last stage's end to the answer (the last report,
  the reply).

The batcher plans every decision of ``m`` from ``now + L_m`` for the deadline
``arrival + T_m - A_m`` (:class:`~ppipe.dataplane.options.SchedulerOptions`). A plan leaves
each model the slack ``S_m = T_m - min_p P_{m,p}(b_min)``, the SLO less its fastest unloaded
path (the smallest usable batch, no waiting, the fastest transfers). The planner keeps
``margin * T_m`` of it free (0.4 by default). A model is served only if
``L_m + A_m < S_m``; otherwise every request is dropped ``deadline-unreachable`` before it
runs, whatever the load, and nothing that would move the budgets ever happens.
:func:`check_margins` refuses such a plan before it is served, naming the margin it needs.

Pure logic (no I/O, no clock): the batcher applies the margins of its options
(:meth:`~ppipe.dataplane.batching.BatchingScheduler.lead_us`), and `ppipe serve` and
`ppipe simulate` set the same defaults (:data:`DEFAULT_DISPATCH_LEAD_US`,
:data:`DEFAULT_ANSWER_BUDGET_US`), so the simulator runs the runtime's rule.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping

from ppipe.errors import UserError
from ppipe.dataplane.options import SchedulerOptions
from ppipe.dataplane.topology import Pipeline, Topology, compile_plan
from ppipe.spec.cluster import ClusterSpec
from ppipe.spec.plan import Plan
from ppipe.spec.profile import ModelProfile

DEFAULT_DISPATCH_LEAD_US = 500.0
"""`ppipe serve`'s and `ppipe simulate`'s fixed dispatch lead ``L_0``."""
DEFAULT_ANSWER_BUDGET_US = 1500.0
"""`ppipe serve`'s and `ppipe simulate`'s fixed answer budget ``A_0``."""
DEFAULT_WAKE_LEAD_US = 2000.0
"""`ppipe serve`'s and `ppipe simulate`'s wake lead: a batch waiting for more requests is
woken this long before its last feasible moment, so that a wall-clock timer that fires
late (the runtime's loop counts whole milliseconds) does not make it a deadline drop. It
dispatches waiting batches earlier, so the simulator runs it too: without it, it would
wait that much longer for batches to fill than the runtime does."""


def serving_options(dispatch_lead_us: float = DEFAULT_DISPATCH_LEAD_US, answer_budget_us: float = DEFAULT_ANSWER_BUDGET_US) -> dict:
    """The data-plane options of the runtime's margins, as `ppipe serve` and `ppipe simulate` pass them."""
    return {"dispatch_lead_us": dispatch_lead_us, "answer_budget_us": answer_budget_us, "input_transfer_lead": True}


def simulated_serving_options(dispatch_lead_us: float = DEFAULT_DISPATCH_LEAD_US, answer_budget_us: float = DEFAULT_ANSWER_BUDGET_US,
                              wake_lead_us: float = DEFAULT_WAKE_LEAD_US) -> dict:
    """What `ppipe simulate` runs to stand for `ppipe serve`: the runtime's margins
    (:func:`serving_options`) and the wake lead its scheduler starts with. (The runtime's
    host widens the lead while its timers fire later than half of it; a simulation's
    timers are punctual, so its lead stays the configured one.)"""
    return {**serving_options(dispatch_lead_us, answer_budget_us), **({"wake_lead_us": wake_lead_us} if wake_lead_us else {})}


ADAPTIVE_SHARE = 0.5
"""The share of the slack left over the fixed margins that an adaptive budget may take: the
rest stays for what the runtime spends before a request reaches the scheduler (reading
and decoding its body), so a budget that grows cannot shut the model off."""


@dataclass(frozen=True)
class ModelMargins:
    """One model's service margins and the slack its plan leaves (us)."""

    model: str
    lead_us: float  # L_m: the fixed lead plus the input's transfer
    input_us: float  # the input's part of the lead
    budget_us: float  # A_m
    slack_us: float  # S_m
    slo_us: float  # T_m

    @property
    def reserved_us(self) -> float:
        """What the runtime takes off the SLO outside the path: ``L_m + A_m``."""
        return self.lead_us + self.budget_us

    @property
    def reachable(self) -> bool:
        return self.reserved_us < self.slack_us


def fastest_path_us(pipe: Pipeline) -> float:
    """``P(b_min)``: the pipeline's unloaded path at its smallest usable batch, with the
    fastest transfer between each pair of pools (none where they share a server)."""
    bs = pipe.batches[-1]
    total = 0.0
    for k, pool in enumerate(pipe.pools):
        total += pool.infer_us[bs]
        if k > 0:
            prev = pipe.pools[k - 1]
            if not (prev.servers & pool.servers):
                bw = min(max(g.bw_gbps for g in prev.vgpus), pool.max_bw_gbps)
                total += prev.out_bits * bs * 1e-3 / bw
    return total


def slack_us(topology: Topology, model: str) -> float:
    """``S_m``: the SLO less the fastest unloaded path over the model's live pipelines."""
    paths = [fastest_path_us(p) for p in topology.pipelines[model] if p.alive and all(pool.vgpus for pool in p.pools)]
    return topology.slo_us[model] - min(paths) if paths else float("-inf")


def margins_of(topology: Topology, options: SchedulerOptions) -> dict[str, ModelMargins]:
    """Every model's margins under ``options`` (its dispatch lead, input transfer, answer budget)."""
    out = {}
    for m in topology.pipelines:
        inp = topology.input_us[m] if options.input_transfer_lead else 0.0
        out[m] = ModelMargins(m, options.dispatch_lead_us + inp, inp, options.budget_us(m), slack_us(topology, m), topology.slo_us[m])
    return out


def service_margins(plan: Plan, profiles: Mapping[str, ModelProfile], cluster: ClusterSpec,
                    options: SchedulerOptions) -> dict[str, ModelMargins]:
    """:func:`margins_of` on the compiled plan."""
    return margins_of(compile_plan(plan, profiles, cluster), options)


def check_margins(margins: Mapping[str, ModelMargins], source: str = "the plan") -> None:
    """Refuse margins that leave a model no feasible path.

    Raises:
        UserError: naming each such model, its slack, the margin it would need, and the fix.
    """
    bad = [x for x in margins.values() if not x.reachable]
    if not bad:
        return
    lines = "; ".join(
        f"{x.model}: the fastest path leaves {x.slack_us / 1e3:.2f} ms of its SLO, the runtime needs "
        f"{x.reserved_us / 1e3:.2f} ms (dispatch lead {x.lead_us / 1e3:.2f} ms, of which the input's transfer "
        f"{x.input_us / 1e3:.2f} ms, answer budget {x.budget_us / 1e3:.2f} ms)" for x in bad)
    raise UserError(
        f"{source} leaves no time for the runtime's margins, so every request would be dropped deadline-unreachable: {lines}",
        fix="re-plan with a larger --margin (the share of the SLO the planner keeps free) or a longer SLO, "
            "or lower --dispatch-lead-ms / --answer-budget-ms",
    )


def adaptive_cap_us(x: ModelMargins) -> float:
    """The most an adaptive addition to the answer budget may add while the model stays
    reachable: ``ADAPTIVE_SHARE * (S_m - L_m - A_m)`` (never below 0)."""
    return max(0.0, ADAPTIVE_SHARE * (x.slack_us - x.reserved_us))
