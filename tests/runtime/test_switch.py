"""Live plan switches of the runtime (Runtime.switch_plan, ppipe.runtime.control.switch): the data
plane's real scheduler, in-process workers on the real data path, no Ray."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

from ppipe.errors import UserError
from ppipe.runtime.scheduler.host import DroppedError, Runtime
from ppipe.spec.cluster import load_cluster
from tests.runtime.conftest import make_plan
from tests.runtime.fakes import FakeWorker, close_workers


def _cluster():
    c = load_cluster("local-cpu")
    return c.model_copy(update={"servers": [s.model_copy(update={"gpus_per_server": 2}) for s in c.servers]})


def _plans(tinynet):
    cluster = _cluster()
    two_stages = make_plan(tinynet, cluster, [(0, 1, "cpu", 2, 1), (2, 2, "cpu", 2, 1)], batch=1, slo_ms=200.0)
    one_stage = make_plan(tinynet, cluster, [(0, 2, "cpu", 1, 1)], batch=1, slo_ms=200.0)
    return cluster, two_stages, one_stage


class _Launcher:
    """start_workers / stop_worker for switch_plan: in-process workers."""

    def __init__(self, fail: bool = False, mailbox: dict | None = None):
        self.started: list[FakeWorker] = []
        self.stopped: list[FakeWorker] = []
        self.fail, self.mailbox = fail, mailbox

    async def start(self, ids):
        if self.fail:
            raise UserError("worker could not load its blocks (test)")
        ws = {v: FakeWorker(v, self.mailbox) for v in ids}
        self.started += ws.values()
        return ws

    def stop(self, w):
        self.stopped.append(w)
        w.kill()


def _x(i):
    return {"x": np.full(2, i, np.float32)}


def test_switch_while_serving_answers_every_request_once_and_moves_new_requests(tinynet):
    cluster, old_plan, new_plan = _plans(tinynet)
    workers = {p.vgpu_id: FakeWorker(p.vgpu_id) for p in old_plan.placement}
    rt = Runtime(old_plan, {"tinynet": tinynet}, cluster, workers, keep_traces=1000)
    launcher = _Launcher()

    async def main():
        await rt.start()
        loop = asyncio.get_running_loop()
        tasks = []
        record = None
        for i in range(120):
            tasks.append(loop.create_task(rt.infer("tinynet", _x(i))))
            if i == 60:
                record = await rt.switch_plan(new_plan, {"tinynet": tinynet}, launcher.start, launcher.stop)
            await asyncio.sleep(0.001)
        outs = await asyncio.gather(*tasks, return_exceptions=True)
        await asyncio.sleep(0.3)  # the drain stops the old plan's workers
        await rt.stop()
        return record, outs

    record, outs = asyncio.run(main())
    errors = [o for o in outs if isinstance(o, BaseException)]
    assert not errors, errors[:3]
    two = [i for i, o in enumerate(outs) if o["y"].tolist() == [2 * i + 2] * 2]  # (x + 1) * 2: the old plan's two stages
    one = [i for i, o in enumerate(outs) if o["y"].tolist() == [2 * i] * 2]  # x * 2: the new plan's one stage
    assert sorted(two + one) == list(range(120))
    assert two and one and max(two) <= 61 <= min(one) + 1  # old before the switch, new after it
    assert record["kept"] == 0 and record["started"] == 1 and record["retiring"] == 2
    assert rt.plan is new_plan and set(rt.workers) == {p.vgpu_id for p in new_plan.placement}
    assert sorted(launcher.stopped, key=id) == sorted(workers.values(), key=id)  # drained, then stopped
    assert not rt.failed  # stopped on purpose: not failures
    assert record["first_dispatch_us"] is not None and record["first_dispatch_us"] >= record["at_us"]


def test_a_plan_whose_workers_cannot_start_is_refused_and_the_old_plan_serves(tinynet):
    cluster, old_plan, new_plan = _plans(tinynet)
    workers = {p.vgpu_id: FakeWorker(p.vgpu_id) for p in old_plan.placement}
    rt = Runtime(old_plan, {"tinynet": tinynet}, cluster, workers)
    launcher = _Launcher(fail=True)

    async def main():
        await rt.start()
        with pytest.raises(UserError, match="could not load"):
            await rt.switch_plan(new_plan, {"tinynet": tinynet}, launcher.start, launcher.stop)
        out = await rt.infer("tinynet", _x(3))
        await rt.stop()
        return out

    assert asyncio.run(main())["y"].tolist() == [8.0, 8.0]
    assert rt.plan is old_plan and not rt.switches


def test_an_old_plan_worker_that_dies_while_draining_fails_only_its_batches(tinynet):
    cluster, old_plan, new_plan = _plans(tinynet)
    workers = {p.vgpu_id: FakeWorker(p.vgpu_id) for p in old_plan.placement}
    rt = Runtime(old_plan, {"tinynet": tinynet}, cluster, workers)
    launcher = _Launcher()
    last = old_plan.placement[-1].vgpu_id  # the old plan's second stage

    async def main():
        await rt.start()
        workers[last].hold = asyncio.Event()
        held = asyncio.get_running_loop().create_task(rt.infer("tinynet", _x(1)))  # waits in the old plan's last stage
        await asyncio.sleep(0.05)
        await rt.switch_plan(new_plan, {"tinynet": tinynet}, launcher.start, launcher.stop)
        workers[last].kill()  # dies while finishing the old plan's batch
        after = await rt.infer("tinynet", _x(2))
        try:
            await held
            held_outcome = "answered"
        except DroppedError as exc:
            held_outcome = exc.reason
        await rt.stop()
        return after, held_outcome

    after, held = asyncio.run(main())
    assert after["y"].tolist() == [4.0, 4.0]  # the new plan serves
    assert held == "worker-failed"
    assert not rt.failed  # the new plan's vGPUs are all well


# ---- end to end: Ray workers, the HTTP app, `ppipe apply` --------------------------------------------------
def test_ppipe_apply_switches_a_serving_server_with_every_request_answered(tinynet, tmp_path):
    import threading

    import httpx
    from click.testing import CliRunner

    from ppipe.cli import main
    from ppipe.runtime.client.bench import run_bench
    from ppipe.runtime.launch.deploy import load_deployment
    from ppipe.runtime.launch.local import start_local_workers
    from ppipe.runtime.ingress.http_server import create_app
    from ppipe.runtime.ingress.http_transport import BackgroundServer
    from ppipe.runtime.control.switch import PlanSwitcher

    cluster = load_cluster("local-cpu")
    old_plan = make_plan(tinynet, cluster, [(0, 1, "cpu", 2, 1), (2, 2, "cpu", 2, 1)], batch=1, slo_ms=200.0)
    new_plan = make_plan(tinynet, cluster, [(0, 2, "cpu", 1, 1)], batch=1, slo_ms=200.0)
    old_plan.save(tmp_path / "plan.yaml")
    new_plan.save(tmp_path / "new.yaml")
    (tmp_path / "other.yaml").write_text((tmp_path / "new.yaml").read_text().replace("cluster: local-cpu", "cluster: HC1-S", 1))
    dep = load_deployment(tmp_path / "plan.yaml")
    workers = start_local_workers(dep, backend="emulated")
    rt = Runtime(dep.plan, dep.profiles, dep.cluster, workers)
    app = create_app(rt, token="s3cret", decode_workers=0)
    switcher = PlanSwitcher(rt, dep, backend="emulated", launcher="local")
    app.fe.switcher = switcher
    try:
        with BackgroundServer(app) as srv:
            result = {}
            load = threading.Thread(target=lambda: result.update(
                res=asyncio.run(run_bench(srv.url, "tinynet", 40.0, 2.0, binary=True, token="s3cret"))))
            load.start()
            import time

            time.sleep(0.6)
            applied = CliRunner().invoke(main, ["apply", str(tmp_path / "new.yaml"), "--url", srv.url, "--token", "s3cret"])
            load.join()
            wrong_cluster = CliRunner().invoke(main, ["apply", str(tmp_path / "other.yaml"), "--url", srv.url, "--token", "s3cret"])
            no_token = CliRunner().invoke(main, ["apply", str(tmp_path / "new.yaml"), "--url", srv.url, "--token", "nope"])
            status = httpx.get(srv.url + "/v2/admin/plan", headers={"authorization": "Bearer s3cret"}).json()
            ready = httpx.get(srv.url + "/v2/health/ready").status_code
    finally:
        for h in [*workers.values(), *switcher.started]:
            h.kill()
    assert applied.exit_code == 0, applied.output
    assert "1 started, 2 finishing their batches" in applied.output
    res = result["res"]
    assert res.sent > 50 and res.ok == res.sent, (res.drops, res.errors)  # every request answered, none lost or failed
    assert wrong_cluster.exit_code == 2 and "is for cluster 'HC1-S'" in wrong_cluster.output
    assert no_token.exit_code == 2 and "HTTP 401" in no_token.output
    assert len(status["switches"]) == 1 and status["vgpus"] == 1 and ready == 200


def test_sighup_rereads_the_plan_file_and_a_bad_file_leaves_the_old_plan(tinynet, tmp_path, caplog):
    import os
    import signal

    from ppipe.runtime.control.switch import PlanSwitcher, SighupReload

    cluster, old_plan, new_plan = _plans(tinynet)
    applied = []

    class Switcher(PlanSwitcher):  # the real file reading and validation; the switch itself recorded
        async def apply(self, plan, source):
            applied.append((plan, source))
            return {}

    path = tmp_path / "plan.yaml"
    new_plan.save(path)
    reload = SighupReload(Switcher(runtime=None, dep=None), path)

    async def main():
        await reload.start()
        os.kill(os.getpid(), signal.SIGHUP)
        for _ in range(100):
            await asyncio.sleep(0.01)
            if applied:
                break
        path.write_text("models: [oops")  # a broken edit: refused, logged
        os.kill(os.getpid(), signal.SIGHUP)
        await asyncio.sleep(0.2)
        await reload.stop()

    asyncio.run(main())
    assert len(applied) == 1 and applied[0][0] == new_plan and applied[0][1] == str(path)
    assert any("is not served" in r.getMessage() and "plan.yaml" in r.getMessage() for r in caplog.records)


def test_admin_endpoint_refusals(tinynet, tmp_path):
    import httpx

    from ppipe.runtime.launch.deploy import Deployment
    from ppipe.runtime.ingress.http_server import create_app
    from ppipe.runtime.ingress.http_transport import BackgroundServer
    from ppipe.runtime.control.switch import PlanSwitcher

    cluster, old_plan, new_plan = _plans(tinynet)
    old_plan.save(tmp_path / "plan.yaml")

    def server(token, switcher):
        workers = {p.vgpu_id: FakeWorker(p.vgpu_id) for p in old_plan.placement}
        rt = Runtime(old_plan, {"tinynet": tinynet}, cluster, workers)
        app = create_app(rt, token=token, decode_workers=0, on_shutdown=lambda: close_workers(workers.values()))
        if switcher:
            app.fe.switcher = PlanSwitcher(rt, Deployment(old_plan, cluster, {"tinynet": tinynet}, str(tmp_path / "plan.yaml")))
        return BackgroundServer(app)

    auth = {"authorization": "Bearer t0k"}
    other = new_plan.model_copy(update={"cluster": "HC1-S"})
    with server(None, True) as srv:
        no_token = httpx.post(srv.url + "/v2/admin/plan", content=b"x")
    with server("t0k", False) as srv:
        no_switcher = httpx.post(srv.url + "/v2/admin/plan", content=b"x", headers=auth)
    with server("t0k", True) as srv:
        wrong = httpx.post(srv.url + "/v2/admin/plan", content=b"x", headers={"authorization": "Bearer nope"})
        garbage = httpx.post(srv.url + "/v2/admin/plan", content=b"models: [oops", headers=auth)
        schema = httpx.post(srv.url + "/v2/admin/plan", content=b"models: []", headers=auth)
        cluster_ = httpx.post(srv.url + "/v2/admin/plan", content=yaml_of(other), headers=auth)
        off_cluster = httpx.post(srv.url + "/v2/admin/plan", content=yaml_of(new_plan.model_copy(update={"placement": [
            p.model_copy(update={"gpu_index": 7}) for p in new_plan.placement]})), headers=auth)
        status = httpx.get(srv.url + "/v2/admin/plan", headers=auth)
    assert no_token.status_code == 403 and "--token" in no_token.json()["error"]
    assert no_switcher.status_code == 409 and "without a plan switcher" in no_switcher.json()["error"]
    assert wrong.status_code == 401
    assert garbage.status_code == 400 and "not valid YAML" in garbage.json()["error"]
    assert schema.status_code == 400 and "request body" in schema.json()["error"]
    assert cluster_.status_code == 400 and "is for cluster 'HC1-S'" in cluster_.json()["error"]
    assert off_cluster.status_code == 400 and ".gpu_index 7: server" in off_cluster.json()["error"], off_cluster.text
    assert status.status_code == 200 and status.json()["switches"] == [] and status.json()["models"] == ["tinynet"]


def yaml_of(plan) -> bytes:
    import yaml

    return yaml.safe_dump(plan.model_dump(mode="json")).encode()


class _AllNccl:
    """A link opener for in-process workers: every edge on a fake NCCL link (the workers'
    shared mailbox, not NCCL); records what each switch opens."""

    def __init__(self):
        self.opened: list[tuple[int, list]] = []

    def choose(self, plan, cluster, profiles, workers):
        from ppipe.runtime.launch.deploy import Deployment, worker_specs
        from ppipe.runtime.workers.transport import pipeline_edges

        return {e: ("nccl", "") for e in pipeline_edges(worker_specs(Deployment(plan, cluster, profiles)))}

    def open(self, workers, edges, gen, kinds=None):
        self.opened.append((gen, list(edges)))


def test_a_switch_over_nccl_keeps_the_edges_of_kept_workers_and_opens_the_others_as_a_new_generation(tinynet):
    """Two stages -> three: the first stage's worker is kept, the second is re-cut under the
    same vGPU id. The kept worker sends the old plan's feature maps to the old worker on the
    edge of generation 0 and the new plan's to the new one on generation 1; once the old
    plan's batches end, the kept worker closes its old edge."""
    cluster = _cluster()
    old_plan = make_plan(tinynet, cluster, [(0, 0, "cpu", 2, 1), (1, 2, "cpu", 2, 1)], batch=1, slo_ms=200.0)
    new_plan = make_plan(tinynet, cluster, [(0, 0, "cpu", 2, 1), (1, 1, "cpu", 2, 1), (2, 2, "cpu", 2, 1)], batch=1, slo_ms=200.0)
    up, mid = (p.vgpu_id for p in old_plan.placement)
    last = new_plan.placement[2].vgpu_id
    assert [p.vgpu_id for p in new_plan.placement[:2]] == [up, mid]  # the re-cut vGPU keeps its id
    mailbox: dict = {}
    workers = {p.vgpu_id: FakeWorker(p.vgpu_id, mailbox) for p in old_plan.placement}
    links = _AllNccl()
    rt = Runtime(old_plan, {"tinynet": tinynet}, cluster, workers, edges={(up, mid): "nccl"}, links=links)
    launcher = _Launcher(mailbox=mailbox)

    async def main():
        await rt.start()
        loop = asyncio.get_running_loop()
        tasks, record = [], None
        for i in range(60):
            tasks.append(loop.create_task(rt.infer("tinynet", _x(i))))
            if i == 30:
                record = await rt.switch_plan(new_plan, {"tinynet": tinynet}, launcher.start, launcher.stop)
            await asyncio.sleep(0.002)
        outs = await asyncio.gather(*tasks, return_exceptions=True)
        await asyncio.sleep(0.3)  # the drain stops the old worker and closes the old edge
        await rt.stop()
        return record, outs

    record, outs = asyncio.run(main())
    errors = [o for o in outs if isinstance(o, BaseException)]
    assert not errors, errors[:3]
    old = [i for i, o in enumerate(outs) if o["y"].tolist() == [2 * i + 2] * 2]  # (x + 1) * 2: two stages
    new = [i for i, o in enumerate(outs) if o["y"].tolist() == [2 * i + 4] * 2]  # (x + 2) * 2: three stages
    assert sorted(old + new) == list(range(60)) and old and new
    assert record["kept"] == 1 and record["started"] == 2 and record["nccl_opened"] == 2
    assert links.opened == [(1, sorted([(up, mid), (mid, last)]))]
    assert rt.nccl_links == {(up, mid): 1, (mid, last): 1}
    sends = [link.send for _, link in workers[up].links if link is not None and link.send is not None]
    gens = [s.gen for s in sends]
    assert gens == sorted(gens) and set(gens) == {0, 1}  # generation 0 until the switch, 1 after
    for g in (0, 1):  # each generation numbered from 0, without gaps
        assert [s.seq for s in sends if s.gen == g] == list(range(gens.count(g)))
    assert workers[up].closed == [(mid, 0)]  # the old edge, closed at the kept worker after the drain
    assert workers[mid] in launcher.stopped
