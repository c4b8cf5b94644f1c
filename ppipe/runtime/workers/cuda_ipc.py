"""Feature maps between two workers on one GPU by CUDA IPC (NCCL refuses two ranks on one device).

Two vGPUs of consecutive pools can be MPS shares (or time-sliced shares) of one card.
Their feature maps need not leave the GPU: the sender hands the receiver a CUDA IPC handle
of its output (``torch.multiprocessing``'s reductions: ``cudaIpcGetMemHandle`` of the
storage plus an IPC event recorded after the producing kernels, which the receiver's
stream waits on when it opens the handle), the receiver copies the tensor into its own
memory and acknowledges, and only then may the sender drop its reference.

The protocol over any pair of queues (``put``/``get``; ``torch.multiprocessing`` queues
between processes, whose pickler turns tensors into handles):

* the sender posts ``{"seq", "batch_id", "tensors": {name: tensor}}`` in message-number
  order and keeps each message's tensors in ``pending`` until its ack arrives (CUDA IPC
  requires the producer's allocation to outlive the consumer's use);
* the receiver takes message ``seq`` (any other number is an :class:`IpcProtocolError`),
  clones every tensor (a copy on its own stream, ordered after the producer's event) and
  acks ``seq``.

Status: the protocol is tested on the CPU (tensors in host memory, one process, plain
queues) and, with ``-m gpu``, between two processes on one GPU; ``scripts/gpu_check.sh``
measures it. ``ppipe serve`` does not use it: each message opens a new IPC handle, which
costs milliseconds; a worker's same-GPU edge is to be a
:class:`~ppipe.runtime.workers.ring_link.RingLink`, whose handles are opened once per edge.
"""

from __future__ import annotations

import queue as queue_mod
from typing import Any

DEFAULT_TIMEOUT_S = 60.0


class IpcProtocolError(RuntimeError):
    """The two ends disagree on the message number (a bug, never a user error)."""


class IpcSender:
    """The upstream end: posts messages and holds their tensors until acknowledged."""

    def __init__(self, outbox: Any, acks: Any):
        self.outbox, self.acks = outbox, acks
        self.next_seq = 0
        self.pending: dict[int, dict[str, Any]] = {}

    def send(self, batch_id: int, tensors: dict[str, Any]) -> int:
        """Post the next message; returns its number."""
        seq = self.next_seq
        self.pending[seq] = tensors
        self.outbox.put({"seq": seq, "batch_id": batch_id, "tensors": tensors})
        self.next_seq += 1
        self.release()
        return seq

    def release(self, wait_for: int | None = None, timeout_s: float = DEFAULT_TIMEOUT_S) -> None:
        """Drop the tensors of acknowledged messages; with ``wait_for``, block until that one is."""
        while True:
            try:
                block = wait_for is not None and wait_for in self.pending
                seq = self.acks.get(timeout=timeout_s) if block else self.acks.get_nowait()
            except queue_mod.Empty:
                if wait_for is not None and wait_for in self.pending:
                    raise TimeoutError(f"no ack for message {wait_for} in {timeout_s:.0f} s") from None
                return
            self.pending.pop(seq, None)


class IpcReceiver:
    """The downstream end: takes messages in number order, copies them, acknowledges."""

    def __init__(self, inbox: Any, acks: Any):
        self.inbox, self.acks = inbox, acks
        self.next_seq = 0

    def recv(self, timeout_s: float = DEFAULT_TIMEOUT_S) -> tuple[int, dict[str, Any]]:
        """The next message as (batch id, tensors in this process's own memory)."""
        msg = self.inbox.get(timeout=timeout_s)
        if msg["seq"] != self.next_seq:
            raise IpcProtocolError(f"expected message {self.next_seq}, got {msg['seq']} (batch {msg['batch_id']})")
        batch_id = msg["batch_id"]
        own = {k: v.clone() for k, v in msg["tensors"].items()}  # ordered after the sender's IPC event
        _synchronize(own)
        del msg  # closes the IPC handles before the ack lets the sender free the memory
        self.acks.put(self.next_seq)
        self.next_seq += 1
        return batch_id, own


def _synchronize(tensors: dict[str, Any]) -> None:
    """Wait for the copies on CUDA (a no-op for host tensors)."""
    for t in tensors.values():
        if getattr(t, "is_cuda", False):
            import torch

            torch.cuda.current_stream(t.device).synchronize()
            return


__all__ = ["IpcProtocolError", "IpcReceiver", "IpcSender"]
