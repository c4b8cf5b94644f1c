"""How feature maps go from worker i to worker i+1: NCCL between GPU workers, else the data path's connections.

Two transports, chosen per *edge* (an ordered pair of vGPUs of consecutive pools of one
pipeline, the sender upstream):

- ``tcp``: worker i sends its output to worker i+1 as stage i+1's message over the data
  path's TCP connections (:mod:`ppipe.runtime.wire.datapath`), host memory to host memory.
- ``nccl``: a dedicated two-rank NCCL communicator per edge (rank 0 the sender, rank 1 the
  receiver; :class:`cupy.cuda.nccl.NcclCommunicator`, its unique id made by the sender and
  handed to the receiver through Ray at start-up). At dispatch the frontend posts *both*
  calls at once: the sender's learns "send your output to peer P as message n of this
  edge", the receiver's "receive message n of this edge from peer P"; neither waits for
  the other's Ray call to finish, and the tensor never leaves the GPUs (fp16 device
  buffers, ``ncclSend``/``ncclRecv`` on the edge's own CUDA stream).

Why one communicator per edge rather than one per pipeline: a worker of pool j talks to
every worker of pools j-1 and j+1, and a receive blocks its CUDA stream until the matching
send arrives. On one shared communicator/stream a worker could queue "receive from A"
before "receive from B" while A is itself stuck behind a send to a third worker that waits
on B: a cycle. Separate communicators (each with its own stream and its own thread here)
make every edge independent; this is also what ``ray.util.collective`` does for p2p.

**Ordering.** NCCL matches sends and receives between two ranks in the order they are
posted and has no tags. The frontend numbers the messages of each edge at dispatch
(0, 1, 2, ...). A worker may run its batches in another order (a later batch can be
reserved into an earlier gap of its vGPU), so each side issues the messages of an edge in
number order: message n+1 waits until message n has been posted (:class:`EdgeChannel`).
Every message is a fixed-size header (JSON: batch id, message number, send time, and each
tensor's name, dtype and shape) followed by the tensors' bytes. The receiver learns the
peer and the message number from its dispatch, and the shapes from the header, because a
profile records the bytes of a cut, not the shapes of its tensors. A sender whose stage
fails still sends a header that says so (``error``), so the edge's numbering never stalls
and the receiver answers its stage with the upstream error instead of waiting forever. If a
worker dies, the frontend aborts the communicators of its edges on the surviving side
(:meth:`EdgeChannel.abort`), which releases a receive that would never complete.

**Plan switches.** A switch (:meth:`ppipe.runtime.scheduler.host.Runtime.prepare_switch`) chooses
the new plan's transports as at start-up; an NCCL edge between two workers it keeps keeps
its communicator and numbering, and every other NCCL edge opens a communicator of the
switch's own *generation* while the old plan serves (:func:`relink`). Both ends key an
edge by (peer, generation) and each message names its generation, because a vGPU that the
switch re-cuts keeps its id: a kept worker can send the old plan's last feature maps to
the old worker of that id and the new plan's first to the new one at once. The old plan's
edges are closed once its batches have ended.

Cost: every NCCL edge is a communicator with its own buffers on both GPUs (NCCL's
``NCCL_BUFFSIZE``, 4 MiB by default, per channel), and NCCL connects a pair on its first
message, so the first batch over an edge is slower. A plan of HC1-S scale has a few dozen
edges (e.g. 3 x 8 = 24 for rtmdet_x); a 100-GPU plan can have hundreds, which is when
``NCCL_BUFFSIZE`` is worth lowering.

Edges whose two vGPUs share one physical GPU (two MPS shares of one card in consecutive
pools) use the data path's connections: NCCL refuses two ranks on one device. With
``--transport ring`` (experimental) they go through a staging ring in the GPU's memory
instead (:mod:`ppipe.runtime.workers.ring_link`: ``ring-cuda``). Ring edges are numbered, opened,
kept and closed exactly as NCCL edges (:data:`LINKED`). ``ring-host``, the same ring in
shared memory, is slower than the data path's TCP on the hosts measured
(``scripts/bench_ring.py``), so no ``--transport`` chooses it; the tests put an edge on it
to run the whole path without a GPU.

Everything here except :class:`NcclLink` and :func:`nccl_capability` is plain Python and is
tested on the CPU with a fake link injected explicitly by the tests; CuPy is imported
lazily, only by those two.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Protocol

import numpy as np

from ppipe.errors import UserError

TRANSPORTS = ("auto", "tcp", "nccl", "ring")
SOCKET, NCCL = "tcp", "nccl"
RING_CUDA, RING_HOST = "ring-cuda", "ring-host"  # ppipe.runtime.workers.ring_link, kinds "cuda" and "host"
LINKED = (NCCL, RING_CUDA, RING_HOST)  # the transports whose edges are EdgeChannels over a Link
HEADER_BYTES = 4096  # one message header; a cut with dozens of named tensors still fits

Edge = tuple[str, str]  # (sender vGPU id, receiver vGPU id)


# ---- capability and selection (frontend side; pure) ----------------------------------------------------
@dataclass(frozen=True)
class Capability:
    """What one worker reports about NCCL (from :func:`nccl_capability` in its process).

    Attributes:
        nccl: the worker can send and receive device tensors over NCCL.
        reason: why not (empty when it can).
        device: the CUDA device the worker sees (``CUDA_VISIBLE_DEVICES``-relative), if any.
        gpu_resident: the backend runs on CUDA (its tensors can stay on the GPU).
    """

    nccl: bool
    reason: str = ""
    device: int | None = None
    gpu_resident: bool = False


def nccl_capability(backend_name: str, gpu: str, gpu_resident: bool) -> Capability:
    """Can this worker process use NCCL? Checked in the worker (its node, its GPU).

    Args:
        backend_name: the worker's backend (``tensorrt``, ``ort``, ``emulated``).
        gpu: the partition's GPU type (``cpu`` for CPU pools).
        gpu_resident: whether the backend runs on CUDA (TensorRT, or onnxruntime whose
            session uses the CUDA execution provider).
    """
    if gpu == "cpu":
        return Capability(False, "the pool runs on CPUs")
    if backend_name == "emulated":
        return Capability(False, "emulated workers have no GPU tensors")
    if not gpu_resident:
        return Capability(False, f"the {backend_name} backend does not run on CUDA here (onnxruntime without the CUDA execution provider?)")
    try:
        import cupy
        from cupy.cuda import nccl  # noqa: F401  (absent when CuPy was built without NCCL)
    except ImportError as exc:
        return Capability(False, f"CuPy with NCCL is not importable ({exc})", gpu_resident=True)
    try:
        n = cupy.cuda.runtime.getDeviceCount()
    except Exception as exc:  # CUDA driver missing or broken
        return Capability(False, f"no CUDA device ({exc})", gpu_resident=True)
    if n < 1:
        return Capability(False, "no CUDA device", gpu_resident=True)
    return Capability(True, "", cupy.cuda.runtime.getDevice(), gpu_resident=True)


def choose_edge(requested: str, up: Any, down: Any, cap_up: Capability, cap_down: Capability) -> tuple[str, str]:
    """The transport of one edge; returns ``(transport, reason)``.

    Args:
        requested: ``auto``, ``tcp``, ``nccl`` or ``ring`` (``ppipe serve --transport``;
            ``ring`` is ``auto`` plus a device ring between two shares of one GPU, which
            NCCL cannot connect).
        up, down: the sender's and receiver's :class:`~ppipe.runtime.workers.worker.WorkerSpec`.
        cap_up, cap_down: their capabilities.

    Raises:
        UserError: ``nccl`` was requested and one of the two workers cannot use it.
    """
    if requested not in TRANSPORTS:
        raise UserError(f"unknown transport '{requested}'", fix=f"use one of {', '.join(TRANSPORTS)}")
    if requested == SOCKET:
        return SOCKET, "requested"
    if requested == "ring" and up.server == down.server and up.gpu_index == down.gpu_index and cap_up.nccl and cap_down.nccl:
        return RING_CUDA, "both vGPUs share one GPU"
    for spec, cap in ((up, cap_up), (down, cap_down)):
        if not cap.nccl:
            if requested == NCCL:
                raise UserError(
                    f"--transport nccl: worker {spec.vgpu_id} ({spec.gpu}) cannot use NCCL: {cap.reason}",
                    fix="serve GPU pools with --backend tensorrt (or ort with the CUDA execution provider) and "
                    "`pip install 'ppipe[gpu]'` on the GPU servers, or use --transport auto / tcp",
                )
            return SOCKET, f"{spec.vgpu_id}: {cap.reason}"
    if up.server == down.server and up.gpu_index == down.gpu_index:
        # NCCL refuses a communicator with two ranks on one device; not a user error
        return SOCKET, "both vGPUs share one GPU (NCCL needs two devices)"
    return NCCL, ""


def pipeline_edges(specs: Iterable[Any]) -> list[Edge]:
    """Every (sender, receiver) pair of vGPUs in consecutive pools of one pipeline."""
    pools: dict[tuple[str, int, int], list[Any]] = {}
    for s in specs:
        pools.setdefault((s.model, s.pipeline, s.partition), []).append(s)
    edges = []
    for (model, pipeline, partition), ups in sorted(pools.items()):
        for u in ups:
            for d in pools.get((model, pipeline, partition + 1), []):
                edges.append((u.vgpu_id, d.vgpu_id))
    return edges


def select_transports(requested: str, specs: Iterable[Any], caps: dict[str, Capability]) -> dict[Edge, tuple[str, str]]:
    """Choose the transport of every edge of every pipeline (see :func:`choose_edge`)."""
    by_id = {s.vgpu_id: s for s in specs}
    return {e: choose_edge(requested, by_id[e[0]], by_id[e[1]], caps[e[0]], caps[e[1]]) for e in pipeline_edges(by_id.values())}


def relink(choice: dict[Edge, tuple[str, str]], kept: Iterable[str], current: dict[Edge, int], gen: int) -> dict[Edge, int]:
    """The linked edges of a new plan (NCCL or ring: :data:`LINKED`), each with its *generation* (which communicator carries it).

    An edge that the running plan sends over NCCL between two workers the new plan keeps
    keeps its communicator, its generation and its message numbering; every other edge that
    ``choice`` (:func:`select_transports` on the new plan) puts on NCCL opens a communicator
    of generation ``gen``, the plan switch's own, above every generation in use. Both ends
    key their channels by (peer, generation): a vGPU re-cut by the switch keeps its id, so
    a kept worker may hold an edge to the old worker of that id (finishing the old plan's
    batches) and one to the new worker at once.
    """
    keep = set(kept)
    return {e: current[e] if e in current and e[0] in keep and e[1] in keep else gen
            for e, (t, _) in choice.items() if t in LINKED}


# ---- the message header (pure) ---------------------------------------------------------------------------
@dataclass(frozen=True)
class Header:
    """What precedes a message's tensors on an NCCL edge."""

    batch_id: int
    seq: int
    sent_wall_us: float
    tensors: tuple[tuple[str, str, tuple[int, ...]], ...]  # (name, dtype, shape)
    error: str | None = None

    def nbytes(self) -> list[int]:
        return [int(np.prod(shape, dtype=np.int64)) * np.dtype(dt).itemsize for _, dt, shape in self.tensors]


