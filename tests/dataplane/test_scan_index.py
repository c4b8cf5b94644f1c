"""The pools' gap heap (Pool.scan_set): probe visits fewer vGPUs and decides exactly the same.

The index is a speed-up only. These tests pin the two things it must guarantee: it never
leaves out a vGPU that could finish by the limit (whatever updates the tables saw), and a
scheduler using it takes the same decisions, decision for decision, as one scanning every
vGPU of every pool.
"""

from __future__ import annotations

import random

import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from ppipe.dataplane import build_scheduler, reservation
from ppipe.dataplane.api import Request
from ppipe.dataplane.tables import ReservationTable
from ppipe.dataplane.testing import ManualClock, ToyModel, ToyPartition, ToyPipeline, replay, toy_cluster, toy_plan, toy_profile
from ppipe.dataplane.topology import Pool, VGpu


def _pool(n: int, infer_us: dict[int, float]) -> Pool:
    pool = Pool(0, 0, 0, "A", 1)
    pool.infer_us = dict(infer_us)
    nic = ReservationTable("nic")
    for i in range(n):
        g = VGpu(f"s{i // 2}/gpu{i % 2}/s0", f"s{i // 2}", "A", 1, nic, nic, 8.0)
        g.pool = pool
        pool.vgpus.append(g)
    pool.vgpus.sort(key=lambda g: g.id)
    pool.refresh()
    return pool


_op = st.tuples(
    st.sampled_from(["add", "add", "add", "remove", "correct", "delay", "prune", "query", "query"]),
    st.integers(0, 7),  # vGPU
    st.floats(0, 400),  # a time offset
    st.floats(0, 300),  # a duration / limit offset
)


@settings(max_examples=150, deadline=None)
@given(ops=st.lists(_op, min_size=1, max_size=80), lat=st.sampled_from([(50.0, 80.0), (1e-3, 200.0), (100.0, 100.0)]))
# Found once: a report of no time left an empty interval that the next reservation overlapped.
@example(ops=[("add", 0, 0.0, 0.0), ("correct", 0, 2.220446049250313e-16, 0.0), ("add", 0, 0.0, 0.0)], lat=(50.0, 80.0))
def test_scan_set_never_leaves_out_a_vgpu_that_could_finish_by_the_limit(ops, lat):
    infer = {1: lat[0], 2: lat[1]}
    pool = _pool(8, infer)
    now = 0.0
    last_query = 0.0  # the data plane's queries never go back in time
    keys: list[tuple[int, object]] = []
    for n, (kind, gi, dt, dd) in enumerate(ops):
        g = pool.vgpus[gi]
        tab = g.table
        if kind == "add":
            l = infer[1 + (n % 2)]
            s = tab.earliest(now + dt, l)
            tab.add(s, l, n)
            keys.append((gi, n))
        elif kind in ("remove", "correct", "delay") and keys:
            vi, key = keys.pop(int(dt) % len(keys))
            t = pool.vgpus[vi].table
            if kind == "remove":
                t.remove(key)
            elif kind == "correct":
                t.correct(key, now + dt / 2, now + dt / 2 + dd, now=now)
            else:
                t.delay(key, now + dt)
        elif kind == "prune":
            now = max(now + dt / 4, last_query)  # time moves on; queries never start before it
            for h in pool.vgpus:
                h.table.prune(now)
        elif kind == "query":
            t = last_query = max(last_query, now + dt / 8)
            l = infer[1 + (n % 2)]
            limit = t + l + dd
            got = pool.scan_set(t, l, limit)
            assert got is not None
            assert [x.id for x in got] == sorted(x.id for x in got)
            need = {h.id for h in pool.vgpus if h.table.earliest(t, l) + l <= limit}
            assert need <= {x.id for x in got}


def test_scan_set_declines_a_query_earlier_than_its_entries():
    pool = _pool(4, {1: 10.0})
    assert pool.scan_set(100.0, 10.0, 200.0) is not None
    assert pool.scan_set(50.0, 10.0, 200.0) is None  # entries were brought up to date at 100


def test_scan_set_leaves_out_busy_vgpus():
    pool = _pool(6, {1: 10.0})
    for i, g in enumerate(pool.vgpus):
        g.table.add(0.0, 100.0 * (i + 1))  # vGPU i is busy until 100 (i + 1)
    got = pool.scan_set(0.0, 10.0, 215.0)  # only those free by 205 can finish by 215
    assert [g.id for g in got] == [g.id for g in pool.vgpus[:2]]


def _world(lookahead: bool, **options):
    # Two pools on two GPU types over several servers: 8 vGPUs (A) then 12 (B); feature
    # maps cross NICs unless both stages share a server.
    cluster = toy_cluster([("a", "A", 2, 4, 8.0), ("b", "B", 4, 3, 8.0)])
    prof = toy_profile("m", {"A": [100.0, 300.0], "B": [120.0, 290.0]}, out_bytes=[20_000, 10], batches=(1, 2, 4))
    pool0 = [(f"a-{i // 2}", i % 2, 0) for i in range(8)]
    pool1 = [(f"b-{i // 4}", i % 4, 0) for i in range(12)]
    plan = toy_plan(cluster, [ToyModel("m", 4.0, [ToyPipeline(2, [ToyPartition(0, 0, "A", 1, pool0), ToyPartition(1, 1, "B", 1, pool1)])])])
    clock = ManualClock()
    return build_scheduler(plan, {"m": prof}, cluster, clock, probe_lookahead=lookahead, **options), clock


def _requests(n: int, mean_gap_us: float, seed: int) -> list[Request]:
    rnd = random.Random(seed)
    t, out = 0.0, []
    for i in range(n):
        t += rnd.expovariate(1.0 / mean_gap_us)
        out.append(Request(i, "m", t, t + 4000.0))
    return out


@pytest.mark.parametrize("lookahead", [True, False])
@pytest.mark.parametrize("jitter", [0.0, 0.3])
def test_indexed_probe_decides_exactly_as_the_full_scan(monkeypatch, lookahead, jitter):
    reqs = _requests(1500, 22.0, seed=7)  # about the pools' capacity: queues, gaps, drops
    failures = [(9000.0, "b-1/gpu2/s0"), (21000.0, "a-3/gpu0/s0")]
    runs = []
    visited = []
    real = Pool.scan_set

    def counting(self, tau, l_i, limit):
        got = real(self, tau, l_i, limit)
        if got is not None:
            visited.append((len(got), len(self.vgpus)))
        return got

    for indexed in (True, False):
        with monkeypatch.context() as m:
            m.setattr(reservation, "_INDEX_MIN_VGPUS", 1)  # every pool uses the index (the 8-vGPU one too)
            m.setattr(Pool, "scan_set", counting if indexed else (lambda self, tau, l_i, limit: None))
            s, clock = _world(lookahead)
            log, outcome = replay(s, clock, reqs, jitter=jitter, seed=3, failures=failures)
        runs.append((log, outcome, s.stats()))
    assert runs[0][0] == runs[1][0]  # every decision, in order, field for field
    assert runs[0][1] == runs[1][1]
    assert runs[0][2] == runs[1][2]
    assert len(runs[0][0]) > 1500
    # and the index did prune: on average the subset is well under the pool
    assert visited and sum(a for a, _ in visited) < 0.5 * sum(b for _, b in visited)
