"""The data path without Ray: the wire format, and StageServers on TCP connections on 127.0.0.1."""

from __future__ import annotations

import asyncio

import msgpack
import numpy as np
import pytest

from ppipe.runtime.datapath import DataPathFull, Inbox, Outbox, StageServer, is_loopback_address, ran_as_reserved
from ppipe.runtime.wire import WireError, pack, unpack


def _message(header, tensors=None) -> bytes:
    """One packed message without its length prefix (what a receiver hands to unpack)."""
    return b"".join(bytes(p) for p in pack(header, tensors))[4:]


def _raw(header_bytes: bytes, body: bytes = b"") -> bytes:
    return len(header_bytes).to_bytes(4, "little") + header_bytes + body


# ---- wire format -----------------------------------------------------------------------------------
def test_a_message_round_trips_header_and_tensors_of_any_dtype_and_shape():
    tensors = {
        "a": np.arange(12, dtype=np.float32).reshape(3, 4),
        "b": np.arange(6, dtype=np.float16)[::2],  # not contiguous: packed as a copy
        "c": np.zeros((0, 5), np.int64),
        "d": np.array(7, np.uint8),
    }
    header, got = unpack(_message({"b": 3, "route": ["x", "y"]}, tensors))
    assert header == {"b": 3, "route": ["x", "y"]}
    assert list(got) == list(tensors)
    for k, v in tensors.items():
        assert got[k].dtype == v.dtype and got[k].shape == v.shape and np.array_equal(got[k], v)


@pytest.mark.parametrize(
    "message, match",
    [
        (b"", "has no header"),
        (b"\x09\0\0\0" + b"\0" * 4, "overruns"),
        (_raw(b"\xc1"), "not msgpack"),
        (_raw(msgpack.packb([1, 2])), "not a map"),
        (_raw(msgpack.packb({"t": 5})), "not a list"),
        (_raw(msgpack.packb({"t": [["a", "<f4", [2]]]})), "needs 8 bytes, the message has 0 left"),
        (_raw(msgpack.packb({"t": [["a", "<f4", [2]]]}), b"\0" * 9), "1 bytes after its tensors"),
        (_raw(msgpack.packb({"t": [["a", "O", [1]]]}), b"\0" * 8), "bad dtype or shape"),
        (_raw(msgpack.packb({"t": [["a", "nope", [1]]]}), b"\0"), "unknown dtype"),
        (_raw(msgpack.packb({"t": [["a", "<f4", [-1]]]})), "bad dtype or shape"),
        (_raw(msgpack.packb({"t": [["a", "<f4", [2**40] * 2]]})), "bad dtype or shape"),
        (_raw(msgpack.packb({"t": [[1, "<f4", [1]]]}), b"\0" * 4), "not \\[name, dtype, shape\\]"),
    ],
)
def test_malformed_messages_raise_wire_errors(message, match):
    with pytest.raises(WireError, match=match):
        unpack(message)


def test_loopback_addresses():
    assert is_loopback_address("tcp://127.0.0.1:5555") and is_loopback_address("tcp://localhost:1")
    assert not is_loopback_address("tcp://10.0.0.3:5555")


