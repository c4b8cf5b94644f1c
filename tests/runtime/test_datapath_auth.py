"""The data path's handshake: only a connection that holds the server's secret is read."""

from __future__ import annotations

import asyncio
import os
import logging

import msgspec
import numpy as np
import pytest

from ppipe.runtime.wire.datapath import Inbox, Outbox, _Receiver, split_address
from ppipe.runtime.wire.frames import pack, unpack
from ppipe.runtime.wire.handshake import NONCE_BYTES, Handshake

SECRET = b"s" * 32


class Probe(msgspec.Struct, array_like=True, frozen=True):
    i: int


async def _delivered(inbox_secret, outbox_secret, n=3, wait_s=0.5):
    """Send ``n`` messages (one with a 2 MB tensor) from an Outbox to an Inbox; returns what arrived and the inbox."""
    got, refusals = [], []
    inbox = Inbox(lambda m: got.append(unpack(m, Probe)), secret=inbox_secret, on_refused=refusals.append)
    out = Outbox(secret=outbox_secret)
    for i in range(n):
        out.send(inbox.address, pack(Probe(i), {"x": np.full(500_000 if i == 1 else 3, i, np.float32)}))
    for _ in range(int(wait_s / 0.01)):
        await asyncio.sleep(0.01)
        if len(got) == n or refusals:
            break
    await asyncio.sleep(0.05)
    out.close(), inbox.close()
    return got, refusals, inbox


def test_a_connection_with_the_secret_is_served_as_before():
    got, refusals, inbox = asyncio.run(_delivered(SECRET, SECRET))
    assert [h.i for h, _ in got] == [0, 1, 2] and got[1][1]["x"].size == 500_000
    assert refusals == [] and inbox.refused == 0


@pytest.mark.parametrize("outbox_secret", [None, b"t" * 32], ids=["no secret", "another secret"])
def test_a_connection_without_the_secret_is_refused_unread_counted_and_logged(outbox_secret, caplog):
    with caplog.at_level(logging.WARNING, "ppipe.runtime"):
        got, refusals, inbox = asyncio.run(_delivered(SECRET, outbox_secret))
    assert got == [] and inbox.refused == 1 and len(refusals) == 1
    assert "wrong answer to the handshake" in refusals[0]
    assert "refused a connection from 127.0.0.1" in caplog.text or f"refused a connection from process {os.getpid()} " in caplog.text


def test_a_replayed_answer_and_a_silent_connection_are_refused(monkeypatch):
    """An answer recorded from one connection is wrong on the next (its nonce is fresh);
    a connection that says nothing is closed after the handshake's time limit."""
    monkeypatch.setattr("ppipe.runtime.wire.datapath.AUTH_TIMEOUT_S", 0.2)

    async def main():
        got, refusals = [], []
        inbox = Inbox(got.append, secret=SECRET, on_refused=refusals.append)
        host, port = split_address(inbox.address)
        reader, writer = await asyncio.open_connection(host, port)
        nonce = await reader.readexactly(NONCE_BYTES)
        answer = Handshake(SECRET).answer(nonce)
        message = b"".join(bytes(p) for p in pack(Probe(1)))
        writer.write(answer + message)  # a good connection
        await asyncio.sleep(0.05)
        r2, w2 = await asyncio.open_connection(host, port)
        await r2.readexactly(NONCE_BYTES)
        w2.write(answer + message)  # the same bytes replayed on a new connection
        r3, w3 = await asyncio.open_connection(host, port)  # says nothing
        await r3.readexactly(NONCE_BYTES)
        closed2 = await asyncio.wait_for(r2.read(), 2)
        closed3 = await asyncio.wait_for(r3.read(), 2)
        for w in (writer, w2, w3):
            w.close()
        inbox.close()
        return got, refusals, closed2, closed3

    got, refusals, closed2, closed3 = asyncio.run(main())
    assert len(got) == 1 and unpack(got[0], Probe)[0] == Probe(1)  # only the good connection's message
    assert closed2 == b"" and closed3 == b""
    assert len(refusals) == 2 and "wrong answer" in refusals[0] and "no answer to the handshake within 0.2 s" in refusals[1]


class _Inbox:
    address = "tcp://127.0.0.1:0"

    def __init__(self):
        self.conns, self.got, self.refusals = set(), [], []
        self.handshake = Handshake(SECRET)

    def deliver(self, message):
        self.got.append(message)

    def refuse(self, conn, why):
        self.refusals.append(why)
        conn.transport.close()


class _Transport:
    def __init__(self):
        self.written, self.closed = b"", False

    def write(self, data):
        self.written += data

    def close(self):
        self.closed = True


def test_nothing_is_allocated_or_delivered_before_the_answer_is_checked():
    """An unauthenticated peer announcing a 4 GB message gets no buffer: its first bytes
    are taken as its answer, which is wrong, and the connection closes."""

    async def main():
        r = _Receiver(_Inbox())
        t = _Transport()
        r.connection_made(t)
        assert len(t.written) == NONCE_BYTES  # the challenge went out first
        data = (2**32 - 1).to_bytes(4, "little") + b"\0" * 60
        buf = r.get_buffer(-1)
        buf[: len(data)] = data
        r.buffer_updated(len(data))
        return r, t

    r, t = asyncio.run(main())
    assert r.message is None and r.inbox.got == [] and t.closed and len(r.inbox.refusals) == 1


