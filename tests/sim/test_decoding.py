"""Decoding before the scheduler in the simulator (SimConfig.decode), admitted by the data
plane's decode rule (ppipe.dataplane.decode), the one `ppipe serve`'s ingresses apply."""

from __future__ import annotations

import pytest

from ppipe.dataplane.decode import DECODE_SHARE_OF_SLACK, DecodePool, expected_end, latest_end_us, refusal
from ppipe.sim.arrivals import make_arrivals
from ppipe.sim.decoding import DECODE_WHERE, DecodeSetup, DecodeStage
from ppipe.sim.simulator import SimConfig, simulate

from sim_fakes import FakeScheduler


def _run(tiny, rate, decode=None, dur=2.0):
    plan, profiles, cluster = tiny
    arr = make_arrivals("poisson", {"tiny": rate}, dur * 1e6, 3)
    factory = lambda plan, profiles, cluster, clock: FakeScheduler(plan, profiles, cluster, clock)  # noqa: E731
    return simulate(plan, profiles, cluster, arr, SimConfig(duration_s=dur, decode=decode), factory)


def test_the_rule():
    assert latest_end_us(1000.0, 8000.0) == 1000.0 + DECODE_SHARE_OF_SLACK * 8000.0
    assert expected_end(100.0, 3000.0, 3, 50.0) == 100.0 + 1000.0 + 50.0
    assert refusal(5000.0, 5000.0) is None and refusal(5001.0, 5000.0) == pytest.approx(1.0)


def test_the_pool_is_fifo_over_its_workers():
    pool = DecodePool(2)
    assert [pool.submit(0.0, 10.0) for _ in range(3)] == [10.0, 10.0, 20.0]
    assert pool.queued_us(0.0) == 30.0 and pool.queued_us(15.0) == 5.0
    assert pool.expected_end_us(0.0, 10.0) == 0.0 + 30.0 / 2 + 10.0  # >= its real end, max(0, 10) + 10
    with pytest.raises(ValueError):
        DecodePool(0)


def test_an_underloaded_pool_admits_every_request_and_adds_its_decode_to_the_latency(tiny):
    plain, decoded = _run(tiny, 200.0), _run(tiny, 200.0, DecodeSetup(cost_us=1000.0, workers=2))
    assert decoded.overall.dropped == 0 and decoded.attainment == 1.0
    assert decoded.overall.p50_latency_ms == pytest.approx(plain.overall.p50_latency_ms + 1.0, abs=0.2)


def test_an_overloaded_pool_drops_at_admission_what_it_cannot_decode_in_time(tiny):
    cost_us, workers, rate, dur = 1000.0, 1, 3000.0, 2.0  # the pool decodes 1000/s of 3000/s (tiny: 1.8 ms to decode)
    res = _run(tiny, rate, DecodeSetup(cost_us=cost_us, workers=workers), dur)
    at_decode = [r for r in res.records if r.drop_where == DECODE_WHERE]
    assert at_decode and all(r.drop_reason == "deadline-unreachable" for r in at_decode)
    assert all("would end" in r.drop_detail for r in at_decode)  # refused before decoding: none decoded too late
    reached = [r for r in res.records if r.drop_where != DECODE_WHERE]
    assert len(reached) <= workers * dur * 1e6 / cost_us + 2 * workers  # no more than the pool decodes
    assert len(reached) >= 0.9 * workers * dur * 1e6 / cost_us  # and it is kept busy


def test_the_stage_refuses_what_cannot_decode(tiny):
    from ppipe.errors import UserError

    plan, profiles, cluster = tiny
    with pytest.raises(UserError, match="decode-workers"):
        DecodeStage(DecodeSetup(1000.0, 0), plan, profiles, cluster, {})
    with pytest.raises(UserError, match="decode costs"):
        DecodeStage(DecodeSetup(-1.0), plan, profiles, cluster, {})
