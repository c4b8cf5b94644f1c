"""The runtime's service margins per model: what it takes off each SLO outside the path.

The data plane applies the margins (:mod:`ppipe.dataplane.margins`: a dispatch lead
``L_m`` and an answer budget ``A_m``, the same rule `ppipe simulate` runs); this module
holds their values while serving:

* the configured parts, a fixed lead ``L_0`` and a fixed budget ``A_0``, plus the input's
  transfer, computed once per plan; a plan that leaves a model no time for them is
  refused (:func:`~ppipe.dataplane.margins.check_margins`);
* an adaptive part of the answer budget, ``a_m``: the 95th percentile of how late the model's
  last ``WINDOW`` batches' answers came after their planned end (0 when they come early),
  recomputed every ``EVERY`` of its batches. A model gets ``min(a_m, cap_m)`` on top of ``A_0``,
  with ``cap_m = min(share * (S_m - L_m - A_0), T_m / 4)``
  (:func:`~ppipe.dataplane.margins.adaptive_cap_us`): lateness that the plan's slack
  cannot absorb makes answers late, but can never make the model unreachable. When the
  cap binds, the server logs it once per model.
* the drop budget, ``A_0 + min(d_m, cap_m)`` with ``d_m`` the median of the same lateness
  (the data plane's ``drop_budget_us``): the answer budget plans the batches, but a request
  is dropped as unreachable only when its answer would come late at the median lateness,
  that is, when it would more likely be late than not; the others are served.

``ppipe_model_reserved_slack_ms{model}`` shows ``L_m + A_m`` as it is, next to
``ppipe_model_slack_ms{model}``, the slack ``S_m`` the plan leaves, and
``ppipe_model_drop_budget_ms{model}``, the drop budget.
"""

from __future__ import annotations

import logging
from typing import Mapping

from prometheus_client import Gauge

from ppipe.dataplane.margins import ModelMargins, adaptive_cap_us, check_margins, service_margins, serving_options
from ppipe.dataplane.options import SchedulerOptions
from ppipe.spec.cluster import ClusterSpec
from ppipe.spec.plan import Plan
from ppipe.spec.profile import ModelProfile

log = logging.getLogger("ppipe.runtime")
WINDOW = 256  # batches whose answer lateness sets the adaptive part
EVERY = 32  # ... recomputed every this many batches
CHANGE_US = 250.0  # the scheduler's options are replaced only when a budget moves this much