# ---- sockets ---------------------------------------------------------------------------------------------
def _three_stage_route(tol=None, late=()):
    """Three StageServers (stage k adds k + 1) and a frontend inbox; returns the report
    messages the frontend got, ``(header, tensors)`` each.

    Stage k of batch b is reserved at ``[100 b + 10 k, 100 b + 10 k + 5)`` (us) and reports
    that, except the ``(b, k)`` pairs in ``late``, which report a start 5 ms late.
    """

    async def main():
        reports = []
        done = asyncio.Event()

        def on_report(message):
            reports.append(unpack(message))
            if sum(1 + len(h.get("carried", [])) for h, _ in reports) == 3 * 4:
                done.set()

        inbox = Inbox(on_report)

        def runner(k):
            async def run(batch_id, index, vgpu_id, payload, batch, timing, link):
                x = payload["tensors"]["x"]
                assert index == k and vgpu_id == f"v{k}" and batch == len(x)
                start = timing[k][2] + (5000.0 if (batch_id, k) in late else 0.0)
                rep = {"batch_id": batch_id, "partition": index, "vgpu_id": vgpu_id, "start_us": start, "end_us": start + 5.0,
                       "transfer_start_us": None, "transfer_end_us": None}
                out = {"x": x + k + 1}
                if index == 2:
                    rep["outputs"] = out
                    return rep, None
                return rep, {"tensors": out, "sent_wall_us": 1.0}

            return run

        servers = [StageServer(f"v{k}", runner(k)) for k in range(3)]
        addrs = [s.open(inbox.address) for s in servers]
        for k in range(2):
            servers[k].connect([addrs[k + 1]])
        out = Outbox()
        for b in range(4):
            timing = [(None, 0.0, 100.0 * b + 10 * k, 100.0 * b + 10 * k + 5) for k in range(3)]
            header = {"b": b, "k": 0, "route": ["v0", "v1", "v2"], "addr": addrs, "n": 2, "timing": timing, "links": None,
                      "tol": tol, "sent": 0.0}
            out.send(addrs[0], pack(header, {"x": np.full(2, 10.0 * b, np.float32)}))
        # a malformed message is dropped by the worker, which keeps serving
        out.send(addrs[0], [(5).to_bytes(4, "little"), b"\1\0\0\0\xc1"])
        await asyncio.wait_for(done.wait(), 10)
        for s in servers:
            s.close()
        inbox.close()
        out.close()
        return reports

    return asyncio.run(main())


def test_a_batch_travels_the_route_worker_to_worker_and_every_stage_reports():
    reports = _three_stage_route()
    by_batch: dict[int, list] = {}
    for rep, tensors in reports:
        assert "carried" not in rep  # no tolerance: every stage reports on its own
        by_batch.setdefault(rep["batch_id"], []).append((rep["partition"], tensors))
    assert sorted(by_batch) == [0, 1, 2, 3]
    for b, reps in by_batch.items():
        assert sorted(k for k, _ in reps) == [0, 1, 2]
        (last,) = [t for k, t in reps if k == 2]
        assert last["x"].tolist() == [10.0 * b + 6] * 2  # 1 + 2 + 3 added along the route
        assert all(t == {} for k, t in reps if k < 2)  # only the last report carries tensors


def test_stages_that_ran_as_reserved_ride_on_to_the_next_report_and_late_ones_report_at_once():
    reports = _three_stage_route(tol=1000.0, late={(1, 1), (2, 0), (3, 2)})
    messages = {}
    for rep, tensors in reports:
        messages.setdefault(rep["batch_id"], []).append(([c["partition"] for c in rep.get("carried", [])], rep["partition"], tensors))
    for b in messages:
        messages[b].sort(key=lambda m: m[1])
    # (the partitions carried, the sender's partition) of each report message, per batch
    assert {b: [(c, k) for c, k, _ in m] for b, m in messages.items()} == {
        0: [([0, 1], 2)],  # all on time: one message
        1: [([0], 1), ([], 2)],  # stage 1 late: it reports at once, with stage 0's report
        2: [([], 0), ([1], 2)],  # stage 0 late
        3: [([0, 1], 2)],  # the last stage always reports (late or not), with what it carries
    }
    for b, m in messages.items():
        assert m[-1][2]["x"].tolist() == [10.0 * b + 6] * 2  # the outputs ride in the last report


