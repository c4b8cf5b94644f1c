"""Prometheus metrics of a running ``ppipe serve`` (served at ``/metrics``).

Each :class:`RuntimeMetrics` has its own registry, so several runtimes (tests) can live in
one process.
"""

from __future__ import annotations

from typing import Any, Container, Mapping, Sequence

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily

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
        # ppipe_batch_size: per model, one count per dispatched batch, kept as {model: {size:
        # batches}} and made a histogram at each scrape (_BatchSizes), not observed per batch
        self.batch_sizes: dict[str, dict[int, int]] = {}
        r.register(_BatchSizes(self.batch_sizes))
        # ppipe_queue_length: per model, changed twice per request: read at each scrape from
        # the runtime's own counts (track_queues), not kept in a locked child
        # ppipe_vgpu_busy_seconds: seconds per vGPU, added by every stage report (several per
        # request), read at each scrape (_DictCollector): a dict's float, not a locked child
        self.busy_s: dict[str, float] = {}
        r.register(_DictCollector(CounterMetricFamily, "ppipe_vgpu_busy_seconds",
                                  "Time each vGPU spent running batches (worker reports).", "vgpu", self.busy_s))
        self.failed = Gauge("ppipe_vgpu_failed", "1 for each vGPU marked failed.", ["vgpu"], registry=r)
        self.late = Counter("ppipe_late", "Served requests that finished after their deadline.", ["model"], registry=r)
        self.refused = Counter("ppipe_datapath_refused", "Data-path connections and reports refused, by reason.", ["reason"], registry=r)
        self._bound: dict[tuple, object] = {}

    def bound(self, metric, *labels: str):
        """``metric.labels(*labels)``, cached: the hot path (several per request) skips
        prometheus_client's label validation and lock on every call after the first."""
        key = (id(metric), labels)
        child = self._bound.get(key)
        if child is None:
            child = self._bound[key] = metric.labels(*labels)
        return child

    def track_queues(self, queued: Mapping[str, int]) -> None:
        """Serve ``ppipe_queue_length{model}`` from ``queued`` (model -> requests submitted and
        not yet dispatched or dropped), as it is at each scrape. Once per metrics."""
        self.registry.register(_DictCollector(GaugeMetricFamily, "ppipe_queue_length",
                                              "Requests submitted and not yet dispatched or dropped.", "model", queued))

    def track_capacity(self, runtime: Any) -> None:
        """Serve ``ppipe_model_capacity_alive_ratio{model}`` for ``runtime``: computed at each
        scrape for the models of ``runtime.plan`` as it is then (a live plan switch adds and
        removes models) from ``runtime.failed`` (:func:`capacity_alive_ratio`). Once per metrics."""
        self.registry.register(_CapacityCollector(runtime))

    def render(self) -> bytes:
        return generate_latest(self.registry)


def merge_metrics(texts: list[bytes], shards: Sequence[int | str] | None = None,
                  up: Mapping[int, bool] | None = None, label: str = "shard") -> bytes:
    """Prometheus text expositions of several shards as one: each family once, with the
    samples of every shard. Where the shards' label sets are disjoint (models, vGPUs: each
    model on one shard) the samples are kept as they are; where a model lives on several
    shards, pass ``shards`` (each text's shard index): every sample then gets a ``shard``
    label, so that a model's series stay apart per shard (sum them by model). ``label``
    names that label where the texts are other processes' (``process``: an ingress's).

    ``up`` (every shard of the server -> whether its text is among ``texts``) adds the gauge
    ``ppipe_shard_up{shard="i"}``, 1 or 0: a shard that could not answer (its process died
    and is being restarted) leaves its series out of this scrape, and the gauge tells a
    scraper so, where a failed scrape of the whole server would lose every series."""
    families: dict[str, list[str]] = {}
    samples: dict[str, list[str]] = {}
    for k, text in enumerate(texts):
        current = None
        for line in text.decode().splitlines():
            if line.startswith("# HELP ") or line.startswith("# TYPE "):
                current = line.split()[2]
                head = families.setdefault(current, [])
                if line not in head:
                    head.append(line)
                samples.setdefault(current, [])
            elif line.strip() and not line.startswith("#"):
                samples.setdefault(current or "", []).append(line if shards is None else _with_shard(line, shards[k], label))
    out = []
    for name, head in families.items():
        out += head + samples.pop(name, [])
    for rest in samples.values():
        out += rest
    if up is not None:
        out += ["# HELP ppipe_shard_up Whether the shard answered this scrape (0: it is down, e.g. being restarted, "
                "and its series are missing)", "# TYPE ppipe_shard_up gauge"]
        out += [f'ppipe_shard_up{{shard="{i}"}} {int(bool(answered))}' for i, answered in sorted(up.items())]
    return ("\n".join(out) + "\n").encode()


