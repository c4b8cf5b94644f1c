"""A link between two workers on one machine through a staging ring (NCCL refuses two ranks on one GPU).

Two vGPUs of consecutive pools can be MPS shares of one card; NCCL will not open a
communicator between them, so today their feature maps cross over TCP, through host
memory twice. A :class:`RingLink` is a :class:`~ppipe.runtime.workers.transport.Link` (what an
:class:`~ppipe.runtime.workers.transport.EdgeChannel` sends and receives through) whose bytes move
through a ring of ``slots`` buffers of ``slot_bytes`` owned by the sender:

* set-up (once per edge): the sender allocates the ring and listens on a Unix socket; the
  receiver connects (``multiprocessing.connection`` with a random key) and maps the ring:
  CUDA IPC handles of the ring and of one interprocess event per slot
  (``cudaIpcGetMemHandle``/``cudaIpcOpenMemHandle``; opening a handle costs milliseconds,
  so it is done once, not per message), or the name of a shared-memory block on the host;
* ``send(buf)``: the buffer goes in chunks of at most ``slot_bytes``; for each, the sender
  takes a free slot (waiting for a credit), copies the chunk in on its stream, records the
  slot's event and posts ``(slot, n)`` on the socket;
* ``recv(buf)``: for each chunk, the receiver makes its stream wait for the slot's event,
  copies the chunk out, waits for that copy and hands the slot back as a credit.

The socket carries only slot numbers; a slot is written again only after its credit, so
no copy can overtake another. ``send`` returns once the sender's copies are queued and
``synchronize`` once they are done: the sender's buffers may then be freed, as with NCCL.

``kind``: ``cuda`` (CuPy, device memory; the real thing, tested with ``-m gpu``) or
``host`` (NumPy over ``multiprocessing.shared_memory``: the same protocol between two
processes on the CPU, which is how the tests check the numbering, chunking, credits and
abort without a GPU).

Status: ``ppipe serve --transport ring`` puts two shares of one GPU on a CUDA ring
(:func:`~ppipe.runtime.workers.transport.choose_edge`: ``ring-cuda``); ``auto`` still sends them
over TCP until the CUDA ring has run on a GPU (``scripts/gpu_check.sh`` step 3 measures
it). The host ring is slower than a TCP socket on the hosts measured
(``scripts/bench_ring.py``: its chunks and credits cost more than the kernel's copies), so
no transport choice uses it; the tests run the whole path over it.
"""

from __future__ import annotations

import os
import tempfile
import time
import uuid
from dataclasses import dataclass
from multiprocessing.connection import Client, Listener
from typing import Any

KINDS = ("cuda", "host")
DEFAULT_SLOT_BYTES = 8 << 20
DEFAULT_SLOTS = 4
CONNECT_TIMEOUT_S = 60.0
# the CUDA runtime's values: cudaEventDisableTiming | cudaEventInterprocess, cudaMemcpyDeviceToDevice
_IPC_EVENT_FLAGS = 0x02 | 0x04
_DEVICE_TO_DEVICE = 3


class RingClosed(RuntimeError):
    """The peer closed or aborted the link."""


@dataclass(frozen=True)
class RingAddress:
    """What both ends of one edge are given (as an NCCL unique id is): where to meet, and the ring's shape."""

    path: str
    authkey: bytes
    kind: str = "cuda"
    slot_bytes: int = DEFAULT_SLOT_BYTES
    slots: int = DEFAULT_SLOTS


def ring_address(kind: str = "cuda", slot_bytes: int = DEFAULT_SLOT_BYTES, slots: int = DEFAULT_SLOTS) -> RingAddress:
    """A fresh meeting point for one edge (a socket path in the temporary folder and a random key)."""
    if kind not in KINDS:
        raise ValueError(f"ring kind must be one of {KINDS}, not {kind!r}")
    path = os.path.join(tempfile.gettempdir(), f"ppipe-ring-{uuid.uuid4().hex[:16]}.sock")
    return RingAddress(path, os.urandom(16), kind, int(slot_bytes), int(slots))


def ring_link(address: RingAddress, rank: int) -> "RingLink":
    """The edge's end for ``rank`` (0 the sender, 1 the receiver); blocks until both have met."""
    return RingLink(address, rank)