def test_ran_as_reserved_compares_start_end_and_a_reserved_transfer_within_the_tolerance():
    rep = {"start_us": 1000.0, "end_us": 2000.0, "transfer_start_us": 500.0, "transfer_end_us": 900.0}
    assert ran_as_reserved(rep, [None, 0.0, 1000.5, 1999.5], 1.0)  # no NIC reserved: the transfer is not compared
    assert not ran_as_reserved(rep, [None, 0.0, 1002.0, 2000.0], 1.0)
    assert not ran_as_reserved(rep, [None, 0.0, 1000.0, 1998.0], 1.0)
    assert ran_as_reserved(rep, [500.0, 400.0, 1000.0, 2000.0], 1.0)
    assert not ran_as_reserved(rep, [500.0, 300.0, 1000.0, 2000.0], 1.0)  # the transfer ended 100 us late
    assert not ran_as_reserved({**rep, "transfer_start_us": None}, [500.0, 400.0, 1000.0, 2000.0], 1.0)
    assert not ran_as_reserved(rep, [None, 0.0, 1000.0], 1.0)  # a timing without the reserved end


def test_a_failing_stage_reports_its_error_and_forwards_nothing():
    async def main():
        got = []
        inbox = Inbox(lambda message: got.append(unpack(message)[0]))

        async def boom(*args):
            raise ValueError("bad input")

        forwarded = []
        nxt = Inbox(lambda message: forwarded.append(message))
        s = StageServer("v0", boom)
        addr = s.open(inbox.address)
        header = {"b": 9, "k": 0, "route": ["v0", "v1"], "addr": [addr, nxt.address], "n": 1, "timing": None, "links": None, "sent": 0.0}
        out = Outbox()  # kept open: closing a socket drops what it has not sent yet
        out.send(addr, pack(header, {"x": np.zeros(1)}))
        for _ in range(200):
            await asyncio.sleep(0.01)
            if got:
                break
        await asyncio.sleep(0.05)
        s.close(), inbox.close(), nxt.close(), out.close()
        return got, forwarded

    got, forwarded = asyncio.run(main())
    assert got == [{"batch_id": 9, "partition": 0, "vgpu_id": "v0", "err": "ValueError: bad input"}]
    assert forwarded == []


def test_a_peer_that_is_not_reading_fails_the_send_instead_of_blocking(monkeypatch):
    monkeypatch.setattr("ppipe.runtime.datapath.MAX_BUFFERED_BYTES", 1000)

    async def main():
        box = Outbox()
        with pytest.raises(DataPathFull, match="bytes already wait for tcp://127.0.0.1:9, which is not connected"):
            for _ in range(100):  # nobody listens on port 9: the queue fills and the send says so
                box.send("tcp://127.0.0.1:9", pack({"b": 1}, {"x": np.zeros(100)}))
        box.close()

    asyncio.run(main())


def test_messages_split_and_merged_by_the_stream_arrive_whole_and_in_order():
    """Large messages span many reads and small ones share a read: the receiver cuts the
    stream at the length prefixes either way."""

    async def main():
        got = []
        done = asyncio.Event()
        inbox = Inbox(lambda m: (got.append(unpack(m)), len(got) == 60 and done.set()))
        out = Outbox()
        for i in range(60):
            n = 300_000 if i % 10 == 0 else 3
            out.send(inbox.address, pack({"i": i}, {"x": np.full(n, i, np.float32)}))
        await asyncio.wait_for(done.wait(), 20)
        out.close(), inbox.close()
        return got

    got = asyncio.run(main())
    assert [h["i"] for h, _ in got] == list(range(60))
    assert all(t["x"].size == (300_000 if h["i"] % 10 == 0 else 3) and np.all(t["x"] == h["i"]) for h, t in got)


def test_a_receiver_closes_a_connection_whose_length_prefix_is_impossible():
    async def main():
        got = []
        inbox = Inbox(got.append)
        reader, writer = await asyncio.open_connection(*inbox.address[len("tcp://"):].split(":"))
        writer.write((2).to_bytes(4, "little") + b"xx")  # shorter than a header length field
        closed = await asyncio.wait_for(reader.read(), 5)
        writer.close()
        await writer.wait_closed()
        inbox.close()
        return got, closed

    got, closed = asyncio.run(main())
    assert got == [] and closed == b""
