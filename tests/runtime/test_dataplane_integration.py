"""The runtime with the data plane's real scheduler: serving, multi-node paths, failures.

Workers are local processes (:mod:`ppipe.runtime.launch.local`, `ppipe serve`'s launcher on
one machine) except where the test is about Ray: paths across Ray nodes, a Ray actor
re-created."""

from __future__ import annotations

import asyncio
import threading
import time

import httpx
import numpy as np
import pytest

from ppipe.runtime.launch.deploy import load_deployment
from ppipe.runtime.launch.launchers import start_function
from ppipe.runtime.scheduler.host import Runtime
from ppipe.runtime.ingress.protocol import decode_infer_response, encode_infer_request
from ppipe.runtime.ingress.http_server import create_app
from ppipe.runtime.ingress.http_transport import BackgroundServer
from ppipe.spec.cluster import load_cluster
from .conftest import THREE_CPUS, make_plan
from .tinynet import reference, write_tinynet

TWO_NODES = """
version: 1
name: two-nodes
bandwidth_efficiency: 1.0
gpu_types:
- {name: cpu, vgpu_levels: [1, 2]}
servers:
- {name: a, gpu_type: cpu, gpus_per_server: 1, count: 1, nic_bandwidth_gbps: 10, ray_resource: nodeA}
- {name: b, gpu_type: cpu, gpus_per_server: 1, count: 1, nic_bandwidth_gbps: 10, ray_resource: nodeB}
"""


def _serve(plan, tmp_path, backend, cluster_file=None, launcher="local"):
    path = tmp_path / "plan.yaml"
    plan.save(path)
    dep = load_deployment(path, cluster_file)
    workers = start_function(launcher)(dep, backend=backend)
    rt = Runtime(dep.plan, dep.profiles, dep.cluster, workers, keep_traces=10_000)
    return rt, workers, create_app(rt, decode_workers=0)  # (no JSON pool: binary bodies only)


def _kill_all(workers):
    for h in workers.values():
        h.kill()


def test_real_scheduler_serves_a_two_partition_plan(tinynet, tmp_path):
    plan = make_plan(tinynet, load_cluster("local-cpu"), [(0, 1, "cpu", 2, 1), (2, 2, "cpu", 2, 1)])
    rt, workers, app = _serve(plan, tmp_path, "ort")
    xs = np.random.default_rng(2).normal(size=(8, 3, 8, 8)).astype(np.float32)
    try:
        with BackgroundServer(app) as srv, httpx.Client(base_url=srv.url, timeout=30) as c:
            body, headers = encode_infer_request({"input": xs}, binary=True)
            r = c.post("/v2/models/tinynet/infer", content=body, headers=headers)
            assert r.status_code == 200, r.text
            got = decode_infer_response(r.content)["logits"]
            np.testing.assert_allclose(got, reference(tinynet.directory, xs), rtol=2e-2, atol=2e-2)
            stats = rt.scheduler.stats() if hasattr(rt.scheduler, "stats") else {}
    finally:
        _kill_all(workers)
    assert all(t.error is None and len(t.reports) == 2 for t in rt.traces)
    assert stats.get("dispatches", len(rt.traces)) == len(rt.traces)


@pytest.mark.ray
def test_batches_cross_nodes_along_reserved_paths(ray_cluster, tmp_path):
    import ray

    prof = write_tinynet(tmp_path / "m", base_us=2000.0)
    cfile = tmp_path / "two-nodes.yaml"
    cfile.write_text(TWO_NODES)
    plan = make_plan(prof, load_cluster(cfile), [(0, 1, "cpu", 1, 1), (2, 2, "cpu", 1, 1)])
    servers = {p.partition: p.server for p in plan.placement}
    assert servers == {0: "a-0", 1: "b-0"}
    node_of = {}
    for n in ray.nodes():
        if n["Alive"]:
            for res in ("nodeA", "nodeB"):
                if res in n["Resources"]:
                    node_of[res] = n["NodeID"]
    rt, workers, app = _serve(plan, tmp_path, "emulated", cfile, launcher="ray")
    try:
        with BackgroundServer(app) as srv, httpx.Client(base_url=srv.url, timeout=30) as c:
            for _ in range(3):
                body, headers = encode_infer_request({"input": np.zeros((4, 3, 8, 8), np.float32)})
                r = c.post("/v2/models/tinynet/infer", content=body, headers=headers)
                assert r.status_code == 200, r.text
                assert decode_infer_response(r.content)["logits"].shape == (4, 5)
    finally:
        _kill_all(workers)
    assert rt.traces
    for t in rt.traces:
        assert t.error is None
        assert [r.node_id for r in t.reports] == [node_of["nodeA"], node_of["nodeB"]]
        assert [r.vgpu_id for r in t.reports] == t.route


