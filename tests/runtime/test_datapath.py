"""The data path without Ray: the wire format, and StageServers on TCP connections on 127.0.0.1."""

from __future__ import annotations

import asyncio

import msgspec
import numpy as np
import pytest

from ppipe.runtime.wire.datapath import DataPathFull, Inbox, Outbox, _Receiver, is_loopback_address
from ppipe.runtime.wire.frames import WireError, pack, unpack
from ppipe.runtime.wire.messages import Reservation, StageMsg, StageReport
from ppipe.runtime.workers.stage_server import StageResult, StageServer


class Probe(msgspec.Struct, array_like=True, frozen=True):
    """A message type for the framing's tests."""

    i: int


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
    header, got = unpack(_message(Probe(3), tensors), Probe)
    assert header == Probe(3)
    assert list(got) == list(tensors)
    for k, v in tensors.items():
        assert got[k].dtype == v.dtype and got[k].shape == v.shape and np.array_equal(got[k], v)


def _head(message, specs) -> bytes:
    return msgspec.msgpack.encode((message, specs))


@pytest.mark.parametrize(
    "message, match",
    [
        (b"", "has no header"),
        (b"\x09\0\0\0" + b"\0" * 4, "overruns"),
        (_raw(b"\xc1"), "not a Probe"),
        (_raw(msgspec.msgpack.encode({"i": 1})), "not a Probe"),
        (_raw(_head([1], 5)), "not a Probe"),
        (_raw(_head(["one"], [])), "not a Probe"),
        (_raw(_head([1], [["a", "<f4", [2], []]])), "needs 8 bytes, the message has 0 left"),
        (_raw(_head([1], [["a", "<f4", [2], []]]), b"\0" * 9), "1 bytes after its tensors"),
        (_raw(_head([1], [["a", "O", [1], []]]), b"\0" * 8), "holds objects"),
        (_raw(_head([1], [["a", "nope", [1], []]]), b"\0"), "unknown dtype"),
        (_raw(_head([1], [["a", "<f4", [-1], []]])), "not a Probe"),
        (_raw(_head([1], [["a", "<f4", [2**40] * 2, []]])), "not a Probe"),
        (_raw(_head([1], [["a", "<f4", [1] * 17, []]])), "not a Probe"),
        (_raw(_head([1], [["a", "<f4", [1], []]] * 65)), "not a Probe"),
        (_raw(_head([1], [[1, "<f4", [1], []]]), b"\0" * 4), "not a Probe"),
        (_raw(_head([1], [["a", "<f4", [2]]]), b"\0" * 8), "not a Probe"),  # a tensor without its shared list
        (_raw(_head([1], [["a", "<f4", [3, 2], [[1, 3, 7, 0]] * 2]])), "2 shared rows for shape"),
        (_raw(_head([1], [["a", "<f4", [2], [[1, 3, 7, 0]]]])), "cannot open the sender's segment|is '"),
    ],
)
def test_malformed_messages_raise_wire_errors(message, match):
    with pytest.raises(WireError, match=match):
        unpack(message, Probe)


def test_a_stage_message_that_contradicts_its_route_is_refused_at_decoding():
    ok = StageMsg(1, 0, ("a", "b"), ("tcp://x:1", "tcp://y:2"), 2, (Reservation(None, 0, 1, 2),) * 2)
    assert unpack(_message(ok), StageMsg)[0] == ok
    for bad in ({"stage": 2}, {"addresses": ("tcp://x:1",)}, {"timing": ()}, {"batch": 0}, {"links": (None,)}):
        fields = {**msgspec.structs.asdict(ok), **bad}
        raw = _raw(_head(list(fields.values()), []))
        with pytest.raises(WireError, match="not a StageMsg"):
            unpack(raw, StageMsg)
    with pytest.raises(WireError, match="not a StageMsg"):  # a report is not a stage message
        unpack(_message(StageReport(1, 0, "a")), StageMsg)


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
            reports.append(unpack(message, StageReport))
            if sum(1 + len(h.carried) for h, _ in reports) == 3 * 4:
                done.set()

        inbox = Inbox(on_report)

        def runner(k):
            async def run(msg, tensors):
                x = tensors["x"]
                assert msg.stage == k and msg.route[k] == f"v{k}" and msg.batch == len(x)
                start = msg.timing[k].start_us + (5000.0 if (msg.batch_id, k) in late else 0.0)
                return StageResult(StageReport(msg.batch_id, k, msg.route[k], start, start + 5.0), {"x": x + k + 1}, 1.0)

            return run

        servers = [StageServer(f"v{k}", runner(k)) for k in range(3)]
        addrs = [s.open(inbox.address) for s in servers]
        for k in range(2):
            servers[k].connect([addrs[k + 1]])
        out = Outbox()
        for b in range(4):
            timing = tuple(Reservation(None, 0.0, 100.0 * b + 10 * k, 100.0 * b + 10 * k + 5) for k in range(3))
            message = StageMsg(b, 0, ("v0", "v1", "v2"), tuple(addrs), 2, timing, None, tol, 0.0)
            out.send(addrs[0], pack(message, {"x": np.full(2, 10.0 * b, np.float32)}))
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
        assert rep.carried == ()  # no tolerance: every stage reports on its own
        by_batch.setdefault(rep.batch_id, []).append((rep.stage, tensors))
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
        messages.setdefault(rep.batch_id, []).append(([c.stage for c in rep.carried], rep.stage, tensors))
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


