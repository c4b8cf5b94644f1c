"""The NCCL transport's logic on the CPU: selection, the message protocol, the driver's
numbering, and one end-to-end run on Ray with a FAKE link injected explicitly (bytes go
through a Ray queue, not NCCL; nothing here is a GPU result). The real NCCL path is in the
CUDA-only tests at the bottom, which skip on machines without a GPU."""

from __future__ import annotations

import asyncio
import functools
import os

import msgspec
import numpy as np
import pytest

from ppipe.errors import UserError
from ppipe.runtime.workers.transport import (
    HEADER_BYTES,
    Capability,
    EdgeAborted,
    EdgeChannel,
    EdgeProtocolError,
    Header,
    UpstreamFailed,
    choose_edge,
    decode_header,
    encode_header,
    nccl_capability,
    pipeline_edges,
    select_transports,
)
from ppipe.runtime.wire.messages import EdgeRef, Reservation, StageLinks, StageMsg
from ppipe.runtime.workers.worker import WorkerSpec
from .fakes import queue_link_pair

OK = Capability(True, "", 0)
CPU = Capability(False, "the pool runs on CPUs")


def _spec(vgpu_id, server="s-0", gpu_index=0, partition=0, pipeline=0, gpu="L4"):
    return WorkerSpec(vgpu_id, server, gpu_index, "m", pipeline, partition, 0, 0, gpu, 1, "m")


# ---- selection --------------------------------------------------------------------------------------------
def test_auto_uses_nccl_only_between_two_capable_workers_on_distinct_gpus():
    a, b = _spec("s-0/gpu0/s0"), _spec("s-1/gpu0/s0", server="s-1", partition=1)
    assert choose_edge("auto", a, b, OK, OK) == ("nccl", "")
    t, why = choose_edge("auto", a, b, OK, CPU)
    assert t == "tcp" and "CPUs" in why
    assert choose_edge("tcp", a, b, OK, OK)[0] == "tcp"
    same = _spec("s-0/gpu0/s1", partition=1)  # another MPS share of the same card
    t, why = choose_edge("auto", a, same, OK, OK)
    assert t == "tcp" and "one GPU" in why
    assert choose_edge("nccl", a, same, OK, OK)[0] == "tcp"  # NCCL cannot; not the user's fault


def test_ring_takes_two_shares_of_one_gpu_and_is_auto_elsewhere():
    a = _spec("s-0/gpu0/s0")
    same_gpu, other_gpu = _spec("s-0/gpu0/s1", partition=1), _spec("s-0/gpu1/s0", gpu_index=1, partition=1)
    remote = _spec("s-1/gpu0/s0", server="s-1", partition=1)
    assert choose_edge("ring", a, same_gpu, OK, OK) == ("ring-cuda", "both vGPUs share one GPU")
    assert choose_edge("ring", a, other_gpu, OK, OK) == ("nccl", "")  # two devices: NCCL can
    assert choose_edge("ring", a, remote, OK, OK) == ("nccl", "")
    host = _spec("s-0/cpu/s1", partition=1, gpu="cpu")
    assert choose_edge("ring", _spec("s-0/cpu/s0", gpu="cpu"), host, CPU, CPU)[0] == "tcp"  # the host ring is slower
    no_cupy = Capability(False, "CuPy with NCCL is not importable", gpu_resident=True)
    assert choose_edge("ring", a, same_gpu, no_cupy, OK)[0] == "tcp"
    assert choose_edge("auto", a, same_gpu, OK, OK)[0] == "tcp"  # auto keeps TCP for one GPU


def test_nccl_requested_but_unavailable_is_a_user_error_naming_the_worker():
    a, b = _spec("s-0/gpu0/s0"), _spec("s-1/gpu0/s0", server="s-1", partition=1)
    with pytest.raises(UserError, match=r"worker s-1/gpu0/s0 \(L4\) cannot use NCCL: no CUDA device"):
        choose_edge("nccl", a, b, OK, Capability(False, "no CUDA device"))
    with pytest.raises(UserError, match="unknown transport 'shm'"):
        choose_edge("shm", a, b, OK, OK)


