"""The in-process launcher (ppipe.runtime.launch.inproc): a plan served on one loop, no Ray.

Emulated workers in this process behind InprocWorkerHandle, the real data plane's scheduler
in the Runtime, the frontend under httpx's ASGI transport. Also the worker's injected clock
(its stage reports are stamped with it) and its data path on the caller's loop.
"""

from __future__ import annotations

import asyncio
import functools
import json
import subprocess
import sys
import textwrap
import threading
from pathlib import Path

import numpy as np
import pytest

from ppipe.runtime.ingress.protocol import decode_infer_response, encode_infer_request
from ppipe.runtime.launch.deploy import load_deployment
from ppipe.runtime.launch.handle import WorkerGone
from ppipe.runtime.launch.inproc import InprocWorkerHandle, inproc_serve, start_inproc_workers
from ppipe.runtime.wire.messages import Reservation, StageMsg
from ppipe.runtime.workers.worker import VgpuWorker, WorkerSpec
from ppipe.spec.cluster import load_cluster
from ppipe.spec.profile import profile_ref

from .conftest import THREE_CPUS, make_plan
from .fakes import FifoScheduler
from .tinynet import write_tinynet

# the test double of the scheduler (as test_serve_local's): batches at once, round robin;
# the data plane's own scheduler waits for a lone request's last moment, which a loaded
# host's timers miss now and then
FIFO = dict(scheduler_factory=functools.partial(FifoScheduler, max_batch=4, window_us=2000.0))


class JumpClock:
    """A worker clock that jumps to the time each wait asks for (after yielding once to the loop)."""

    def __init__(self, t_us: float):
        self.t_us = t_us
        self.waits: list[float] = []  # every wait's time
        self.near: list[float] = []  # those of the waits on the loop's timer alone

    def now_us(self) -> float:
        return self.t_us

    async def sleep_until(self, t_us: float) -> None:
        self.waits.append(t_us)
        await asyncio.sleep(0)
        self.t_us = max(self.t_us, t_us)

    async def sleep_near(self, t_us: float) -> None:  # to the time exactly: this clock has no timer error
        self.near.append(t_us)
        await self.sleep_until(t_us)


def _spec(prof, vgpu_id: str, partition: int, first: int, last: int) -> WorkerSpec:
    return WorkerSpec(vgpu_id, "localhost", 0, prof.name, 0, partition, first, last, "cpu", 1, profile_ref(prof))


def test_a_stage_is_stamped_and_waits_on_the_workers_clock(tinynet):
    clock = JumpClock(1e15)
    first = VgpuWorker(_spec(tinynet, "v0", 0, 0, 1), "emulated", clock=clock, data_loop="current")
    second = VgpuWorker(_spec(tinynet, "v1", 1, 2, 2), "emulated", clock=clock, data_loop="current")
    t0 = clock.t_us
    timing = (Reservation(None, 0.0, t0 + 5000.0, t0 + 6000.0), Reservation(t0 + 7000.0, 250.0, t0 + 8000.0, t0 + 9000.0))
    msg = StageMsg(7, 0, ("v0", "v1"), ("tcp://a:1", "tcp://b:1"), 2, timing)
    x = np.zeros((2, 3, 8, 8), np.float32)

    async def main():
        one = await first.run_stage(msg, {"input": x})
        received = clock.t_us
        two = await second.run_stage(StageMsg(7, 1, msg.route, msg.addresses, 2, timing, sent_us=one.sent_us), one.tensors)
        return one, received, two

    one, received, two = asyncio.run(main())
    r0, r1 = one.report, two.report
    assert (r0.received_us, r0.start_us) == (t0, t0 + 5000.0)  # waited for the reserved start, on the clock
    assert r0.end_us == r0.start_us + first.backend.latency_us(2) and one.sent_us == r0.end_us
    assert r0.node_id is None  # no Ray in this process
    # the next stage's emulated transfer begins at its reserved start, lasts its reservation,
    # and the stage starts at its reserved start; every stamp is the clock's
    assert r1.received_us == received
    assert (r1.transfer_start_us, r1.transfer_end_us) == (t0 + 7000.0, t0 + 7250.0)
    assert (r1.start_us, r1.end_us) == (t0 + 8000.0, t0 + 8000.0 + second.backend.latency_us(2))
    assert two.tensors["logits"].shape == (2, 5)
    # the emulated backend starts itself: the worker waits on the loop's timer alone, and one
    # precise wait spans the rest of the wait for the start and the inference
    assert clock.near[0] == clock.waits[0] == t0 + 5000.0 and clock.waits[1] == r0.end_us