def test_an_outbox_with_a_secret_gives_up_on_a_listener_that_sends_no_challenge(monkeypatch, caplog):
    monkeypatch.setattr("ppipe.runtime.wire.datapath.AUTH_TIMEOUT_S", 0.2)

    async def main():
        got = []
        inbox = Inbox(got.append)  # not authenticating
        out = Outbox(secret=SECRET)
        out.send(inbox.address, pack(Probe(1)))
        await asyncio.sleep(0.5)
        peers = dict(out.peers)
        out.close(), inbox.close()
        return got, peers

    got, peers = asyncio.run(main())
    assert got == [] and peers == {}  # nothing was sent unanswered; the next send connects anew
    assert "sent no handshake within 0.2 s" in caplog.text


def test_a_secret_too_short_is_refused():
    with pytest.raises(ValueError, match="at least 16 bytes"):
        Handshake(b"short")


# ---- the scheduler's host with a secret ------------------------------------------------------------------
def _secret_runtime(tinynet, hold=False):
    """A two-stage tinynet plan on fake workers, served with a data-path secret; stage 1's
    worker holds its stage while ``hold`` so that a forger has a batch in flight to aim at."""
    import functools

    from ppipe.runtime.scheduler.host import Runtime
    from ppipe.spec.cluster import load_cluster

    from .conftest import make_plan
    from .fakes import FakeWorker, FifoScheduler

    cluster = load_cluster("local-cpu")
    plan = make_plan(tinynet, cluster, [(0, 1, "cpu", 2, 1), (2, 2, "cpu", 2, 1)])
    peers = {p.vgpu_id: FakeWorker(p.vgpu_id) for p in plan.placement}
    rt = Runtime(plan, {"tinynet": tinynet}, cluster, peers, scheduler_factory=functools.partial(FifoScheduler, max_batch=1),
                 keep_traces=10, data_secret=SECRET)
    return rt, peers


def _refused(rt) -> dict[str, float]:
    return {s.labels["reason"]: s.value for m in rt.metrics.refused.collect() for s in m.samples if s.name.endswith("_total")}


def test_a_served_batch_crosses_authenticated_connections_and_forgeries_change_nothing(tinynet, caplog):
    """The workers get the server's secret as their data paths open, and every connection
    proves it. A connection without it, a report from another vGPU than its stage's, a
    report of a stage that reported already, and a report that carries one of another
    batch are refused, logged and counted; the request is answered with its own outputs
    all the same."""
    from ppipe.runtime.wire.messages import StageReport

    rt, peers = _secret_runtime(tinynet)
    last = rt.plan.placement[-1].vgpu_id
    first = rt.plan.placement[0].vgpu_id

    async def main():
        await rt.start()
        assert all(w.secret == SECRET for w in peers.values())
        peers[last].hold = asyncio.Event()  # the batch waits at its last stage
        answer = asyncio.ensure_future(rt.infer("tinynet", {"x": np.full(2, 5, np.float32)}))
        for _ in range(200):
            await asyncio.sleep(0.01)
            if rt.traces and rt.traces[0].reports:
                break
        batch = rt.traces[0].batch_id
        forged = {"y": np.full((1, 2), 666.0, np.float32)}
        plain = Outbox()  # no secret
        plain.send(rt._inbox.address, pack(StageReport(batch, 1, last, 1.0, 2.0), forged))
        armed = Outbox(secret=SECRET)
        armed.send(rt._inbox.address, pack(StageReport(batch, 1, first, 1.0, 2.0), forged))  # stage 1 is not first's
        armed.send(rt._inbox.address, pack(StageReport(batch, 0, first, 1.0, 2.0)))  # stage 0 reported already
        stray = StageReport(batch + 99, 0, first, 1.0, 2.0)  # riding on a report of another batch
        armed.send(rt._inbox.address, pack(StageReport(batch, 1, last, 1.0, 2.0, carried=(stray,)), forged))
        await asyncio.sleep(0.3)
        peers[last].hold.set()
        out = await asyncio.wait_for(answer, 10)
        plain.close(), armed.close()
        await rt.stop()
        return out

    with caplog.at_level(logging.WARNING, "ppipe.runtime"):
        out = asyncio.run(main())
    assert out["y"].tolist() == [12.0, 12.0]  # (5 + 1) * 2, not the forger's 666
    assert _refused(rt) == {"handshake": 1.0, "report-from-another-vgpu": 1.0, "repeated-report": 1.0, "report-of-another-batch": 1.0}
    assert "refused a connection from 127.0.0.1" in caplog.text or f"refused a connection from process {os.getpid()} " in caplog.text and "refused (report-from-another-vgpu)" in caplog.text
