"""Workloads whose model mix shifts over time: a synthetic sinusoidal mix, and Azure Functions replay.

:mod:`ppipe.sim.arrivals` draws each model's arrivals at a constant mean rate. Real traffic
moves: the Azure Functions traces the paper replays are diurnal, each function with its
own phase, so the max-min plan made for one mix puts capacity in the wrong pools later.
This module makes such workloads for the simulator and the re-plan controller
(:mod:`ppipe.control.replan`).

Shifting mix
------------
The total rate ``R`` (req/s) stays constant; model ``i`` of ``n`` (in the given order) gets
the share

    s_i(t) = 1/n + a sin(2 pi t / P + 2 pi i / n),        a = 0.6 / n by default,

so with n = 3, ``s_i(t) = 1/3 + 0.2 sin(2 pi t / P + i 2 pi / 3)`` (issue 21). For n >= 2
the phases are spread evenly around the circle, so ``sum_i sin(theta + 2 pi i / n) = 0``
and the shares always sum to 1; ``a <= 1/n`` keeps every share >= 0 (each model's peak is
``(1 + n a)`` times its mean share: 1.6 at the default). With one model the share is 1.

Model i's arrivals are a Poisson process of rate ``lambda_i(t) = R s_i(t)``, drawn by
thinning (Lewis and Shedler): a homogeneous Poisson process of rate
``lambda_max = R (1/n + a)`` whose points ``t`` are kept with probability
``lambda_i(t) / lambda_max``. The result is exactly the inhomogeneous process; each model
has its own random stream (:func:`~ppipe.sim.arrivals.model_rng`), so one seed gives the
same arrivals.

Azure Functions 2021
--------------------
``AzureFunctionsInvocationTraceForTwoWeeksJan2021.txt`` is a CSV with the header
``app,func,end_timestamp,duration``: one row per invocation, the function's (hashed) app
and name, the invocation's end time in seconds from the start of the trace, and its
duration in seconds. An invocation arrived at ``end_timestamp - duration`` (as
:func:`~ppipe.sim.arrivals.read_trace` reads it). :func:`replay_azure_functions` takes a
mapping ``func -> model`` (several functions may feed one model; functions not in the
mapping are ignored), keeps the functions' relative timing (time 0 is the earliest mapped
arrival, so their phases stay aligned), and optionally compresses time by a ``speedup``
(the paper's traces span hours; a 10-minute period stands for a day's shift).
"""

from __future__ import annotations

import csv
import math
from pathlib import Path
from typing import Mapping, Sequence

import numpy as np

from ppipe.errors import UserError
from ppipe.sim.arrivals import model_rng

AZURE_2021_COLUMNS = ("app", "func", "end_timestamp", "duration")


def default_amplitude(n: int) -> float:
    """``0.6 / n``: the issue's 0.2 for three models; 0 for one (a single share cannot move)."""
    return 0.6 / n if n > 1 else 0.0


def shifting_shares(t_s: np.ndarray | float, n: int, period_s: float, amplitude: float | None = None) -> np.ndarray:
    """Shares ``s_i(t)`` (module docstring) as an array of shape ``(n,) + shape(t_s)``."""
    a = default_amplitude(n) if amplitude is None else amplitude
    t = np.asarray(t_s, dtype=float)
    phase = 2 * math.pi * t / period_s
    return np.stack([1.0 / n + a * np.sin(phase + 2 * math.pi * i / n) for i in range(n)]) if n > 1 else np.ones((1,) + t.shape)


def shifting_rates(t_s: float, models: Sequence[str], total_rps: float, period_s: float, amplitude: float | None = None):
    """``(rate, trend)`` per model at ``t_s``: ``R s_i(t)`` (req/s) and its derivative (req/s per s).

    The true rates of :func:`shifting_poisson_arrivals`; a controller never sees them (it
    counts arrivals), a benchmark's oracle does.
    """
    n = len(models)
    a = default_amplitude(n) if amplitude is None else amplitude
    w = 2 * math.pi / period_s
    rate = {m: float(total_rps * shifting_shares(t_s, n, period_s, a)[i]) for i, m in enumerate(models)}
    trend = {m: (total_rps * a * w * math.cos(w * t_s + 2 * math.pi * i / n) if n > 1 else 0.0) for i, m in enumerate(models)}
    return rate, trend


