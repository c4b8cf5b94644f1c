"""A plan, its profiles and its cluster, ``k`` times slower: the same plan problem in dilated time.

Every latency of the problem is multiplied by ``k`` and every bandwidth divided by it:
profiled block latencies ``L x k``, NIC bandwidths ``B / k`` (so each transfer takes
``k`` times as long), SLOs ``T x k``; the plan keeps its pipelines, partitions, batches
and placement, with latencies ``x k`` and throughputs ``/ k``. In dilated time the plan is
exactly as feasible as in real time: every reservation, transfer and deadline of the data
plane scales by ``k``.

What does not scale is the host: the runtime's own costs (parsing a request, moving its
bytes, waking a worker) stay what they are. Serving the dilated plan therefore shows how
the data plane serves the plan when those costs are ``k`` times smaller against its
slack: a rehearsal on a host slower than the one the plan is for (a laptop for a GPU
fleet), and a test whose outcome does not depend on how busy its host is.
"""

from __future__ import annotations

from pathlib import Path

from ppipe.spec.base import dump_yaml
from ppipe.spec.cluster import ClusterSpec
from ppipe.spec.plan import Plan
from ppipe.spec.profile import ModelProfile


def dilated_profile(profile: ModelProfile, k: float) -> ModelProfile:
    """The profile with every latency ``x k`` (its per-layer timings are left out)."""
    man = profile.manifest.model_copy(update={
        "latency_bs1_us": {g: v * k for g, v in profile.manifest.latency_bs1_us.items()},
        "slo_ms": None if profile.manifest.slo_ms is None else profile.manifest.slo_ms * k,
        "layers": None,
    })
    return ModelProfile(manifest=man, table={key: v * k for key, v in profile.table.items()})


def dilated_cluster(cluster: ClusterSpec, k: float) -> ClusterSpec:
    """The cluster with every NIC ``k`` times slower, named ``<name>-x<k>``."""
    servers = [s.model_copy(update={"nic_bandwidth_gbps": s.nic_bandwidth_gbps / k}) for s in cluster.servers]
    return cluster.model_copy(update={"name": f"{cluster.name}-x{k:g}", "servers": servers})


def dilated_plan(plan: Plan, k: float) -> Plan:
    """The plan with latencies and SLOs ``x k`` and throughputs ``/ k``; same pipelines and placement."""
    def partition(p):
        return p.model_copy(update={"infer_us": p.infer_us * k, "transfer_us": p.transfer_us * k,
                                    "throughput_rps": p.throughput_rps / k})

    def pipeline(pp):
        return pp.model_copy(update={"throughput_rps": pp.throughput_rps / k, "latency_us": pp.latency_us * k,
                                     "partitions": [partition(p) for p in pp.partitions]})

    models = [m.model_copy(update={"slo_ms": m.slo_ms * k, "throughput_rps": m.throughput_rps / k,
                                   "pipelines": [pipeline(pp) for pp in m.pipelines]}) for m in plan.models]
    return plan.model_copy(update={"cluster": f"{plan.cluster}-x{k:g}", "models": models})


def save_dilated(plan: Plan, profiles: dict[str, ModelProfile], cluster: ClusterSpec, k: float, out_dir: str | Path) -> Path:
    """Write the dilated plan (``plan.yaml``), cluster (``cluster.yaml``) and profiles
    (``profiles/<model>/``) into ``out_dir``; returns the plan's path.

    Raises ValueError for ``k <= 0``.
    """
    if not k > 0:
        raise ValueError(f"a time dilation must be > 0, got {k}")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    cluster_file = out / "cluster.yaml"
    dump_yaml(dilated_cluster(cluster, k).model_dump(mode="json"), cluster_file)
    refs = {m: str(dilated_profile(p, k).save(out / "profiles" / m).resolve()) for m, p in profiles.items()}
    slow = dilated_plan(plan, k)
    slow = slow.model_copy(update={"cluster_file": str(cluster_file.resolve()),
                                   "models": [m.model_copy(update={"profile": refs[m.name]}) for m in slow.models]})
    slow.save(out / "plan.yaml")
    return out / "plan.yaml"
