"""Inputs handed to a worker on this machine through shared memory (ppipe.runtime.wire.shared_inputs)."""

from __future__ import annotations

import gc
import os
import subprocess
import sys
import threading

import httpx
import msgspec
import numpy as np
import pytest

from ppipe.runtime.ingress.protocol import decode_infer_response, encode_infer_request
from ppipe.runtime.wire import shared_inputs
from ppipe.runtime.wire.frames import Rows, SharedTensorError, WireError, pack, unpack
from ppipe.runtime.wire.shared_inputs import InputArena, SharedMaps, SharedRef, slot_bytes

from .conftest import tinynet_served
from .tinynet import reference

pytestmark = pytest.mark.skipif(not hasattr(os, "memfd_create"), reason="needs memfd_create (Linux)")


class Probe(msgspec.Struct, array_like=True):
    i: int


def test_slot_sizes_are_powers_of_two_then_whole_mebibytes():
    assert [slot_bytes(n) for n in (1, 4096, 4097, 600_000, 1 << 20)] == [4096, 4096, 8192, 1 << 20, 1 << 20]
    assert slot_bytes(12_800_064) == 13 << 20


def test_a_slot_comes_back_when_its_last_view_is_gone():
    arena = InputArena(min_bytes=0)
    a = arena.take(1000)
    a[:] = 7
    start = arena.locate(a).offset
    view = np.frombuffer(memoryview(a[8:])[:16], np.float32)  # a view of a view: it keeps the slot
    del a
    gc.collect()
    b = arena.take(1000)
    assert arena.locate(b).offset != start  # the first slot is still held by `view`
    assert (view.view(np.uint8) == 7).all()
    del view
    gc.collect()
    c = arena.take(1000)
    assert arena.locate(c).offset == start  # handed back, and handed out again
    assert arena.held_bytes == shared_inputs.SEGMENT_BYTES  # one segment served all three


def test_the_arena_gives_nothing_under_its_minimum_or_past_its_limit():
    arena = InputArena(limit_bytes=3 << 20, min_bytes=1024)
    assert arena.take(1023) is None
    held = [arena.take(1 << 20) for _ in range(3)]
    assert all(h is not None for h in held)
    assert arena.take(1 << 20) is None and arena.held_bytes == 3 << 20
    assert arena.locate(np.zeros(4096, np.uint8)) is None  # ordinary memory is not in the arena


def test_a_body_is_placed_with_its_tensors_on_a_64_byte_boundary():
    arena = InputArena(min_bytes=0)
    body = arena.body(537, lead=37)
    assert len(body) == 537 and not body.readonly
    assert np.frombuffer(body, np.uint8)[37:].ctypes.data % 64 == 0


def _child_sums(message: bytes) -> list[float]:
    """Unpack ``message`` in another process: the sum of each tensor there."""
    code = ("import sys, json; from ppipe.runtime.wire.frames import unpack; import msgspec\n"
            "class Probe(msgspec.Struct, array_like=True):\n    i: int\n"
            "m, t = unpack(sys.stdin.buffer.read(), Probe)\n"
            "print(json.dumps([m.i] + [[list(a.shape), float(a.astype('f8').sum())] for a in t.values()]))")
    out = subprocess.run([sys.executable, "-c", code], input=message, capture_output=True, check=True)
    import json

    return json.loads(out.stdout)


def test_rows_in_the_arena_cross_to_another_process_without_their_bytes():
    arena = InputArena(min_bytes=0)
    rng = np.random.default_rng(0)
    want = rng.normal(size=(3, 3, 224, 224)).astype(np.float32)
    rows = []
    for x in want:
        slot = arena.take(x.nbytes)
        row = slot.view(np.float32).reshape(x.shape)
        row[:] = x
        rows.append(row)
    pieces = pack(Probe(5), {"one": Rows(rows[:1]), "three": Rows(rows)}, arena)
    assert len(pieces) == 1 and len(pieces[0]) < 200  # the header only: no tensor bytes on the wire
    got = _child_sums(pieces[0][4:])
    assert got[0] == 5
    assert got[1][0] == [1, 3, 224, 224] and got[1][1] == pytest.approx(float(want[0].astype("f8").sum()), rel=1e-9)
    assert got[2][0] == [3, 3, 224, 224] and got[2][1] == pytest.approx(float(want.astype("f8").sum()), rel=1e-9)
    # rows not all in the arena go inline, stacked, as before
    mixed = pack(Probe(6), {"x": Rows([rows[0], want[1]])}, arena)
    assert sum(len(memoryview(p).cast("B")) for p in mixed[1:]) == 2 * want[0].nbytes
    np.testing.assert_array_equal(unpack(b"".join(bytes(p) for p in mixed)[4:], Probe)[1]["x"], want[:2])