def test_a_worker_serves_its_data_path_on_the_callers_loop_with_no_thread(tinynet):
    with pytest.raises(ValueError, match="data_loop"):
        VgpuWorker(_spec(tinynet, "v0", 0, 0, 2), "emulated", data_loop="elsewhere")
    worker = VgpuWorker(_spec(tinynet, "v0", 0, 0, 2), "emulated", data_loop="current")

    async def main():
        before = {t.name for t in threading.enumerate()}
        addr = await worker.open_data_path("tcp://127.0.0.1:9")
        after = {t.name for t in threading.enumerate()}
        worker.close_data_path()
        return addr, after - before

    addr, new_threads = asyncio.run(main())
    assert addr.startswith("tcp://127.0.0.1:") and not [n for n in new_threads if n.startswith("ppipe-data")]
    assert worker.data_path is None


def test_a_killed_handle_ends_its_lifeline_and_refuses_calls(tinynet):
    handle = InprocWorkerHandle(VgpuWorker(_spec(tinynet, "v0", 0, 0, 2), "emulated", data_loop="current"))

    async def main():
        await handle.open_data_path("tcp://127.0.0.1:9")
        life = asyncio.ensure_future(handle.lifeline())
        await asyncio.sleep(0.01)
        assert not life.done()
        await asyncio.to_thread(handle.kill)  # from another thread: handed to the worker's loop
        with pytest.raises(WorkerGone):
            await asyncio.wait_for(life, 1)
        handle.kill()  # again: nothing
        with pytest.raises(WorkerGone):
            await handle.connect_peers([])

    asyncio.run(main())
    assert handle.gone and handle.worker.data_path is None


# ---- a plan served in process -----------------------------------------------------------------------------
@pytest.fixture(scope="module")
def two_stage(tinynet, tmp_path_factory):
    plan = make_plan(tinynet, load_cluster("local-cpu"), [(0, 1, "cpu", 2, 1), (2, 2, "cpu", 2, 1)])
    path = tmp_path_factory.mktemp("inproc") / "plan.yaml"
    plan.save(path)
    return load_deployment(path)


def test_start_inproc_workers_builds_one_worker_per_vgpu_on_the_callers_loop(two_stage):
    workers = start_inproc_workers(two_stage)
    assert sorted(workers) == sorted(p.vgpu_id for p in two_stage.plan.placement)
    assert all(h.worker.data_loop == "current" and h.worker.backend.name == "emulated" for h in workers.values())


def test_requests_are_answered_with_the_models_shapes(two_stage):
    async def main():
        async with inproc_serve(two_stage, http=True, keep_traces=100, **FIFO) as s:
            codes, shapes = [], []
            for i, n in enumerate([1, 3, 1, 2]):
                body, headers = encode_infer_request({"input": np.zeros((n, 3, 8, 8), np.float32)}, binary=bool(i % 2))
                r = await s.client.post("/v2/models/tinynet/infer", content=body, headers=headers)
                codes.append(r.status_code)
                out = decode_infer_response(r.content, r.headers.get("inference-header-content-length"))
                shapes.append(out["logits"].shape)
            meta = (await s.client.get("/v2/models/tinynet")).json()
            ready = (await s.client.get("/v2/health/ready")).json()
            return codes, shapes, meta, ready, list(s.runtime.traces)

    codes, shapes, meta, ready, traces = asyncio.run(asyncio.wait_for(main(), 60))
    assert codes == [200] * 4
    assert shapes == [(1, 5), (3, 5), (1, 5), (2, 5)]
    assert meta["outputs"][0]["name"] == "logits" and ready == {"ready": True, "started": True}
    done = [t for t in traces if t.error is None]
    assert done and all([r.stage for r in t.reports] == [0, 1] for t in done)  # worker to worker, both stages