def encode_header(h: Header) -> np.ndarray:
    """The header as ``HEADER_BYTES`` uint8 (UTF-8 JSON, zero padded)."""
    doc = {"b": h.batch_id, "n": h.seq, "t": h.sent_wall_us, "x": [[n, d, list(s)] for n, d, s in h.tensors]}
    if h.error is not None:
        doc["e"] = h.error[:512]
    raw = json.dumps(doc, separators=(",", ":")).encode()
    if len(raw) > HEADER_BYTES:
        raise ValueError(f"message header of {len(raw)} bytes exceeds {HEADER_BYTES} (too many tensors in one cut)")
    out = np.zeros(HEADER_BYTES, dtype=np.uint8)
    out[: len(raw)] = np.frombuffer(raw, dtype=np.uint8)
    return out


def decode_header(buf: np.ndarray) -> Header:
    raw = bytes(np.asarray(buf, dtype=np.uint8)).rstrip(b"\0")
    doc = json.loads(raw)
    return Header(doc["b"], doc["n"], doc["t"], tuple((n, d, tuple(s)) for n, d, s in doc["x"]), doc.get("e"))


class EdgeProtocolError(RuntimeError):
    """The two ends of an edge disagree (a bug, never a user error): refuse the batch."""


class UpstreamFailed(RuntimeError):
    """The sender of this edge failed its stage and said so instead of sending tensors."""