def test_edges_join_consecutive_pools_of_one_pipeline_only():
    specs = [_spec("p0a"), _spec("p0b"), _spec("p1a", partition=1), _spec("p2a", partition=2), _spec("q1", pipeline=1, partition=1)]
    assert pipeline_edges(specs) == [("p0a", "p1a"), ("p0b", "p1a"), ("p1a", "p2a")]
    caps = {s.vgpu_id: OK for s in specs} | {"p2a": CPU}
    specs = [s if s.vgpu_id == "p0a" else _spec(s.vgpu_id, server=f"x{i}", partition=s.partition, pipeline=s.pipeline) for i, s in enumerate(specs)]
    got = select_transports("auto", specs, caps)
    assert {e: t for e, (t, _) in got.items()} == {("p0a", "p1a"): "nccl", ("p0b", "p1a"): "nccl", ("p1a", "p2a"): "tcp"}


def test_capability_is_refused_for_cpu_emulated_and_host_only_backends():
    assert not nccl_capability("ort", "cpu", False).nccl
    assert "emulated" in nccl_capability("emulated", "L4", False).reason
    assert "CUDA execution provider" in nccl_capability("ort", "T4", False).reason
    try:
        import cupy  # noqa: F401
    except ImportError:
        cap = nccl_capability("tensorrt", "L4", True)
        assert not cap.nccl and "CuPy" in cap.reason


# ---- the message protocol ------------------------------------------------------------------------------------
def test_header_round_trip_and_size_limit():
    h = Header(7, 3, 1.5e15, (("a", "<f2", (2, 3)), ("idx", "<i8", (2,))), None)
    buf = encode_header(h)
    assert buf.dtype == np.uint8 and buf.shape == (HEADER_BYTES,)
    assert decode_header(buf) == h
    assert h.nbytes() == [12, 16]
    assert decode_header(encode_header(Header(1, 0, 2.0, (), "ValueError: boom"))).error == "ValueError: boom"
    with pytest.raises(ValueError, match="exceeds"):
        encode_header(Header(1, 0, 0.0, tuple((f"t{i}" * 20, "<f2", (1,)) for i in range(100))))


def _channels():
    s, r = queue_link_pair()
    return EdgeChannel(s, "down", "send"), EdgeChannel(r, "up", "recv")


def test_channel_carries_fp16_feature_maps_and_other_dtypes_unchanged():
    async def main():
        tx, rx = _channels()
        x = np.arange(24, dtype=np.float32).reshape(2, 3, 4) / 7
        idx = np.array([[1, 2], [3, 4]], dtype=np.int64)
        send = asyncio.create_task(tx.send(0, 11, {"x": x, "idx": idx}, 123.0))
        got, head = await rx.recv(0, 11)
        await send
        return x, idx, got, head

    x, idx, got, head = asyncio.run(main())
    assert got["x"].dtype == np.float16 and got["x"].shape == (2, 3, 4)
    np.testing.assert_allclose(got["x"], x, rtol=1e-3)
    np.testing.assert_array_equal(got["idx"], idx)
    assert head.sent_wall_us == 123.0 and head.batch_id == 11


def test_channel_posts_messages_in_number_order_whatever_order_batches_finish():
    async def main():
        tx, rx = _channels()
        order = []
        orig = tx._send_sync

        def spy(seq, *args):
            order.append(seq)
            orig(seq, *args)

        tx._send_sync = spy
        # batch of message 1 finishes first (e.g. it was reserved into an earlier gap)
        s1 = asyncio.create_task(tx.send(1, 21, {"y": np.ones((1, 2), np.float16)}, 0.0))
        await asyncio.sleep(0.05)
        assert order == []  # message 1 waits for message 0
        s0 = asyncio.create_task(tx.send(0, 20, {"y": np.zeros((1, 2), np.float16)}, 0.0))
        r0 = await rx.recv(0, 20)
        r1 = await rx.recv(1, 21)
        await asyncio.gather(s0, s1)
        return order, r0, r1

    order, (t0, _), (t1, _) = asyncio.run(main())
    assert order == [0, 1]
    assert t0["y"].sum() == 0 and t1["y"].sum() == 2


