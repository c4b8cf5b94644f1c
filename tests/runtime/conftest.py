"""Runtime test fixtures: a tiny model, hand-built plans, and ONE Ray cluster per session.

The session's Ray cluster (``ray.cluster_utils.Cluster``) has two nodes on this machine,
offering the custom resources ``nodeA`` and ``nodeB``, so the multi-node test and the
single-node ones share one Ray instance. Plans on ``local-cpu`` (no ``ray_resource``)
land on either node.
"""

from __future__ import annotations

import contextlib
import functools
import importlib.util
import os
from pathlib import Path

import pytest

from ppipe.spec.cluster import ClusterSpec
from ppipe.spec.plan import ModelPlan, PartitionPlan, PipelinePlan, Plan, PlanSettings, SolverReport

from .tinynet import write_tinynet


# one server of three CPU 'GPUs': room for a two-partition plan and a spare
THREE_CPUS = """
version: 1
name: three-cpus
bandwidth_efficiency: 1.0
gpu_types:
- {name: cpu, vgpu_levels: [1, 2]}
servers:
- {name: h, gpu_type: cpu, gpus_per_server: 3, count: 1, nic_bandwidth_gbps: 10}
"""


def make_plan(profile, cluster: ClusterSpec, partitions, batch: int = 4, slo_ms: float | None = None, profile_ref: str | None = None) -> Plan:
    """A one-pipeline plan: ``partitions`` = [(first, last, gpu, vgpu, count)], placed by the planner's placer."""
    from ppipe.planner.placement import place

    parts = []
    for first, last, gpu, v, count in partitions:
        infer = profile.partition_latency_us(gpu, v, batch, first, last)
        parts.append(
            PartitionPlan(first_block=first, last_block=last, gpu=gpu, vgpu=v, count=count, infer_us=infer, throughput_rps=count * batch / infer * 1e6)
        )
    lat = sum(p.infer_us for p in parts)
    thr = min(p.throughput_rps for p in parts)
    mp = ModelPlan(
        name=profile.name,
        profile=profile_ref or str(profile.directory),
        slo_ms=slo_ms or profile.manifest.slo_ms or 200.0,
        weight=1.0,
        throughput_rps=thr,
        pipelines=[PipelinePlan(batch=batch, throughput_rps=thr, latency_us=lat, partitions=parts)],
    )
    return Plan(
        cluster=cluster.name,
        settings=PlanSettings(planner="hand", formulation="ppipe", gpu_rule="physical", objective="none", margin=0.0, max_partitions=3),
        solver=SolverReport(name="none", status="heuristic", seconds=0.0, objective=0.0),
        models=[mp],
        placement=place([mp], cluster),
    )


RAY_MISSING = importlib.util.find_spec("ray") is None
SKIP_WITHOUT_RAY = pytest.mark.skip(reason="Ray is not installed (the extra ppipe[ray]; CI's .[test] pulls it)")


@contextlib.contextmanager
def tinynet_served(tinynet, tmp_path_factory):
    """tinynet's two partitions on local ``ort`` workers behind the HTTP frontend, scheduled
    by the test double of the scheduler (fakes.py): yields ``(url, runtime)``."""
    from ppipe.runtime.ingress.http_server import create_app
    from ppipe.runtime.ingress.http_transport import BackgroundServer
    from ppipe.runtime.launch.deploy import load_deployment
    from ppipe.runtime.launch.local import start_local_workers
    from ppipe.runtime.scheduler.host import Runtime
    from ppipe.spec.cluster import load_cluster

    from .fakes import FifoScheduler

    plan = make_plan(tinynet, load_cluster("local-cpu"), [(0, 1, "cpu", 2, 1), (2, 2, "cpu", 2, 1)])
    path = tmp_path_factory.mktemp("plan") / "plan.yaml"
    plan.save(path)
    dep = load_deployment(path)
    workers = start_local_workers(dep, backend="ort")
    try:
        factory = functools.partial(FifoScheduler, max_batch=4, window_us=3000.0)
        rt = Runtime(dep.plan, dep.profiles, dep.cluster, workers, scheduler_factory=factory, keep_traces=100)
        app = create_app(rt, token=None, max_body_bytes=1 << 20, decode_workers=0)
        with BackgroundServer(app) as srv:
            yield srv.url, rt
    finally:
        for h in workers.values():
            h.kill()


def pytest_collection_modifyitems(items):
    """A test that uses the session's Ray cluster is a Ray test: marked ``ray`` whether or not
    it says so. Without Ray (ppipe[ray] is an extra), the Ray tests skip and say why."""
    for item in items:
        if "ray_cluster" in getattr(item, "fixturenames", ()) and item.get_closest_marker("ray") is None:
            item.add_marker(pytest.mark.ray)
        if RAY_MISSING and item.get_closest_marker("ray") is not None:
            item.add_marker(SKIP_WITHOUT_RAY)


@pytest.fixture(autouse=True)
def _ray_only_in_ray_tests(request, monkeypatch):
    """Outside tests marked ``ray``, ``ray.init`` fails the test: the runtime's other tests run
    on in-process workers (:mod:`ppipe.runtime.launch.inproc`, tests/runtime/fakes.py) and
    must not start a Ray session by accident (seconds each, and a shared session's state)."""
    if request.node.get_closest_marker("ray") is not None:
        return
    try:
        import ray
    except ImportError:  # without ppipe[ray] nothing can start Ray
        return

    def refuse(*args, **kwargs):
        raise AssertionError(f"{request.node.nodeid} starts Ray but is not marked @pytest.mark.ray")

    monkeypatch.setattr(ray, "init", refuse)


@pytest.fixture(scope="session")
def tinynet(tmp_path_factory):
    d = tmp_path_factory.mktemp("tinynet")
    return write_tinynet(d)


@pytest.fixture(scope="session")
def ray_cluster():
    """One Ray instance for the whole runtime tier: two nodes with custom resources."""
    ray = pytest.importorskip("ray")
    from ray.cluster_utils import Cluster

    if ray.is_initialized():
        ray.shutdown()
    os.environ.setdefault("RAY_DEDUP_LOGS", "0")
    os.environ.setdefault("RAY_worker_niceness", "0")  # as `ppipe serve` starts its Ray (ppipe.runtime.cli.init_ray)
    cluster = Cluster(
        initialize_head=True,
        head_node_args={"num_cpus": 2, "resources": {"nodeA": 1}, "object_store_memory": 80 * 1024 * 1024, "include_dashboard": False},
    )
    cluster.add_node(num_cpus=2, resources={"nodeB": 1}, object_store_memory=80 * 1024 * 1024)
    cluster.wait_for_nodes()
    ray.init(address=cluster.address, include_dashboard=False, log_to_driver=False)
    yield cluster
    ray.shutdown()
    cluster.shutdown()


def write_cluster(path: Path, text: str) -> Path:
    path.write_text(text)
    return path
