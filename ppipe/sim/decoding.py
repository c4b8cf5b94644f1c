"""Decoding before the scheduler in the simulator (``ppipe simulate --decode-ms``).

A served request whose input must be decoded first (a JSON body, encoded images) reaches
the scheduler only once an ingress's decode pool has decoded it, and is admitted to that
pool by the data plane's decode admission (:mod:`ppipe.dataplane.decode`), the rule the
ingresses of ``ppipe serve`` apply. Here every request of a model costs a fixed decode
time on a pool of ``workers`` (FIFO): at its arrival ``a`` it is dropped
``deadline-unreachable`` if the pool's expected end ``e`` is past ``latest_m(a)``, else it
is decoded and then submitted with its own arrival time (its deadline unchanged), or
dropped if the decode ended past ``latest_m(a)``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping

from ppipe.dataplane.decode import DecodePool, decode_slack_us, latest_end_us, refusal
from ppipe.dataplane.margins import service_margins
from ppipe.dataplane.options import SchedulerOptions
from ppipe.errors import UserError

DECODE_WHERE = "decode"
"""``RequestRecord.drop_where`` of a request dropped by decode admission."""


@dataclass(frozen=True)
class DecodeSetup:
    """What decoding costs: ``cost_us`` per request (one figure for every model, or per
    model) on a pool of ``workers``."""

    cost_us: float | Mapping[str, float]
    workers: int = 1

    def cost_of(self, model: str) -> float:
        return self.cost_us if isinstance(self.cost_us, (int, float)) else self.cost_us[model]


class DecodeStage:
    """The pool and the admission rule of one run.

    Args:
        setup: the decode costs and pool size.
        plan, profiles, cluster: what is simulated (the models' decode slack).
        scheduler_options: the run's data-plane options (its margins).
    """

    def __init__(self, setup: DecodeSetup, plan, profiles, cluster, scheduler_options: Mapping):
        if setup.workers < 1:
            raise UserError(f"--decode-workers must be >= 1, got {setup.workers}", fix="e.g. --decode-workers 2")
        costs = [setup.cost_of(m.name) for m in plan.models]
        if any(not c >= 0 for c in costs):
            raise UserError(f"decode costs must be >= 0, got {costs}", fix="e.g. --decode-ms 5")
        options = SchedulerOptions.from_kwargs({k: v for k, v in scheduler_options.items() if k in SchedulerOptions.model_fields})
        self.setup = setup
        self.pool = DecodePool(setup.workers)
        self.slack_us = decode_slack_us(service_margins(plan, profiles, cluster, options))

    def admit(self, model: str, arrival_us: float, now_us: float) -> tuple[float | None, str]:
        """``(decode end, "")`` for an admitted request (queued now), or ``(None, why)``."""
        latest = latest_end_us(arrival_us, self.slack_us[model])
        cost = self.setup.cost_of(model)
        late = refusal(self.pool.expected_end_us(now_us, cost), latest)
        if late is not None:
            return None, f"decoding would end {late / 1e3:.1f} ms too late for the SLO"
        return self.pool.submit(now_us, cost), ""

    def late_by_us(self, model: str, arrival_us: float, now_us: float) -> float | None:
        """After a decode that ended now: how late it is (None: in time)."""
        return refusal(now_us, latest_end_us(arrival_us, self.slack_us[model]))