def test_a_ref_to_anything_but_a_shared_input_segment_is_refused(tmp_path):
    with open(tmp_path / "f", "wb+") as fh:
        fh.write(b"\0" * 8192)
        fh.flush()
        ref = SharedRef(os.getpid(), fh.fileno(), 1, 0)
        with pytest.raises(shared_inputs.SharedInputError, match="not the shared-input segment"):
            SharedMaps().array(ref, 16)
    arena = InputArena(min_bytes=0)
    slot = arena.take(4096)
    good = arena.locate(slot)
    maps = SharedMaps()
    assert maps.array(good, 4096).nbytes == 4096
    with pytest.raises(shared_inputs.SharedInputError, match="outside"):
        maps.array(good._replace(offset=shared_inputs.SEGMENT_BYTES - 8), 16)
    with pytest.raises(shared_inputs.SharedInputError, match="not the shared-input segment"):
        SharedMaps().array(good._replace(serial=good.serial + 1), 16)  # a segment of another serial
    # on the wire: the message's header comes with the error, so a worker can fail its batch
    message = b"".join(bytes(p) for p in pack(Probe(9), {"x": Rows([slot])}, arena))[4:]
    bad = message.replace(good.serial.to_bytes(8, "big"), (good.serial ^ 1).to_bytes(8, "big"))
    assert bad != message
    with pytest.raises(SharedTensorError) as err:
        unpack(bad, Probe, SharedMaps())
    assert err.value.header == Probe(9) and isinstance(err.value, WireError)


@pytest.fixture(scope="module")
def served_shared(tinynet, tmp_path_factory):
    """tinynet served (conftest.tinynet_served), this process's arena taking every body."""
    arena = InputArena(min_bytes=0)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(shared_inputs, "_arena", arena)
        mp.setattr(shared_inputs, "_arena_made", True)
        with tinynet_served(tinynet, tmp_path_factory) as (url, rt):
            yield url, rt, arena


def test_binary_bodies_reach_the_workers_through_shared_memory_and_answer_right(served_shared, tinynet):
    url, rt, arena = served_shared
    rng = np.random.default_rng(2)
    xs = rng.normal(size=(5, 3, 8, 8)).astype(np.float32)
    with httpx.Client(base_url=url, timeout=30) as c:
        for x in xs:
            body, headers = encode_infer_request({"input": x[None]}, binary=True)
            r = c.post("/v2/models/tinynet/infer", content=body, headers=headers)
            assert r.status_code == 200, r.text
            got = decode_infer_response(r.content, r.headers.get("inference-header-content-length"))["logits"]
            np.testing.assert_allclose(got, reference(tinynet.directory, x[None]), rtol=2e-2, atol=2e-2)
        sent_alone = arena.located
        assert sent_alone >= len(xs)  # every sample's row was named, not sent
        body, headers = encode_infer_request({"input": xs}, binary=True)  # rows of one body, batched
        r = c.post("/v2/models/tinynet/infer", content=body, headers=headers)
        assert r.status_code == 200, r.text
        got = decode_infer_response(r.content, r.headers.get("inference-header-content-length"))["logits"]
        np.testing.assert_allclose(got, reference(tinynet.directory, xs), rtol=2e-2, atol=2e-2)
        assert arena.located >= sent_alone + len(xs)
        # a JSON body is not the binary extension: ordinary memory, on the socket
        body, headers = encode_infer_request({"input": xs[:1]})
        before = arena.located
        r = c.post("/v2/models/tinynet/infer", content=body, headers=headers)
        assert r.status_code == 200 and arena.located == before
    assert any(len(t.request_ids) > 1 for t in rt.traces if t.error is None)