def test_failed_sender_tells_the_receiver_and_a_mismatch_is_refused():
    async def main():
        tx, rx = _channels()
        await asyncio.gather(tx.send(0, 5, None, 0.0, error="RuntimeError: backend failed"), _expect(rx.recv(0, 5), UpstreamFailed, "backend failed"))
        # the numbering went on: message 1 works; a receiver told another batch refuses it
        await asyncio.gather(tx.send(1, 6, {"z": np.ones(3, np.float16)}, 0.0), _expect(rx.recv(1, 99), EdgeProtocolError, "batch 99"))
        with pytest.raises(EdgeProtocolError, match="posted twice"):
            await rx.recv(0, 5)

    asyncio.run(main())


async def _expect(coro, exc_type, text):
    with pytest.raises(exc_type, match=text):
        await coro


def test_abort_releases_a_receive_whose_sender_died():
    async def main():
        _, rx = _channels()
        pending = asyncio.create_task(rx.recv(0, 1))
        await asyncio.sleep(0.05)
        rx.abort("up failed")
        with pytest.raises(EdgeAborted, match="up failed"):
            await asyncio.wait_for(pending, 5)
        with pytest.raises(EdgeAborted):
            await rx.recv(1, 2)

    asyncio.run(main())


# ---- the CUDA path (skips without a GPU) ----------------------------------------------------------------------------
def _two_gpus() -> bool:
    try:
        import cupy
        from cupy.cuda import nccl  # noqa: F401

        return cupy.cuda.runtime.getDeviceCount() >= 2
    except Exception:
        return False


def _cupy_nccl() -> bool:
    try:
        import cupy
        from cupy.cuda import nccl  # noqa: F401

        return cupy.cuda.runtime.getDeviceCount() >= 1
    except Exception:
        return False


@pytest.mark.gpu
@pytest.mark.skipif(not _cupy_nccl(), reason="needs CuPy with NCCL and a CUDA device")
def test_a_gpu_worker_with_cupy_reports_nccl():
    cap = nccl_capability("tensorrt", "L4", True)
    assert cap.nccl and cap.device is not None and cap.reason == ""


@pytest.mark.gpu
@pytest.mark.skipif(not _two_gpus(), reason="needs CuPy with NCCL and two CUDA devices (NCCL refuses two ranks on one GPU)")
def test_nccl_link_moves_a_device_feature_map_between_two_gpus():
    import threading

    import cupy

    from ppipe.runtime.workers.transport import NcclLink, nccl_unique_id

    uid = nccl_unique_id()
    links = {}

    def join(rank):
        cupy.cuda.Device(rank).use()  # a worker process sees its one GPU as the current device
        links[rank] = NcclLink(uid, rank)

    ts = [threading.Thread(target=join, args=(r,)) for r in (0, 1)]
    [t.start() for t in ts]
    [t.join(60) for t in ts]
    assert set(links) == {0, 1}

    async def main():
        tx, rx = EdgeChannel(links[0], "down", "send"), EdgeChannel(links[1], "up", "recv")
        with cupy.cuda.Device(0):
            x = cupy.random.standard_normal((4, 64, 28, 28), dtype=cupy.float32)
        send = asyncio.create_task(tx.send(0, 1, {"feat": x}, 0.0))
        got, head = await rx.recv(0, 1)
        await send
        return x.get(), got

    x, got = asyncio.run(main())
    assert isinstance(got["feat"], cupy.ndarray) and got["feat"].dtype == cupy.float16
    assert got["feat"].device.id == 1
    np.testing.assert_allclose(got["feat"].get(), x, rtol=1e-2, atol=1e-2)


