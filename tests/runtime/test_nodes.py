"""Several machines without Ray: actor names and incarnations, the capacity gauge, the
server-level readiness rule, abandoned references consumed (the Ray tests are in
test_multinode.py)."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import numpy as np
import pytest

from ppipe.runtime.launch import deploy
from ppipe.runtime.launch.deploy import actor_name, next_incarnation
from ppipe.runtime.scheduler.metrics import RuntimeMetrics, capacity_alive_ratio
from ppipe.runtime.launch.refs import consume
from ppipe.spec.cluster import load_cluster
from .conftest import make_plan


def test_actor_names_and_incarnations():
    assert actor_name("p4-0/gpu0/s0") == "ppipe-vgpu-p4-0/gpu0/s0"
    assert actor_name("p4-0/gpu0/s0", 0) == "ppipe-vgpu-p4-0/gpu0/s0"
    assert actor_name("p4-0/gpu0/s0", 3) == "ppipe-vgpu-p4-0/gpu0/s0-3"
    with pytest.raises(ValueError):
        actor_name("x", -1)
    vid = "test-nodes/gpu0/s9"
    deploy._incarnations.pop(vid, None)
    assert [next_incarnation(vid) for _ in range(3)] == [1, 2, 3]  # never 0: that is the first worker's
    deploy._note_incarnation(vid, 7)  # a worker started as incarnation 7 elsewhere in the process
    assert next_incarnation(vid) == 8
    deploy._note_incarnation(vid, 2)  # an older number does not move it back
    assert next_incarnation(vid) == 9


def _two_pools(tinynet):
    cluster = load_cluster("local-cpu")
    cluster = cluster.model_copy(update={"servers": [s.model_copy(update={"gpus_per_server": 2}) for s in cluster.servers]})
    return make_plan(tinynet, cluster, [(0, 1, "cpu", 2, 2), (2, 2, "cpu", 2, 1)])


def test_capacity_alive_ratio_follows_the_plan_and_the_failed_vgpus(tinynet):
    plan = _two_pools(tinynet)
    pool0 = [p.vgpu_id for p in plan.placements_of("tinynet", 0, 0)]
    pool1 = [p.vgpu_id for p in plan.placements_of("tinynet", 0, 1)]
    pl = plan.models[0].pipelines[0]
    part0 = pl.partitions[0]
    assert capacity_alive_ratio(plan, "tinynet", set()) == 1.0
    # one of pool 0's two vGPUs lost: the pool serves half its planned throughput, the pipeline no more
    half = min(pl.throughput_rps, part0.throughput_rps / 2) / pl.throughput_rps
    assert capacity_alive_ratio(plan, "tinynet", {pool0[0]}) == pytest.approx(half)
    assert 0 < half <= 1
    assert capacity_alive_ratio(plan, "tinynet", set(pool0)) == 0.0
    assert capacity_alive_ratio(plan, "tinynet", set(pool1)) == 0.0
    assert capacity_alive_ratio(plan, "nope", set()) == 0.0


def test_the_capacity_gauge_is_read_at_each_scrape(tinynet):
    plan = _two_pools(tinynet)
    rt = SimpleNamespace(plan=plan, failed={})
    m = RuntimeMetrics()
    m.track_capacity(rt)
    assert 'ppipe_model_capacity_alive_ratio{model="tinynet"} 1.0' in m.render().decode()
    rt.failed[plan.placements_of("tinynet", 0, 1)[0].vgpu_id] = 0.0
    assert 'ppipe_model_capacity_alive_ratio{model="tinynet"} 0.0' in m.render().decode()
    rt.failed.clear()
    assert 'ppipe_model_capacity_alive_ratio{model="tinynet"} 1.0' in m.render().decode()
    # a live plan switch: the gauge follows the plan's models
    rt.plan = plan.model_copy(update={"models": [plan.models[0].model_copy(update={"name": "other"})],
                                      "placement": [q.model_copy(update={"model": "other"}) for q in plan.placement]})
    text = m.render().decode()
    assert 'ppipe_model_capacity_alive_ratio{model="other"} 1.0' in text and 'model="tinynet"' not in text


def test_server_is_ready_while_at_least_one_model_is(tinynet):
    from ppipe.runtime.ingress.http_server import Frontend

    plan = make_plan(tinynet, load_cluster("local-cpu"), [(0, 2, "cpu", 1, 1)])
    b = plan.models[0].model_copy(update={"name": "b"})
    plan = plan.model_copy(update={"models": [plan.models[0], b]})
    ready = {"tinynet": True, "b": True}
    rt = SimpleNamespace(plan=plan, started=True, model_ready=lambda m: ready[m], metrics=RuntimeMetrics())
    fe = Frontend(rt, decode_workers=0)

    def server_ready():
        r = asyncio.run(fe.ready(None))
        return r.status_code

    assert server_ready() == 200
    ready["b"] = False  # b lost its node: the server still serves tinynet
    assert server_ready() == 200
    ready["tinynet"] = False
    assert server_ready() == 503
    ready["b"] = True
    assert server_ready() == 200
    rt.started = False
    assert server_ready() == 503


def test_consumed_references_retrieve_their_error():
    seen = []

    class Ref:  # an awaitable like a Ray ObjectRef whose actor died
        def __await__(self):
            seen.append("awaited")
            raise RuntimeError("ActorDiedError: the actor died")
            yield  # pragma: no cover

    async def main():
        await consume(Ref(), "peer.drop_peer(x)")

    asyncio.run(main())  # no exception escapes, and the error was retrieved
    assert seen == ["awaited"]


@pytest.mark.ray
def test_workers_are_named_actors_and_a_held_name_takes_the_next_incarnation(ray_cluster, tinynet, tmp_path):
    import ray

    from ppipe.runtime.launch.deploy import load_deployment, respawn_worker, start_workers

    plan = make_plan(tinynet, load_cluster("local-cpu"), [(0, 2, "cpu", 1, 1)])
    plan.save(tmp_path / "plan.yaml")
    dep = load_deployment(tmp_path / "plan.yaml")
    (vid,) = [p.vgpu_id for p in plan.placement]
    deploy._incarnations.pop(vid, None)
    first = start_workers(dep, backend="emulated")
    again = third = None
    try:
        assert ray.get_actor(actor_name(vid)) is not None
        again = respawn_worker(dep, vid, "emulated")  # the first one still alive and named
        assert ray.get(again.actor.ping.remote()) is not None and ray.get_actor(actor_name(vid, 1)) is not None
        # an explicit incarnation whose name is held takes the next free one
        third = respawn_worker(dep, vid, "emulated", incarnation=1)
        assert ray.get_actor(actor_name(vid, 2)) is not None
    finally:
        for h in (*first.values(), again, third):
            if h is not None:
                h.kill()


@pytest.mark.ray
def test_a_consumed_reference_of_a_failed_call_is_no_unhandled_error(ray_cluster, monkeypatch):
    """Ray logs 'Unhandled error' for a dropped reference that holds an error; one consumed
    (refs.consume on a loop, refs.settle in blocking code) is not reported."""
    import gc
    import time

    import ray
    import ray._private.worker as ray_worker

    from ppipe.runtime.launch.refs import settle

    @ray.remote(num_cpus=0)
    class Fails:
        def call(self, tag):
            raise RuntimeError(f"boom {tag}")

    reported: list[str] = []
    monkeypatch.setattr(ray_worker, "_unhandled_error_handler", lambda e: reported.append(str(e)))
    actor = Fails.remote()

    def wait_for(tag: str, seconds: float = 10.0) -> bool:
        t0 = time.monotonic()
        while time.monotonic() - t0 < seconds:
            gc.collect()
            if any(f"boom {tag}" in r for r in reported):
                return True
            time.sleep(0.1)
        return False

    async def consumed():
        ref = actor.call.remote("consumed")
        await consume(ref, "Fails.call")
        del ref

    try:
        actor.call.remote("dropped")  # the reference dropped at once: Ray reports it
        assert wait_for("dropped")
        asyncio.run(consumed())
        ref = actor.call.remote("settled")
        assert settle([ref]) == 1
        del ref
        ref = actor.call.remote("last")  # dropped: once it is reported, the two before would have been too
        del ref
        assert wait_for("last")
        assert not any("boom consumed" in r or "boom settled" in r for r in reported), reported
    finally:
        ray.kill(actor)


def test_a_re_created_worker_that_cannot_open_its_data_path_is_killed_before_the_next_try(tinynet):
    from .fakes import FakeWorker
    from .test_units import _runtime

    rt, peers = _runtime(tinynet, max_batch=1)
    victim = rt.plan.placements_of("tinynet", 0, 1)[0].vgpu_id
    made = []

    async def respawn(vgpu_id):
        w = FakeWorker(vgpu_id)
        if not made:  # the first re-created worker fails to open its data path
            async def broken(*_):
                raise RuntimeError("no data path")

            w.open_data_path = broken
        made.append(w)
        peers[vgpu_id] = w
        return w

    rt.respawn, rt.respawn_interval_s = respawn, 0.02

    async def main():
        await rt.start()
        peers[victim].kill()
        for _ in range(500):
            await asyncio.sleep(0.01)
            if len(made) == 2 and rt.model_ready("tinynet"):
                break
        out = await rt.infer("tinynet", {"x": np.full(2, 1.0, np.float32)})
        await rt.stop()
        return out

    out = asyncio.run(main())
    assert len(made) == 2 and made[0].killed and not made[1].killed and rt.workers[victim] is made[1]
    assert out["y"].tolist() == [4.0, 4.0]


def test_a_server_leaving_and_coming_back_is_logged_once_each(caplog):
    from ppipe.runtime.launch.deploy import note_server

    caplog.set_level("WARNING", logger="ppipe.runtime")
    seen = [note_server("p4-7", offered) for offered in (True, False, False, False, True, True, False, True)]
    assert seen == [False, True, False, False, True, False, True, True]  # first True: never gone, nothing to say
    lines = [r.getMessage() for r in caplog.records]
    assert sum("p4-7: no Ray node" in x for x in lines) == 2 and sum("p4-7: its Ray node is back" in x for x in lines) == 2
