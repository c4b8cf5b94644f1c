"""Shifting workloads (ppipe.sim.workloads): the sinusoidal mix and Azure Functions 2021 replay."""

from __future__ import annotations

import numpy as np
import pytest

from ppipe.errors import UserError
from ppipe.sim.workloads import replay_azure_functions, shifting_poisson_arrivals, shifting_shares

MODELS = ["a", "b", "c"]


@pytest.mark.parametrize("n", [2, 3, 5])
def test_shares_sum_to_one_and_stay_non_negative(n):
    t = np.linspace(0, 1000, 101)
    s = shifting_shares(t, n, period_s=600.0)
    assert np.allclose(s.sum(axis=0), 1.0)
    assert s.min() >= 0
    assert np.isclose(s.max(), 1 / n + 0.6 / n, atol=1e-3)


def test_three_models_follow_the_issue_formula():
    t = np.array([0.0, 150.0, 400.0])
    s = shifting_shares(t, 3, period_s=600.0)
    for i in range(3):
        assert np.allclose(s[i], 1 / 3 + 0.2 * np.sin(2 * np.pi * t / 600 + i * 2 * np.pi / 3))


def test_thinned_arrivals_follow_the_time_varying_rate():
    arr = shifting_poisson_arrivals(MODELS, 600.0, 600e6, seed=1, period_s=600.0)
    total = sum(v.size for v in arr.values())
    assert abs(total - 600 * 600) < 5 * np.sqrt(600 * 600)  # steady total rate
    # per 60 s bin, each model's count is its share's integral x R (Poisson noise only)
    edges = np.arange(0, 601, 60.0)
    mid = np.linspace(0, 600, 6001)
    for i, m in enumerate(MODELS):
        counts, _ = np.histogram(arr[m] / 1e6, bins=edges)
        expect = [600.0 * np.trapezoid(shifting_shares(mid[(mid >= lo) & (mid <= lo + 60)], 3, 600.0)[i], mid[(mid >= lo) & (mid <= lo + 60)])
                  for lo in edges[:-1]]
        assert np.all(np.abs(counts - expect) < 5 * np.sqrt(np.asarray(expect)) + 5), (m, counts, expect)
        assert np.all(np.diff(arr[m]) >= 0) and arr[m].min() >= 0 and arr[m].max() < 600e6


def test_same_seed_same_arrivals_other_seed_other_arrivals():
    a = shifting_poisson_arrivals(MODELS, 100.0, 30e6, seed=3)
    b = shifting_poisson_arrivals(MODELS, 100.0, 30e6, seed=3)
    c = shifting_poisson_arrivals(MODELS, 100.0, 30e6, seed=4)
    assert all(np.array_equal(a[m], b[m]) for m in MODELS)
    assert not np.array_equal(a["a"], c["a"])


def test_bad_shifting_arguments_are_refused():
    with pytest.raises(UserError, match="amplitude"):
        shifting_poisson_arrivals(MODELS, 10.0, 1e6, 0, amplitude=0.5)
    with pytest.raises(UserError, match="period"):
        shifting_poisson_arrivals(MODELS, 10.0, 1e6, 0, period_s=0)
    with pytest.raises(UserError, match="repeat"):
        shifting_poisson_arrivals(["a", "a"], 10.0, 1e6, 0)


AZ = """app,func,end_timestamp,duration
x1,f1,10.5,0.5
x1,f2,12.0,1.0
x2,f3,13.0,0.25
x1,f1,20.0,2.0
x9,other,1.0,0.5
"""


def test_azure_replay_maps_functions_to_models_and_keeps_their_phase(tmp_path):
    p = tmp_path / "af.txt"
    p.write_text(AZ)
    out = replay_azure_functions(p, {"f1": "m", "f2": "m", "f3": "n"}, duration_us=60e6)
    # arrivals: f1 10.0, 18.0; f2 11.0; f3 12.75; time 0 = 10.0 (earliest mapped arrival)
    assert np.allclose(out["m"], [0.0, 1e6, 8e6])
    assert np.allclose(out["n"], [2.75e6])
    fast = replay_azure_functions(p, {"f1": "m"}, duration_us=60e6, speedup=2.0)
    assert np.allclose(fast["m"], [0.0, 4e6])


@pytest.mark.parametrize("text, mapping, match", [
    ("app,func,end_time,duration\nx,f1,1,0\n", {"f1": "m"}, "lacks column.*end_timestamp"),
    (AZ + "x1,f1,abc,0.1\n", {"f1": "m"}, "line 7: end_timestamp 'abc'"),
    (AZ, {"nope": "m"}, r"\['nope'\] have no invocation"),
    (AZ, {}, "no function is mapped"),
])
def test_azure_bad_input_names_file_field_and_fix(tmp_path, text, mapping, match):
    p = tmp_path / "af.txt"
    p.write_text(text)
    with pytest.raises(UserError, match=match) as e:
        replay_azure_functions(p, mapping, 1e6)
    assert str(p) in str(e.value) and "To fix" in str(e.value)


def test_azure_missing_file(tmp_path):
    with pytest.raises(UserError, match="not found"):
        replay_azure_functions(tmp_path / "none.txt", {"f": "m"}, 1e6)


def test_shifting_rates_are_the_generators_rates_and_their_derivative():
    from ppipe.sim.workloads import shifting_rates

    models = ["a", "b", "c"]
    for t in (0.0, 77.0, 450.0):
        rate, trend = shifting_rates(t, models, 900.0, 600.0)
        assert sum(rate.values()) == pytest.approx(900.0)
        assert [rate[m] for m in models] == pytest.approx(list(900.0 * shifting_shares(t, 3, 600.0)))
        ahead, _ = shifting_rates(t + 1e-3, models, 900.0, 600.0)
        assert [(ahead[m] - rate[m]) / 1e-3 for m in models] == pytest.approx([trend[m] for m in models], rel=1e-3, abs=1e-3)


def test_fluid_max_load_of_capacity_that_follows_the_mix():
    from ppipe.sim.workloads import fluid_max_load

    s = shifting_shares(np.arange(0, 600, 10.0), 3, 600.0).T
    x = 900.0 * s  # every instant's plan carries 900 req/s in the mix's proportions
    assert fluid_max_load(s, x, 1000.0, target=1.0) == pytest.approx(0.9)
    # 1 % may be lost: the demand may exceed 900 by 1 % of itself
    assert fluid_max_load(s, x, 1000.0, target=0.99) == pytest.approx(0.9 / 0.99)


def test_fluid_max_load_allows_a_short_overload_within_the_budget():
    from ppipe.sim.workloads import fluid_max_load

    # one model; 100 samples, one of which has half the capacity
    s = np.ones((100, 1))
    x = np.full((100, 1), 100.0)
    x[0] = 50.0
    assert fluid_max_load(s, x, 100.0, target=1.0) == pytest.approx(0.5)
    # above L = 1 every sample loses: f(L) = ((100 L - 50) + 99 (100 L - 100)) / (100 x 100 L)
    # = 1 - 0.995 / L, which is 0.01 at L = 0.995 / 0.99
    assert fluid_max_load(s, x, 100.0, target=0.99) == pytest.approx(0.995 / 0.99)


def test_fluid_max_load_refuses_mismatched_shapes():
    from ppipe.sim.workloads import fluid_max_load

    with pytest.raises(UserError, match="same"):
        fluid_max_load(np.ones((3, 2)), np.ones((3, 3)), 1.0)
