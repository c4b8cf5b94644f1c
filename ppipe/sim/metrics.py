"""Metrics of a simulation run, computed from its records.

Definitions (per model, and over all requests):

* **SLO attainment** = requests completed by their deadline / all requests that arrived
  in the window. Dropped, late (completed after the deadline) and unfinished requests all
  miss. Unlike the paper's public simulator, late completions of multi-stage pipelines
  count as misses.
* **goodput** = on-time completions per second of window.
* **drop rate**, **late rate** = shares of all requests; drops are broken down by reason
  and by where they happened (``queue``, ``in-flight:stage0``, ``after-stage<k>``).
* **latency** p50/p99 = over completed requests (on time or late), arrival to completion.
* **temporal utilization** of a GPU type = busy time of its vGPUs inside the window, each
  weighted 1/v, over (window x GPUs). Given twice: over all GPUs of that type in the cluster
  (``utilization``), and over the GPUs the plan uses (``utilization_used``).
* **batch histogram** = dispatched batches per batch size, per model.
* **probes per dispatch** = the scheduler's probe counter (if it exposes one) / dispatches;
  **scheduler time per dispatch** = wall time inside scheduler calls / dispatches (all calls:
  submit, wake, report -- what one dispatch costs the process, all told).
"""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import asdict, dataclass, field
from typing import Any, Iterable

import numpy as np

from ppipe.sim.records import BatchRecord, Outcome, RequestRecord


@dataclass
class ModelMetrics:
    model: str
    requests: int
    ok: int
    late: int
    dropped: int
    unfinished: int
    attainment: float
    goodput_rps: float
    offered_rps: float
    drop_rate: float
    late_rate: float
    p50_latency_ms: float | None
    p99_latency_ms: float | None
    drops_by_reason: dict[str, int] = field(default_factory=dict)
    drops_by_where: dict[str, int] = field(default_factory=dict)
    batch_histogram: dict[int, int] = field(default_factory=dict)


@dataclass
class SimResult:
    """Summary of one run. ``records``/``batches`` are kept for plots and tests (not in JSON)."""

    duration_s: float
    models: dict[str, ModelMetrics]
    overall: ModelMetrics
    utilization: dict[str, float]
    utilization_used: dict[str, float]
    dispatches: int
    probes_per_dispatch: float | None
    scheduler_us_per_dispatch: float | None
    scheduler_calls: int
    events: int
    wall_s: float
    sim_s_per_wall_s: float
    cpu_s: float
    sim_s_per_cpu_s: float
    anomalies: list[str]
    anomaly_count: int
    stopped_at_s: float | None = None  # the run stopped early here: every model was already below the target (see ppipe.sim.simulator)
    execution: str = "events"  # "exact": batches written from their plans; "events": every stage simulated (SimConfig.execution)
    records: list[RequestRecord] = field(default_factory=list, repr=False)
    batches: list[BatchRecord] = field(default_factory=list, repr=False)
    vgpus: dict[str, Any] = field(default_factory=dict, repr=False)
    switches: list[dict] = field(default_factory=list)  # plan switches of a run with re-planning (SimConfig.replan)

    @property
    def attainment(self) -> float:
        return self.overall.attainment

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        for k in ("records", "batches", "vgpus"):
            d.pop(k)
        if not d["switches"]:
            d.pop("switches")  # (a run without re-planning writes what it always wrote)
        return d


def _percentile_ms(lat_us: list[float], q: float) -> float | None:
    if not lat_us:
        return None
    return float(np.percentile(np.asarray(lat_us), q)) / 1e3


def model_metrics(name: str, records: Iterable[RequestRecord], batches: Iterable[BatchRecord], duration_s: float) -> ModelMetrics:
    """Metrics of one set of requests (one model, or all) from hand-built or simulated records."""
    counts = Counter()
    reasons: Counter = Counter()
    where: Counter = Counter()
    lat: list[float] = []
    n = 0
    for r in records:
        n += 1
        o = r.outcome
        counts[o] += 1
        if o is Outcome.DROPPED:
            reasons[r.drop_reason] += 1
            where[r.drop_where or "?"] += 1
        elif o is not Outcome.UNFINISHED:
            lat.append(r.completion_us - r.arrival_us)
    hist = Counter(b.batch for b in batches)
    ok = counts[Outcome.OK]
    return ModelMetrics(
        model=name,
        requests=n,
        ok=ok,
        late=counts[Outcome.LATE],
        dropped=counts[Outcome.DROPPED],
        unfinished=counts[Outcome.UNFINISHED],
        # no request offered: nothing was missed
        attainment=ok / n if n else 1.0,
        goodput_rps=ok / duration_s,
        offered_rps=n / duration_s,
        drop_rate=counts[Outcome.DROPPED] / n if n else 0.0,
        late_rate=counts[Outcome.LATE] / n if n else 0.0,
        p50_latency_ms=_percentile_ms(lat, 50),
        p99_latency_ms=_percentile_ms(lat, 99),
        drops_by_reason=dict(sorted(reasons.items())),
        drops_by_where=dict(sorted(where.items())),
        batch_histogram=dict(sorted(hist.items())),
    )