def _tinynet_pair(tinynet, tmp_path, backend="ort"):
    """Workers of a two-partition tinynet plan on local-cpu: (deployment, workers, sender id, receiver id)."""
    from ppipe.runtime.launch.deploy import load_deployment, start_workers
    from ppipe.spec.cluster import load_cluster
    from .conftest import make_plan

    plan = make_plan(tinynet, load_cluster("local-cpu"), [(0, 1, "cpu", 2, 1), (2, 2, "cpu", 2, 1)])
    plan.save(tmp_path / "plan.yaml")
    dep = load_deployment(tmp_path / "plan.yaml")
    workers = start_workers(dep, backend=backend)
    (up,), (down,) = ([p.vgpu_id for p in plan.placements_of("tinynet", 0, j)] for j in (0, 1))
    return dep, workers, up, down


def _answers(dep, workers, edges, xs):
    """Serve ``xs`` one request each (FIFO batches of up to 3): (logits stacked, the runtime)."""
    from ppipe.runtime.scheduler.host import Runtime
    from .fakes import FifoScheduler

    rt = Runtime(dep.plan, dep.profiles, dep.cluster, workers, edges=edges, keep_traces=50,
                 scheduler_factory=functools.partial(FifoScheduler, max_batch=3, window_us=3000.0))

    async def main():
        await rt.start()
        try:
            return await asyncio.gather(*(rt.infer("tinynet", {"input": x}) for x in xs))
        finally:
            await rt.stop()

    return np.stack([o["logits"] for o in asyncio.run(main())]), rt


# ---- end to end on Ray with a fake link (the protocol across processes; not NCCL) ----------------------------------
@pytest.mark.ray
def test_two_partitions_over_a_fake_link_answer_like_the_whole_model(ray_cluster, tinynet, tmp_path, monkeypatch):
    import ray
    from ray.util.queue import Queue

    from ppipe.runtime.launch.deploy import connect_edges, setup_transport
    from . import fakes
    from .fakes import ray_queue_link
    from .tinynet import reference

    ray.cloudpickle.register_pickle_by_value(fakes)  # workers cannot import the tests package

    dep, workers, up, down = _tinynet_pair(tinynet, tmp_path)
    try:
        # what the workers report decides: CPU workers get the sockets, and NCCL on demand is refused
        assert setup_transport(dep, workers, "auto") == {(up, down): ("tcp", f"{up}: the pool runs on CPUs")}
        with pytest.raises(UserError, match=f"--transport nccl: worker {up} \\(cpu\\) cannot use NCCL: the pool runs on CPUs"):
            setup_transport(dep, workers, "nccl")
        # a pair that cannot open its communicator (no CuPy here) is a UserError, not a hang
        with monkeypatch.context() as m:
            m.setattr("ppipe.runtime.workers.transport.select_transports", lambda *a, **k: {(up, down): ("nccl", "")})
            with pytest.raises(UserError, match=r"opening the NCCL communicators of 1 worker pair\(s\) failed"):
                setup_transport(dep, workers, "auto", timeout_s=60)
        # the test picks the edge's transport itself: CPU workers would never get NCCL
        connect_edges(workers, [(up, down)], link_factory=ray_queue_link, unique_ids=[Queue()])
        xs = np.random.default_rng(3).normal(size=(7, 3, 8, 8)).astype(np.float32)
        got, rt = _answers(dep, workers, {(up, down): "nccl"}, xs)
        np.testing.assert_allclose(got, reference(tinynet.directory, xs), rtol=2e-2, atol=2e-2)
        batches = [t for t in rt.traces if t.error is None]
        assert len(batches) >= 3 and sum(len(t.request_ids) for t in batches) == 7
        # every batch's feature map went over the edge, as numbered messages 0..n-1
        pings = ray.get([workers[up].actor.ping.remote(), workers[down].actor.ping.remote()])
        assert pings[0]["edges"] == {f"send:{down}": len(batches)}
        assert pings[1]["edges"] == {f"recv:{up}": len(batches)}
        if os.geteuid() == 0:  # workers undo Ray's worker niceness where they may
            assert pings[0]["nice"] == 0
        assert all(t.reports[1].transfer_start_us <= t.reports[1].transfer_end_us for t in batches)
    finally:
        for h in workers.values():
            h.kill()


def _on_a_host_ring(monkeypatch, up, down):
    """The test puts the edge on the shared-memory ring itself (no --transport chooses it)."""
    monkeypatch.setattr("ppipe.runtime.workers.transport.select_transports", lambda *a, **k: {(up, down): ("ring-host", "the test")})


