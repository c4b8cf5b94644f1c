"""A test double of the data plane's scheduler (the real one is ppipe.dataplane's).

It lets runtime tests pin down the driver's contract independent of the data plane's
policy: requests wait up to ``window_us`` for a batch of ``max_batch`` (exercising WakeAt),
then go round robin over the live vGPUs of each partition of pipeline 0.
"""

from __future__ import annotations

from ppipe.dataplane.api import Dispatch, Drop, DropReason, Stage, WakeAt


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


# ---- fake links for the NCCL transport's protocol (NOT a GPU, NOT NCCL) ----------------------------------
# They move the bytes of ppipe.runtime.transport's messages through a queue, so that the
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
