"""Test doubles of the runtime tests: a scheduler, a worker, and fake NCCL links.

:class:`FifoScheduler` stands in for the data plane's scheduler, so that runtime tests pin
down the driver's contract independent of the data plane's policy: requests wait up to
``window_us`` for a batch of ``max_batch`` (exercising WakeAt), then go round robin over
the live vGPUs of each partition of pipeline 0. :class:`FakeWorker` is a vGPU worker
in-process: the real data path around a fake stage.
"""

from __future__ import annotations

import asyncio

from ppipe.dataplane.api import Dispatch, Drop, DropReason, Stage, WakeAt
from ppipe.runtime.clock import wall_us
from ppipe.runtime.launch.handle import WorkerGone
from ppipe.runtime.wire.messages import StageReport
from ppipe.runtime.workers.stage_server import StageResult, StageServer


class FifoScheduler:
    def __init__(self, plan, profiles, cluster, clock, policy="fifo", max_batch=4, window_us=2000.0, drop_all=False):
        self.plan, self.profiles, self.clock = plan, profiles, clock
        self.max_batch, self.window_us, self.drop_all = max_batch, window_us, drop_all
        self.queue: dict[str, list] = {m.name: [] for m in plan.models}
        self.failed: set[str] = set()
        self.reports = []
        self.dispatched: list[Dispatch] = []
        self.rr: dict[tuple, int] = {}
        self.next_batch = 0
        self.wakes = 0

    def submit(self, request):
        if self.drop_all:
            return [Drop(request, DropReason.DEADLINE_UNREACHABLE, "test scheduler drops everything")]
        q = self.queue[request.model]
        q.append(request)
        if len(q) >= self.max_batch:
            return self._flush(request.model)
        return [WakeAt(q[0].arrival_us + self.window_us)]

    def wake(self):
        self.wakes += 1
        out = []
        now = self.clock.now_us()
        for m, q in self.queue.items():
            if q and now >= q[0].arrival_us + self.window_us - 1:
                out += self._flush(m)
            elif q:
                out.append(WakeAt(q[0].arrival_us + self.window_us))
        return out

    def report(self, report):
        self.reports.append(report)
        return []

    def mark_failed(self, vgpu_id):
        self.failed.add(vgpu_id)
        return []

    def mark_recovered(self, vgpu_id):
        self.failed.discard(vgpu_id)
        return []

    def _flush(self, model):
        q = self.queue[model]
        reqs, self.queue[model] = tuple(q[: self.max_batch]), q[self.max_batch :]
        mp = self.plan.model(model)
        stages = []
        now = self.clock.now_us()
        for j, part in enumerate(mp.pipelines[0].partitions):
            live = [p for p in self.plan.placements_of(model, 0, j) if p.vgpu_id not in self.failed]
            if not live:
                return [Drop(r, DropReason.NO_PIPELINE, f"partition {j} has no live vGPU") for r in reqs]
            k = self.rr.get((model, j), 0)
            self.rr[(model, j)] = k + 1
            p = live[k % len(live)]
            stages.append(
                Stage(j, p.vgpu_id, p.server, part.first_block, part.last_block, None if j == 0 else now, 0.0, now, part.infer_us)
            )
        d = Dispatch(self.next_batch, model, 0, reqs, tuple(stages), ())
        self.next_batch += 1
        self.dispatched.append(d)
        out = [d]
        if self.queue[model]:
            out.append(WakeAt(self.queue[model][0].arrival_us + self.window_us))
        return out