def test_a_failing_stage_reports_its_error_and_forwards_nothing():
    async def main():
        got = []
        inbox = Inbox(lambda message: got.append(unpack(message, StageReport)[0]))

        async def boom(*args):
            raise ValueError("bad input")

        forwarded = []
        nxt = Inbox(lambda message: forwarded.append(message))
        s = StageServer("v0", boom)
        addr = s.open(inbox.address)
        message = StageMsg(9, 0, ("v0", "v1"), (addr, nxt.address), 1, (Reservation(None, 0, 0, 0),) * 2, sent_us=0.0)
        out = Outbox()  # kept open: closing a socket drops what it has not sent yet
        out.send(addr, pack(message, {"x": np.zeros(1)}))
        for _ in range(200):
            await asyncio.sleep(0.01)
            if got:
                break
        await asyncio.sleep(0.05)
        s.close(), inbox.close(), nxt.close(), out.close()
        return got, forwarded

    got, forwarded = asyncio.run(main())
    assert got == [StageReport(9, 0, "v0", error="ValueError: bad input")]
    assert forwarded == []


def test_a_peer_that_is_not_reading_fails_the_send_instead_of_blocking(monkeypatch):
    monkeypatch.setattr("ppipe.runtime.wire.datapath.MAX_BUFFERED_BYTES", 1000)

    async def main():
        box = Outbox()
        with pytest.raises(DataPathFull, match="bytes already wait for tcp://127.0.0.1:9, which is not connected"):
            for _ in range(100):  # nobody listens on port 9: the queue fills and the send says so
                box.send("tcp://127.0.0.1:9", pack(Probe(1), {"x": np.zeros(100)}))
        box.close()

    asyncio.run(main())


def test_messages_split_and_merged_by_the_stream_arrive_whole_and_in_order():
    """Large messages span many reads and small ones share a read: the receiver cuts the
    stream at the length prefixes either way."""

    async def main():
        got = []
        done = asyncio.Event()
        inbox = Inbox(lambda m: (got.append(unpack(m, Probe)), len(got) == 60 and done.set()))
        out = Outbox()
        for i in range(60):
            n = 300_000 if i % 10 == 0 else 3
            out.send(inbox.address, pack(Probe(i), {"x": np.full(n, i, np.float32)}))
        await asyncio.wait_for(done.wait(), 20)
        out.close(), inbox.close()
        return got

    got = asyncio.run(main())
    assert [h.i for h, _ in got] == list(range(60))
    assert all(t["x"].size == (300_000 if h.i % 10 == 0 else 3) and np.all(t["x"] == h.i) for h, t in got)


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


# ---- receiving in place, sending without joining ---------------------------------------------------------
class _FakeInbox:
    address = "tcp://127.0.0.1:0"
    handshake = None  # connections not authenticated (tests/runtime/test_datapath_auth.py covers the handshake)

    def __init__(self):
        self.conns, self.got = set(), []

    def deliver(self, message):
        self.got.append(message)


class _FakeReadTransport:
    def __init__(self):
        self.closed = False

    def close(self):
        self.closed = True


def _receiver():
    r = _Receiver(_FakeInbox())
    r.connection_made(_FakeReadTransport())
    return r


