"""probe() is Algorithm 2 with its speed-ups changing nothing: checked against a plain version.

The plain version below evaluates every live vGPU of every pool with the tables' own
queries (``earliest_slot``, ``ReservationTable.earliest``), in the probe's order (the
longest-idle vGPU, then the others by id) and with its rules (a strictly better candidate
replaces the best; the stop at the lower bound). The probe leaves candidates out (gap
heap, lower bounds), caches NIC slots per server and writes the gap search out; on random
worlds driven through feedback, failures and probes "from later", every probe must return
the plain version's path and times exactly.
"""

from __future__ import annotations

import random

import pytest

from ppipe.dataplane import build_scheduler, reservation
from ppipe.dataplane.api import Request
from ppipe.dataplane.tables import EPS_US, earliest_slot
from ppipe.dataplane.testing import ManualClock, ToyModel, ToyPartition, ToyPipeline, replay, toy_cluster, toy_plan, toy_profile

_INF = float("inf")


def plain_probe(sched, pipeline, bs, t0=None):
    """Algorithm 2 (and the look-ahead), every candidate evaluated: [(vgpu id, T, l_n, S)], finish."""
    now = sched.clock.now_us()
    t0 = now if t0 is None else t0
    local_gbps = sched.options.local_transfer_gbps
    pools = pipeline.pools
    prev, t, bits, path = None, t0, 0.0, []
    for k, pool in enumerate(pools):
        l_i = pool.infer_us[bs]
        local_us = 0.0 if prev is None or local_gbps is None else bits * 1e-3 / local_gbps
        if prev is None:
            bound = t + l_i
        elif prev.server in pool.servers:
            bound = t + local_us + l_i
        else:
            bound = t + bits * 1e-3 / min(prev.bw_gbps, pool.max_bw_gbps) + l_i
        look = sched.options.probe_lookahead and k + 1 < len(pools)
        seed = pool.longest_idle()
        best = None  # (finish, departure, uplink busy-until, hop)
        for g in [seed] + [x for x in pool.vgpus if x is not seed]:
            if prev is None:
                ts, l_n = None, 0.0
                arrival = t
            elif g.server == prev.server:
                ts, l_n = t, local_us
                arrival = t + l_n
            else:
                l_n = bits * 1e-3 / min(prev.bw_gbps, g.bw_gbps)
                ts = earliest_slot([prev.up, g.down], t, l_n)
                arrival = ts + l_n
            s = g.table.earliest(arrival, l_i)
            f = s + l_i
            hop = (g.id, ts, l_n, s)
            if not look:
                if best is None or f < best[0]:
                    best = (f, f, 0.0, hop)
                    if f <= bound + EPS_US:
                        break
                continue
            u = g.up.busy_until()
            nxt = pools[k + 1]
            if u <= f or g.server in nxt.servers:
                d = f
            else:
                d = g.up.earliest(f, pool.out_bits * bs * 1e-3 / min(nxt.max_bw_gbps, g.bw_gbps))
            if g is seed:
                best = (f, d, u, hop)
                if f <= bound + EPS_US and d <= f + EPS_US:
                    break
                continue
            bf, bd, bu, _ = best
            if d < bd - EPS_US or (d <= bd + EPS_US and (f < bf - EPS_US or (f <= bf + EPS_US and u < bu))):
                best = (f, d, u, hop)
                if d <= bound + EPS_US and u <= t0:
                    break
        f, _, _, hop = best
        path.append(hop)
        prev, t, bits = sched.topology.vgpus[hop[0]], f, pool.out_bits * bs
    return path, t


def _world(seed: int):
    """A random pipeline world: 1-3 pools of 1-12 vGPUs, servers of 1-4 GPUs, NICs of 1-25 Gbit/s."""
    for attempt in range(100):
        world = _try_world(random.Random(1000 * seed + attempt))
        if world is not None:
            return world
    raise AssertionError("no world with a pipeline")


def _try_world(rnd: random.Random):
    groups = [(f"g{i}", "AB"[i % 2], rnd.randint(1, 4), rnd.randint(2, 5), rnd.choice([1.0, 8.0, 25.0])) for i in range(rnd.randint(1, 3))]
    cluster = toy_cluster(groups)
    nparts = rnd.choice([1, 2, 2, 3])
    # Whole-us latencies and no jitter in half of the worlds: many exact ties.
    ties = rnd.random() < 0.5
    lat = {t: [float(rnd.choice([50, 100, 150])) if ties else rnd.uniform(20, 300) for _ in range(nparts)] for t in "AB"}
    out_bytes = [rnd.choice([10, 5_000, 50_000]) for _ in range(nparts)]
    prof = toy_profile("m", lat, out_bytes=out_bytes, batches=(1, 2, 4))
    slots = [(f"g{i}-{c}", gi, grp[1]) for i, grp in enumerate(groups) for c in range(grp[3]) for gi in range(grp[2])]
    rnd.shuffle(slots)
    pipes = []
    while len(pipes) < 2 and len(slots) >= nparts:
        parts = []
        for d in range(nparts):
            typ = slots[0][2]
            mine = [x for x in slots if x[2] == typ][: rnd.choice([1, 2, 4, 8, 12])]
            slots = [x for x in slots if x not in mine]
            parts.append(ToyPartition(d, d, typ, 1, [(srv, gi, 0) for srv, gi, _ in mine]))
            if not slots and d < nparts - 1:
                break
        if len(parts) == nparts:
            pipes.append(ToyPipeline(rnd.choice([1, 2, 4]), parts))
    if not pipes:
        return None
    slo_ms = (sum(max(lat["A"][d], lat["B"][d]) for d in range(nparts)) * 4 + 2 * 50_000 * 8 / 1e3) / 1000
    plan = toy_plan(cluster, [ToyModel("m", slo_ms, pipes)])
    return rnd, plan, prof, cluster, slo_ms, 0.0 if ties else 0.3


@pytest.mark.parametrize("lookahead", [True, False])
@pytest.mark.parametrize("seed", range(10))
def test_probe_returns_the_plain_algorithms_path_and_times(monkeypatch, seed, lookahead):
    rnd, plan, prof, cluster, slo_ms, jitter = _world(seed)
    monkeypatch.setattr(reservation, "_INDEX_MIN_VGPUS", rnd.choice([1, 8]))  # the gap heap on small pools too, or not
    clock = ManualClock()
    options = {"probe_lookahead": lookahead, "exact_last_moment": rnd.random() < 0.5}
    if rnd.random() < 0.5:
        options["local_transfer_gbps"] = 40.0
    sched = build_scheduler(plan, {"m": prof}, cluster, clock, **options)
    checked = []
    real = sched.probe

    def checked_probe(pipeline, bs, t0=None):
        want = plain_probe(sched, pipeline, bs, t0)
        got = real(pipeline, bs, t0)
        assert ([(h.vgpu.id, h.transfer_start, h.transfer_us, h.start) for h in got.hops], got.finish) == want
        checked.append(len(got.hops))
        return got

    sched.probe = checked_probe
    gap = rnd.uniform(10, 40)
    t, reqs = 0.0, []
    for i in range(400):
        t += round(rnd.expovariate(1 / gap)) if jitter == 0.0 else rnd.expovariate(1 / gap)
        reqs.append(Request(i, "m", t, t + slo_ms * 1000))
    vids = [pl.vgpu_id for pl in plan.placement]
    replay(sched, clock, reqs, jitter=jitter, seed=seed, failures=[(t / 2, rnd.choice(vids))])
    assert len(checked) > 300