def _with_shard(line: str, shard: int | str, label: str = "shard") -> str:
    """A sample line of the text exposition with the label ``<label>="<shard>"`` added."""
    name_end = min((i for i in (line.find("{"), line.find(" ")) if i >= 0), default=len(line))
    if line[name_end:name_end + 1] == "{":
        close = line.index("}", name_end)
        inner = line[name_end + 1:close]
        return f'{line[:close]}{"," if inner else ""}{label}="{shard}"{line[close:]}'
    return f'{line[:name_end]}{{{label}="{shard}"}}{line[name_end:]}'


def capacity_alive_ratio(plan: Any, model: str, failed: Container[str]) -> float:
    """The share of ``model``'s planned throughput that its live vGPUs provide.

    A pipeline's planned throughput is its ``throughput_rps`` in the plan; with some vGPUs
    of a pool dead, that pool serves ``alive/count`` of its planned throughput
    (``PartitionPlan.throughput_rps``), and the pipeline no more than its slowest pool:
    ``min(pipeline, min over pools of pool * alive/count)``. A pipeline with a pool all
    dead provides 0. The ratio is the sum over pipelines of that, over the sum of the
    pipelines' planned throughputs (1.0 for a model that plans none).
    """
    try:
        mp = plan.model(model)
    except KeyError:
        return 0.0
    planned = alive = 0.0
    for i, pl in enumerate(mp.pipelines):
        planned += pl.throughput_rps
        cap = pl.throughput_rps
        for j, part in enumerate(pl.partitions):
            vgpus = plan.placements_of(model, i, j)
            live = sum(p.vgpu_id not in failed for p in vgpus)
            share = live / len(vgpus) if vgpus else 0.0
            cap = min(cap, part.throughput_rps * share) if share < 1.0 else cap
        alive += cap
    return alive / planned if planned > 0 else 1.0


class _DictCollector:
    """One metric family with one label, its samples a dict's items as they are at each
    scrape: the values the hot path keeps in plain dicts (several changes per request),
    not in prometheus_client's locked children."""

    def __init__(self, family: type, name: str, help_text: str, label: str, values: Mapping[str, float]) -> None:
        self.family, self.name, self.help_text, self.label, self.values = family, name, help_text, label, values

    def describe(self):
        return [self.family(self.name, self.help_text, labels=[self.label])]

    def collect(self):
        f = self.family(self.name, self.help_text, labels=[self.label])
        for key, value in sorted(self.values.items()):
            f.add_metric([key], value)
        yield f


class _BatchSizes:
    """``ppipe_batch_size``, a histogram per model over :data:`BATCH_BUCKETS`, from the
    runtime's counts of dispatched batches by size (``{model: {size: batches}}``)."""

    def __init__(self, counts: Mapping[str, Mapping[int, int]]) -> None:
        self.counts = counts

    def describe(self):
        return [HistogramMetricFamily("ppipe_batch_size", "Size of dispatched batches.", labels=["model"])]

    def collect(self):
        f = HistogramMetricFamily("ppipe_batch_size", "Size of dispatched batches.", labels=["model"])
        for model, by_size in sorted(self.counts.items()):
            sizes = sorted(by_size.items())
            buckets = [(str(float(b)), sum(n for size, n in sizes if size <= b)) for b in BATCH_BUCKETS]
            buckets.append(("+Inf", sum(n for _, n in sizes)))
            f.add_metric([model], buckets, sum_value=float(sum(size * n for size, n in sizes)))
        yield f


class _CapacityCollector:
    """``ppipe_model_capacity_alive_ratio``, one sample per model of the runtime's plan."""

    def __init__(self, runtime: Any) -> None:
        self.runtime = runtime

    def describe(self):
        return [GaugeMetricFamily("ppipe_model_capacity_alive_ratio", CAPACITY_HELP, labels=["model"])]

    def collect(self):
        plan, failed = self.runtime.plan, self.runtime.failed
        g = GaugeMetricFamily("ppipe_model_capacity_alive_ratio", CAPACITY_HELP, labels=["model"])
        for m in plan.models:
            g.add_metric([m.name], capacity_alive_ratio(plan, m.name, failed))
        yield g


CAPACITY_HELP = "Share of the model's planned throughput that its live vGPUs still provide (1: all, 0: no complete pipeline)."
