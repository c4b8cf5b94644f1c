"""Request arrival processes: Poisson, bursty (gamma inter-arrivals), and trace replay.

Every generator returns sorted arrival times in microseconds in ``[0, duration_us)`` for
one model at a mean rate (requests per second). Randomness comes from a
:class:`numpy.random.Generator` that the caller seeds, so the same seed gives the same
arrivals (:func:`model_rng` derives one independent stream per model from one seed).

Traces
------
* Azure Functions 2021 (``AzureFunctionsInvocationTraceForTwoWeeksJan2021``): a CSV with a
  header that has ``end_timestamp`` and ``duration`` columns, both in seconds. The arrival
  of an invocation is ``end_timestamp - duration`` (docs/planning-model.md, "How serving is measured").
* A plain list of timestamps: one number (seconds) per line, optionally with the header
  ``timestamp``/``arrival``/``time``.

A trace is replayed at a target rate by scaling its time axis: with ``n`` arrivals over a
span ``S`` seconds the trace's own rate is ``n / S``; multiplying every gap by
``(n / S) / rate`` gives the target mean rate and keeps the burst structure (the
coefficient of variation of the gaps). A trace shorter than the window (after scaling) is
repeated; each model starts at its own random offset into the trace so that models driven
by one trace are not burst-aligned (the paper assigns trace functions to models round
robin; with one function per file, a random phase is the closest equivalent).
"""

from __future__ import annotations

import csv
import enum
import math
from pathlib import Path
from typing import Sequence

import numpy as np

from ppipe.errors import UserError


class ArrivalKind(str, enum.Enum):
    POISSON = "poisson"
    BURSTY = "bursty"
    TRACE = "trace"
    SHIFTING = "shifting"  # a sinusoidal model mix at a steady total rate (ppipe.sim.workloads)


def model_rng(seed: int, index: int) -> np.random.Generator:
    """An independent random stream for model number ``index`` of a run seeded by ``seed``."""
    return np.random.default_rng(np.random.SeedSequence([int(seed), int(index)]))


def _renewal(gaps_fn, rate_rps: float, duration_us: float) -> np.ndarray:
    """Arrival times of a renewal process whose gaps (in us) come from ``gaps_fn(n)``."""
    if rate_rps <= 0 or duration_us <= 0:
        return np.empty(0)
    mean_gap_us = 1e6 / rate_rps
    expected = duration_us / mean_gap_us
    chunks = []
    t0 = 0.0
    # Draw in chunks sized to the expected count (plus slack) so one draw nearly always suffices.
    n = int(expected + 6 * math.sqrt(expected + 1) + 16)
    while True:
        gaps = gaps_fn(n)
        times = t0 + np.cumsum(gaps)
        chunks.append(times)
        if times[-1] >= duration_us:
            break
        t0 = float(times[-1])
    out = np.concatenate(chunks)
    return out[out < duration_us]


def poisson_arrivals(rate_rps: float, duration_us: float, rng: np.random.Generator) -> np.ndarray:
    """Poisson arrivals: exponential gaps with mean ``1/rate``."""
    scale = 1e6 / rate_rps if rate_rps > 0 else 0.0
    return _renewal(lambda n: rng.exponential(scale, n), rate_rps, duration_us)


def gamma_arrivals(rate_rps: float, duration_us: float, cv: float, rng: np.random.Generator) -> np.ndarray:
    """Bursty arrivals: gamma-distributed gaps with mean ``1/rate`` and coefficient of variation ``cv``.

    ``cv = 1`` is Poisson; ``cv > 1`` is burstier (shape ``k = 1/cv^2`` < 1 gives many short
    gaps and a few long ones).
    """
    if cv <= 0:
        raise UserError(f"--cv must be > 0 for bursty arrivals, got {cv}", fix="give e.g. --cv 2 (1 = Poisson)")
    shape = 1.0 / (cv * cv)
    scale = (1e6 / rate_rps) / shape if rate_rps > 0 else 0.0
    return _renewal(lambda n: rng.gamma(shape, scale, n), rate_rps, duration_us)