def utilization(vgpus: dict, gpu_counts: dict[str, int], window_us: float) -> tuple[dict[str, float], dict[str, float]]:
    """(over all GPUs of each type, over the GPUs the plan uses) from the vGPUs' busy times."""
    busy: dict[str, float] = {g: 0.0 for g in gpu_counts}
    used: dict[str, set] = {g: set() for g in gpu_counts}
    for vg in vgpus.values():
        busy[vg.gpu] = busy.get(vg.gpu, 0.0) + vg.busy_in_window_us / vg.level
        # vgpu_id = <server>/gpu<i>/s<slot>: the physical GPU is the part before the slot
        used.setdefault(vg.gpu, set()).add(vg.vgpu_id.rsplit("/", 1)[0])
    all_gpus = {g: (busy[g] / (window_us * gpu_counts[g]) if gpu_counts.get(g) else 0.0) for g in busy}
    used_gpus = {g: (busy[g] / (window_us * len(used[g])) if used.get(g) else 0.0) for g in busy}
    return all_gpus, used_gpus


def summarize(sim, wall_s: float, cpu_s: float | None = None) -> SimResult:
    """Summarize a finished :class:`~ppipe.sim.simulator.Simulator`."""
    dur = sim.config.duration_s
    stopped = sim.stopped_at_us
    if stopped is not None:
        # the requests that arrived before the stop, over the time they arrived in
        dur = max(min(dur, stopped / 1e6), 1e-9)
    by_model: dict[str, list[RequestRecord]] = {m.name: [] for m in sim.plan.models}
    for r in sim.records:
        by_model[r.model].append(r)
    batches_by_model: dict[str, list[BatchRecord]] = {m: [] for m in by_model}
    for b in sim.batches:
        batches_by_model.setdefault(b.model, []).append(b)
    models = {m: model_metrics(m, recs, batches_by_model[m], dur) for m, recs in by_model.items()}
    overall = model_metrics("all", sim.records, sim.batches, dur)
    retired = getattr(sim, "retired_vgpus", None)
    util, util_used = utilization({**sim.vgpus, **retired} if retired else sim.vgpus, sim.cluster.gpu_counts, dur * 1e6)
    dispatches = len(sim.batches)
    probes = _probe_count(sim.scheduler)
    # simulated time = the arrival window (the drain after it is bookkeeping, not load)
    sim_s = dur
    cpu_s = wall_s if cpu_s is None else cpu_s
    return SimResult(
        duration_s=dur,
        models=models,
        overall=overall,
        utilization=util,
        utilization_used=util_used,
        dispatches=dispatches,
        probes_per_dispatch=(probes / dispatches) if (probes is not None and dispatches) else None,
        scheduler_us_per_dispatch=(sim.scheduler_s * 1e6 / dispatches) if dispatches else None,
        scheduler_calls=sim.scheduler_calls,
        events=sim.loop.processed,
        wall_s=wall_s,
        sim_s_per_wall_s=sim_s / wall_s if wall_s > 0 else math.inf,
        cpu_s=cpu_s,
        sim_s_per_cpu_s=sim_s / cpu_s if cpu_s > 0 else math.inf,
        anomalies=list(sim.anomalies),
        anomaly_count=sim.anomaly_count,
        stopped_at_s=None if stopped is None else stopped / 1e6,
        execution="exact" if getattr(sim, "exact", False) else "events",
        records=sim.records,
        batches=sim.batches,
        vgpus=sim.vgpus,
        switches=list(getattr(sim, "switch_log", [])),
    )


def _probe_count(scheduler: Any) -> int | None:
    """The scheduler's count of probe() calls, under the names the data plane may use."""
    for name in ("probe_calls", "probes", "n_probes"):
        v = getattr(scheduler, name, None)
        if isinstance(v, (int, np.integer)):
            return int(v)
    stats = getattr(scheduler, "stats", None)
    if callable(stats):
        stats = stats()
    if isinstance(stats, dict):
        for name in ("probe_calls", "probes"):
            if isinstance(stats.get(name), (int, np.integer)):
                return int(stats[name])
    for name in ("probe_calls", "probes"):
        v = getattr(stats, name, None)
        if isinstance(v, (int, np.integer)):
            return int(v)
    return None
