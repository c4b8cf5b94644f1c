"""The scheduler's host reads time only from the clock it is given (``Runtime(clock_factory=...)``)."""

from __future__ import annotations

import asyncio
import functools

import numpy as np

from ppipe.runtime.clock import WallClock, wall_us
from ppipe.runtime.scheduler.host import Runtime
from ppipe.spec.cluster import load_cluster
from .conftest import make_plan
from .fakes import FakeWorker, FifoScheduler


class StampingClock(WallClock):
    """A wall clock whose timeline began an hour ago, and which keeps every wall stamp it gave."""

    def __init__(self, loop):
        super().__init__(loop, origin_wall_us=wall_us() - 3600e6)
        self.stamps: list[float] = []

    def wall_now_us(self) -> float:
        t = super().wall_now_us()
        self.stamps.append(t)
        return t


def test_the_host_runs_on_the_injected_clock_and_stamps_each_batch_with_it(tinynet):
    cluster = load_cluster("local-cpu")
    plan = make_plan(tinynet, cluster, [(0, 1, "cpu", 2, 1), (2, 2, "cpu", 2, 1)])
    workers = {p.vgpu_id: FakeWorker(p.vgpu_id) for p in plan.placement}
    rt = Runtime(plan, {"tinynet": tinynet}, cluster, workers, scheduler_factory=functools.partial(FifoScheduler, max_batch=1),
                 keep_traces=10, clock_factory=StampingClock)

    async def main():
        await rt.start()
        outs = [await rt.infer("tinynet", {"x": np.full(2, i, np.float32)}) for i in range(3)]
        await rt.stop()
        return outs

    outs = asyncio.run(main())
    assert [o["y"].tolist() for o in outs] == [[2 * i + 2] * 2 for i in range(3)]
    assert isinstance(rt.clock, StampingClock) and rt.scheduler.clock is rt.clock
    assert len(rt.clock.stamps) == 3  # one stage-0 message per batch, stamped by the clock
    # the traces are on the injected timeline (an hour in), not on one of the host's own
    assert all(3590e6 < t.dispatched_us < 3700e6 for t in rt.traces) and len(rt.traces) == 3