def test_a_killed_worker_is_marked_failed_and_its_batches_answered_worker_failed(tmp_path):
    prof = write_tinynet(tmp_path / "m", base_us=4000.0)  # ~4-20 ms per stage: batches are in flight
    cfile = tmp_path / "three.yaml"
    cfile.write_text(THREE_CPUS)
    plan = make_plan(prof, load_cluster(cfile), [(0, 1, "cpu", 1, 2), (2, 2, "cpu", 1, 1)], slo_ms=400.0)
    plan.save(tmp_path / "plan.yaml")
    dep = load_deployment(tmp_path / "plan.yaml", cfile)
    victim = plan.placements_of("tinynet", 0, 0)[0].vgpu_id
    body, headers = encode_infer_request({"input": np.zeros((1, 3, 8, 8), np.float32)}, binary=True)

    async def main():
        async with inproc_serve(dep, http=True, keep_traces=10_000, **FIFO) as s:
            rt = s.runtime

            async def one():
                r = await s.client.post("/v2/models/tinynet/infer", content=body, headers=headers)
                return r.status_code, r.headers.get("ppipe-drop-reason", "")

            first = [asyncio.ensure_future(one()) for _ in range(40)]
            while not [t for t in rt.traces if t.route[0] == victim and not t.reports and t.error is None]:
                await asyncio.sleep(0.001)
            s.workers[victim].kill()
            before = await asyncio.gather(*first)
            after = [await one() for _ in range(10)]
            return before, after, dict(rt.failed), list(rt.traces)

    before, after, failed, traces = asyncio.run(asyncio.wait_for(main(), 60))
    assert victim in failed
    assert all(code in (200, 503) for code, _ in before)
    assert ("503", "worker-failed") in {(str(c), r) for c, r in before}, before
    assert after == [(200, "")] * 10  # the other vGPU of the pool serves on
    assert not [t for t in traces if victim in t.route and t.dispatched_us > failed[victim]]


def test_serving_in_process_imports_no_ray(two_stage):
    script = textwrap.dedent(f"""
        import asyncio, functools, json, sys
        import numpy as np
        sys.path.insert(0, {str(Path(__file__).parents[2])!r})
        from ppipe.runtime.launch.deploy import load_deployment
        from ppipe.runtime.launch.inproc import inproc_serve
        from ppipe.runtime.ingress.protocol import encode_infer_request
        from tests.runtime.fakes import FifoScheduler

        async def main():
            fifo = functools.partial(FifoScheduler, max_batch=4, window_us=2000.0)
            async with inproc_serve(load_deployment({two_stage.plan_file!r}), http=True, scheduler_factory=fifo) as s:
                body, headers = encode_infer_request({{"input": np.zeros((2, 3, 8, 8), np.float32)}})
                return (await s.client.post("/v2/models/tinynet/infer", content=body, headers=headers)).status_code

        code = asyncio.run(main())
        print(json.dumps({{"code": code, "ray": "ray" in sys.modules}}))
    """)
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout.strip().splitlines()[-1]) == {"code": 200, "ray": False}


@pytest.mark.parametrize("factory, tolerance_us, fed_per_stage", [
    ({}, 1e12, 0),  # the reservation policy: every stage within the tolerance, none fed
    ({}, 0.0, 1),  # no stage runs to the nanosecond: every report fed
    ({}, None, 1),  # no tolerance: every stage reports, every report fed
    (FIFO, 1e12, 1),  # a policy that does not reserve every use reads every report
])
def test_the_scheduler_is_fed_only_the_reports_outside_the_tolerance(tinynet, tmp_path, factory, tolerance_us, fed_per_stage):
    """The report tolerance (ppipe.dataplane.feedback): the host keeps every report for its
    traces, and feeds the reservation policy only those of stages that ran further than the
    tolerance from their reservations, as ``ppipe simulate``'s "changed" workers send them."""
    plan = make_plan(tinynet, load_cluster("local-cpu"), [(0, 1, "cpu", 2, 1), (2, 2, "cpu", 2, 1)], slo_ms=400.0)
    plan.save(tmp_path / "plan.yaml")
    dep = load_deployment(tmp_path / "plan.yaml")

    async def main():
        async with inproc_serve(dep, keep_traces=100, report_tolerance_us=tolerance_us, **factory) as s:
            sched, fed = s.runtime.scheduler, []
            report = sched.report
            sched.report = lambda r: (fed.append(r), report(r))[1]
            for _ in range(3):  # full batches of 4 (a lone request would wait for its last moment)
                await asyncio.gather(*(s.runtime.infer("tinynet", {"input": np.zeros((3, 8, 8), np.float32)}) for _ in range(4)))
            return fed, [t for t in s.runtime.traces if t.error is None]

    fed, done = asyncio.run(asyncio.wait_for(main(), 60))
    assert len(done) >= 3 and all([r.stage for r in t.reports] == [0, 1] for t in done)
    assert len(fed) == fed_per_stage * 2 * len(done)