def _feed(r, data: bytes, chunk: int) -> list:
    """Feed ``data`` to a receiver the way the transport does: read at most ``chunk`` bytes
    into each buffer ``get_buffer`` hands out; returns those buffers."""
    bufs, pos = [], 0
    while pos < len(data):
        buf = r.get_buffer(-1)
        n = min(chunk, len(buf), len(data) - pos)
        buf[:n] = data[pos : pos + n]
        bufs.append(buf)
        r.buffer_updated(n)
        pos += n
    return bufs


def _wire_bytes(header, tensors=None) -> bytes:
    return b"".join(bytes(p) for p in pack(header, tensors))


@pytest.mark.parametrize("chunk, floats", [(1, 3_000), (7, 40_000), (64 * 1024, 300_000)])
def test_a_message_in_many_small_reads_is_delivered_whole(chunk, floats):
    x = np.random.default_rng(chunk).standard_normal(floats).astype(np.float32)  # 300_000: more than the shared buffer
    data = _wire_bytes(Probe(1), {"x": x}) + _wire_bytes(Probe(2))
    r = _receiver()
    _feed(r, data, chunk)
    assert len(r.inbox.got) == 2 and not r.transport.closed
    (h1, t1), (h2, t2) = (unpack(m, Probe) for m in r.inbox.got)
    assert h1 == Probe(1) and t1["x"].tobytes() == x.tobytes() and (h2, t2) == (Probe(2), {})


def test_two_messages_in_one_read_are_both_delivered_and_survive_the_next_read():
    a, b = _wire_bytes(Probe(1), {"x": np.arange(5, dtype=np.int16)}), _wire_bytes(Probe(2))
    r = _receiver()
    _feed(r, a + b + a[:3], len(a + b) + 3)  # two messages and the start of a length prefix
    assert [unpack(m, Probe)[0].i for m in r.inbox.got] == [1, 2]
    _feed(r, a[3:] + b"\xff" * 64, len(a))  # overwrites the shared buffer the first two were read into
    (h1, t1), _, (h3, t3) = (unpack(m, Probe) for m in r.inbox.got)
    assert h1 == h3 == Probe(1) and t1["x"].tolist() == t3["x"].tolist() == [0, 1, 2, 3, 4]


def test_a_bad_length_prefix_closes_the_connection_after_the_messages_before_it(caplog):
    r = _receiver()
    _feed(r, _wire_bytes(Probe(1)) + (3).to_bytes(4, "little") + b"xyz", 1 << 20)
    assert [unpack(m, Probe)[0] for m in r.inbox.got] == [Probe(1)]
    assert r.transport.closed and "a message of 3 bytes is malformed" in caplog.text