def test_killed_worker_fails_its_requests_and_the_rest_keeps_serving(tmp_path):
    prof = write_tinynet(tmp_path / "m", base_us=4000.0)  # ~4-20 ms per stage: batches are in flight
    cfile = tmp_path / "three.yaml"
    cfile.write_text(THREE_CPUS)
    plan = make_plan(prof, load_cluster(cfile), [(0, 1, "cpu", 1, 2), (2, 2, "cpu", 1, 1)], slo_ms=400.0)
    pool0 = [p.vgpu_id for p in plan.placements_of("tinynet", 0, 0)]
    victim = pool0[0]
    rt, workers, app = _serve(plan, tmp_path, "emulated", cfile)
    results: list[tuple[float, int, str]] = []
    x = np.zeros((1, 3, 8, 8), np.float32)
    body, headers = encode_infer_request({"input": x}, binary=True)

    async def load(url: str, seconds: float, rate: float) -> None:
        async with httpx.AsyncClient(base_url=url, timeout=30) as c:
            async def one():
                t = time.monotonic()
                r = await c.post("/v2/models/tinynet/infer", content=body, headers=headers)
                results.append((t, r.status_code, r.headers.get("ppipe-drop-reason", "")))

            tasks = []
            t0 = time.monotonic()
            while time.monotonic() - t0 < seconds:
                tasks.append(asyncio.create_task(one()))
                await asyncio.sleep(1 / rate)
            await asyncio.gather(*tasks)

    killed_at = {}

    def killer():
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            # a batch whose first stage, on the victim, is reserved to run now or later (its
            # report may ride on to the last stage's, so "no report yet" would not tell)
            now = rt.clock.now_us()
            busy = [t for t in list(rt.traces) if t.route[0] == victim and not t.reports and t.error is None and t.reserved_us[0][1] > now]
            if busy and time.monotonic() - start > 0.5:
                killed_at["t"] = time.monotonic()
                killed_at["clock_us"] = rt.clock.now_us()
                workers[victim].kill()
                return
            time.sleep(0.002)

    try:
        with BackgroundServer(app) as srv:
            start = time.monotonic()
            th = threading.Thread(target=killer)
            th.start()
            asyncio.run(load(srv.url, 2.0, 60.0))
            th.join()
            with httpx.Client(base_url=srv.url) as c:
                ready = c.get("/v2/health/ready").status_code
    finally:
        _kill_all({k: v for k, v in workers.items() if k != victim})
    assert "t" in killed_at, "the victim never had a batch in flight"
    sent = len(results)
    assert sent > 100 and all(code in (200, 503) for _, code, _ in results)  # every request answered
    failed = [r for r in results if r[1] == 503]
    assert any(reason == "worker-failed" for _, _, reason in failed), failed[:5]
    # each dropped request is counted once, whoever dropped it (the scheduler or the driver)
    counted = _drop_counts(rt)
    answered = {}
    for _, code, reason in failed:
        answered[reason] = answered.get(reason, 0) + 1
    assert counted.get("worker-failed", 0) == answered["worker-failed"], (counted, answered)
    # the scheduler learnt of the failure within a second, and routed nothing to it after
    assert victim in rt.failed and rt.failed[victim] - killed_at["clock_us"] < 1e6
    late = [t for t in rt.traces if victim in t.route and t.dispatched_us > rt.failed[victim]]
    assert not late
    # the rest keeps serving: requests sent a second after the kill are served (a rare
    # deadline drop on this loaded machine is tolerated; a worker-failed one is not)
    after = [(code, reason) for t, code, reason in results if t > killed_at["t"] + 1.0]
    assert after and not [a for a in after if a[1] == "worker-failed"]
    assert sum(code == 200 for code, _ in after) >= 0.9 * len(after), [a for a in after if a[0] != 200]
    assert ready == 200


