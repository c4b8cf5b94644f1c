"""One worker per vGPU: runs its partition; feature maps go worker to worker.

A worker is a Ray actor (:func:`ppipe.runtime.launch.ray_workers.actor_class`: Ray places it by custom resources, starts it
and tells the frontend when it dies) or, for tests and rehearsals on one host, an object in
the frontend's own process (:mod:`ppipe.runtime.launch.inproc`); the code is the same. The
batches themselves come over the data path (:mod:`ppipe.runtime.wire.datapath`): the
worker's inbox receives a stage message (the batch's tensors, the reserved route and its
workers' addresses), :meth:`VgpuWorker.run_stage` waits for the reserved start and runs the
partition, and the output goes straight to the next stage's worker while a small report
(when the stage really ran, in wall-clock stamps) goes to the frontend. The last stage's
report carries the model's outputs. Between GPU workers that can, the feature maps go over
NCCL instead (:mod:`ppipe.runtime.workers.transport`: the frontend posts both stages of an edge
at once, the sender's "send your output to P as message n", the receiver's "receive
message n from P"). Feature maps are cast to fp16 before they leave a worker.

The actor is asynchronous so that its control calls (``ping``, ``lifeline``) answer while a
batch runs; an asyncio lock makes batches on one vGPU run one at a time, in arrival order.
Every stamp of a report and every wait before a stage is read from the worker's clock
(:mod:`ppipe.runtime.workers.stage_clock`; the wall clock unless one is given).
"""

from __future__ import annotations

import asyncio
import os
import sys
from dataclasses import dataclass
from typing import Any, Callable

import numpy as np

from ppipe.errors import UserError
from ppipe.runtime.wire.handoff import check_seals
from ppipe.runtime.wire.messages import EdgeRef, StageMsg, StageReport
from ppipe.runtime.workers.stage_clock import WALL_CLOCK, StageClock
from ppipe.runtime.workers.stage_server import StageResult, StageServer

DATA_LOOPS = ("own-thread", "current")
"""Where a worker serves its data path (:class:`VgpuWorker`'s ``data_loop``)."""


@dataclass(frozen=True)
class WorkerSpec:
    """What one vGPU worker runs (from the plan's placement)."""

    vgpu_id: str
    server: str
    gpu_index: int
    model: str
    pipeline: int
    partition: int
    first_block: int
    last_block: int
    gpu: str
    vgpu: int
    profile: str  # plan.yaml-style reference (ppipe.spec.profile.profile_ref)
    batch: int = 1  # the pipeline's planned batch (TensorRT tunes its engines for it)