class EdgeAborted(RuntimeError):
    """The edge's communicator was aborted (its peer died)."""


# ---- links: the blocking p2p primitives of one edge ---------------------------------------------------------
class Link(Protocol):
    """One end of a two-rank communicator, as :class:`EdgeChannel` uses it.

    Calls block (they run on the edge's own thread). ``xp`` is the array module of the
    link's buffers (CuPy for :class:`NcclLink`; NumPy for the tests' fake).
    """

    xp: Any

    def send(self, buf: Any) -> None:
        """Queue a send of a contiguous uint8 buffer to the peer."""

    def recv(self, buf: Any) -> None:
        """Queue a receive from the peer into a contiguous uint8 buffer."""

    def synchronize(self) -> None:
        """Wait until every queued send/receive has completed."""

    # optional: ``activate()`` makes the link's CUDA device current on the calling thread
    # optional: ``stream``, a context manager (a CUDA stream) that send/recv are queued on;
    # the channel stages its buffers (header copy, fp16 cast) on it, so that they are
    # ordered before the send that reads them (see EdgeChannel._on_link_stream)

    def abort(self) -> None:
        """Tear the communicator down; blocked calls return with an error."""


class NcclLink:
    """A two-rank :class:`cupy.cuda.nccl.NcclCommunicator` with its own non-blocking stream.

    Args:
        unique_id: from :func:`nccl_unique_id` (made by the sender, rank 0).
        rank: 0 for the sender, 1 for the receiver; the peer is ``1 - rank``.

    The constructor blocks until both ranks have joined (``ncclCommInitRank``).
    """

    def __init__(self, unique_id: Any, rank: int):
        import cupy
        from cupy.cuda import nccl

        self.xp, self._nccl = cupy, nccl
        self.rank, self.peer = rank, 1 - rank
        self.device = cupy.cuda.runtime.getDevice()  # the caller's current device (the worker's GPU)
        self.stream = cupy.cuda.Stream(non_blocking=True)
        self.comm = nccl.NcclCommunicator(2, unique_id, rank)

    def activate(self) -> None:
        self.xp.cuda.Device(self.device).use()

    def send(self, buf: Any) -> None:
        self.comm.send(buf.data.ptr, buf.nbytes, self._nccl.NCCL_UINT8, self.peer, self.stream.ptr)

    def recv(self, buf: Any) -> None:
        self.comm.recv(buf.data.ptr, buf.nbytes, self._nccl.NCCL_UINT8, self.peer, self.stream.ptr)

    def synchronize(self) -> None:
        self.stream.synchronize()
        self.comm.check_async_error()

    def abort(self) -> None:
        self.comm.abort()