class RingLink:
    """One end of a ring edge (see the module docstring). Calls block; one thread per edge calls them."""

    def __init__(self, address: RingAddress, rank: int):
        if rank not in (0, 1):
            raise ValueError(f"rank must be 0 (sender) or 1 (receiver), not {rank}")
        self.address, self.rank = address, rank
        self.mem = _CudaRing(address) if address.kind == "cuda" else _HostRing(address)
        self.xp = self.mem.xp
        self.stream = self.mem.stream  # EdgeChannel stages its buffers on it (None on the host)
        self.closed: str | None = None
        if rank == 0:
            self.conn = _accept(address)
            self.conn.send(self.mem.export())
            self.free = list(range(address.slots))
        else:
            self.conn = _connect(address)
            self.mem.open(self.conn.recv())

    def activate(self) -> None:
        self.mem.activate()

    def send(self, buf: Any) -> None:
        """Copy ``buf`` (contiguous uint8) into the ring chunk by chunk and announce each chunk."""
        n = int(buf.nbytes)
        for off in range(0, n, self.address.slot_bytes):
            size = min(self.address.slot_bytes, n - off)
            slot = self._free_slot()
            self.mem.copy_in(slot, buf, off, size)
            self._post(("chunk", slot, size))

    def recv(self, buf: Any) -> None:
        """Fill ``buf`` (contiguous uint8) from the announced chunks, handing each slot back when copied.

        A sender that has sent its last message may be gone before that message's last
        credit: the bytes are all here, so that credit's failure is not the receive's."""
        n, off = int(buf.nbytes), 0
        while off < n:
            kind, slot, size = self._take()
            if kind != "chunk" or size > n - off:
                raise RuntimeError(f"ring edge out of step: got {kind} of {size} bytes with {n - off} of {n} still to fill")
            self.mem.copy_out(slot, buf, off, size)
            off += size
            try:
                self._post(("credit", slot, 0))
            except RingClosed:
                if off < n or self.closed is not None:
                    raise

    def synchronize(self) -> None:
        self.mem.synchronize()

    def abort(self) -> None:
        """Tell the peer and close: its blocked call raises :class:`RingClosed`, so does ours.

        The ring's memory is not freed here, since the peer may still be copying from it:
        a host ring loses its name (the memory goes with the last mapping), a device ring
        stays allocated until :meth:`close` or the sender's process ends.
        """
        if self.closed is not None:
            return
        self.closed = "aborted"
        try:
            self.conn.send(("abort", -1, 0))
        except OSError:
            pass
        self.conn.close()
        if self.rank == 0:
            self.mem.unlink()

    def close(self) -> None:
        if self.closed is None:
            self.closed = "closed"
            self.conn.close()
        self.mem.close(owner=self.rank == 0)

    # -- the control socket ---------------------------------------------------------------------------------
    def _free_slot(self) -> int:
        while not self.free:
            kind, slot, _ = self._take()
            if kind != "credit":
                raise RuntimeError(f"ring edge out of step: the sender got {kind}")
            self.free.append(slot)
        return self.free.pop(0)

    def _post(self, msg: tuple[str, int, int]) -> None:
        if self.closed is not None:
            raise RingClosed(f"the ring edge was {self.closed} here")
        try:
            self.conn.send(msg)
        except OSError as exc:
            raise RingClosed(f"the ring edge's peer is gone: {exc}") from None

    def _take(self) -> tuple[str, int, int]:
        if self.closed is not None:
            raise RingClosed(f"the ring edge was {self.closed} here")
        try:
            msg = self.conn.recv()
        except (EOFError, OSError) as exc:
            raise RingClosed(f"the ring edge's peer is gone: {type(exc).__name__}") from None
        if msg[0] == "abort":
            self.closed = "aborted by the peer"
            raise RingClosed("the ring edge was aborted by the peer")
        return msg


def _accept(address: RingAddress) -> Any:
    listener = Listener(address.path, family="AF_UNIX", authkey=address.authkey)
    try:
        return listener.accept()
    finally:
        listener.close()  # the path goes; the accepted connection stays


def _connect(address: RingAddress) -> Any:
    deadline = time.monotonic() + CONNECT_TIMEOUT_S
    while True:
        try:
            return Client(address.path, family="AF_UNIX", authkey=address.authkey)
        except (FileNotFoundError, ConnectionRefusedError):
            if time.monotonic() > deadline:
                raise TimeoutError(f"no sender listened at {address.path} within {CONNECT_TIMEOUT_S:.0f} s") from None
            time.sleep(0.01)