def read_trace(path: str | Path) -> np.ndarray:
    """Read a trace file into sorted arrival times in seconds, starting at 0.

    Raises:
        UserError: the file is missing, empty, or has neither format.
    """
    p = Path(path)
    if not p.is_file():
        raise UserError("trace file not found", fix="give the path to an Azure Functions 2021 CSV or a list of timestamps", file=str(p))
    with p.open(newline="") as fh:
        rows = [r for r in csv.reader(fh) if r and any(c.strip() for c in r)]
    if not rows:
        raise UserError("trace file is empty", fix="give a file with at least two arrivals", file=str(p))
    header = [c.strip().lower() for c in rows[0]]
    times: list[float] = []
    if "end_timestamp" in header and "duration" in header:
        ie, idur = header.index("end_timestamp"), header.index("duration")
        for lineno, r in enumerate(rows[1:], start=2):
            try:
                times.append(float(r[ie]) - float(r[idur]))
            except (ValueError, IndexError):
                raise UserError(
                    f"line {lineno}: cannot read end_timestamp/duration from {r}",
                    fix="both columns must be numbers in seconds",
                    file=str(p),
                ) from None
    else:
        body = rows
        if header and len(header) == 1 and header[0] in ("timestamp", "timestamp_s", "arrival", "arrival_s", "time", "time_s"):
            body = rows[1:]
        for lineno, r in enumerate(body, start=1 + (body is not rows)):
            if len(r) != 1:
                raise UserError(
                    f"line {lineno}: expected one timestamp per line, got {r}",
                    fix="give either an Azure Functions 2021 CSV (header with end_timestamp,duration) "
                    "or one arrival time in seconds per line",
                    file=str(p),
                )
            try:
                times.append(float(r[0]))
            except ValueError:
                raise UserError(f"line {lineno}: '{r[0]}' is not a number", fix="timestamps are seconds", file=str(p)) from None
    arr = np.sort(np.asarray(times, dtype=float))
    if arr.size < 2 or not np.all(np.isfinite(arr)) or arr[-1] <= arr[0]:
        raise UserError(
            f"trace has {arr.size} usable arrival(s) spanning no time",
            fix="give at least two distinct, finite arrival times",
            file=str(p),
        )
    return arr - arr[0]


def trace_arrivals(
    trace_s: np.ndarray, rate_rps: float, duration_us: float, rng: np.random.Generator | None = None
) -> np.ndarray:
    """Replay a trace (seconds from 0, sorted) at a mean rate over ``[0, duration_us)``.

    The trace's gaps are scaled so its mean rate is ``rate_rps`` (see the module docstring);
    the scaled trace is tiled as often as needed and read from a random offset (``rng``; 0
    without one).
    """
    trace_s = np.asarray(trace_s, dtype=float)
    if rate_rps <= 0 or duration_us <= 0:
        return np.empty(0)
    n = trace_s.size
    span_s = float(trace_s[-1] - trace_s[0])
    # n arrivals over the span; one period of the tiled trace is n gaps long, the gap that
    # closes a period being the mean gap (so the tiled process keeps the mean rate).
    native_rate = (n - 1) / span_s
    factor = native_rate / rate_rps
    period_us = (span_s + 1.0 / native_rate) * factor * 1e6
    base_us = (trace_s - trace_s[0]) * factor * 1e6
    offset_us = float(rng.uniform(0.0, period_us)) if rng is not None else 0.0
    reps = int(math.ceil((duration_us + offset_us) / period_us)) + 1
    tiled = (base_us[None, :] + period_us * np.arange(reps)[:, None]).ravel() - offset_us
    return tiled[(tiled >= 0) & (tiled < duration_us)]


def make_arrivals(
    kind: ArrivalKind | str,
    rates_rps: dict[str, float],
    duration_us: float,
    seed: int,
    *,
    cv: float = 2.0,
    trace_s: np.ndarray | None = None,
    models: Sequence[str] | None = None,
    period_s: float = 600.0,
) -> dict[str, np.ndarray]:
    """Arrival times (us) per model. Models are seeded in ``models`` order (default: sorted names).

    ``shifting``: the total of ``rates_rps`` at a steady rate, shared among the models by
    the sinusoidal mix of :mod:`ppipe.sim.workloads` (period ``period_s``; each model's mean
    share is 1/n whatever its own rate).
    """
    kind = ArrivalKind(kind)
    order = list(models) if models is not None else sorted(rates_rps)
    if kind is ArrivalKind.SHIFTING:
        from ppipe.sim.workloads import shifting_poisson_arrivals

        total = sum(float(rates_rps.get(name, 0.0)) for name in order)
        return shifting_poisson_arrivals(order, total, duration_us, seed, period_s=period_s)
    out: dict[str, np.ndarray] = {}
    for i, name in enumerate(order):
        rate = float(rates_rps.get(name, 0.0))
        rng = model_rng(seed, i)
        if kind is ArrivalKind.POISSON:
            out[name] = poisson_arrivals(rate, duration_us, rng)
        elif kind is ArrivalKind.BURSTY:
            out[name] = gamma_arrivals(rate, duration_us, cv, rng)
        else:
            if trace_s is None:
                raise UserError("trace arrivals need a trace file", fix="give --arrivals trace --trace FILE")
            out[name] = trace_arrivals(trace_s, rate, duration_us, rng)
    return out
