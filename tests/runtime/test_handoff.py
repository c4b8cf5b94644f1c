"""Feature maps to a worker on this machine through shared memory (ppipe.runtime.wire.handoff)."""

from __future__ import annotations

import asyncio
import gc

import numpy as np
import pytest

from ppipe.runtime.wire.datapath import Inbox, Outbox
from ppipe.runtime.wire.frames import pack, unpack
from ppipe.runtime.wire.handoff import MIN_MAP_BYTES, SEAL_BYTES, MapHandoff, MapReused, check_seals
from ppipe.runtime.wire.messages import Reservation, Seal, StageMsg, StageReport
from ppipe.runtime.wire.shared_inputs import InputArena, SharedMaps
from ppipe.runtime.workers.stage_server import StageResult, StageServer

MAP = (np.arange(300_000) % 2048).astype(np.float16).reshape(3, 100, 1000)  # 0.6 MB, as ResNet-50's maps are


def _msg(stage: int = 1, seals: tuple[Seal, ...] = ()) -> StageMsg:
    timing = (Reservation(None, 0, 0, 0), Reservation(0, 0, 0, 0))
    return StageMsg(4, stage, ("v0", "v1"), ("tcp://127.0.0.1:1", "tcp://127.0.0.1:2"), 3, timing, sent_us=0.0, seals=seals)


def _wire(pieces: list) -> bytes:
    return b"".join(bytes(p) for p in pieces)[4:]


def test_a_map_crosses_by_where_it_lies_and_its_seal_holds():
    handoff = MapHandoff(InputArena())
    placed, seals = handoff.place({"y": MAP}, hold_until_us=2e6, now_us=1e6)
    message = _wire(pack(_msg(seals=seals), placed, handoff.arena))
    assert len(message) < 1000  # the map's bytes stayed in shared memory
    maps = SharedMaps()
    msg, tensors = unpack(message, StageMsg, maps)
    np.testing.assert_array_equal(tensors["y"], MAP)
    assert msg.seals == seals and len(seals) == 1 and seals[0].token != 0
    check_seals(msg.seals, maps)  # nothing wrote the slot since
    assert handoff.held == 1


def test_a_slot_reused_after_its_hold_fails_the_stage_that_still_reads_it():
    handoff = MapHandoff(InputArena())
    placed, first = handoff.place({"y": MAP}, hold_until_us=1e6, now_us=0.0)
    maps = SharedMaps()
    _, tensors = unpack(_wire(pack(_msg(seals=first), placed, handoff.arena)), StageMsg, maps)
    del placed
    gc.collect()
    check_seals(first, maps)  # held: still the map sent
    _, second = handoff.place({"y": MAP[::-1].copy()}, hold_until_us=3e6, now_us=2e6)  # the first hold has ended
    assert second[0].ref == first[0].ref  # the same slot, written again
    with pytest.raises(MapReused, match="reused before this stage ended"):
        check_seals(first, maps)
    assert not np.array_equal(tensors["y"], MAP)  # what a late stage would have computed on
    check_seals(second, maps)