def _drop_counts(rt) -> dict[str, float]:
    """``ppipe_drops_total`` of a runtime by reason (all models)."""
    out: dict[str, float] = {}
    for fam in rt.metrics.registry.collect():
        for smp in fam.samples:
            if smp.name == "ppipe_drops_total":
                out[smp.labels["reason"]] = out.get(smp.labels["reason"], 0.0) + smp.value
    return out


@pytest.mark.ray
def test_a_killed_worker_is_re_created_and_the_model_is_served_again(ray_cluster, tinynet, tmp_path):
    """Without restarting the server: the worker's actor is killed, the runtime re-creates it
    (deploy.respawn_worker), it loads its blocks, and the scheduler routes to it again."""
    import ray

    from ppipe.runtime.launch.deploy import respawn_worker

    plan = make_plan(tinynet, load_cluster("local-cpu"), [(0, 1, "cpu", 2, 1), (2, 2, "cpu", 2, 1)])
    plan.save(tmp_path / "plan.yaml")
    dep = load_deployment(tmp_path / "plan.yaml")
    workers = start_function("ray")(dep, backend="ort")

    async def respawn(vgpu_id):
        return await asyncio.to_thread(respawn_worker, dep, vgpu_id, "ort")

    # as ppipe serve: a waiting batch wakes 2 ms before its last feasible moment (a late timer must not drop it)
    rt = Runtime(dep.plan, dep.profiles, dep.cluster, workers, respawn=respawn, respawn_interval_s=0.2, keep_traces=100,
                 scheduler_options={"wake_lead_us": 2000.0})
    victim = plan.placements_of("tinynet", 0, 1)[0].vgpu_id
    x = np.random.default_rng(4).normal(size=(1, 3, 8, 8)).astype(np.float32)
    body, headers = encode_infer_request({"input": x}, binary=True)
    try:
        with BackgroundServer(create_app(rt, decode_workers=0)) as srv, httpx.Client(base_url=srv.url, timeout=30) as c:
            # served before the kill (a few tries: on a loaded host the cold first request may
            # miss its deadline before the runtime has seen how late its timers fire)
            for _ in range(5):
                first = c.post("/v2/models/tinynet/infer", content=body, headers=headers)
                if first.status_code == 200:
                    break
            assert first.status_code == 200, first.text
            old_pid = ray.get(workers[victim].actor.ping.remote())["pid"]
            workers[victim].kill()
            t0 = time.monotonic()
            while c.get("/v2/health/ready").status_code == 200 and time.monotonic() - t0 < 10:
                time.sleep(0.02)
            assert victim in rt.failed  # seen dead
            while c.get("/v2/health/ready").status_code != 200 and time.monotonic() - t0 < 60:
                time.sleep(0.1)
            back_s = time.monotonic() - t0
            for _ in range(5):  # the new worker is cold: as before the kill, a loaded host may drop the first try
                r = c.post("/v2/models/tinynet/infer", content=body, headers=headers)
                if r.status_code != 503 or "deadline-unreachable" not in r.text:
                    break
            new_pid = ray.get(rt.workers[victim].actor.ping.remote())["pid"]
    finally:
        _kill_all(rt.workers)
    assert back_s < 60 and victim not in rt.failed
    assert r.status_code == 200, r.text
    got = decode_infer_response(r.content, r.headers.get("inference-header-content-length"))["logits"]
    np.testing.assert_allclose(got, reference(tinynet.directory, x), rtol=2e-2, atol=2e-2)
    assert rt.traces[-1].route[1] == victim and rt.traces[-1].error is None
    assert new_pid != old_pid  # a new worker process
    print(f"vGPU {victim} served again {back_s:.1f} s after its worker was killed")