@pytest.mark.ray
def test_two_workers_talk_through_a_staging_ring_opened_as_serve_opens_it(ray_cluster, tinynet, tmp_path, monkeypatch):
    """A ring edge end to end on the CPU: the sender makes the ring's address, both workers
    open it (LinkOpener, as at start-up), and every batch's feature map crosses it as a
    numbered message (the CUDA kind differs only in where the ring lives)."""
    import ray

    from ppipe.runtime.launch.deploy import setup_transport
    from .tinynet import reference

    dep, workers, up, down = _tinynet_pair(tinynet, tmp_path)
    try:
        _on_a_host_ring(monkeypatch, up, down)
        edges = setup_transport(dep, workers, "ring")
        assert edges == {(up, down): ("ring-host", "the test")}
        xs = np.random.default_rng(5).normal(size=(6, 3, 8, 8)).astype(np.float32)
        got, rt = _answers(dep, workers, edges, xs)
        np.testing.assert_allclose(got, reference(tinynet.directory, xs), rtol=2e-2, atol=2e-2)
        batches = [t for t in rt.traces if t.error is None]
        pings = ray.get([workers[up].actor.ping.remote(), workers[down].actor.ping.remote()])
        assert pings[0]["edges"] == {f"send:{down}": len(batches)} and pings[1]["edges"] == {f"recv:{up}": len(batches)}
    finally:
        for h in workers.values():
            h.kill()


@pytest.mark.ray
def test_emulated_workers_send_over_a_ring_edge_too(ray_cluster, tinynet, tmp_path, monkeypatch):
    import ray

    from ppipe.runtime.launch.deploy import setup_transport

    dep, workers, up, down = _tinynet_pair(tinynet, tmp_path, backend="emulated")
    try:
        _on_a_host_ring(monkeypatch, up, down)
        edges = setup_transport(dep, workers, "ring")
        assert edges[(up, down)][0] == "ring-host"
        got, rt = _answers(dep, workers, edges, np.zeros((4, 3, 8, 8), np.float32))
        assert got.shape == (4, *tinynet.manifest.outputs[0].shape)
        sent = ray.get(workers[up].actor.ping.remote())["edges"][f"send:{down}"]
        assert sent == len([t for t in rt.traces if t.error is None]) > 0
    finally:
        for h in workers.values():
            h.kill()


# ---- the worker's NCCL path in-process (two VgpuWorker bodies, a fake link, onnxruntime) ------------------------------
def _pair_of_workers(tinynet):
    from ppipe.runtime.workers.worker import VgpuWorker
    from ppipe.spec.profile import profile_ref

    ref = profile_ref(tinynet)
    up = VgpuWorker(WorkerSpec("a/gpu0/s0", "a", 0, "tinynet", 0, 0, 0, 1, "cpu", 1, ref), "ort")
    down = VgpuWorker(WorkerSpec("b/gpu0/s0", "b", 0, "tinynet", 0, 1, 2, 2, "cpu", 1, ref), "ort")
    s, r = queue_link_pair()
    up.channels[("send", "b/gpu0/s0", 0)] = EdgeChannel(s, "b/gpu0/s0", "send")
    down.channels[("recv", "a/gpu0/s0", 0)] = EdgeChannel(r, "a/gpu0/s0", "recv")
    return up, down


def _stage_pair(up, down, batch_id, seq, x, down_id="b/gpu0/s0", gen=None):
    edge = dict(seq=seq) if gen is None else dict(seq=seq, gen=gen)
    links = (StageLinks(send=EdgeRef("b/gpu0/s0", **edge)), StageLinks(recv=EdgeRef("a/gpu0/s0", **edge)))
    msg = StageMsg(batch_id, 0, ("a/gpu0/s0", down_id), ("tcp://up:1", "tcp://down:1"), len(x), (Reservation(None, 0, 0, 0),) * 2, links, sent_us=0.0)
    return up.run_stage(msg, {"input": x}), down.run_stage(msgspec.structs.replace(msg, stage=1, sent_us=None), None)


