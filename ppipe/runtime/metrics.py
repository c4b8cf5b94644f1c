"""Prometheus metrics of a running ``ppipe serve`` (served at ``/metrics``).

Each :class:`RuntimeMetrics` has its own registry, so several runtimes (tests) can live in
one process.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

LATENCY_BUCKETS_S = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 1.0, 2.5, 5.0)
BATCH_BUCKETS = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 64)


class RuntimeMetrics:
    """The runtime's counters, gauges and histograms."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter("ppipe_requests", "Inference requests answered, by HTTP status.", ["model", "code"], registry=r)
        self.drops = Counter("ppipe_drops", "Requests dropped, by reason.", ["model", "reason"], registry=r)
        self.latency = Histogram(
            "ppipe_request_latency_seconds", "Arrival to answer of served requests.", ["model"], buckets=LATENCY_BUCKETS_S, registry=r
        )
        self.batch = Histogram("ppipe_batch_size", "Size of dispatched batches.", ["model"], buckets=BATCH_BUCKETS, registry=r)
        self.queue = Gauge("ppipe_queue_length", "Requests submitted and not yet dispatched or dropped.", ["model"], registry=r)
        self.busy = Counter("ppipe_vgpu_busy_seconds", "Time each vGPU spent running batches (worker reports).", ["vgpu"], registry=r)
        self.failed = Gauge("ppipe_vgpu_failed", "1 for each vGPU marked failed.", ["vgpu"], registry=r)
        self.late = Counter("ppipe_late", "Served requests that finished after their deadline.", ["model"], registry=r)
        self._bound: dict[tuple, object] = {}

    def bound(self, metric, *labels: str):
        """``metric.labels(*labels)``, cached: the hot path (several per request) skips
        prometheus_client's label validation and lock on every call after the first."""
        key = (id(metric), labels)
        child = self._bound.get(key)
        if child is None:
            child = self._bound[key] = metric.labels(*labels)
        return child

    def render(self) -> bytes:
        return generate_latest(self.registry)