class ServiceBudgets:
    """Margins of the served plan, with the adaptive answer budget.

    Args:
        lead_us: the fixed dispatch lead ``L_0``.
        budget_us: the fixed answer budget ``A_0``.
        registry: where the two gauges are registered (None: none).
    """

    def __init__(self, lead_us: float = 0.0, budget_us: float = 0.0, registry=None):
        if lead_us < 0 or budget_us < 0:
            raise ValueError(f"dispatch lead and answer budget must be >= 0 us, got {lead_us} and {budget_us}")
        self.lead_us, self.budget_us = lead_us, budget_us
        self.margins: dict[str, ModelMargins] = {}
        self._lateness: dict[str, list[float]] = {}  # per model, its last WINDOW batches' answer lateness (a ring)
        self._seen: dict[str, int] = {}
        self.late_us: dict[str, float] = {}  # per model, the adaptive part a before its cap
        self.typical_us: dict[str, float] = {}  # per model, the median lateness d before its cap
        self._capped: set[str] = set()  # models whose cap bound (logged once each)
        self._applied: dict[str, float] = {}  # the answer budget per model in the scheduler's options
        self._applied_drop: dict[str, float] = {}  # ... and the drop budget
        self._gauges = None if registry is None else (
            Gauge("ppipe_model_reserved_slack_ms", "Time the runtime takes off the model's SLO outside the reserved path "
                  "(dispatch lead with the input's transfer, plus the answer budget).", ["model"], registry=registry),
            Gauge("ppipe_model_slack_ms", "The model's SLO less its fastest unloaded path in the plan.", ["model"], registry=registry),
            Gauge("ppipe_model_drop_budget_ms", "The answer budget of the drop test: a request is dropped as unreachable "
                  "only when its answer would come after its deadline less this.", ["model"], registry=registry),
        )

    @property
    def active(self) -> bool:
        """Whether any margin is configured (else the scheduler gets no margin options)."""
        return self.lead_us > 0 or self.budget_us > 0

    def for_plan(self, plan: Plan, profiles: Mapping[str, ModelProfile], cluster: ClusterSpec) -> dict[str, ModelMargins]:
        """The plan's margins with the fixed parts; refuses a plan that cannot meet them (UserError)."""
        margins = service_margins(plan, profiles, cluster, SchedulerOptions(**serving_options(self.lead_us, self.budget_us)))
        check_margins(margins)
        return margins

    def options(self, margins: Mapping[str, ModelMargins]) -> dict:
        """The scheduler options for these margins, the adaptive parts of the budgets included."""
        return {**serving_options(self.lead_us, self.budget_us), **self._budgets(margins)}

    def _budgets(self, margins: Mapping[str, ModelMargins]) -> dict[str, dict[str, float]]:
        return {"answer_budget_us": {m: self._budget(x) for m, x in margins.items()},
                "drop_budget_us": {m: self._drop_budget(x) for m, x in margins.items()}}

    def adopt(self, margins: Mapping[str, ModelMargins]) -> None:
        """Make these the served plan's margins (at start, and when a plan switch commits)."""
        self.margins = dict(margins)
        self._applied = {m: self._budget(x) for m, x in margins.items()}
        self._applied_drop = {m: self._drop_budget(x) for m, x in margins.items()}
        self._publish()

    def answer_was_late(self, model: str, late_us: float) -> dict[str, dict[str, float]] | None:
        """Record one batch's answer lateness; returns the scheduler options to update, the
        per-model answer and drop budgets, when the model's moved by more than ``CHANGE_US``
        (else None)."""
        window = self._lateness.get(model)
        if window is None:
            window = self._lateness[model] = [0.0] * WINDOW
        seen = self._seen[model] = self._seen.get(model, 0) + 1
        window[(seen - 1) % WINDOW] = late_us
        if seen % EVERY:
            return None
        typical, late = _percentiles(window[: min(seen, WINDOW)], (50, 95))
        self.typical_us[model], self.late_us[model] = max(0.0, float(typical)), max(0.0, float(late))
        x = self.margins.get(model)
        if x is None:
            return None
        budget, drop = self._budget(x), self._drop_budget(x)
        if abs(budget - self._applied.get(model, 0.0)) <= CHANGE_US and abs(drop - self._applied_drop.get(model, 0.0)) <= CHANGE_US:
            return None
        self._applied[model], self._applied_drop[model] = budget, drop
        self._publish()
        return {"answer_budget_us": dict(self._applied), "drop_budget_us": dict(self._applied_drop)}

    def _budget(self, x: ModelMargins) -> float:
        """``A_0 + min(a, cap_m)``, logging once per model when the cap binds."""
        cap = min(adaptive_cap_us(x), 0.25 * x.slo_us)
        late = self.late_us.get(x.model, 0.0)
        if late > cap and x.model not in self._capped:
            self._capped.add(x.model)
            log.warning("%s: answers come %.1f ms after their planned end, more than the %.1f ms its plan's slack leaves "
                        "the answer budget; the budget stays at %.1f ms so that the model is still served (its answers "
                        "may be late)", x.model, late / 1e3, cap / 1e3, (x.budget_us + cap) / 1e3)
        return x.budget_us + min(late, cap)

    def _drop_budget(self, x: ModelMargins) -> float:
        """``A_0 + min(d, cap_m)``: the drop test's budget (never above :meth:`_budget`)."""
        cap = min(adaptive_cap_us(x), 0.25 * x.slo_us)
        return x.budget_us + min(self.typical_us.get(x.model, 0.0), self.late_us.get(x.model, 0.0), cap)

    def _publish(self) -> None:
        if self._gauges is None:
            return
        reserved, slack, drop = self._gauges
        for m, x in self.margins.items():
            reserved.labels(m).set((x.lead_us + self._applied.get(m, x.budget_us)) / 1e3)
            slack.labels(m).set(x.slack_us / 1e3)
            drop.labels(m).set(self._applied_drop.get(m, x.budget_us) / 1e3)


def _percentiles(values: list[float], qs: tuple[float, ...]) -> list[float]:
    """NumPy's default percentiles (linear between the closest ranks) of a short list, for
    the budgets' window (sorting a few hundred floats costs much less than ``np.percentile``)."""
    xs = sorted(values)
    out = []
    for q in qs:
        pos = q / 100 * (len(xs) - 1)
        lo = int(pos)
        hi = min(lo + 1, len(xs) - 1)
        out.append(xs[lo] + (xs[hi] - xs[lo]) * (pos - lo))
    return out