def test_a_worker_keeps_edges_of_two_generations_to_one_vgpu_id_apart_and_closes_one(tinynet):
    """After a plan switch that re-cut its peer, a kept worker holds an edge to the old
    worker of that id (generation 0) and one to the new worker (generation 1): each message
    goes on the edge its link names, and closing the old edge leaves the new one."""
    from ppipe.runtime.workers.worker import VgpuWorker
    from ppipe.spec.profile import profile_ref
    from .tinynet import reference

    up, old_down = _pair_of_workers(tinynet)
    new_down = VgpuWorker(WorkerSpec("b/gpu0/s0", "b", 0, "tinynet", 0, 1, 2, 2, "cpu", 1, profile_ref(tinynet)), "ort")
    s, r = queue_link_pair()
    up.channels[("send", "b/gpu0/s0", 1)] = EdgeChannel(s, "b/gpu0/s0", "send")
    new_down.channels[("recv", "a/gpu0/s0", 1)] = EdgeChannel(r, "a/gpu0/s0", "recv")
    xs = np.random.default_rng(6).normal(size=(2, 2, 3, 8, 8)).astype(np.float32)

    async def main():
        _, new = await asyncio.gather(*_stage_pair(up, new_down, 1, 0, xs[0], gen=1))
        _, old = await asyncio.gather(*_stage_pair(up, old_down, 2, 0, xs[1], gen=0))
        closed = await up.close_edges([("b/gpu0/s0", 0)])
        return new, old, closed

    new, old, closed = asyncio.run(asyncio.wait_for(main(), 20))
    np.testing.assert_allclose(new.tensors["logits"], reference(tinynet.directory, xs[0]), rtol=2e-2, atol=2e-2)
    np.testing.assert_allclose(old.tensors["logits"], reference(tinynet.directory, xs[1]), rtol=2e-2, atol=2e-2)
    assert closed == 1 and list(up.channels) == [("send", "b/gpu0/s0", 1)]
    assert asyncio.run(up.ping())["edges"] == {"send:b/gpu0/s0@1": 1}


def test_worker_stages_over_an_edge_answer_like_the_whole_model_and_survive_failures(tinynet):
    from .tinynet import reference

    up, down = _pair_of_workers(tinynet)
    xs = np.random.default_rng(5).normal(size=(3, 2, 3, 8, 8)).astype(np.float32)

    async def main():
        first, last = await asyncio.gather(*_stage_pair(up, down, 1, 0, xs[0]))
        # a receiver posted with the wrong vGPU fails, yet takes its message off the edge
        bad = await asyncio.gather(*_stage_pair(up, down, 2, 1, xs[1], down_id="c/gpu0/s0"), return_exceptions=True)
        # a sender whose backend fails tells the receiver, which fails that batch only
        bad2 = await asyncio.gather(*_stage_pair(up, down, 3, 2, np.zeros((2, 5), np.float32)), return_exceptions=True)
        _, again = await asyncio.gather(*_stage_pair(up, down, 4, 3, xs[2]))
        return first, last, bad, bad2, again

    first, last, bad, bad2, again = asyncio.run(asyncio.wait_for(main(), 20))
    assert first.tensors is None  # the feature map went over the edge, not in the stage's output
    np.testing.assert_allclose(last.tensors["logits"], reference(tinynet.directory, xs[0]), rtol=2e-2, atol=2e-2)  # the model's outputs
    assert last.report.transfer_start_us <= last.report.transfer_end_us <= last.report.start_us
    assert isinstance(bad[1], RuntimeError) and "not b/gpu0/s0" in str(bad[1])
    assert not isinstance(bad[0], Exception)  # the sender's message was delivered and drained
    assert isinstance(bad2[0], Exception) and isinstance(bad2[1], UpstreamFailed)
    np.testing.assert_allclose(again.tensors["logits"], reference(tinynet.directory, xs[2]), rtol=2e-2, atol=2e-2)
    assert up.channels[("send", "b/gpu0/s0", 0)].next_seq == down.channels[("recv", "a/gpu0/s0", 0)].next_seq == 4
