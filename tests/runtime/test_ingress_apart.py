"""Ingress apart from decisions: ingresses hold the tensors, the scheduler sees metadata only.

In process, on one loop (``inproc_serve(..., ingresses=N)``): tinynet's two stages on the
``ort`` backend (real arithmetic, so every answer is checked against the whole model), the
runtime with ``accept_ingresses``, and N :class:`IngressRuntime`. A batch may hold requests
of several ingresses: the scheduler sends the first worker the rows their arrivals offered,
or else each ingress sends it its rows and the worker runs the batch once all are in; the
last worker answers each ingress with its rows.
"""

from __future__ import annotations

import asyncio
import functools

import numpy as np
import pytest

from ppipe.runtime.ingress import remote
from ppipe.runtime.ingress.protocol import decode_infer_response, encode_infer_request
from ppipe.runtime.clock import wall_us
from ppipe.runtime.launch.deploy import load_deployment
from ppipe.runtime.launch.inproc import inproc_serve
from ppipe.runtime.scheduler.host import DroppedError
from ppipe.runtime.scheduler.ingresses import REMOTE_TIMEOUT_CHECK_S, RemoteInput
import msgspec

from ppipe.runtime.wire.datapath import Inbox, Outbox
from ppipe.runtime.wire.frames import pack, unpack
from ppipe.runtime.wire.messages import Answer, AnswerTo, IngressInbox, Reservation, StageMsg, StageReport
from ppipe.runtime.workers.stage_server import StageResult, StageServer
from ppipe.spec.cluster import load_cluster

from .conftest import make_plan
from .fakes import FifoScheduler
from .tinynet import reference

FIFO = dict(scheduler_factory=functools.partial(FifoScheduler, max_batch=4, window_us=5000.0))


@pytest.fixture(scope="module")
def two_stage(tinynet, tmp_path_factory):
    plan = make_plan(tinynet, load_cluster("local-cpu"), [(0, 1, "cpu", 2, 1), (2, 2, "cpu", 2, 1)])
    path = tmp_path_factory.mktemp("ingress-apart") / "plan.yaml"
    plan.save(path)
    return load_deployment(path)


def _inputs(n: int, seed: int = 0) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [rng.normal(0, 1, (3, 8, 8)).astype(np.float32) for _ in range(n)]


def test_requests_of_two_ingresses_share_batches_and_each_gets_its_own_rows(two_stage):
    xs = _inputs(16)

    async def main():
        async with inproc_serve(two_stage, backend="ort", ingresses=2, keep_traces=100, **FIFO) as s:
            outs = await asyncio.gather(*(s.ingresses[i % 2].infer("tinynet", {"input": x}) for i, x in enumerate(xs)))
            return outs, list(s.runtime.traces), [len(i._held) for i in s.ingresses], len(s.runtime._remote)

    outs, traces, held, remote = asyncio.run(asyncio.wait_for(main(), 60))
    want = reference(two_stage.profiles['tinynet'].directory, np.stack(xs))
    got = np.stack([o["logits"] for o in outs])
    np.testing.assert_allclose(got, want, rtol=2e-2, atol=2e-2)  # fp16 between the stages
    assert traces and all(t.error is None for t in traces)
    assert held == [0, 0] and remote == 0  # nothing kept after the answers


