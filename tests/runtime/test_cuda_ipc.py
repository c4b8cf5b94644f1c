"""CUDA IPC handoff between two workers on one GPU (issue 23): the protocol on the CPU, the real thing with -m gpu.

The CPU tests run the sender and receiver in one process over plain queues with host
tensors: they check numbering, acknowledgement and release, not CUDA. The gpu test runs
the receiver in a second process (torch.multiprocessing, spawn) on the same GPU.
"""

from __future__ import annotations

import queue

import pytest

from ppipe.runtime.workers.cuda_ipc import IpcProtocolError, IpcReceiver, IpcSender

torch = pytest.importorskip("torch", reason="torch is not installed (pip install '.[torch]'); CI's .[test] does not pull it")


def _pair():
    box, acks = queue.Queue(), queue.Queue()
    return IpcSender(box, acks), IpcReceiver(box, acks), box


def test_the_receiver_gets_copies_in_order_and_the_sender_holds_tensors_until_acked():
    tx, rx, _ = _pair()
    xs = [torch.full((2, 3), float(i), dtype=torch.float16) for i in range(3)]
    for i, x in enumerate(xs):
        assert tx.send(100 + i, {"fmap": x}) == i
    assert sorted(tx.pending) == [0, 1, 2]  # nothing acknowledged yet
    batch, got = rx.recv(timeout_s=1)
    assert batch == 100 and torch.equal(got["fmap"], xs[0]) and got["fmap"].data_ptr() != xs[0].data_ptr()
    tx.release()
    assert sorted(tx.pending) == [1, 2]
    rx.recv(timeout_s=1), rx.recv(timeout_s=1)
    tx.release(wait_for=2, timeout_s=1)
    assert tx.pending == {}


def test_a_message_out_of_order_is_refused_and_a_missing_ack_times_out():
    tx, rx, box = _pair()
    box.put({"seq": 5, "batch_id": 1, "tensors": {}})
    with pytest.raises(IpcProtocolError, match="expected message 0, got 5"):
        rx.recv(timeout_s=1)
    tx.send(1, {"fmap": torch.zeros(1)})
    with pytest.raises(TimeoutError, match="no ack for message 0"):
        tx.release(wait_for=0, timeout_s=0.05)


def _receiver(inbox, acks, results, n):
    rx = IpcReceiver(inbox, acks)
    for _ in range(n):
        batch, got = rx.recv()
        # NumPy pickles by value; a tensor goes by a file descriptor that dies with this process
        results.put((batch, got["fmap"].cpu().numpy()))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA build of torch and a GPU")
def test_on_a_gpu_two_processes_hand_over_device_tensors_byte_for_byte():
    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    inbox, acks, results = ctx.Queue(), ctx.Queue(), ctx.Queue()
    proc = ctx.Process(target=_receiver, args=(inbox, acks, results, 3))
    proc.start()
    tx = IpcSender(inbox, acks)
    xs = [torch.randn(8, 64, 56, 56, device="cuda").half() for _ in range(3)]
    for i, x in enumerate(xs):
        tx.send(i, {"fmap": x})
    got = [results.get(timeout=120) for _ in xs]
    tx.release(wait_for=2)
    proc.join(timeout=60)
    assert [b for b, _ in got] == [0, 1, 2]
    for (_, g), x in zip(got, xs):
        assert torch.equal(torch.from_numpy(g), x.cpu())