def test_small_maps_and_a_full_arena_go_on_the_socket():
    assert MapHandoff(InputArena()).place({"y": np.zeros(100, np.float16)}, 1.0, 0.0) is None  # under the arena's minimum
    full = MapHandoff(InputArena(limit_bytes=512 << 10))
    assert full.place({"y": MAP}, 1.0, 0.0) is None and full.held == 0
    assert MapHandoff(InputArena()).place({"y": np.array([object()] * 10000)}, 1.0, 0.0) is None
    served = MapHandoff.for_this_process()  # as a worker makes it: from MIN_MAP_BYTES up
    assert served.place({"y": np.zeros(MIN_MAP_BYTES // 4, np.float16)}, 1.0, 0.0) is None
    assert served.place({"y": np.zeros(MIN_MAP_BYTES // 2, np.float16)}, 1.0, 0.0) is not None


def test_the_seal_is_ahead_of_the_map_in_its_slot():
    handoff = MapHandoff(InputArena())
    placed, (seal,) = handoff.place({"y": MAP}, 1.0, 0.0)
    assert handoff.arena.locate(placed["y"]).offset == seal.ref[3] + SEAL_BYTES


def test_a_worker_forwards_its_output_to_a_worker_on_this_machine_through_shared_memory():
    """Three stage servers on loopback: stage 0's large output reaches stage 1 as sealed
    refs, whole; stage 1's small one goes on the socket, without stage 0's seals."""

    async def main():
        got: dict[int, tuple] = {}
        reports_got: list = []
        reports = Inbox(lambda message: reports_got.append(unpack(message, StageReport)[0]))

        def stage(k: int, out: dict):
            async def run(msg, tensors):
                got[k] = (msg, {n: np.array(t) for n, t in (tensors or {}).items()})
                return StageResult(StageReport(msg.batch_id, k, f"v{k}", 1.0 + k, 2.0 + k), out, 2.0 + k)
            return run

        servers = [StageServer("v0", stage(0, {"y": MAP})), StageServer("v1", stage(1, {"z": np.ones(8, np.float16)})),
                   StageServer("v2", stage(2, {"out": np.ones(2, np.float32)}))]
        addrs = tuple(s.open(reports.address) for s in servers)
        timing = (Reservation(None, 0, 0, 0), Reservation(0, 0, 0, 0), Reservation(0, 0, 0, 0))
        out = Outbox()
        out.send(addrs[0], pack(StageMsg(4, 0, ("v0", "v1", "v2"), addrs, 3, timing, sent_us=0.0), {"x": np.zeros(3, np.float32)}))
        for _ in range(300):
            await asyncio.sleep(0.01)
            if len(got) == 3 and len(reports_got) == 3:
                break
        held = [s.handoff.held for s in servers]
        for s in servers:
            s.close()
        out.close(), reports.close()
        return got, reports_got, held

    got, reports, held = asyncio.run(main())
    np.testing.assert_array_equal(got[1][1]["y"], MAP)
    assert len(got[1][0].seals) == 1 and held == [1, 0, 0]
    assert got[2][0].seals == () and got[2][1]["z"].tolist() == [1.0] * 8
    assert sorted(r.stage for r in reports) == [0, 1, 2] and all(r.error is None for r in reports)


def test_a_stage_whose_input_map_was_reused_reports_an_error_not_an_answer(tinynet):
    from ppipe.runtime.workers.worker import VgpuWorker, WorkerSpec
    from ppipe.spec.profile import profile_ref

    spec = WorkerSpec("v1", "localhost", 0, tinynet.name, 0, 1, 2, 2, "cpu", 1, profile_ref(tinynet))
    worker = VgpuWorker(spec, "emulated", data_loop="current")
    handoff = MapHandoff(InputArena())
    _, seals = handoff.place({"y": MAP}, 0.0, 0.0)
    stale = tuple(Seal(s.ref, s.token + 1) for s in seals)  # as after another writer's turn
    x = np.zeros((1, 8, 4, 4), np.float16)
    with pytest.raises(MapReused):
        asyncio.run(worker.run_stage(StageMsg(4, 1, ("v0", "v1"), ("tcp://a:1", "tcp://b:1"), 1,
                                              (Reservation(None, 0, 0, 0), Reservation(0, 0, 0, 0)), sent_us=0.0, seals=stale),
                                     {"h": x}))
    result = asyncio.run(worker.run_stage(StageMsg(4, 1, ("v0", "v1"), ("tcp://a:1", "tcp://b:1"), 1,
                                                   (Reservation(None, 0, 0, 0), Reservation(0, 0, 0, 0)), sent_us=0.0, seals=seals),
                                          {"h": x}))
    assert result.report.error is None


def test_the_slots_of_a_burst_give_their_pages_back_with_the_process_arena():
    from ppipe.runtime.wire.shared_inputs import trim_process_arena

    handoff = MapHandoff.for_this_process()
    assert handoff is not None
    keep = handoff.arena.keep_resident
    for t in range(keep + 3):  # a burst: that many maps held at once, one slot each
        handoff.place({"y": MAP}, hold_until_us=5.0, now_us=float(t) / 10)
    handoff.place({"y": MAP}, hold_until_us=10.0, now_us=6.0)  # the holds over: one slot again, keep + 2 free
    gc.collect()
    assert trim_process_arena() >= 2 * MAP.nbytes  # the free slots past the few taken next
    assert handoff.held == 1


def test_a_worker_writes_ahead_the_slots_its_first_maps_take():
    import os

    handoff = MapHandoff.for_this_process()
    assert handoff.prefault(MAP.nbytes) == handoff.arena.keep_resident
    (seg,) = handoff.arena._segments
    assert os.fstat(seg.fd).st_blocks * 512 >= handoff.arena.keep_resident * MAP.nbytes  # resident before any map
    placed, _ = handoff.place({"y": MAP}, 1.0, 0.0)
    assert handoff.arena.locate(placed["y"]).fd == seg.fd  # the first map takes one of them
    assert handoff.prefault(1000) == 0  # a map that goes on the socket needs none


def test_off_a_machine_that_may_reorder_stores_maps_go_on_the_socket(monkeypatch):
    import platform

    monkeypatch.setattr(platform, "machine", lambda: "aarch64")
    assert MapHandoff.for_this_process() is None