# ---- a worker in-process ----------------------------------------------------------------------------------
class FakeWorker:
    """A :class:`~ppipe.runtime.launch.handle.WorkerHandle` in-process: the real data path
    (:class:`StageServer`, TCP on 127.0.0.1) around a fake stage (x + 1, then y = 2x).
    ``kill()`` stops it like a dead worker: its inbox closes and its lifeline raises
    :class:`WorkerGone`; ``die_on_next_stage`` kills it while it holds a batch; ``hold`` (an
    asyncio.Event) makes its stages wait for it. It records the edges it was told to drop
    (``dropped``) and close (``closed``), and ``killed``: how often ``kill()`` was called."""

    def __init__(self, vgpu_id, mailbox=None):
        self.vgpu_id, self.dead, self.die_on_next_stage = vgpu_id, False, False
        self.hold: asyncio.Event | None = None
        self.mailbox = {} if mailbox is None else mailbox  # (sender, receiver, gen, seq) -> future: a fake NCCL edge
        self.links, self.dropped, self.closed = [], [], []
        self.killed = 0
        self.server = StageServer(vgpu_id, self._run)
        self._gone: asyncio.Event | None = None
        self.secret: bytes | None = None  # the data-path secret it was opened with

    async def open_data_path(self, frontend, secret=None):
        if secret is not None and self.server.inbox is None:
            self.secret = secret
            self.server = StageServer(self.vgpu_id, self._run, secret)
        return self.server.open(frontend)

    async def connect_peers(self, peers):
        self.server.connect(peers)

    async def drop_peer(self, peer, gens=None):
        self.dropped.append(peer)
        return 1

    async def close_edges(self, edges):
        self.closed += edges
        return len(edges)

    async def lifeline(self):
        self._gone = self._gone or asyncio.Event()
        await self._gone.wait()
        raise WorkerGone(f"{self.vgpu_id} was killed")

    def kill(self):
        self.killed += 1
        self.dead = True
        self.server.close()
        self._gone = self._gone or asyncio.Event()
        self._gone.set()

    def _box(self, key):
        return self.mailbox.setdefault(key, asyncio.get_running_loop().create_future())

    async def _run(self, msg, tensors):
        k = msg.stage
        link = msg.links[k] if msg.links is not None else None
        self.links.append((msg.batch_id, link))
        if self.hold is not None:
            await self.hold.wait()
        if self.die_on_next_stage:
            self.kill()
            await asyncio.Event().wait()  # the stage never ends
        if link is not None and link.recv is not None:
            assert tensors is None  # nothing came through the frontend
            tensors = await self._box((link.recv.peer, self.vgpu_id, link.recv.gen, link.recv.seq))
        t = wall_us()
        rep = StageReport(msg.batch_id, k, self.vgpu_id, t, t + 1)
        v = next(iter(tensors.values()))  # the one input, whatever its name
        out = {"x": v + 1} if k + 1 < len(msg.route) else {"y": v * 2}
        if link is not None and link.send is not None:
            self._box((self.vgpu_id, link.send.peer, link.send.gen, link.send.seq)).set_result(out)
            return StageResult(rep, None, t + 1)
        return StageResult(rep, out, t + 1)


def close_workers(workers) -> None:
    """Close fake workers' data paths: the ``on_shutdown`` of an app that serves them, so that
    their sockets close on the server's loop, after the runtime, before the loop ends."""
    for w in workers:
        w.server.close()


# ---- fake links for the NCCL transport's protocol (NOT a GPU, NOT NCCL) ----------------------------------
# They move the bytes of ppipe.runtime.workers.transport's messages through a queue, so that the
# channel's numbering, header and error handling run on the CPU. Tests inject them
# explicitly (EdgeChannel(link, ...) or connect_edges(..., link_factory=...)); the real
# NcclLink is only exercised by the CUDA tests.
import queue as _queue
import threading as _threading

import numpy as _np


class QueueLink:
    """One end of an in-process fake link: ``send`` puts a copy of the bytes, ``recv`` takes one."""

    xp = _np

    def __init__(self, q_out, q_in):
        self.q_out, self.q_in = q_out, q_in
        self.aborted = _threading.Event()
        self.sent = 0

    def send(self, buf):
        self.q_out.put(bytes(_np.asarray(buf)))
        self.sent += 1

    def recv(self, buf):
        while True:
            if self.aborted.is_set():
                raise RuntimeError("fake link aborted")
            try:
                data = self.q_in.get(timeout=0.02)
                break
            except _queue.Empty:
                continue
        if len(data) != buf.nbytes:
            raise RuntimeError(f"fake link: message of {len(data)} bytes into a buffer of {buf.nbytes}")
        buf[:] = _np.frombuffer(data, dtype=_np.uint8)

    def synchronize(self):
        pass

    def abort(self):
        self.aborted.set()


def queue_link_pair():
    """(sender end, receiver end) of an in-process fake link."""
    q = _queue.Queue()
    return QueueLink(q, None), QueueLink(None, q)


class RayQueueLink(QueueLink):
    """A fake link between two Ray workers through a ``ray.util.queue.Queue`` actor (the
    'unique id' of the edge). A test double of the transport's protocol across processes."""

    def __init__(self, rq, rank):
        super().__init__(None, None)
        self.rq, self.rank = rq, rank

    def send(self, buf):
        self.rq.put(bytes(_np.asarray(buf)))
        self.sent += 1

    def recv(self, buf):
        from ray.util.queue import Empty

        while True:
            if self.aborted.is_set():
                raise RuntimeError("fake link aborted")
            try:
                data = self.rq.get(timeout=0.05)
                break
            except Empty:
                continue
        buf[:] = _np.frombuffer(data, dtype=_np.uint8)


def ray_queue_link(unique_id, rank):
    return RayQueueLink(unique_id, rank)
