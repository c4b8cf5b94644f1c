"""The ring link between two workers on one machine (issue 23): the protocol on the host, the CUDA ring with -m gpu.

The host ring (``kind="host"``: shared memory, NumPy) runs the same numbering, chunking,
credits and abort as the CUDA ring between two processes; the gpu test runs the CUDA ring.
"""

from __future__ import annotations

import asyncio
import multiprocessing as mp
import threading

import numpy as np
import pytest

from ppipe.runtime.workers.ring_link import RingClosed, ring_address, ring_link
from ppipe.runtime.workers.transport import EdgeChannel, UpstreamFailed


def _messages(xp=np):
    """Three batches' feature maps: several chunks each at 4 KiB slots, one integer tensor, one empty."""
    rng = np.random.default_rng(7)
    out = []
    for i in range(3):
        out.append({
            "fmap": xp.asarray(rng.standard_normal((4, 3000 + 700 * i)).astype(np.float32)),
            "idx": xp.asarray(np.arange(10 * (i + 1), dtype=np.int64)),
            "none": xp.asarray(np.zeros((0, 5), np.float16)),
        })
    return out


def _sender(address, kind: str) -> None:
    xp = np
    if kind == "cuda":
        import cupy as xp
    link = ring_link(address, 0)
    channel = EdgeChannel(link, "down", "send")

    async def go():
        for seq, tensors in enumerate(_messages(xp)):
            await channel.send(seq, 100 + seq, tensors, 1.5)
        await channel.send(3, 103, None, 2.0, error="stage 1 failed: out of memory")

    asyncio.run(go())
    link.close()


def _receive_all(address, kind: str) -> list:
    ctx = mp.get_context("spawn")
    proc = ctx.Process(target=_sender, args=(address, kind))
    proc.start()
    link = ring_link(address, 1)
    channel = EdgeChannel(link, "up", "recv")

    async def go():
        got = [await channel.recv(seq, 100 + seq) for seq in range(3)]
        with pytest.raises(UpstreamFailed, match="out of memory"):
            await channel.recv(3, 103)
        return got

    try:
        return asyncio.run(go())
    finally:
        proc.join(timeout=60)
        link.close()
        assert proc.exitcode == 0


def test_messages_larger_than_the_ring_arrive_whole_and_in_order_between_two_processes():
    got = _receive_all(ring_address("host", slot_bytes=4096, slots=2), "host")
    for (tensors, head), want in zip(got, _messages()):
        assert head.sent_wall_us == 1.5
        np.testing.assert_array_equal(tensors["fmap"], want["fmap"].astype(np.float16))  # feature maps cross as fp16
        np.testing.assert_array_equal(tensors["idx"], want["idx"])
        assert tensors["none"].shape == (0, 5)


def _pair(address):
    """Both ends in one process (the sender's set-up waits for the receiver)."""
    ends = {}
    t = threading.Thread(target=lambda: ends.setdefault(0, ring_link(address, 0)))
    t.start()
    ends[1] = ring_link(address, 1)
    t.join(timeout=30)
    return ends[0], ends[1]


def test_an_abort_releases_a_sender_that_waits_for_a_free_slot():
    tx, rx = _pair(ring_address("host", slot_bytes=1024, slots=2))
    failure = []

    def send():
        try:
            tx.send(np.zeros(10_000, np.uint8))  # ten chunks through two slots, and nobody reads
        except RingClosed as exc:
            failure.append(str(exc))

    t = threading.Thread(target=send)
    t.start()
    t.join(timeout=0.3)
    assert t.is_alive()  # blocked on a credit
    rx.abort()
    t.join(timeout=10)
    assert failure and "aborted by the peer" in failure[0]
    tx.close(), rx.close()


def test_a_sender_that_aborts_removes_its_rings_name_and_the_receiver_is_released():
    from multiprocessing import shared_memory

    tx, rx = _pair(ring_address("host", slot_bytes=1024, slots=2))
    name = tx.mem.shm.name
    failure = []
    t = threading.Thread(target=lambda: failure.append(pytest.raises(RingClosed, rx.recv, np.empty(10, np.uint8))))
    t.start()
    tx.abort()
    t.join(timeout=10)
    assert failure and "aborted by the peer" in str(failure[0].value)
    with pytest.raises(FileNotFoundError):
        shared_memory.SharedMemory(name=name)
    tx.close(), rx.close()


def test_a_chunk_that_overfills_the_receivers_buffer_is_refused():
    tx, rx = _pair(ring_address("host", slot_bytes=1024, slots=2))
    tx.send(np.ones(1000, np.uint8))
    with pytest.raises(RuntimeError, match="out of step: got chunk of 1000 bytes with 500 of 500 still to fill"):
        rx.recv(np.empty(500, np.uint8))
    tx.close(), rx.close()


def test_a_ring_kind_and_rank_are_checked():
    with pytest.raises(ValueError, match="ring kind"):
        ring_address("rdma")
    with pytest.raises(ValueError, match="rank must be 0"):
        ring_link(ring_address("host"), 2)


def _cuda_device() -> bool:
    try:
        import cupy

        return cupy.cuda.runtime.getDeviceCount() > 0
    except Exception:
        return False


@pytest.mark.gpu
@pytest.mark.skipif(not _cuda_device(), reason="needs CuPy and a CUDA device")
def test_on_a_gpu_the_cuda_ring_carries_device_feature_maps_between_two_processes():
    import cupy

    got = _receive_all(ring_address("cuda", slot_bytes=4096, slots=2), "cuda")
    for (tensors, _head), want in zip(got, _messages()):
        assert isinstance(tensors["fmap"], cupy.ndarray)
        np.testing.assert_array_equal(cupy.asnumpy(tensors["fmap"]), want["fmap"].astype(np.float16))
        np.testing.assert_array_equal(cupy.asnumpy(tensors["idx"]), want["idx"])