@pytest.mark.parametrize("forwarded", [True, False], ids=["scheduler-forwards", "ingresses-send"])
def test_a_batch_mixes_the_rows_of_both_ingresses(two_stage, forwarded, monkeypatch):
    """Rows of two ingresses in one batch, answered each with its own: sent to the first
    worker by the scheduler (the arrivals offered the small inputs' bytes), or, where the
    arrivals offer nothing (inputs neither small nor in shared memory), by each ingress."""
    if not forwarded:
        monkeypatch.setattr(remote, "INLINE_INPUT_BYTES", 0)
    xs = _inputs(8, seed=1)

    async def main():
        async with inproc_serve(two_stage, backend="ort", ingresses=2, keep_traces=100, **FIFO) as s:
            rt = s.runtime
            seen: list[set[int]] = []
            orig = rt._answers_to

            def spy(d):
                seen.append({r.payload.ingress for r in d.requests})
                assert all(isinstance(r.payload, RemoteInput) for r in d.requests)  # the scheduler holds no array
                return orig(d)

            rt._answers_to = spy
            tasks = []
            for i in range(0, len(xs), 2):  # two requests of one ingress per tick, then two of the other's
                tasks += [asyncio.ensure_future(s.ingresses[i // 2 % 2].infer("tinynet", {"input": x})) for x in xs[i:i + 2]]
                await asyncio.sleep(0.001)
            return await asyncio.gather(*tasks), seen, rt.forwarded_batches

    outs, seen, forwarded_batches = asyncio.run(asyncio.wait_for(main(), 60))
    assert {0, 1} in seen  # some batch held requests of both ingresses
    assert forwarded_batches == (len(seen) if forwarded else 0)
    np.testing.assert_allclose(np.stack([o["logits"] for o in outs]), reference(two_stage.profiles['tinynet'].directory, np.stack(xs)), rtol=2e-2, atol=2e-2)


def test_a_drop_reaches_the_ingress_as_its_error(two_stage):
    drop = dict(scheduler_factory=functools.partial(FifoScheduler, drop_all=True))

    async def main():
        async with inproc_serve(two_stage, ingresses=1, **drop) as s:
            with pytest.raises(DroppedError) as err:
                await s.ingresses[0].infer("tinynet", {"input": np.zeros((3, 8, 8), np.float32)})
            with pytest.raises(DroppedError) as unknown:
                await s.ingresses[0].infer("nope", {"input": np.zeros((3, 8, 8), np.float32)})
            return err.value, unknown.value, len(s.ingresses[0]._held)

    err, unknown, held = asyncio.run(asyncio.wait_for(main(), 30))
    assert err.reason == "deadline-unreachable" and "drops everything" in err.detail
    assert unknown.reason == "unknown-model" and held == 0


def test_a_request_nobody_decides_on_is_timed_out_by_the_scheduler_and_told_to_its_ingress(two_stage):
    """The scheduler keeps no timer per ingress request: its sweep answers one unanswered at
    SLO + grace with ``timeout``, and the ingress gets that refusal (its own grace is longer)."""
    never = dict(scheduler_factory=functools.partial(FifoScheduler, max_batch=4, window_us=60e6))

    async def main():
        async with inproc_serve(two_stage, ingresses=1, **never) as s:
            rt, ingress = s.runtime, s.ingresses[0]
            rt.answer_grace_s = 0.05
            t0 = asyncio.get_running_loop().time()
            with pytest.raises(DroppedError) as err:
                await ingress.infer("tinynet", {"input": np.zeros((3, 8, 8), np.float32)})
            return err.value, asyncio.get_running_loop().time() - t0, len(rt._remote), len(rt._pending), rt._queued["tinynet"]

    err, waited, remote, pending, queued = asyncio.run(asyncio.wait_for(main(), 30))
    slo_s = two_stage.plan.model("tinynet").slo_ms / 1e3
    assert err.reason == "timeout" and "no answer within" in err.detail
    assert slo_s + 0.05 <= waited + 1e-3 and waited < slo_s + 0.05 + 2 * REMOTE_TIMEOUT_CHECK_S
    assert (remote, pending, queued) == (0, 0, 0)


def test_a_request_the_scheduler_never_answers_is_timed_out_by_its_ingress(two_stage):
    """The ingress keeps no timer per request either: its own sweep answers one still held at
    SLO + its grace with ``timeout`` (here the scheduler's grace is the longer)."""
    from ppipe.runtime.ingress.remote import TIMEOUT_CHECK_S

    never = dict(scheduler_factory=functools.partial(FifoScheduler, max_batch=4, window_us=60e6))

    async def main():
        async with inproc_serve(two_stage, ingresses=1, **never) as s:
            ingress = s.ingresses[0]
            ingress.answer_grace_s = 0.05
            t0 = asyncio.get_running_loop().time()
            with pytest.raises(DroppedError) as err:
                await ingress.infer("tinynet", {"input": np.zeros((3, 8, 8), np.float32)})
            return err.value, asyncio.get_running_loop().time() - t0, len(ingress._held)

    err, waited, held = asyncio.run(asyncio.wait_for(main(), 30))
    slo_s = two_stage.plan.model("tinynet").slo_ms / 1e3
    assert err.reason == "timeout" and "no answer within" in err.detail
    assert slo_s + 0.05 <= waited + 1e-3 and waited < slo_s + 0.05 + 2 * TIMEOUT_CHECK_S
    assert held == 0


def test_the_http_frontend_serves_over_an_ingress(two_stage):
    xs = np.stack(_inputs(3, seed=2))

    async def main():
        async with inproc_serve(two_stage, backend="ort", http=True, ingresses=2, **FIFO) as s:
            body, headers = encode_infer_request({"input": xs}, binary=True)
            r = await s.client.post("/v2/models/tinynet/infer", content=body, headers=headers)
            ready = (await s.client.get("/v2/health/ready")).json()
            return r.status_code, decode_infer_response(r.content, r.headers.get("inference-header-content-length")), ready

    code, out, ready = asyncio.run(asyncio.wait_for(main(), 60))
    assert code == 200 and ready == {"ready": True, "started": True}
    np.testing.assert_allclose(out["logits"], reference(two_stage.profiles['tinynet'].directory, xs), rtol=2e-2, atol=2e-2)


def test_an_ingress_gone_fails_its_batches_and_the_others_still_get_one_answer(two_stage):
    async def main():
        slow = dict(scheduler_factory=functools.partial(FifoScheduler, max_batch=4, window_us=20000.0))
        async with inproc_serve(two_stage, backend="ort", ingresses=2, **slow) as s:
            rt, (a, b) = s.runtime, s.ingresses
            x = {"input": np.zeros((3, 8, 8), np.float32)}
            ta = [asyncio.ensure_future(a.infer("tinynet", x)) for _ in range(2)]
            tb = [asyncio.ensure_future(b.infer("tinynet", x)) for _ in range(2)]
            await asyncio.sleep(0.005)  # arrived, queued in one batch-to-be
            a._inbox.close()  # ingress a dies: it sends no rows
            a._outbox.close()
            rt.ingress_gone(0)
            done_b = await asyncio.gather(*tb, return_exceptions=True)
            for t in ta:
                t.cancel()
            return done_b, len(rt._remote), rt.ingresses

    done_b, remote, ingresses = asyncio.run(asyncio.wait_for(main(), 30))
    # b's requests are answered (served, or refused with a reason), never left waiting
    assert all(isinstance(r, dict) or (isinstance(r, DroppedError) and r.reason in ("worker-failed", "withdrawn")) for r in done_b)
    assert remote == 0 and list(ingresses) == [1]


def test_a_stage_server_runs_a_batch_once_all_its_rows_are_in_and_answers_each_ingress():
    runs: list[np.ndarray] = []

    async def run(msg, tensors):
        runs.append(tensors["x"])
        report = StageReport(msg.batch_id, msg.stage, "v0", 1.0, 2.0)
        return StageResult(report, {"y": tensors["x"] * 10}, 2.0)

    async def main():
        got: dict[str, list] = {"a": [], "b": [], "report": []}
        inbox_a = Inbox(lambda m: got["a"].append(unpack(m, IngressInbox)))
        inbox_b = Inbox(lambda m: got["b"].append(unpack(m, IngressInbox)))
        front = Inbox(lambda m: got["report"].append(unpack(m, StageReport)))
        server = StageServer("v0", run)
        addr = server.open(front.address)
        answers = (AnswerTo(inbox_a.address, 0, (7, 8)), AnswerTo(inbox_b.address, 2, (3,)))
        t = wall_us()
        msg = StageMsg(5, 0, ("v0",), (addr,), 3, (Reservation(None, 0.0, t, t + 1e3),), answers=answers)
        ancient = StageMsg(4, 0, ("v0",), (addr,), 2, (Reservation(None, 0.0, 0.0, 1.0),), part=(0, 1), answers=answers[:1])
        out = Outbox()
        out.send(addr, pack(ancient, {"x": np.array([[9.0]])}))  # a batch whose other row never comes
        out.send(addr, pack(msgspec.structs.replace(msg, part=(2, 1)), {"x": np.array([[3.0]])}))
        await asyncio.sleep(0.05)
        assert runs == []  # two rows missing
        out.send(addr, pack(msgspec.structs.replace(msg, part=(0, 2)), {"x": np.array([[1.0], [2.0]])}))
        for _ in range(200):
            if got["a"] and got["b"] and got["report"]:
                break
            await asyncio.sleep(0.01)
        left = dict(server._parts)
        server.close(), out.close(), inbox_a.close(), inbox_b.close(), front.close()
        return got, left

    got, left = asyncio.run(asyncio.wait_for(main(), 10))
    assert left == {}  # the ancient batch's lone row was let go, long past its reserved end
    assert len(runs) == 1 and runs[0].ravel().tolist() == [1.0, 2.0, 3.0]  # in row order
    (ans_a, ya), = got["a"]
    (ans_b, yb), = got["b"]
    assert isinstance(ans_a, Answer) and ans_a.rids == (7, 8) and ya["y"].ravel().tolist() == [10.0, 20.0]
    assert ans_b.rids == (3,) and yb["y"].ravel().tolist() == [30.0]
    (rep, outputs), = got["report"]
    assert rep.batch_id == 5 and outputs == {}  # the outputs went to the ingresses, not with the report


@pytest.fixture
def arena(monkeypatch):
    """A fresh shared-input arena as this process's, sharing inputs of any size; every input
    too large to ride with its arrival (all of them)."""
    from ppipe.runtime.wire import shared_inputs

    arena = shared_inputs.InputArena(min_bytes=0)
    monkeypatch.setattr(shared_inputs, "_arena", arena)
    monkeypatch.setattr(shared_inputs, "_arena_made", True)
    monkeypatch.setattr(remote, "INLINE_INPUT_BYTES", 0)
    return arena


def _served_by_two_ingresses(dep, xs: list[np.ndarray], sent: list[np.ndarray]) -> int:
    """Serve ``sent`` (the inputs ``xs``, wherever they lie) through two ingresses in turn,
    check every answer against the model, and return the batches the scheduler forwarded."""

    async def main():
        async with inproc_serve(dep, backend="ort", ingresses=2, **FIFO) as s:
            outs = await asyncio.gather(*(s.ingresses[i % 2].infer("tinynet", {"input": x}) for i, x in enumerate(sent)))
            return outs, s.runtime.forwarded_batches

    outs, forwarded_batches = asyncio.run(asyncio.wait_for(main(), 60))
    want = reference(dep.profiles['tinynet'].directory, np.stack(xs))
    np.testing.assert_allclose(np.stack([o["logits"] for o in outs]), want, rtol=2e-2, atol=2e-2)
    return forwarded_batches


@pytest.mark.parametrize("near", [True, False], ids=["worker-on-this-machine", "worker-elsewhere"])
def test_inputs_in_shared_memory_go_to_the_first_worker_from_the_scheduler_by_ref(two_stage, arena, near, monkeypatch):
    """Inputs too large to ride with the arrival that lie in the ingress's shared memory: the
    arrival offers their refs, and the scheduler sends them on to the first worker (nothing
    goes back to the ingress) where the worker is on the ingress's machine; where it is not
    (``same_machine`` says so here), the ingress is told to send them, as any input."""
    from ppipe.runtime.scheduler import ingresses

    if not near:
        monkeypatch.setattr(ingresses, "same_machine", lambda a, b: False)
    xs = _inputs(8, seed=2)
    shared = []
    for x in xs:  # each input in a slot, as the HTTP transport puts a body's
        slot = arena.take(x.nbytes).view(np.float32).reshape(x.shape)
        slot[...] = x
        shared.append(slot)
    forwarded_batches = _served_by_two_ingresses(two_stage, xs, shared)
    assert (forwarded_batches > 0) == near
    assert arena.located >= len(xs)  # offered by ref (and, elsewhere, sent by ref by the ingress: one machine here)


def test_inputs_outside_shared_memory_are_copied_in_and_forwarded_by_ref(two_stage, arena):
    """Inputs that do not lie in shared memory (a gRPC message's bytes, a decoded JSON body):
    the ingress copies them into its arena, so that the scheduler still sends the first
    worker the batch itself by ref; the answers are those of the inputs sent."""
    xs = _inputs(6, seed=3)
    assert _served_by_two_ingresses(two_stage, xs, xs) > 0
    assert arena.located >= len(xs)
    assert arena.lent_bytes == 0  # every copy's slot came back with its answer


def test_an_input_that_cannot_be_shared_is_left_as_it_is():
    """``in_shared_memory``: inputs small enough to ride inline, an array of objects, or one
    too small for a slot leave the request's inputs unchanged (they are sent when asked)."""
    from ppipe.runtime.wire.shared_inputs import InputArena

    arena = InputArena(min_bytes=1024)
    big = np.arange(4096, dtype=np.float32).reshape(64, 64)
    small = {"x": np.ones(8, np.float32)}
    assert remote.in_shared_memory(small, arena) is small
    mixed = {"x": big, "tag": np.ones(4, np.float32)}  # the 16-byte one is below the slot size
    assert remote.in_shared_memory(mixed, arena) is mixed
    shared = remote.in_shared_memory({"x": big}, arena)
    assert arena.locate(shared["x"]) is not None and shared["x"] is not big
    np.testing.assert_array_equal(shared["x"], big)
    assert remote.in_shared_memory(shared, arena)["x"] is shared["x"]  # already there: no second copy
    assert arena.share(np.array([b"jpeg"] * 600, dtype=object)) is None
