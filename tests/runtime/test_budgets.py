"""The runtime's service margins while serving (ppipe.runtime.scheduler.budgets) and its punctual sleep."""

from __future__ import annotations

import asyncio
import logging

import pytest
from prometheus_client import CollectorRegistry

from ppipe.dataplane.margins import ModelMargins
from ppipe.runtime.scheduler.budgets import EVERY, WINDOW, ServiceBudgets
from ppipe.runtime.clock import sleep_until, wall_us


def _margins(slack_us: float = 6000.0, lead_us: float = 2000.0, budget_us: float = 1500.0, slo_us: float = 15000.0):
    return {"m": ModelMargins("m", lead_us, 500.0, budget_us, slack_us, slo_us)}


def test_the_adaptive_budget_follows_lateness_and_is_capped_so_the_model_stays_served(caplog):
    reg = CollectorRegistry()
    b = ServiceBudgets(1500.0, 1500.0, reg)
    margins = _margins()
    b.adopt(margins)
    assert b.options(margins)["answer_budget_us"] == {"m": 1500.0}
    for _ in range(EVERY):
        assert b.answer_was_late("m", -300.0) is None  # early answers: the budget stays as configured
    changed = None
    for _ in range(2 * EVERY):
        changed = b.answer_was_late("m", 800.0) or changed
    # A_0 + the 95th percentile of the lateness; the drop test's, A_0 + its median (the same here)
    assert changed == {"answer_budget_us": {"m": pytest.approx(2300.0)}, "drop_budget_us": {"m": pytest.approx(2300.0)}}
    with caplog.at_level(logging.WARNING, logger="ppipe.runtime"):
        for _ in range(2 * WINDOW):
            changed = b.answer_was_late("m", 50_000.0) or changed  # far later than the slack allows
    cap = 0.5 * (6000.0 - 3500.0)  # half of what the slack leaves over the fixed margins
    assert changed["answer_budget_us"] == {"m": pytest.approx(1500.0 + cap)} == changed["drop_budget_us"]
    assert b.answer_was_late("other", 50_000.0) is None  # a model's lateness is its own
    assert b.margins["m"].reserved_us + cap < b.margins["m"].slack_us  # still reachable
    assert sum("the budget stays at" in r.getMessage() for r in caplog.records) == 1  # said once
    assert reg.get_sample_value("ppipe_model_reserved_slack_ms", {"model": "m"}) == pytest.approx((2000.0 + 1500.0 + cap) / 1e3)
    assert reg.get_sample_value("ppipe_model_slack_ms", {"model": "m"}) == pytest.approx(6.0)
    with pytest.raises(ValueError, match=">= 0"):
        ServiceBudgets(-1.0, 0.0)


def test_the_drop_budget_follows_the_median_lateness_and_the_answer_budget_its_tail():
    """Answers that come 0-2 ms late, evenly: the batches are planned for the tail (A_0 + p95),
    but only a request that would be late at the median lateness is hopeless (A_0 + p50)."""
    import numpy as np

    reg = CollectorRegistry()
    b = ServiceBudgets(1500.0, 1500.0, reg)
    margins = _margins(slack_us=12_000.0)  # room: neither part reaches its cap
    b.adopt(margins)
    assert b.options(margins)["drop_budget_us"] == {"m": 1500.0}
    changed = None
    for late in np.tile(np.linspace(0.0, 2000.0, EVERY), WINDOW // EVERY):
        changed = b.answer_was_late("m", float(late)) or changed
    assert changed["answer_budget_us"]["m"] == pytest.approx(1500.0 + 1900.0, abs=70.0)
    assert changed["drop_budget_us"]["m"] == pytest.approx(1500.0 + 1000.0, abs=70.0)
    assert b.options(margins)["drop_budget_us"] == changed["drop_budget_us"]
    assert reg.get_sample_value("ppipe_model_drop_budget_ms", {"model": "m"}) == pytest.approx(changed["drop_budget_us"]["m"] / 1e3)


def test_sleep_until_ends_at_its_time_not_a_timer_tick_later():
    async def main():
        late = []
        for i in range(20):
            t = wall_us() + 1500.0 + 37.0 * i
            await sleep_until(t)
            late.append(wall_us() - t)
        return late

    late = asyncio.run(main())
    assert min(late) >= 0.0  # never early
    assert sorted(late)[len(late) // 2] < 700.0  # the median well under the loop timers' 1 ms tick