def nccl_unique_id() -> Any:
    """A fresh NCCL unique id (call it in the sender's process: it needs CUDA)."""
    from cupy.cuda import nccl

    return nccl.get_unique_id()


def nccl_link(unique_id: Any, rank: int) -> NcclLink:
    return NcclLink(unique_id, rank)


LinkFactory = Callable[[Any, int], Link]


# ---- the channel: numbering, header, tensors ------------------------------------------------------------------
class EdgeChannel:
    """One end of an edge: posts its messages in message-number order on the edge's thread.

    Args:
        link: the edge's communicator end.
        peer: the other vGPU's id (for messages).
        role: ``send`` (this worker is upstream) or ``recv``.
    """

    def __init__(self, link: Link, peer: str, role: str):
        if role not in ("send", "recv"):
            raise ValueError(f"role must be send or recv, not {role!r}")
        self.link, self.peer, self.role = link, peer, role
        self.xp = link.xp
        self.next_seq = 0
        self.aborted: str | None = None
        self._cond: asyncio.Condition | None = None
        # one thread per edge: blocking NCCL calls of one edge never hold up another edge,
        # and the FIFO of a single thread keeps the posting order the numbering decided
        self._thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"edge-{role}-{peer}")

    async def _turn(self, seq: int) -> None:
        if self._cond is None:
            self._cond = asyncio.Condition()
        async with self._cond:
            await self._cond.wait_for(lambda: self.next_seq >= seq or self.aborted is not None)
        if self.aborted is not None:
            raise EdgeAborted(f"edge with {self.peer} was aborted: {self.aborted}")
        if self.next_seq != seq:
            raise EdgeProtocolError(f"message {seq} with {self.peer} was posted twice (next is {self.next_seq})")

    async def _advance(self) -> None:
        async with self._cond:
            self.next_seq += 1
            self._cond.notify_all()

    async def send(self, seq: int, batch_id: int, tensors: dict[str, Any] | None, sent_wall_us: float, error: str | None = None) -> None:
        """Send message ``seq``: the batch's feature maps (fp16), or an error notice.

        Returns when the peer has the bytes (the buffers may then be freed).
        """
        await self._turn(seq)
        fut = asyncio.get_running_loop().run_in_executor(self._thread, self._send_sync, seq, batch_id, tensors, sent_wall_us, error)
        await self._advance()  # the thread's FIFO now holds the order: the next message may queue
        await self._finish(fut)

    async def _finish(self, fut: Any) -> Any:
        try:
            return await fut
        except Exception:
            if self.aborted is not None:
                raise EdgeAborted(f"edge with {self.peer} was aborted: {self.aborted}") from None
            raise

    def _send_sync(self, seq: int, batch_id: int, tensors: dict[str, Any] | None, sent_wall_us: float, error: str | None) -> None:
        """Stage the header and tensors on the link's stream, send them, wait until sent.

        Device tensors handed in must be complete (their producer synchronized its stream,
        as the backends do before they return). The copies and casts made here are queued
        on the link's stream, ahead of the sends that read them: with CuPy >= 13 a host to
        device ``asarray`` is asynchronous on the *current* stream, and the link's
        non-blocking stream would not wait for the default one.
        """
        self._activate()
        xp = self.xp
        with self._on_link_stream():
            bufs: list[Any] = []
            metas: list[tuple[str, str, tuple[int, ...]]] = []
            if error is None:
                for name, arr in (tensors or {}).items():
                    arr = xp.asarray(arr)
                    if arr.dtype.kind == "f" and arr.dtype != np.float16:
                        arr = arr.astype(np.float16)  # feature maps cross partitions as fp16
                    arr = xp.ascontiguousarray(arr)
                    metas.append((name, arr.dtype.str, tuple(int(d) for d in arr.shape)))
                    bufs.append(arr.reshape(-1).view(xp.uint8))
            self.link.send(xp.asarray(encode_header(Header(batch_id, seq, sent_wall_us, tuple(metas), error))))
            for b in bufs:
                if b.size:
                    self.link.send(b)
        self.link.synchronize()

    def _on_link_stream(self) -> Any:
        """The link's stream as the current stream (a no-op for links without one)."""
        stream = getattr(self.link, "stream", None)
        return stream if stream is not None else contextlib.nullcontext()

    def _activate(self) -> None:
        # CUDA's current device is per thread: make the link's device current on the edge's thread
        activate = getattr(self.link, "activate", None)
        if activate is not None:
            activate()

    async def recv(self, seq: int, batch_id: int) -> tuple[dict[str, Any], Header]:
        """Receive message ``seq`` of this edge; returns (device tensors by name, header).

        Raises:
            UpstreamFailed: the sender reported that its stage failed.
            EdgeProtocolError: the message is not the one the dispatch announced.
        """
        await self._turn(seq)
        fut = asyncio.get_running_loop().run_in_executor(self._thread, self._recv_sync)
        await self._advance()
        tensors, head = await self._finish(fut)
        if head.seq != seq or head.batch_id != batch_id:
            raise EdgeProtocolError(
                f"edge from {self.peer}: expected message {seq} of batch {batch_id}, got message {head.seq} of batch {head.batch_id}"
            )
        if head.error is not None:
            raise UpstreamFailed(f"the previous stage ({self.peer}) failed: {head.error}")
        return tensors, head

    def _recv_sync(self) -> tuple[dict[str, Any], Header]:
        self._activate()
        xp = self.xp
        # buffers come from CuPy's stream-ordered pool: take them on the stream that fills them
        with self._on_link_stream():
            hbuf = xp.empty(HEADER_BYTES, dtype=xp.uint8)
            self.link.recv(hbuf)
            self.link.synchronize()
            head = decode_header(xp.asnumpy(hbuf) if hasattr(xp, "asnumpy") else hbuf)
            out: dict[str, Any] = {}
            for (name, dt, shape), n in zip(head.tensors, head.nbytes()):
                buf = xp.empty(n, dtype=xp.uint8)
                if n:
                    self.link.recv(buf)
                out[name] = buf.view(np.dtype(dt)).reshape(shape)
        self.link.synchronize()  # the tensors are complete before any other stream reads them
        return out, head

    def abort(self, why: str) -> None:
        """Release everything waiting on this edge (its peer is gone)."""
        if self.aborted is not None:
            return
        self.aborted = why
        try:
            self.link.abort()
        finally:
            self._thread.shutdown(wait=False, cancel_futures=True)
            if self._cond is not None:
                cond = self._cond

                async def wake() -> None:
                    async with cond:
                        cond.notify_all()

                try:
                    asyncio.get_running_loop().create_task(wake())
                except RuntimeError:  # not on the loop: nothing is waiting there
                    pass