def fluid_max_load(shares: np.ndarray, capacities_rps: np.ndarray, scale_rps: float, target: float = 0.99) -> float:
    """The largest load at which a fluid model of the mix keeps ``target`` of the demand (a reference, not a run).

    Time is sampled evenly (e.g. over one period of the shifting mix). At load ``L`` model
    ``m`` asks for ``L S s_m(t)`` req/s (``S = scale_rps``) and the plan serving at ``t``
    carries ``x_m(t)``; what exceeds the capacity is lost, nothing queues (the SLOs are
    milliseconds), nothing else is lost. The lost share of the demand,

        f(L) = sum_{t,m} max(0, L S s_m(t) - x_m(t)) / sum_t L S
             = mean_t sum_m max(0, s_m(t) - x_m(t) / (L S)),

    rises with ``L`` (each term is non-decreasing in ``L``), so the answer, the largest
    ``L`` with ``f(L) <= 1 - target``, is found by bisection. With ``target = 1`` it is
    ``min_{t,m} x_m(t) / (S s_m(t))``: the load at which the worst instant just fits.

    With ``x(t)`` the max-min plan for the mix at ``t`` this bounds a controller that
    re-plans for free at every instant; with one plan throughout it predicts a static plan.

    Args:
        shares: ``(T, n)`` shares ``s_m(t)`` (each row sums to 1).
        capacities_rps: ``(T, n)`` capacities ``x_m(t)`` of the plan serving at each sample.
        scale_rps: ``S``, the total rate at load 1.
        target: the share of the demand to keep, in (0, 1].

    Raises:
        UserError: shapes differ, or ``scale_rps`` or ``target`` is out of range.
    """
    s = np.asarray(shares, dtype=float)
    x = np.asarray(capacities_rps, dtype=float)
    if s.shape != x.shape or s.ndim != 2 or s.size == 0:
        raise UserError(f"shares {s.shape} and capacities {x.shape} must be the same (T, n) shape", fix="give one row per sample time")
    if not scale_rps > 0 or not 0 < target <= 1:
        raise UserError(f"scale must be > 0 and target in (0, 1], got {scale_rps} and {target}", fix="e.g. scale = the load-1 total, target 0.99")
    pos = s > 0
    if target == 1.0:
        return float(np.min(np.where(pos, x / np.where(pos, s, 1.0), np.inf)) / scale_rps)
    budget = 1.0 - target

    def lost(load: float) -> float:
        return float(np.maximum(s - x / (load * scale_rps), 0.0).sum(axis=1).mean())

    lo = 0.0
    hi = 1.0
    while lost(hi) <= budget:  # (lost(L) -> 1 as L grows: the bracket's top is found)
        lo, hi = hi, 2 * hi
    for _ in range(60):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if lost(mid) <= budget else (lo, mid)
    return lo


def _check_shifting(models: Sequence[str], total_rps: float, duration_us: float, period_s: float, amplitude: float) -> None:
    if not models:
        raise UserError("a shifting workload needs at least one model", fix="give the plan's model names")
    if len(set(models)) != len(models):
        raise UserError(f"model names repeat in {list(models)}", fix="give each model once")
    if total_rps < 0 or duration_us < 0:
        raise UserError(f"total rate and duration must be >= 0, got {total_rps} req/s, {duration_us} us", fix="give positive values")
    if period_s <= 0:
        raise UserError(f"the period of the shifting mix must be > 0 s, got {period_s}", fix="give e.g. --period-s 600")
    n = len(models)
    if n > 1 and not (0 <= amplitude <= 1.0 / n):
        raise UserError(
            f"amplitude {amplitude} is outside [0, 1/{n}]: some share would fall below 0 for {n} models",
            fix=f"give an amplitude in [0, 1/{n}] = [0, {1.0 / n:.4f}]",
        )


def shifting_poisson_arrivals(
    models: Sequence[str],
    total_rps: float,
    duration_us: float,
    seed: int,
    *,
    period_s: float = 600.0,
    amplitude: float | None = None,
) -> dict[str, np.ndarray]:
    """Arrival times (us) per model of the shifting mix (module docstring), by thinning.

    Args:
        models: model names; model ``i``'s phase is ``2 pi i / n`` and its random stream
            ``model_rng(seed, i)``.
        total_rps: the steady total rate R.
        duration_us: the arrival window ``[0, duration_us)``.
        seed: seed of the arrivals.
        period_s: period P of the shares.
        amplitude: a (default ``0.6 / n``).
    """
    n = len(models)
    a = default_amplitude(n) if amplitude is None else float(amplitude)
    _check_shifting(models, total_rps, duration_us, period_s, a)
    out: dict[str, np.ndarray] = {}
    lam_max = total_rps * (1.0 / n + a) if n > 1 else total_rps
    for i, name in enumerate(models):
        rng = model_rng(seed, i)
        if lam_max <= 0 or duration_us <= 0:
            out[name] = np.empty(0)
            continue
        count = rng.poisson(lam_max * duration_us / 1e6)
        cand = np.sort(rng.uniform(0.0, duration_us, count))  # a homogeneous process on the window
        keep_p = shifting_shares(cand / 1e6, n, period_s, a)[i] * total_rps / lam_max
        out[name] = cand[rng.uniform(0.0, 1.0, count) < keep_p]
    return out


