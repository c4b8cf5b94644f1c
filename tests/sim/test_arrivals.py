"""Arrival processes: rates, burstiness, seeded determinism, trace parsing and rescaling."""

from __future__ import annotations

import numpy as np
import pytest

from ppipe.errors import UserError
from ppipe.sim.arrivals import gamma_arrivals, make_arrivals, model_rng, poisson_arrivals, read_trace, trace_arrivals

DUR_US = 20e6


def _cv(t):
    g = np.diff(t)
    return g.std() / g.mean()


def test_poisson_rate_and_cv():
    t = poisson_arrivals(500.0, DUR_US, model_rng(1, 0))
    assert abs(t.size / 20 - 500) < 500 * 0.03  # 10k draws: 3 % is > 3 sigma
    assert np.all(np.diff(t) >= 0) and t[0] >= 0 and t[-1] < DUR_US
    assert _cv(t) == pytest.approx(1.0, abs=0.05)


@pytest.mark.parametrize("cv", [0.5, 2.0, 4.0])
def test_gamma_rate_and_cv(cv):
    t = gamma_arrivals(1000.0, DUR_US, cv, model_rng(2, 0))
    assert abs(t.size / 20 - 1000) < 1000 * 0.1
    assert _cv(t) == pytest.approx(cv, rel=0.15)


def test_seeded_determinism_and_independent_models():
    a = make_arrivals("poisson", {"m1": 100, "m2": 100}, 5e6, seed=7)
    b = make_arrivals("poisson", {"m1": 100, "m2": 100}, 5e6, seed=7)
    c = make_arrivals("poisson", {"m1": 100, "m2": 100}, 5e6, seed=8)
    assert np.array_equal(a["m1"], b["m1"]) and np.array_equal(a["m2"], b["m2"])
    assert not np.array_equal(a["m1"], c["m1"])
    assert not np.array_equal(a["m1"][:50], a["m2"][:50])


def test_zero_rate_gives_no_arrivals():
    assert poisson_arrivals(0.0, DUR_US, model_rng(0, 0)).size == 0


def test_bad_cv_is_a_user_error():
    with pytest.raises(UserError, match="cv"):
        gamma_arrivals(10, 1e6, 0.0, model_rng(0, 0))


def test_azure_2021_trace_arrival_is_end_minus_duration(tmp_path):
    p = tmp_path / "azure.csv"
    p.write_text("app,func,end_timestamp,duration\nx,f,10.5,0.5\nx,f,10.0,2.0\nx,f,12.25,0.25\n")
    t = read_trace(p)
    # arrivals 10.0, 8.0, 12.0 -> sorted and shifted to start at 0
    assert t.tolist() == [0.0, 2.0, 4.0]


def test_plain_timestamp_trace(tmp_path):
    p = tmp_path / "ts.txt"
    p.write_text("timestamp\n3\n1\n2\n")
    assert read_trace(p).tolist() == [0.0, 1.0, 2.0]


@pytest.mark.parametrize(
    "body,match",
    [("", "empty"), ("timestamp\n1\n", "usable"), ("1,2,3\n4,5,6\n", "one timestamp"), ("a\nb\n", "not a number"),
     ("end_timestamp,duration\n1,x\n", "cannot read")],
)
def test_bad_traces(tmp_path, body, match):
    p = tmp_path / "t.csv"
    p.write_text(body)
    with pytest.raises(UserError, match=match):
        read_trace(p)


def test_missing_trace_file(tmp_path):
    with pytest.raises(UserError, match="not found"):
        read_trace(tmp_path / "nope.csv")


def test_trace_rescaled_to_rate_keeps_burstiness():
    rng = np.random.default_rng(3)
    # a bursty native trace: gamma gaps with CV 3 at ~7 req/s over ~1000 s
    gaps = rng.gamma(1 / 9, 9 / 7, 7000)
    trace = np.concatenate([[0.0], np.cumsum(gaps)])
    t = trace_arrivals(trace, 2000.0, 5e6, model_rng(0, 0))
    assert abs(t.size / 5 - 2000) < 2000 * 0.25  # bursty: the window sees a noisy count
    assert _cv(t) > 2.0
    # tiled when the window is longer than the scaled trace; mean rate holds over many periods
    short = np.array([0.0, 0.1, 0.2, 1.0])
    t2 = trace_arrivals(short, 100.0, 10e6)
    assert t2.size == pytest.approx(1000, rel=0.01)
    assert np.all(np.diff(t2) >= 0)