def test_a_stage_whose_shared_inputs_cannot_be_mapped_fails_its_batch_with_why():
    import asyncio

    from ppipe.runtime.wire.datapath import Inbox, Outbox
    from ppipe.runtime.wire.messages import Reservation, StageMsg, StageReport
    from ppipe.runtime.workers.stage_server import StageServer

    arena = InputArena(min_bytes=0)
    slot = arena.take(4096)

    async def main():
        got, ran = [], []
        inbox = Inbox(lambda message: got.append(unpack(message, StageReport)[0]))

        async def run(*args):
            ran.append(args)

        s = StageServer("v0", run)
        addr = s.open(inbox.address)
        message = StageMsg(9, 0, ("v0",), (addr,), 1, (Reservation(None, 0, 0, 0),), sent_us=0.0)
        pieces = pack(message, {"x": Rows([slot])}, arena)
        ref = arena.locate(slot)
        pieces[0] = pieces[0].replace(ref.serial.to_bytes(8, "big"), (ref.serial ^ 1).to_bytes(8, "big"))  # a segment gone
        out = Outbox()
        out.send(addr, pieces)
        for _ in range(200):
            await asyncio.sleep(0.01)
            if got:
                break
        s.close(), inbox.close(), out.close()
        return got, ran

    got, ran = asyncio.run(main())
    assert not ran and len(got) == 1
    assert got[0].batch_id == 9 and got[0].error.startswith("SharedTensorError: tensor 'x':")


@pytest.mark.parametrize("value, on", [("0", False), ("-1", False), ("lots", False), ("8", True), (None, True)])
def test_ppipe_shared_inputs_mb_sizes_or_turns_off_the_arena(monkeypatch, value, on):
    if value is None:
        monkeypatch.delenv("PPIPE_SHARED_INPUTS_MB", raising=False)
    else:
        monkeypatch.setenv("PPIPE_SHARED_INPUTS_MB", value)
    monkeypatch.setattr(shared_inputs, "_arena", None)  # (both restored after the test)
    monkeypatch.setattr(shared_inputs, "_arena_made", False)  # made anew on the next use
    arena = shared_inputs.process_arena()
    assert (arena is not None) == on
    if value == "8":
        assert arena.limit_bytes == 8 << 20


def test_a_trim_gives_back_the_pages_of_free_slots_and_keeps_those_in_use():
    arena = InputArena(min_bytes=0, keep_resident=0)
    held, freed = arena.take(1 << 20), arena.take(1 << 20)
    held[:], freed[:] = 1, 2  # their pages are written: resident in the memfd
    seg = arena._segments[0]
    del freed
    gc.collect()
    resident = os.fstat(seg.fd).st_blocks * 512
    assert resident >= 2 << 20
    assert arena.trim() == 1 << 20  # the free slot's pages, not the held one's
    assert os.fstat(seg.fd).st_blocks * 512 <= resident - (1 << 20)
    assert (held == 1).all()
    assert arena.trim() == 0  # nothing written since


def test_a_forked_child_makes_an_arena_of_its_own():
    """The parent's arena is the parent's: a forked child's first use makes a new one, with its pid."""
    parent = shared_inputs.process_arena()
    if parent is None:
        pytest.skip("shared inputs are off here (PPIPE_SHARED_INPUTS_MB=0, or no memfd)")
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: say whether its arena is new and its own, then leave at once
        child = shared_inputs.process_arena()
        os.write(w, b"1" if child is not None and child is not parent and child.pid == os.getpid() else b"0")
        os._exit(0)
    os.close(w)
    said = os.read(r, 1)
    os.waitpid(pid, 0)
    assert said == b"1"
    assert shared_inputs.process_arena() is parent


def test_a_slot_given_back_inside_the_arenas_own_lock_does_not_stop_the_thread():
    """The last view of a slot may go inside the arena's locked sections of the same thread
    (the cyclic collector runs inside any allocation there): giving it back must not wait
    for that lock. The slot is on its free list again afterwards."""
    arena = InputArena(min_bytes=0)
    held = [arena.take(1000)]

    def drop_inside_the_lock():
        with arena._lock:
            held.clear()  # the slot's finalizer runs here, on this thread, with the lock held

    t = threading.Thread(target=drop_inside_the_lock, daemon=True)
    t.start()
    t.join(10)
    assert not t.is_alive(), "giving a slot back inside the arena's lock stopped the thread"
    assert arena.lent_bytes == 0
    again = arena.take(1000)
    assert again is not None and arena.lent_bytes == slot_bytes(1000)


def test_a_trim_leaves_the_slots_taken_next_resident_and_prefault_writes_them_ahead():
    arena = InputArena(min_bytes=0, keep_resident=2)
    assert arena.prefault(1 << 20) == 2
    seg = arena._segments[0]
    assert os.fstat(seg.fd).st_blocks * 512 >= 2 << 20  # written ahead: resident
    assert arena.trim() == 0  # the two slots taken next stay
    burst = [arena.take(1 << 20) for _ in range(5)]
    for b in burst:
        b[:] = 3
    del burst, b
    gc.collect()
    assert arena.trim() == 3 << 20  # the burst's other three go back
    assert os.fstat(seg.fd).st_blocks * 512 <= 3 << 20
    assert arena.trim() == 0