def read_azure_functions(path: str | Path, mapping: Mapping[str, str]) -> dict[str, np.ndarray]:
    """Arrival times (s, sorted, not shifted) per model from an Azure Functions 2021 CSV.

    Args:
        path: the CSV (header ``app,func,end_timestamp,duration``, more columns allowed).
        mapping: function name (the ``func`` column) -> model name.

    Raises:
        UserError: the file is missing or empty, a column is missing, a row does not parse,
            or a mapped function has no invocation in the file.
    """
    p = Path(path)
    if not p.is_file():
        raise UserError("Azure Functions trace not found", fix="give the path to AzureFunctionsInvocationTraceForTwoWeeksJan2021.txt", file=str(p))
    if not mapping:
        raise UserError("no function is mapped to a model", fix="give a mapping func -> model (e.g. --map FUNC=MODEL)", file=str(p))
    times: dict[str, list[float]] = {m: [] for m in mapping.values()}
    seen: set[str] = set()
    with p.open(newline="") as fh:
        reader = csv.reader(fh)
        header = [c.strip().lower() for c in next(reader, [])]
        missing = [c for c in ("func", "end_timestamp", "duration") if c not in header]
        if missing:
            raise UserError(
                f"the header lacks column(s) {missing} (it reads {header or 'nothing'})",
                fix="give an Azure Functions 2021 invocation trace: header app,func,end_timestamp,duration",
                file=str(p),
            )
        i_f, i_e, i_d = header.index("func"), header.index("end_timestamp"), header.index("duration")
        for lineno, row in enumerate(reader, start=2):
            if not row or len(row) <= max(i_f, i_e, i_d):
                if row and any(c.strip() for c in row):
                    raise UserError(f"line {lineno}: {len(row)} field(s), the header has {len(header)}", fix="repair or drop the line", file=str(p))
                continue
            model = mapping.get(row[i_f].strip())
            if model is None:
                continue
            try:
                t = float(row[i_e]) - float(row[i_d])
            except ValueError:
                raise UserError(
                    f"line {lineno}: end_timestamp '{row[i_e]}' or duration '{row[i_d]}' is not a number",
                    fix="both are seconds (floats)", file=str(p),
                ) from None
            if not math.isfinite(t):
                raise UserError(f"line {lineno}: arrival time is not finite", fix="repair or drop the line", file=str(p))
            times[model].append(t)
            seen.add(row[i_f].strip())
    absent = sorted(set(mapping) - seen)
    if absent:
        raise UserError(f"mapped function(s) {absent} have no invocation in the file", fix="map functions that appear in the 'func' column", file=str(p))
    return {m: np.sort(np.asarray(v, dtype=float)) for m, v in times.items()}


def replay_azure_functions(
    path: str | Path,
    mapping: Mapping[str, str],
    duration_us: float,
    *,
    speedup: float = 1.0,
    start_s: float = 0.0,
) -> dict[str, np.ndarray]:
    """Arrival times (us) per model in ``[0, duration_us)`` replayed from an Azure Functions 2021 CSV.

    Trace time ``T`` (s after the earliest mapped arrival) becomes simulated time
    ``(T - start_s) / speedup``: ``speedup = 60`` plays an hour of the trace in a minute
    (rates x 60, mix shifts 60 x faster). No tiling: the trace must cover the window.

    Raises:
        UserError: bad file (see :func:`read_azure_functions`), or ``speedup <= 0``.
    """
    if not (speedup > 0) or not math.isfinite(speedup):
        raise UserError(f"speedup must be > 0, got {speedup}", fix="give e.g. speedup=60 (an hour of trace per simulated minute)")
    per_model = read_azure_functions(path, mapping)
    t0 = min(v[0] for v in per_model.values() if v.size)
    out = {}
    for m, v in per_model.items():
        us = (v - t0 - start_s) / speedup * 1e6
        out[m] = us[(us >= 0) & (us < duration_us)]
    return out