def to_wire(tensors: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """Feature maps cross partitions as fp16 (floating tensors only; integers unchanged)."""
    return {k: (v.astype(np.float16) if v.dtype.kind == "f" and v.dtype != np.float16 else v) for k, v in tensors.items()}


def pin_cuda_env(env: dict[str, str]) -> None:
    """Set the worker's GPU (``CUDA_VISIBLE_DEVICES``) and MPS share in its own process.

    Deploy also passes them through Ray's ``runtime_env``, but the workers run with
    ``num_gpus=0`` and Ray releases before 2.60 overwrite ``CUDA_VISIBLE_DEVICES`` for such
    actors. Setting them here, first thing in the actor, holds whatever Ray did, provided
    CUDA was not initialized yet (CUDA reads them once, at initialization).

    Raises:
        RuntimeError: CUDA is already initialized in this process (through torch) with
            another device: the pin would be silently ignored.
    """
    changed = {k: v for k, v in env.items() if os.environ.get(k) != v}
    if not changed:
        return
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_initialized():
        raise RuntimeError(f"CUDA is already initialized in this worker; cannot apply {changed} (import order bug)")
    os.environ.update(changed)


def check_gpu_sharing(spec: WorkerSpec, gpu_resident: bool, provenance: str, mps_running: Callable[[], bool]) -> None:
    """Refuse a GPU worker of level v > 1 that would share its GPU otherwise than its profile says.

    A level-v latency in a profile is a 1/v MPS share of the GPU (the PPipe artifact's,
    ``ppipe profile`` under an MPS daemon, and the roofline, whose constants are fitted on
    such timings), unless its provenance says the v processes were time-sliced. Without an
    MPS control daemon the GPU runs the v workers' contexts in turns, which is much slower
    per worker than an MPS share (measured: ``docs/measurements/h100-2026-11-27``), and
    every stage would overrun the plan. Workers off the GPU, at level 1, or profiled
    time-sliced are not checked.

    Raises:
        UserError: the profile expects MPS shares and ``mps_running()`` is false.
    """
    if not gpu_resident or spec.vgpu == 1 or "time-sliced" in provenance or mps_running():
        return
    raise UserError(
        f"vGPU {spec.vgpu_id} is a 1/{spec.vgpu} MPS share of a {spec.gpu} in the plan, as its profile was measured, "
        "and no MPS control daemon runs on its server: its workers would take turns on the whole GPU instead",
        fix="start the daemon on every GPU server (`nvidia-cuda-mps-control -d`, as the user that runs Ray) before "
        "`ppipe serve`, or plan with a profile measured time-sliced",
    )


class VgpuWorker:
    """The body of a vGPU worker: a Ray actor's (:class:`~ppipe.runtime.launch.ray_workers.VgpuActor`, started by
    :mod:`ppipe.runtime.launch.deploy`) or an in-process one's (:mod:`ppipe.runtime.launch.inproc`).

    It leaves its process alone (environment, priority): that is the Ray actor's, whose
    process it is.

    Args:
        spec: the vGPU and the partition it runs.
        backend: ``ort``, ``tensorrt``, ``torch`` or ``emulated``.
        backend_options: passed to :func:`ppipe.runtime.workers.backends.make_backend`.
        clock: the stamps and waits of its stages (:class:`~ppipe.runtime.workers.stage_clock.StageClock`),
            also the emulated backend's sleeps; None: the wall clock.
        data_loop: where the data path is served: ``own-thread``, an event loop on a thread
            of its own (a Ray actor: see :meth:`open_data_path`), or ``current``, the loop
            that calls :meth:`open_data_path` (an in-process worker beside the frontend).
    """

    def __init__(self, spec: WorkerSpec, backend: str, backend_options: dict[str, Any] | None = None, *,
                 clock: StageClock | None = None, data_loop: str = "own-thread"):
        from ppipe.runtime.workers.backends import make_backend
        from ppipe.spec.profile import load_profile_ref

        if data_loop not in DATA_LOOPS:
            raise ValueError(f"data_loop must be one of {', '.join(DATA_LOOPS)}, got {data_loop!r}")
        self.spec, self.clock, self.data_loop = spec, clock or WALL_CLOCK, data_loop
        profile = load_profile_ref(spec.profile)
        opts = {"opt_batch": spec.batch, **{k: v for k, v in (backend_options or {}).items() if k != "emulate_network"}}
        self.backend = make_backend(backend, profile, spec.gpu, spec.vgpu, spec.first_block, spec.last_block, clock=self.clock, **opts)
        from ppipe.profiler.trt_backend import mps_available

        check_gpu_sharing(spec, bool(getattr(self.backend, "gpu_resident", False)), profile.manifest.provenance.get(spec.gpu, ""), mps_available)
        # the emulated backend rehearses a cluster: feature maps take the planned NIC time
        self.emulate_network = backend == "emulated" and bool((backend_options or {}).get("emulate_network", True))
        # the map it sends the next stage at its planned batch (None: the last partition sends none)
        last = spec.last_block + 1 >= len(profile.manifest.blocks)
        per_sample = profile.cut_bytes(spec.last_block)
        cap = getattr(self.backend, "max_bytes_per_sample", None)  # the emulated backend's cap on its maps
        self.map_bytes = None if last else (per_sample if cap is None else min(per_sample, cap)) * spec.batch
        self._starts_itself = bool(getattr(self.backend, "starts_itself", False))  # (read once: every stage asks)
        self._lock: asyncio.Lock | None = None
        self.batches = 0
        # (send|recv, peer vGPU, generation) -> EdgeChannel; a plan switch opens its new edges
        # as a new generation, so an edge to a re-cut vGPU of the same id never meets the old one's
        self.channels: dict[tuple[str, str, int], Any] = {}
        self.data_path: Any = None  # the StageServer, once the frontend opens the data path
        self._data_loop: asyncio.AbstractEventLoop | None = None
        self._node: str | None = None

    async def ping(self) -> dict[str, Any]:
        """Liveness probe; also tells where the worker runs."""
        return {
            "vgpu_id": self.spec.vgpu_id,
            "node_id": self._node_id(),
            "pid": os.getpid(),
            "batches": self.batches,
            "cuda_visible_devices": os.environ.get("CUDA_VISIBLE_DEVICES"),
            "mps_thread_percentage": os.environ.get("CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"),
            "nice": os.getpriority(os.PRIO_PROCESS, 0) if hasattr(os, "getpriority") else 0,
            # NCCL edges and how many messages each has carried
            "edges": {f"{role}:{peer}" + (f"@{gen}" if gen else ""): ch.next_seq for (role, peer, gen), ch in self.channels.items()},
        }

    # ---- data path (see ppipe.runtime.wire.datapath) ------------------------------------------------------
    async def open_data_path(self, frontend: str, secret: bytes | None = None) -> str:
        """Bind this worker's inbox and connect to the frontend's; returns the inbox's address.

        ``secret``: the server's data-path secret (see :class:`StageServer`); a later call
        (the frontend's re-opening after a plan switch) keeps the first one's.

        With ``data_loop="own-thread"`` the data path runs on an event loop of its own, on
        its own thread (uvloop where it is installed), not on the loop Ray runs the actor's
        methods on: stages then pay only for their own work, not for Ray's tracing wrappers
        and wake-ups (measured here: about half the worker's CPU per stage). With
        ``current`` it runs on the calling loop, which an in-process worker shares with the
        frontend (no thread, no hop between loops).
        """
        def open_() -> str:
            if self.data_path is None:
                self.data_path = StageServer(self.spec.vgpu_id, self.run_stage, secret)
            return self.data_path.open(frontend)

        return await self._on_data_loop(open_)

    async def connect_peers(self, peers: list[str]) -> None:
        """Connect to the next stage's workers (by data-path address) before the first batch,
        and write ahead the shared-memory slots its maps to them go in
        (:meth:`~ppipe.runtime.wire.handoff.MapHandoff.prefault`), whose pages a first map
        would otherwise fault in one by one on its way."""
        def connect() -> None:
            self.data_path.connect(peers)
            if self.map_bytes and self.data_path.handoff is not None:
                self.data_path.handoff.prefault(self.map_bytes)

        await self._on_data_loop(connect)

    async def _on_data_loop(self, fn: Any) -> Any:
        """Run ``fn()`` on the data path's loop (its own started on first use) and return its result."""
        if self.data_loop == "current":
            return fn()
        if self._data_loop is None:
            self._data_loop = _start_loop_thread(f"ppipe-data-{self.spec.vgpu_id}")

        async def call() -> Any:
            return fn()

        return await asyncio.wrap_future(asyncio.run_coroutine_threadsafe(call(), self._data_loop))

    async def lifeline(self) -> None:
        """Never returns: the frontend awaits it, and Ray fails the call when this actor dies."""
        await asyncio.Event().wait()

    def close_data_path(self) -> None:
        """Close the data path as a dying process would: the inbox and its connections, the
        connections to peers, the stages in flight and the edges; then stop the data path's
        own loop, if it has one. Call it on the loop that serves the data path where that
        is the caller's (``data_loop="current"``); from any thread otherwise."""
        server, self.data_path = self.data_path, None
        loop, self._data_loop = self._data_loop, None

        def close() -> None:
            if server is not None:
                server.close()
            for key in list(self.channels):
                self.channels.pop(key).abort(f"{self.spec.vgpu_id} closed")
            if loop is not None:
                loop.stop()

        if loop is None:
            close()
        else:
            loop.call_soon_threadsafe(close)

    # ---- transport (NCCL edges; see ppipe.runtime.workers.transport) -------------------------------------
    async def transport_caps(self) -> dict[str, Any]:
        """Whether this worker can use NCCL (checked here: its node, its GPU, its backend)."""
        from dataclasses import asdict

        from ppipe.runtime.workers.transport import nccl_capability

        cap = nccl_capability(self.backend.name, self.spec.gpu, bool(getattr(self.backend, "gpu_resident", False)))
        return asdict(cap)

    async def nccl_unique_id(self) -> Any:
        """A fresh NCCL unique id, made here (the sender of an edge makes its edge's id)."""
        from ppipe.runtime.workers.transport import nccl_unique_id

        return nccl_unique_id()

    async def ring_address(self, kind: str) -> Any:
        """A fresh meeting point for a ring edge, made here (the sender of an edge owns its ring)."""
        from ppipe.runtime.workers.ring_link import ring_address

        return ring_address(kind)

    async def connect(self, peer: str, unique_id: Any, rank: int, link_factory: Any = None, gen: int = 0) -> str:
        """Join the two-rank communicator of the edge with ``peer`` (rank 0: this worker sends),
        of generation ``gen`` (0: opened at start-up; n: by the plan switch that opened it).

        Blocks (on a thread of its own) until the peer joins too, so the frontend posts
        both ends at once. ``link_factory(unique_id, rank)`` makes the link: NCCL by default,
        :func:`~ppipe.runtime.workers.ring_link.ring_link` for a ring edge (its address as the id), a fake in tests.
        """
        from concurrent.futures import ThreadPoolExecutor

        from ppipe.runtime.workers.transport import EdgeChannel, nccl_link

        factory = link_factory or nccl_link
        with ThreadPoolExecutor(max_workers=1) as pool:  # init blocks; never on a shared pool
            link = await asyncio.get_running_loop().run_in_executor(pool, factory, unique_id, rank)
        role = "send" if rank == 0 else "recv"
        self.channels[(role, peer, gen)] = EdgeChannel(link, peer, role)
        return role

    async def drop_peer(self, peer: str, gens: list[int] | None = None) -> int:
        """``peer`` died: abort the edges with it (releases a receive that would never end);
        ``gens``: only the edges of these generations (None: all).

        On the data path's loop when it runs, where the edges' stages wait."""
        return await self._abort_edges([(p, g) for (_, p, g) in self.channels if p == peer and (gens is None or g in gens)],
                                       f"{peer} failed")

    async def close_edges(self, edges: list[tuple[str, int]]) -> int:
        """Tear down the edges ``(peer, generation)`` an earlier plan used, once its batches
        have ended (a plan switch that did not keep them); frees their NCCL buffers."""
        return await self._abort_edges([(p, g) for p, g in edges], "closed: an earlier plan's edge")

    async def _abort_edges(self, edges: list[tuple[str, int]], why: str) -> int:
        wanted = set(edges)

        def abort() -> int:
            keys = [k for k in self.channels if (k[1], k[2]) in wanted]
            for k in keys:
                self.channels.pop(k).abort(why)
            return len(keys)

        return abort() if self._data_loop is None else await self._on_data_loop(abort)

    @staticmethod
    def _key(role: str, edge: EdgeRef) -> tuple[str, str, int]:
        """The channel key of a stage's edge."""
        return role, edge.peer, edge.gen

    def _channel(self, role: str, edge: EdgeRef):
        ch = self.channels.get(self._key(role, edge))
        if ch is None:
            raise RuntimeError(f"{self.spec.vgpu_id} has no NCCL edge to {role} {'to' if role == 'send' else 'from'} "
                               f"{edge.peer} (generation {edge.gen})")
        return ch

    # ---- stages ----------------------------------------------------------------------------------------------
    async def run_stage(self, msg: StageMsg, tensors: dict[str, Any] | None) -> StageResult:
        """Run stage ``msg.stage`` of a batch (the data path calls it per stage message).

        ``tensors`` are the batch's inputs (first stage) or the previous stage's fp16
        output; with an NCCL or ring ``recv`` edge they come over the edge instead and
        ``tensors`` is None. A stage does not start before its reserved start (as in the
        simulator): running a batch early could push an earlier-reserved batch, whose data
        is still on its way, past its slot. With ``emulate_network`` (emulated backend), a
        feature map from another stage also "arrives" no sooner than ``max(sent,
        transfer_start) + transfer_us`` of its reservation.

        Returns the stage's report (wall-clock ``start_us``/``end_us``, ``received_us``
        when the message arrived and, after the first stage, the transfer's stamps) and
        its output: to the next stage as fp16 feature maps, the model's outputs after the
        last stage, None when they went over a ``send`` edge.
        """
        received = self.clock.now_us()
        k = msg.stage
        link = msg.links[k] if msg.links is not None else None
        send, recv = (link.send, link.recv) if link is not None else (None, None)
        sent = recv_posted = False
        try:
            if msg.route[k] != self.spec.vgpu_id:
                raise RuntimeError(f"batch {msg.batch_id} stage {k} is for {msg.route[k]}, not {self.spec.vgpu_id}")
            recv_posted = recv is not None
            tensors, xfer, not_before = await self._stage_input(msg, tensors, recv, received)
            begin = max(not_before, msg.timing[k].start_us)
            outputs, start, end = await self._run_partition(tensors, msg.batch, begin, device_out=send is not None)
            if msg.seals:
                check_seals(msg.seals)  # its input map was not reused while it ran
            self.batches += 1
            report = StageReport(msg.batch_id, k, self.spec.vgpu_id, start, end, xfer[0], xfer[1], received, self._node_id())
            if send is not None:
                # the report waits for the send too: the frontend hears of this stage once its
                # output has left (the receiver's report has the transfer's stamps)
                await self._channel("send", send).send(send.seq, msg.batch_id, outputs, end)
                sent = True
                return StageResult(report, None, end)
            if k + 1 == len(msg.route):
                return StageResult(report, outputs, end)  # the model's outputs ride in the report
            return StageResult(report, to_wire(outputs), end)
        except BaseException as exc:
            await self._keep_edges_numbered(msg.batch_id, recv if not recv_posted else None, send if not sent else None, exc)
            raise

    async def _stage_input(self, msg: StageMsg, tensors: dict[str, Any] | None, recv: EdgeRef | None,
                           received: float) -> tuple[dict[str, Any], tuple[float | None, float | None], float]:
        """The stage's input tensors, its transfer's (start, end) in wall-clock us (None, None
        on the first stage), and the earliest time the stage may start (its input is here)."""
        k = msg.stage
        if recv is not None:
            tensors, head = await self._channel("recv", recv).recv(recv.seq, msg.batch_id)
            xfer = (head.sent_wall_us, self.clock.now_us())
            if not getattr(self.backend, "accepts_device", False):
                tensors = {name: _to_host(v) for name, v in tensors.items()}
            return tensors, xfer, xfer[1]
        if tensors is None:
            raise RuntimeError(f"batch {msg.batch_id} stage {k} came without tensors and without an edge to receive them from")
        if k == 0:
            return tensors, (None, None), received
        xfer, not_before = (msg.sent_us, received), received
        reserved = msg.timing[k]
        if self.emulate_network and reserved.transfer_us > 0 and msg.sent_us is not None:
            begin = max(msg.sent_us, reserved.transfer_start_us if reserved.transfer_start_us is not None else msg.sent_us)
            xfer = (begin, begin + reserved.transfer_us)
            not_before = max(not_before, xfer[1])
        return tensors, xfer, not_before

    async def _run_partition(self, tensors: dict[str, Any], batch: int, begin_us: float,
                             device_out: bool) -> tuple[dict[str, Any], float, float]:
        """Run the partition on the vGPU from ``begin_us`` on, one batch at a time; ``(outputs,
        start, end)``. ``device_out``: keep the outputs on the GPU (for an NCCL edge) where the
        backend can.

        The wait for ``begin_us`` comes before the vGPU's lock, so a batch reserved earlier
        whose input comes later still goes first. A backend that starts itself (the emulated
        one) takes the wait's last millisecond into its own: the worker waits on the loop's
        timer alone, and the backend's one precise wait ends at ``begin_us`` plus its latency.
        """
        if self._lock is None:
            self._lock = asyncio.Lock()
        await (self.clock.sleep_near(begin_us) if self._starts_itself else self.clock.sleep_until(begin_us))
        async with self._lock:
            start = self.clock.now_us()
            if self._starts_itself:
                start = max(start, begin_us)
                outputs = await self.backend.run(tensors, batch, start_us=start)
            elif device_out and getattr(self.backend, "device_outputs", False):
                outputs = await self.backend.run(tensors, batch, device_out=True)
            else:
                outputs = await self.backend.run(tensors, batch)
            return outputs, start, self.clock.now_us()

    async def _keep_edges_numbered(self, batch_id: int, recv: EdgeRef | None, send: EdgeRef | None, exc: BaseException) -> None:
        """A stage failed: take its message off its ``recv`` edge anyway (the sender posts it
        whatever happens here, and the edge's later messages queue behind it) and send an
        error on its ``send`` edge (the receiver learns why nothing comes, and the edge's
        numbering goes on). Either edge may be aborted already: the peer fails either way."""
        if recv is not None and self._key("recv", recv) in self.channels:
            try:
                await self.channels[self._key("recv", recv)].recv(recv.seq, batch_id)
            except Exception:
                pass
        if send is not None:
            try:
                await self._channel("send", send).send(send.seq, batch_id, None, self.clock.now_us(), error=f"{type(exc).__name__}: {exc}")
            except Exception:
                pass

    def _node_id(self) -> str | None:
        """The node this worker runs on, as its launcher names nodes (None: not named, an
        in-process worker); a Ray actor's is its Ray node."""
        return self._node


def undo_ray_niceness() -> int:
    """Run at the driver's priority; returns the process's niceness afterwards.

    Ray starts worker processes at niceness 15 (its ``worker_niceness``), which suits batch
    jobs. A vGPU worker is on the latency path of every request it serves: at niceness 15
    every busier process on its host (the frontend, Ray's daemons, anything else) takes the
    CPU first, and its timed wake-ups (reserved starts, emulated latencies) slip. Lowering
    niceness needs privileges (root or RLIMIT_NICE); without them the worker stays as Ray
    made it.
    """
    if not hasattr(os, "getpriority"):
        return 0
    try:
        if os.getpriority(os.PRIO_PROCESS, 0) > 0:
            os.setpriority(os.PRIO_PROCESS, 0, 0)
    except OSError:
        pass
    return os.getpriority(os.PRIO_PROCESS, 0)


def _start_loop_thread(name: str) -> asyncio.AbstractEventLoop:
    """A new event loop (uvloop's where installed) running on a daemon thread until stopped
    (then closed)."""
    import threading

    try:
        import uvloop

        loop = uvloop.new_event_loop()
    except ImportError:
        loop = asyncio.new_event_loop()

    def run() -> None:
        try:
            loop.run_forever()
        finally:
            loop.close()

    threading.Thread(target=run, name=name, daemon=True).start()
    return loop


def _to_host(arr: Any) -> np.ndarray:
    """A device (CuPy) array as NumPy; NumPy arrays pass through."""
    get = getattr(arr, "get", None)
    return arr if isinstance(arr, np.ndarray) or get is None else get()