# ---- the ring's memory ---------------------------------------------------------------------------------------------
class _HostRing:
    """The ring in a shared-memory block: NumPy copies, nothing to order."""

    def __init__(self, address: RingAddress):
        import numpy as np

        self.xp, self.stream, self.address = np, None, address
        self.shm: Any = None
        self.view: Any = None
        self.unlinked = False

    def export(self) -> dict[str, Any]:
        from multiprocessing import shared_memory

        self.shm = shared_memory.SharedMemory(create=True, size=self.address.slots * self.address.slot_bytes)
        self.view = self.xp.ndarray(self.shm.size, dtype=self.xp.uint8, buffer=self.shm.buf)
        return {"name": self.shm.name}

    def open(self, exported: dict[str, Any]) -> None:
        from multiprocessing import shared_memory

        self.shm = shared_memory.SharedMemory(name=exported["name"])
        self.view = self.xp.ndarray(self.shm.size, dtype=self.xp.uint8, buffer=self.shm.buf)

    def activate(self) -> None:
        pass

    def copy_in(self, slot: int, buf: Any, off: int, n: int) -> None:
        base = slot * self.address.slot_bytes
        self.view[base : base + n] = buf.reshape(-1)[off : off + n]

    def copy_out(self, slot: int, buf: Any, off: int, n: int) -> None:
        base = slot * self.address.slot_bytes
        buf.reshape(-1)[off : off + n] = self.view[base : base + n]

    def synchronize(self) -> None:
        pass

    def unlink(self) -> None:
        """Remove the block's name; the mappings stay valid until closed."""
        if self.shm is not None and not self.unlinked:
            self.unlinked = True
            self.shm.unlink()

    def close(self, owner: bool) -> None:
        if self.shm is not None:
            self.view = None
            self.shm.close()
            if owner:
                self.unlink()
            self.shm = None


class _CudaRing:
    """The ring in device memory of the sender's GPU, mapped by the receiver through CUDA IPC.

    Each slot has an interprocess event, recorded by the sender after its copy in and
    waited on by the receiver's stream before its copy out. The memory comes from
    ``cudaMalloc`` itself (an IPC handle names a whole allocation, not a pool's slice).
    """

    def __init__(self, address: RingAddress):
        import cupy

        self.xp, self.address = cupy, address
        self.rt = cupy.cuda.runtime
        self.device = self.rt.getDevice()
        self.stream = cupy.cuda.Stream(non_blocking=True)
        self.ptr = 0
        self.events: list[int] = []

    def export(self) -> dict[str, Any]:
        rt = self.rt
        self.ptr = rt.malloc(self.address.slots * self.address.slot_bytes)
        self.events = [rt.eventCreateWithFlags(_IPC_EVENT_FLAGS) for _ in range(self.address.slots)]
        return {"mem": rt.ipcGetMemHandle(self.ptr), "events": [rt.ipcGetEventHandle(e) for e in self.events]}

    def open(self, exported: dict[str, Any]) -> None:
        rt = self.rt
        self.ptr = rt.ipcOpenMemHandle(exported["mem"])
        self.events = [rt.ipcOpenEventHandle(h) for h in exported["events"]]

    def activate(self) -> None:
        self.xp.cuda.Device(self.device).use()

    def copy_in(self, slot: int, buf: Any, off: int, n: int) -> None:
        dst = self.ptr + slot * self.address.slot_bytes
        self.rt.memcpyAsync(dst, buf.data.ptr + off, n, _DEVICE_TO_DEVICE, self.stream.ptr)
        self.rt.eventRecord(self.events[slot], self.stream.ptr)

    def copy_out(self, slot: int, buf: Any, off: int, n: int) -> None:
        src = self.ptr + slot * self.address.slot_bytes
        self.rt.streamWaitEvent(self.stream.ptr, self.events[slot], 0)
        self.rt.memcpyAsync(buf.data.ptr + off, src, n, _DEVICE_TO_DEVICE, self.stream.ptr)
        self.stream.synchronize()  # the slot may be written again once its credit is back

    def synchronize(self) -> None:
        self.stream.synchronize()

    def unlink(self) -> None:
        pass  # an IPC handle has no name to remove; the allocation is freed by close

    def close(self, owner: bool) -> None:
        if not self.ptr:
            return
        if owner:
            for e in self.events:
                self.rt.eventDestroy(e)
            self.rt.free(self.ptr)
        else:
            self.rt.ipcCloseMemHandle(self.ptr)
        self.ptr, self.events = 0, []


__all__ = ["KINDS", "RingAddress", "RingClosed", "RingLink", "ring_address", "ring_link"]
