"""Runtime pieces without Ray: clock, backends, deployment checks, the driver with fake workers."""

from __future__ import annotations

import asyncio
import functools
import time

import numpy as np
import pytest

from ppipe.dataplane.api import Drop, DropReason, WakeAt
from ppipe.errors import NotAvailableError, UserError
from ppipe.runtime.workers.backends import EmulatedBackend, OrtBackend, interpolated_latency_us, make_backend
from ppipe.runtime.wire.messages import EdgeRef
from ppipe.runtime.clock import WallClock, wall_us
from ppipe.runtime.launch.deploy import Deployment, node_resources_for, worker_env, worker_specs
from ppipe.runtime.scheduler.host import DroppedError, Runtime
from ppipe.runtime.workers.worker import WorkerSpec, to_wire
from ppipe.spec.cluster import ClusterSpec, load_cluster
from .conftest import make_plan
from .fakes import FakeWorker, FifoScheduler
from .tinynet import reference


# ---- clock -------------------------------------------------------------------------------------
def test_wall_clock_timeline_and_timers():
    async def main():
        c = WallClock()
        t0 = c.now_us()
        assert 0 <= t0 < 1e6
        assert abs(c.from_wall_us(wall_us()) - c.now_us()) < 1e4
        assert c.to_wall_us(c.from_wall_us(123.0)) == pytest.approx(123.0)
        fired = []
        target = c.now_us() + 20_000
        c.call_at(target, lambda: fired.append(c.now_us()))
        c.call_at(c.now_us() - 5_000, lambda: fired.append(-1.0))  # in the past: at once
        await asyncio.sleep(0.06)
        return target, fired

    target, fired = asyncio.run(main())
    assert fired[0] == -1.0 and fired[1] >= target  # a timer never fires before its time


# ---- backends --------------------------------------------------------------------------------------
def test_interpolated_latency_matches_profile_and_interpolates(tinynet):
    p = tinynet
    assert interpolated_latency_us(p, "cpu", 1, 4, 0, 2) == pytest.approx(p.partition_latency_us("cpu", 1, 4, 0, 2))
    l2, l4 = (p.partition_latency_us("cpu", 1, b, 0, 1) for b in (2, 4))
    assert interpolated_latency_us(p, "cpu", 1, 3, 0, 1) == pytest.approx((l2 + l4) / 2)
    l8 = p.partition_latency_us("cpu", 1, 8, 0, 1)
    assert interpolated_latency_us(p, "cpu", 1, 12, 0, 1) == pytest.approx(l8 + (l8 - l4) * (12 - 8) / 4)
    with pytest.raises(UserError, match="no timings for gpu=T4"):
        interpolated_latency_us(p, "T4", 1, 1, 0, 1)