def test_a_big_message_is_read_into_one_buffer_of_its_own_whatever_the_number_of_reads():
    """The receive cost is linear: after the first read, every read of a message lands in
    place in the message's own buffer (the view handed out is of that buffer, just past
    what came), and that buffer, not a copy, is delivered, read-only."""
    x = np.random.default_rng(0).standard_normal(2_000_000).astype(np.float16)
    data = _wire_bytes(Probe(1), {"x": x})
    r = _receiver()
    bufs = _feed(r, data, 64 * 1024)
    own = bufs[1].obj
    assert bufs[0].obj is not own  # the first read: the shared buffer, for the length prefix
    assert all(b.obj is own for b in bufs[1:]) and len(bufs) == -(-len(data) // (64 * 1024))
    assert [len(b) for b in bufs[1:]] == [len(data) - k * 64 * 1024 for k in range(1, len(bufs))]
    (message,) = r.inbox.got
    assert message.obj is own and message.readonly
    _, tensors = unpack(message, Probe)
    assert np.shares_memory(tensors["x"], np.asarray(own)) and not tensors["x"].flags.writeable
    assert tensors["x"].tobytes() == x.tobytes()


@pytest.mark.parametrize("loop", ["asyncio", "uvloop"])
def test_a_13_mb_tensor_round_trips_byte_exact_over_loopback(loop):
    if loop == "uvloop":
        uvloop = pytest.importorskip("uvloop")
    x = np.random.default_rng(13).standard_normal(13 * 2**20 // 2).astype(np.float16)

    async def main():
        got = asyncio.get_running_loop().create_future()
        inbox = Inbox(lambda m: got.set_result(unpack(m, Probe)))
        out = Outbox()
        out.send(inbox.address, pack(Probe(1), {"x": x, "y": np.arange(3)}))
        header, tensors = await asyncio.wait_for(got, 20)
        out.close(), inbox.close()
        return header, tensors

    header, tensors = asyncio.run(main()) if loop == "asyncio" else uvloop.run(main())
    assert header == Probe(1) and tensors["y"].tolist() == [0, 1, 2]
    assert tensors["x"].dtype == np.float16 and tensors["x"].view(np.uint16).tobytes() == x.view(np.uint16).tobytes()


class _FakeWriteTransport(asyncio.WriteTransport):
    """Takes ``capacity`` bytes per write into the "socket" and buffers the rest, as
    asyncio's transports do; ``writelines`` is the base class's, which joins."""

    def __init__(self, protocol, capacity: int):
        super().__init__()
        self.protocol, self.capacity, self.writes, self.buffered = protocol, capacity, [], 0

    def set_write_buffer_limits(self, high=None, low=None):
        assert high == 0

    def get_write_buffer_size(self):
        return self.buffered

    def is_closing(self):
        return False

    def write(self, data):
        self._take([data])

    def _take(self, pieces):
        self.writes.append(pieces)
        self.buffered += max(0, sum(len(p) for p in pieces) - self.capacity)
        if self.buffered:
            self.protocol.pause_writing()

    def drain(self):
        self.buffered = 0
        self.protocol.resume_writing()


class _FakeGatheringTransport(_FakeWriteTransport):
    def writelines(self, pieces):  # its own: one writev, no join
        self._take(list(pieces))


@pytest.mark.parametrize("gathers", [False, True])
def test_a_sender_hands_the_transport_views_of_the_tensor_a_chunk_at_a_time(gathers):
    from ppipe.runtime.wire import datapath

    chunk = datapath.WRITE_CHUNK_BYTES
    x = np.arange(int(2.5 * chunk) // 4, dtype=np.float32)
    s = datapath._Sender(Outbox(), "tcp://127.0.0.1:9")
    s.send(pack(Probe(1), {"x": x}))  # not connected yet: queued
    t = (_FakeGatheringTransport if gathers else _FakeWriteTransport)(s, capacity=chunk // 2)
    s.connection_made(t)
    assert s.gathers is gathers
    assert len(t.writes) == 2 and s.paused  # the socket is full: the rest waits, uncopied
    while s.queue:
        t.drain()
    pieces = [p for w in t.writes for p in w]
    assert all(sum(len(p) for p in w) <= chunk + 1024 for w in t.writes)
    tensor_pieces = [p for p in pieces if isinstance(p, memoryview)]
    head = datapath.HEAD_START_BYTES
    # where the transport gathers, the header rides with a short first write: the receiver starts reading early
    expected = [head, chunk, chunk, x.nbytes - 2 * chunk - head] if gathers else [chunk, chunk, x.nbytes - 2 * chunk]
    assert [len(p) for p in tensor_pieces] == expected
    assert all(p.obj is x for p in tensor_pieces)  # views of the array: nothing copied
    assert len(t.writes) == 4 and (len(t.writes[0]) == 2) is gathers  # header + head start in one writev, or alone
    assert b"".join(bytes(p) for p in pieces) == _wire_bytes(Probe(1), {"x": x})


def test_a_sender_joins_a_header_and_its_small_tensors_into_one_write():
    from ppipe.runtime.wire import datapath

    s = datapath._Sender(Outbox(), "tcp://127.0.0.1:9")
    t = _FakeWriteTransport(s, capacity=1 << 30)
    s.connection_made(t)
    s.send(pack(Probe(1), {"x": np.zeros(3), "y": np.ones(2, np.int8)}))
    assert len(t.writes) == 1 and bytes(t.writes[0][0]) == _wire_bytes(Probe(1), {"x": np.zeros(3), "y": np.ones(2, np.int8)})


def test_a_peer_that_cannot_be_reached_drops_its_queue_with_one_warning(caplog):
    async def main():
        box = Outbox()
        box.send("tcp://127.0.0.1:9", pack(Probe(1), {"x": np.zeros(100)}))  # nobody listens on port 9
        for _ in range(200):
            await asyncio.sleep(0.01)
            if "tcp://127.0.0.1:9" not in box.peers:
                break
        box.close()
        return box

    box = asyncio.run(main())
    assert box.peers == {} and "cannot connect to tcp://127.0.0.1:9" in caplog.text
    assert f"{len(_wire_bytes(Probe(1), {'x': np.zeros(100)}))} queued bytes dropped" in caplog.text