def test_emulated_backend_sleeps_for_the_profile_and_emits_fp16_of_the_cut_size(tinynet):
    b = EmulatedBackend(tinynet, "cpu", 1, 0, 1)

    async def run():
        t = wall_us()
        out = await b.run({}, 4)
        return out, wall_us() - t

    out, took_us = asyncio.run(run())
    assert took_us >= 0.98 * tinynet.partition_latency_us("cpu", 1, 4, 0, 1)
    (arr,) = out.values()
    assert arr.dtype == np.float16 and arr.shape == (4, tinynet.cut_bytes(1) // 2)
    capped = EmulatedBackend(tinynet, "cpu", 1, 0, 1, max_bytes_per_sample=64).outputs(2)
    assert next(iter(capped.values())).shape == (2, 32)
    last = EmulatedBackend(tinynet, "cpu", 1, 2, 2).outputs(3)  # the model's declared outputs
    assert last["logits"].shape == (3, 5)


def test_ort_partitions_chained_with_fp16_cuts_equal_the_whole_model(tinynet):
    x = np.random.default_rng(0).normal(size=(3, 3, 8, 8)).astype(np.float32)
    a = OrtBackend(tinynet, "cpu", 2, 0, 1)
    b = OrtBackend(tinynet, "cpu", 2, 2, 2)
    mid = a.run_sync({"input": x})
    assert list(mid) == ["t1"]
    wire = to_wire(mid)
    assert wire["t1"].dtype == np.float16
    out = b.run_sync(wire)
    np.testing.assert_allclose(out["logits"], reference(tinynet.directory, x), rtol=2e-2, atol=2e-2)


def test_backend_errors_are_user_errors(tinynet, tmp_path):
    with pytest.raises(UserError, match="unknown backend 'onnx'"):
        make_backend("onnx", tinynet, "cpu", 1, 0, 0)
    # a profile whose block files are gone and that the profiler cannot regenerate
    from ppipe.spec.profile import ModelProfile

    broken = ModelProfile(
        manifest=tinynet.manifest.model_copy(update={"blocks": [b.model_copy(update={"onnx": None}) for b in tinynet.manifest.blocks]}),
        table=tinynet.table,
        directory=tmp_path,
    )
    with pytest.raises(UserError, match="no ONNX graph to cut|no runnable ONNX sub-model"):
        OrtBackend(broken, "cpu", 1, 0, 1)


def test_tensorrt_backend_without_tensorrt_is_a_clear_error(tinynet):
    pytest.importorskip("numpy")
    try:
        import tensorrt  # noqa: F401

        pytest.skip("TensorRT is installed here")
    except ImportError:
        pass
    with pytest.raises(NotAvailableError, match="needs TensorRT and CuPy"):
        make_backend("tensorrt", tinynet, "cpu", 1, 0, 0)


# ---- deployment ------------------------------------------------------------------------------------------
GROUPS = """
version: 1
name: g
gpu_types:
- {name: cpu, vgpu_levels: [1, 2]}
servers:
- {name: a, gpu_type: cpu, gpus_per_server: 1, count: 2, nic_bandwidth_gbps: 10, ray_resource: rackA}
- {name: b, gpu_type: cpu, gpus_per_server: 1, count: 1, nic_bandwidth_gbps: 10}
"""


def _spec(server: str, gpu="cpu", v=1) -> WorkerSpec:
    return WorkerSpec(f"{server}/gpu0/s0", server, 0, "m", 0, 0, 0, 0, gpu, v, "/x")


def test_node_resources_prefer_the_per_server_resource(tmp_path):
    import yaml

    cluster = ClusterSpec.model_validate(yaml.safe_load(GROUPS))
    assert node_resources_for(_spec("a-1"), cluster, {"rackA", "rackA-1"}) == {"rackA-1": 0.001}
    assert node_resources_for(_spec("a-0"), cluster, {"rackA", "rackA-1"}) == {"rackA": 0.001}
    assert node_resources_for(_spec("b-0"), cluster, set()) == {}
    with pytest.raises(UserError, match=r"(?s)no Ray node offers resource .rackA.*servers\[0\]\.ray_resource"):
        node_resources_for(_spec("a-0"), cluster, {"CPU"}, "g.yaml")


def test_worker_env_pins_the_gpu_and_the_mps_share():
    assert worker_env(_spec("a-0", "L4", 4), "tensorrt") == {"CUDA_VISIBLE_DEVICES": "0", "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE": "25"}
    assert worker_env(_spec("a-0", "L4", 1), "ort") == {"CUDA_VISIBLE_DEVICES": "0"}
    assert worker_env(_spec("a-0", "L4", 2), "emulated") == {}
    assert worker_env(_spec("a-0", "cpu", 2), "ort") == {}


def test_worker_specs_follow_the_placement_and_reject_a_plan_without_one(tinynet):
    cluster = load_cluster("local-cpu")
    plan = make_plan(tinynet, cluster, [(0, 1, "cpu", 2, 1), (2, 2, "cpu", 2, 1)])
    specs = worker_specs(Deployment(plan, cluster, {"tinynet": tinynet}, "plan.yaml"))
    assert [(s.vgpu_id, s.first_block, s.last_block, s.batch) for s in specs] == [
        ("localhost-0/gpu0/s0", 0, 1, plan.models[0].pipelines[0].batch),
        ("localhost-0/gpu0/s1", 2, 2, plan.models[0].pipelines[0].batch),
    ]
    empty = plan.model_copy(update={"placement": []})
    with pytest.raises(UserError, match="plan.yaml: the plan has no placement"):
        worker_specs(Deployment(empty, cluster, {"tinynet": tinynet}, "plan.yaml"))
    short = plan.model_copy(update={"placement": plan.placement[:1]})
    with pytest.raises(UserError, match="partition 1 plans 1 vGPU"):
        worker_specs(Deployment(short, cluster, {"tinynet": tinynet}, "plan.yaml"))


# ---- the driver with fake workers (no Ray) ---------------------------------------------------------------------
def _runtime(tinynet, edges=None, counts=(1, 1), **sched):
    cluster = load_cluster("local-cpu")
    if sum(counts) > 2:  # room for more vGPUs: two CPU 'GPUs'
        cluster = cluster.model_copy(update={"servers": [s.model_copy(update={"gpus_per_server": 2}) for s in cluster.servers]})
    plan = make_plan(tinynet, cluster, [(0, 1, "cpu", 2, counts[0]), (2, 2, "cpu", 2, counts[1])])
    mailbox: dict = {}
    peers = {p.vgpu_id: FakeWorker(p.vgpu_id, mailbox) for p in plan.placement}
    rt = Runtime(plan, {"tinynet": tinynet}, cluster, peers, scheduler_factory=functools.partial(FifoScheduler, **sched),
                 keep_traces=100, edges=edges)
    return rt, peers


def test_driver_batches_answers_each_request_with_its_own_row(tinynet):
    rt, _ = _runtime(tinynet, max_batch=3, window_us=5000.0)

    async def main():
        await rt.start()
        outs = await asyncio.gather(*(rt.infer("tinynet", {"x": np.full(2, i, np.float32)}) for i in range(5)))
        await rt.stop()
        return outs

    outs = asyncio.run(main())
    assert [o["y"].tolist() for o in outs] == [[2 * i + 2, 2 * i + 2] for i in range(5)]  # (x + 1) * 2
    assert [len(t.request_ids) for t in rt.traces] == [3, 2]  # one full batch, one after the WakeAt window
    assert rt.scheduler.wakes >= 1 and len(rt.scheduler.reports) == 4


def test_driver_takes_outputs_from_the_last_report_and_keeps_one_report_per_stage_in_traces(tinynet):
    rt, peers = _runtime(tinynet, max_batch=1)

    async def main():
        await rt.start()
        out = await rt.infer("tinynet", {"x": np.full(2, 3, np.float32)})
        await rt.stop()
        return out

    assert asyncio.run(main())["y"].tolist() == [8.0, 8.0]
    assert len(rt.traces) == 1 and len(rt.traces[0].reports) == 2
    assert [r.stage for r in rt.traces[0].reports] == [0, 1]
    assert all(rep.carried == () for t in rt.traces for rep in t.reports)  # each stage's report once, not also as carried
    import gc

    assert gc.get_freeze_count() > 0  # Runtime.start froze the start-up objects


def test_reports_that_arrive_out_of_order_all_reach_the_scheduler_and_answer_once(tinynet):
    rt, peers = _runtime(tinynet, max_batch=1)
    rt.report_tolerance_us = None  # every stage reports on its own (none rides on with the next)
    first = rt.plan.placements_of("tinynet", 0, 0)[0].vgpu_id
    server = peers[first].server
    send_report = server._report
    # stage 0's report reaches the frontend 50 ms after stage 1's (another worker, another connection)
    server._report = lambda rep, carried, out=None: asyncio.get_running_loop().call_later(0.05, send_report, rep, carried, out)

    async def main():
        await rt.start()
        outs = await asyncio.gather(*(rt.infer("tinynet", {"x": np.full(2, i, np.float32)}) for i in range(3)))
        await asyncio.sleep(0.2)
        await rt.stop()
        return outs

    outs = asyncio.run(main())
    assert [o["y"].tolist() for o in outs] == [[2 * i + 2] * 2 for i in range(3)]
    got = [(r.batch_id, r.partition) for r in rt.scheduler.reports]
    assert sorted(got) == [(b, k) for b in range(3) for k in (0, 1)]
    assert got.index((0, 1)) < got.index((0, 0))  # really out of order
    assert not rt._inflight  # every batch forgotten once both stages reported
    assert all([r.stage for r in t.reports] == [0, 1] for t in rt.traces)


def test_driver_answers_drops_with_their_reason(tinynet):
    rt, _ = _runtime(tinynet, drop_all=True)

    async def main():
        await rt.start()
        try:
            with pytest.raises(DroppedError, match="dropped: deadline-unreachable: test scheduler drops everything"):
                await rt.infer("tinynet", {"x": np.zeros(1, np.float32)})
        finally:
            await rt.stop()

    asyncio.run(main())
    assert rt._queued["tinynet"] == 0


@pytest.mark.parametrize("tolerance_us", [None, 1e12])
def test_driver_marks_a_dead_worker_failed_and_fails_its_batch(tinynet, tolerance_us):
    rt, peers = _runtime(tinynet, max_batch=1)
    rt.report_tolerance_us = tolerance_us  # None: stage 0 reports at once; 1e12: its report rides on with the batch
    victim = rt.plan.placements_of("tinynet", 0, 1)[0].vgpu_id

    async def main():
        await rt.start()
        peers[victim].die_on_next_stage = True
        with pytest.raises(DroppedError, match=f"worker-failed: vGPU {victim} failed while running the batch"):
            await rt.infer("tinynet", {"x": np.zeros(1, np.float32)})
        await rt.stop()

    asyncio.run(main())
    assert victim in rt.failed and victim in rt.scheduler.failed
    assert not rt.model_ready("tinynet")
    assert rt.traces[0].error.startswith("worker-failed")
    # stage 0's report came on its own, or died with the worker that carried it on
    assert len(rt.traces[0].reports) == (1 if tolerance_us is None else 0)


def test_a_request_dropped_by_the_scheduler_and_the_driver_is_answered_and_counted_once(tinynet):
    rt, peers = _runtime(tinynet, max_batch=1)
    victim = rt.plan.placements_of("tinynet", 0, 1)[0].vgpu_id

    async def main():
        await rt.start()
        sched = rt.scheduler
        # as the data plane does: a dead vGPU's in-flight requests are dropped by the scheduler too
        sched.mark_failed = lambda v: [Drop(r, DropReason.WORKER_FAILED, f"{v} died") for d in sched.dispatched for r in d.requests]
        peers[victim].die_on_next_stage = True
        with pytest.raises(DroppedError, match="worker-failed"):
            await rt.infer("tinynet", {"x": np.zeros(1, np.float32)})
        await rt.stop()

    asyncio.run(main())
    assert rt.metrics.drops.labels("tinynet", "worker-failed")._value.get() == 1


def test_a_dead_worker_is_re_created_and_serves_again(tinynet):
    rt, peers = _runtime(tinynet, max_batch=1)
    victim = rt.plan.placements_of("tinynet", 0, 1)[0].vgpu_id
    tries = []

    async def respawn(vgpu_id):
        tries.append(vgpu_id)
        if len(tries) < 3:
            raise RuntimeError("its node is not back")
        peers[vgpu_id] = FakeWorker(vgpu_id)  # a new worker, on a new port
        return peers[vgpu_id]

    rt.respawn, rt.respawn_interval_s = respawn, 0.02

    async def main():
        await rt.start()
        old = rt.addresses[victim]
        peers[victim].kill()
        while victim not in rt.failed:
            await asyncio.sleep(0.01)
        assert not rt.model_ready("tinynet")
        for _ in range(300):
            await asyncio.sleep(0.01)
            if rt.model_ready("tinynet"):
                break
        out = await rt.infer("tinynet", {"x": np.full(2, 1.0, np.float32)})
        await rt.stop()
        return old, out

    old, out = asyncio.run(main())
    assert tries == [victim] * 3 and victim not in rt.failed and victim not in rt.scheduler.failed
    assert rt.addresses[victim] != old and rt.workers[victim] is peers[victim]
    assert out["y"].tolist() == [4.0, 4.0] and rt.traces[-1].route[1] == victim  # served through the new worker


def test_a_worker_that_dies_idle_is_marked_failed(tinynet):
    rt, peers = _runtime(tinynet)
    victim = rt.plan.placements_of("tinynet", 0, 0)[0].vgpu_id

    async def main():
        await rt.start()
        peers[victim].kill()
        for _ in range(50):
            await asyncio.sleep(0.01)
            if victim in rt.scheduler.failed:
                break
        await rt.stop()

    asyncio.run(main())
    assert victim in rt.scheduler.failed and list(rt.failed) == [victim]


def test_early_timer_is_re_armed_not_delivered(tinynet):
    rt, _ = _runtime(tinynet)

    class Early:
        """A clock whose timers fire 5 ms early (as asyncio may, by a tick)."""

        def __init__(self, inner):
            self.inner = inner

        def __getattr__(self, k):
            return getattr(self.inner, k)

        def call_at(self, t_us, fn):
            return self.inner.call_at(t_us - 5000, fn)

    async def main():
        await rt.start()
        rt.clock = Early(rt.clock)
        seen = []
        rt.scheduler.wake = lambda: seen.append(rt.clock.now_us()) or []
        t = rt.clock.now_us() + 20_000
        rt._apply([WakeAt(t)])
        await asyncio.sleep(0.06)
        await rt.stop()
        return t, seen

    t, seen = asyncio.run(main())
    assert len(seen) == 1 and seen[0] >= t


def test_driver_numbers_the_messages_of_each_nccl_edge_and_posts_both_ends(tinynet):
    rt, peers = _runtime(tinynet, counts=(2, 1), max_batch=1)
    ups = [p.vgpu_id for p in rt.plan.placements_of("tinynet", 0, 0)]
    down = rt.plan.placements_of("tinynet", 0, 1)[0].vgpu_id
    # one edge over (fake) NCCL, the other over the data path's connections
    rt, peers = _runtime(tinynet, edges={(ups[0], down): ("nccl", ""), (ups[1], down): ("tcp", "")}, counts=(2, 1), max_batch=1)

    async def main():
        await rt.start()
        outs = [await rt.infer("tinynet", {"x": np.full(1, float(i), np.float32)}) for i in range(6)]
        peers[down].die_on_next_stage = True
        try:
            await rt.infer("tinynet", {"x": np.zeros(1, np.float32)})
        except DroppedError as exc:
            failed.append(exc.reason)
        await rt.stop()
        return outs

    failed = []
    outs = asyncio.run(main())
    assert failed == ["worker-failed"]
    got = [float(o["y"][0]) for o in outs]
    assert got == [2.0 * (i + 1) for i in range(6)]
    sends = [link.send for _, link in peers[ups[0]].links if link]
    recvs = [link.recv for _, link in peers[down].links if link]
    n = len(sends)
    assert n >= 3  # round robin: half the batches took the NCCL edge
    assert sends == [EdgeRef(down, k, 0) for k in range(n)]
    assert recvs[:n] == [EdgeRef(ups[0], k, 0) for k in range(n)]
    other = [link for _, link in peers[ups[1]].links]
    assert other == [None] * len(other)  # the tcp edge carries no link
    # the dead receiver's NCCL peer is told to abort the edge; the tcp peer is not
    assert peers[ups[0]].dropped == [down]
    assert peers[ups[1]].dropped == []


def test_a_request_nobody_decides_on_is_answered_with_a_timeout(tinynet):
    # the scheduler waits 10 s for a batch of 4; the runtime answers at SLO + grace instead
    rt, _ = _runtime(tinynet, max_batch=4, window_us=10e6)
    rt.answer_grace_s = 0.05

    async def main():
        await rt.start()
        t0 = asyncio.get_running_loop().time()
        with pytest.raises(DroppedError, match="timeout: no answer within"):
            await rt.infer("tinynet", {"x": np.zeros(1, np.float32)})
        waited = asyncio.get_running_loop().time() - t0
        await rt.stop()
        return waited

    waited = asyncio.run(main())
    slo_s = rt.plan.model("tinynet").slo_ms / 1e3
    assert slo_s + 0.05 <= waited + 1e-3
    assert not rt._pending and rt._queued["tinynet"] == 0


def _real_runtime(tinynet, **kw):
    """tinynet on two fake workers under the data plane's own scheduler (not the FIFO double)."""
    rt, peers = _runtime(tinynet, max_batch=1)
    return Runtime(rt.plan, rt.profiles, rt.cluster, peers, keep_traces=100, **kw)


def test_the_margins_reach_the_data_plane_and_leave_arrivals_and_slo_deadlines_alone(tinynet):
    from ppipe.dataplane.margins import service_margins
    from ppipe.dataplane.options import SchedulerOptions

    rt = _real_runtime(tinynet)
    slack_us = service_margins(rt.plan, rt.profiles, rt.cluster, SchedulerOptions())["tinynet"].slack_us
    lead_us, budget_us = 0.5 * slack_us, 0.1 * slack_us  # a large lead: a loaded host's pauses cannot blur the check
    # (the batch of 4 waits for its last moment: a wake lead keeps a late timer from missing it)
    rt = _real_runtime(tinynet, dispatch_lead_us=lead_us, answer_budget_us=budget_us, scheduler_options={"wake_lead_us": 0.2 * slack_us})

    async def main():
        await rt.start()
        t_true = rt.clock.true_now_us()
        await rt.infer("tinynet", {"x": np.zeros(2, np.float32)})
        await rt.stop()
        return t_true

    t_true = asyncio.run(main())
    (trace,) = rt.traces
    arrival = trace.arrivals_us[0]
    assert t_true <= arrival < t_true + 0.1 * slack_us
    assert trace.reserved_us[0][0] >= arrival + lead_us  # planned to start when the dispatch can be there
    opts = rt.scheduler.options
    assert opts.dispatch_lead_us == lead_us and opts.input_transfer_lead
    assert opts.budget_us("tinynet") == budget_us
    assert rt.budgets.margins["tinynet"].reserved_us == pytest.approx(rt.scheduler.lead_us("tinynet") + budget_us)
    metrics = rt.metrics.render().decode()
    assert 'ppipe_model_reserved_slack_ms{model="tinynet"}' in metrics and 'ppipe_model_slack_ms{model="tinynet"}' in metrics


def test_a_plan_without_room_for_the_margins_is_refused_at_start(tinynet):
    rt = _real_runtime(tinynet)
    slo_us = rt.plan.model("tinynet").slo_ms * 1e3
    rt = _real_runtime(tinynet, answer_budget_us=slo_us)
    with pytest.raises(UserError, match="leaves no time for the runtime's margins.*tinynet.*runtime needs"):
        asyncio.run(rt.start())
    with pytest.raises(ValueError, match="must be >= 0"):
        _runtime_with(tinynet, answer_budget_us=-1)


def _runtime_with(tinynet, **kw):
    from ppipe.runtime.scheduler.host import Runtime

    rt, peers = _runtime(tinynet, max_batch=1)
    return Runtime(rt.plan, rt.profiles, rt.cluster, peers, **kw)


def test_infer_fast_path_answers_like_the_routes_and_leaves_the_rest_to_them(tinynet):
    import httpx

    from ppipe.runtime.ingress.protocol import decode_infer_response, encode_infer_request
    from ppipe.runtime.ingress.http_server import create_app

    rt, _ = _runtime(tinynet, max_batch=1)
    app = create_app(rt, token="t0k", max_body_bytes=4096, decode_workers=0)

    async def main():
        await rt.start()  # (ASGITransport runs no lifespan)
        auth = {"authorization": "Bearer t0k"}
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://x") as c:
            body, headers = encode_infer_request({"input": np.full((1, 3, 8, 8), 3.0, np.float32)}, binary=True, binary_output=True)
            ok = await c.post("/v2/models/tinynet/infer", content=body, headers={**headers, **auth})
            no_token = await c.post("/v2/models/tinynet/infer", content=body, headers=headers)
            unknown = await c.post("/v2/models/nope/infer", content=b"{}", headers=auth)
            too_big = await c.post("/v2/models/tinynet/infer", content=b"x" * 5000, headers=auth)
            nested = await c.post("/v2/models/a/b/infer", content=b"{}", headers=auth)  # not a model name: starlette's 404
            meta = await c.get("/v2/models/tinynet", headers=auth)  # not infer: the starlette route
        await rt.stop()
        return ok, no_token, unknown, too_big, nested, meta

    ok, no_token, unknown, too_big, nested, meta = asyncio.run(main())
    assert ok.status_code == 200 and ok.headers["content-type"] == "application/octet-stream"
    out = decode_infer_response(ok.content, ok.headers["inference-header-content-length"])
    assert out["y"].shape == (1, 3, 8, 8) and np.all(out["y"] == 8.0)  # the fake stages: (3 + 1) * 2
    assert no_token.status_code == 401 and "bearer token" in no_token.json()["error"]
    assert unknown.status_code == 404 and "unknown model 'nope'" in unknown.json()["error"]
    assert too_big.status_code == 413 and "exceeds the limit of 4096 bytes" in too_big.json()["error"]
    assert nested.status_code == 404
    assert meta.status_code == 200 and meta.json()["name"] == "tinynet"


def test_tensorrt_precision_follows_the_profiles_provenance():
    from ppipe.profiler.trt_backend import precision_of

    assert precision_of("measured: TensorRT 10.3 fp16 on NVIDIA L4, an engine per block") == "fp16"
    assert precision_of("measured: TensorRT 10.3 tf32 on NVIDIA L4") == "tf32"
    assert precision_of("") == "tf32"  # the artifact's (and ppipe profile's) default


def test_a_refused_multi_sample_request_stops_submitting_and_withdraws_its_queued_samples(tinynet):
    """Issue 20: a 503 for a request of 100 samples computed 22 of them. Now the first drop
    ends the request: later samples are not submitted, queued ones are withdrawn."""
    from ppipe.runtime.scheduler.host import DroppedError

    rt, _ = _runtime(tinynet, max_batch=100, window_us=50_000.0)  # samples wait in the queue for a batch

    async def main():
        await rt.start()
        sched = rt.scheduler
        submitted = []
        real_submit = sched.submit

        def submit(req):
            submitted.append(req.id)
            if len(submitted) == 4:  # the 4th sample is refused
                from ppipe.dataplane.api import Drop, DropReason

                return [Drop(req, DropReason.QUEUE_FULL, "test")]
            return real_submit(req)

        withdrawn = []

        def withdraw(ids):
            withdrawn.extend(ids)
            sched.queue["tinynet"] = [r for r in sched.queue["tinynet"] if r.id not in ids]
            return []

        sched.submit, sched.withdraw = submit, withdraw
        samples = [{"x": np.full(2, i, np.float32)} for i in range(10)]
        with pytest.raises(DroppedError) as exc:
            await rt.infer_samples("tinynet", samples)
        await asyncio.sleep(0.1)  # past the batching window: nothing was left to dispatch
        await rt.stop()
        return submitted, withdrawn, exc.value.reason

    submitted, withdrawn, reason = asyncio.run(main())
    assert reason == "queue-full"
    assert len(submitted) == 4  # samples 5..10 never reached the scheduler
    assert withdrawn == submitted[:3]  # the three queued ones were taken back
    assert not rt.traces and not rt._pending  # nothing computed, nothing left waiting


def test_a_batch_whose_reports_stop_is_answered_worker_failed_not_left_to_time_out(tinynet):
    """A lost data-path message (a broken connection between workers) never reports: the
    batch is answered once it is report_grace_s (or the SLO) past its planned end."""
    from ppipe.runtime.scheduler.host import DroppedError

    cluster = load_cluster("local-cpu")
    plan = make_plan(tinynet, cluster, [(0, 1, "cpu", 2, 1), (2, 2, "cpu", 2, 1)], slo_ms=100.0)
    peers = {p.vgpu_id: FakeWorker(p.vgpu_id) for p in plan.placement}
    rt = Runtime(plan, {"tinynet": tinynet}, cluster, peers, scheduler_factory=functools.partial(FifoScheduler, max_batch=1),
                 report_grace_s=0.2)
    second = plan.placement[-1].vgpu_id

    async def main():
        await rt.start()
        peers[second].hold = asyncio.Event()  # its stage never ends, and it never reports
        t = time.perf_counter()
        with pytest.raises(DroppedError) as exc:
            await rt.infer("tinynet", {"x": np.zeros(2, np.float32)})
        waited = time.perf_counter() - t
        peers[second].hold.set()
        ok = await rt.infer("tinynet", {"x": np.zeros(2, np.float32)})
        await rt.stop()
        return exc.value, waited, ok

    err, waited, ok = asyncio.run(main())
    assert err.reason == "worker-failed" and f"no report from vGPU {second}" in err.detail
    assert waited < 10.0  # not the 30 s answer grace
    assert ok["y"].tolist() == [2.0, 2.0] and not rt._inflight


@pytest.mark.parametrize("adapt", [True, False])
def test_the_wake_lead_follows_late_timers_so_a_waiting_request_is_not_dropped(tinynet, adapt):
    """A lone request of a batch-4 plan waits for partners until its last feasible moment
    less the wake lead. Timers that fire 15 ms late (a busy host) dropped it at 2 ms of lead;
    the runtime widens the lead to twice the lateness it sees."""
    from ppipe.runtime.scheduler.host import DroppedError

    cluster = load_cluster("local-cpu")
    cluster = cluster.model_copy(update={"servers": [s.model_copy(update={"gpus_per_server": 2}) for s in cluster.servers]})
    plan = make_plan(tinynet, cluster, [(0, 1, "cpu", 1, 1), (2, 2, "cpu", 1, 1)], batch=4, slo_ms=100.0)
    peers = {p.vgpu_id: FakeWorker(p.vgpu_id) for p in plan.placement}
    rt = Runtime(plan, {"tinynet": tinynet}, cluster, peers, scheduler_options={"wake_lead_us": 2000.0})
    if not adapt:
        rt._timer_was_late = lambda late_us: None

    async def main():
        await rt.start()
        call_at = rt.clock.call_at
        rt.clock.call_at = lambda t, fn: call_at(t + 15_000.0, fn)  # every timer 15 ms late
        outcomes = []
        for i in range(6):
            try:
                await rt.infer("tinynet", {"x": np.zeros(2, np.float32)})
                outcomes.append("ok")
            except DroppedError as exc:
                outcomes.append(exc.reason)
        await rt.stop()
        return outcomes

    outcomes = asyncio.run(main())
    if adapt:
        assert outcomes[1:] == ["ok"] * 5, outcomes  # the first late timer teaches the lead
    else:
        assert outcomes.count("deadline-unreachable") >= 4, outcomes


