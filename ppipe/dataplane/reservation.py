"""The paper's scheduler: resource reservation (§5.4, Algorithm 2) + adaptive batching.

``probe(pipeline, bs)`` walks the pipeline's pools in order. In each pool it tries every
live vGPU (in id order) and keeps the one whose inference *finishes* earliest:

* the feature map must first cross from the previous stage's vGPU: the transfer needs the
  sender server's **uplink** and the receiver server's **downlink** free at the same time
  for ``l_n = bs * bits_per_sample / min(bw_up, bw_down)``
  (``earliest_slot([up, down], t, l_n)``);
* then the vGPU must be free for the partition's inference ``l_i`` (``earliest_slot([gpu],
  t, l_i)``); slots may fill gaps between existing reservations.

Two vGPUs on the same server (a decision the paper leaves open: its example puts every GPU
on its own node): the feature map does not cross a NIC, so no NIC is reserved, and the copy
takes no time unless ``local_transfer_gbps`` is set (then ``bytes * 8 / that``).
The transfer time may differ between candidates of a pool (servers of different NIC
speeds, or local vs remote), a generalisation of Algorithm 2's one ``l_n`` per partition.

``reserve(result)`` marks every interval of the returned path busy (vGPU, uplink, downlink),
keyed by ``(batch_id, partition, kind)`` for feedback correction.

Speed (the hot path; target <= 50 us per dispatch decision on a 100-GPU plan):

* latencies are precomputed per (pool, batch); no pydantic object is read;
* in a pool, the transfer slot depends only on the receiving *server*, so it is computed
  once per server per probe (a T4 server can host 8 vGPUs of one pool);
* a candidate that finishes at the lower bound (``t + min l_n + l_i``: no waiting at all,
  fastest possible transfer) cannot be beaten, so the scan of the pool stops there;
* before scanning, the pool's longest-idle vGPU (the one whose reservations end first,
  kept in a lazy heap, :meth:`Pool.longest_idle`) is tried; if it meets the lower bound it
  is taken without a scan. Under light and moderate load this makes a probe O(log n) per
  pool instead of O(n);
* a candidate whose transfer alone, without any waiting, cannot beat the best so far is
  skipped before its NIC slot is searched;
* the scan itself visits only the vGPUs that could beat the seed: each pool keeps a lazy
  heap of lower bounds on when each vGPU can next start (:meth:`Pool.scan_set`), so a
  probe of a large, busy pool looks at a few vGPUs instead of all of them (the
  75-vGPU P4 pool of efficientnet-b8 on HC1-L: about 2 visited per scan at load 1.0).
  The vGPUs left out would fail the scan's own "cannot beat the best" tests, and the
  rest are visited in the same id order, so the decisions are those of the full scan
  (``tests/dataplane/test_scan_index.py`` and ``tests/sim/test_probe_index_equivalence.py``
  compare the two decision for decision).

Tie-break (deterministic): the longest-idle vGPU (ties: lower id) is tried first and is
the best so far when the scan starts; the scan in id order replaces it only by a vGPU that
finishes strictly earlier (then keeps the first of equals). Preferring the longest-idle
vGPU among equals also spreads work over the pool, and the scan prunes from the start.

Look-ahead (``probe_lookahead``, default on; off = Algorithm 2's greedy as above): in a
pool that is not the last, candidates are compared by when their output can *leave*
(:meth:`ReservationScheduler._scan_lookahead`), so a pool's work spreads over the
servers' uplinks instead of piling on the ones with the lowest ids.
"""

from __future__ import annotations

from bisect import bisect_right

from ppipe.dataplane.batching import BatchingScheduler, Hop, ProbeResult
from ppipe.dataplane.tables import EPS_US, earliest_slot
from ppipe.dataplane.topology import Pipeline, VGpu

_INF = float("inf")
_INDEX_MIN_VGPUS = 8
"""Pools smaller than this are scanned whole: most of their vGPUs would pass the gap heap's
test anyway, and the scan is cheaper than the heap walk (either way, the same decision)."""
_LOOKAHEAD_CREEP_US = 1e-3
"""How far (us) the best ``L`` of a look-ahead scan may rise by ties before the subset scan is redone in full."""


class ReservationScheduler(BatchingScheduler):
    """PPipe's data plane: Algorithm 1 over reservation-table probes (Algorithm 2)."""

    policy_name = "reservation"
    executes_as_planned = True  # every vGPU and NIC use is reserved (ppipe.dataplane.api)

    def probe(self, pipeline: Pipeline, bs: int, t0: float | None = None) -> ProbeResult:
        """The path through ``pipeline`` at batch ``bs`` that finishes earliest, greedily per pool.

        Stateless: reads the tables, reserves nothing. ``t0`` defaults to now.
        """
        self.counters.probes += 1
        now = self.clock.now_us()
        if t0 is None:
            t0 = now
        # The time the pools' gap heaps may assume every later query starts at or after
        # (a probe "from later", exact_last_moment's, must not tighten them past now).
        tau = t0 if t0 < now else now
        local_gbps = self.options.local_transfer_gbps
        t_g = t0
        last: VGpu | None = None
        hops: list[Hop] = []
        busy = 0.0  # sum of transfer and inference durations on the path
        bits = 0.0
        pools = pipeline.pools
        npools = len(pools)
        look = self.options.probe_lookahead
        for k, pool in enumerate(pools):
            l_i = pool.infer_us[bs]
            slots: dict[str, tuple[float, float]] = {}
            # Lower bound on any candidate's finish: no waiting, fastest transfer.
            if last is None:
                local_us = 0.0
                bound = t_g + l_i
            else:
                local_us = 0.0 if local_gbps is None else bits * 1e-3 / local_gbps
                if last.server in pool.servers:
                    min_ln = local_us
                else:
                    min_ln = bits * 1e-3 / min(last.bw_gbps, pool.max_bw_gbps)
                bound = t_g + min_ln + l_i
            best: Hop | None = None
            best_t = _INF
            if look and k + 1 < npools:
                best, best_t = self._scan_lookahead(pool, pools[k + 1], bs, t0, t_g, last, bits, l_i, local_us, bound, tau)
            # Fast path: the vGPU idle longest; if it meets the lower bound nobody beats it.
            g = pool.longest_idle() if best is None else None
            seed: Hop | None = None
            if g is not None:
                if last is None:  # (self._candidate inlined for the first pool: no transfer)
                    tab = g.table
                    ends = tab.ends
                    s = tab.earliest(t_g, l_i) if ends and ends[-1] > t_g + EPS_US else t_g
                    f = s + l_i
                    hop = Hop(g, None, 0.0, False, None, s, l_i)
                else:
                    f, hop = self._candidate(g, t_g, last, bits, l_i, local_us, slots)
                if f <= bound + EPS_US:
                    best, best_t = hop, f
                else:
                    # It is the best so far: the scan starts from it (prunes from the start;
                    # a vGPU of the scan replaces it only if strictly earlier).
                    seed, best_t = hop, f
            if best is None:
                # Scan in id order (the hot loop of the data plane: locals, no calls). Only
                # the vGPUs that could finish before the seed are visited: every other one
                # would fail `f < best_t` (best_t only decreases from the seed's finish), so
                # visiting the subset in the same order takes the same decision.
                scan = pool.scan_set(tau, l_i, best_t) if seed is not None and len(pool.vgpus) >= _INDEX_MIN_VGPUS else None
                if scan is None:
                    scan = pool.vgpus
                elif scan and seed.vgpu in scan:
                    # The seed cannot beat itself (`f < best_t` is strict): not visited again.
                    scan = () if len(scan) == 1 else [x for x in scan if x is not seed.vgpu]
                eps = EPS_US
                b_g = None
                b_ts = b_s = 0.0
                b_ln = 0.0
                b_nic = False
                if not scan:
                    pass  # (the usual case under load: the seed stays the best)
                elif last is None:
                    for g in scan:
                        s = t_g
                        tab = g.table
                        ends = tab.ends
                        if ends and ends[-1] > s + eps:
                            i = bisect_right(ends, s + eps)
                            starts = tab.starts
                            n = len(ends)
                            lim = l_i - eps
                            while i < n and starts[i] < s + lim:
                                if ends[i] > s:
                                    s = ends[i]
                                i += 1
                        f = s + l_i
                        if f < best_t:
                            best_t, b_g, b_s = f, g, s
                            if f <= bound + eps:
                                break
                    if b_g is not None:
                        best = Hop(b_g, None, 0.0, False, None, b_s, l_i)
                else:
                    last_server = last.server
                    last_bw = last.bw_gbps
                    up = last.up
                    kbits = bits * 1e-3
                    for g in scan:
                        server = g.server
                        if server == last_server:
                            ts, l_n, nic = t_g, local_us, False
                        else:
                            cached = slots.get(server)
                            if cached is None:
                                bw = g.bw_gbps
                                l_n = kbits / (last_bw if last_bw < bw else bw)
                                s = t_g + l_n
                                if s + l_i >= best_t:
                                    continue  # cannot beat the best even without waiting
                                # Before searching both NICs: the GPU alone, from the
                                # earliest arrival, may already rule the candidate out.
                                ends = g.table.ends
                                if ends and ends[-1] > s + eps:
                                    i = bisect_right(ends, s + eps)
                                    starts = g.table.starts
                                    n = len(ends)
                                    lim = l_i - eps
                                    while i < n and starts[i] < s + lim:
                                        if ends[i] > s:
                                            s = ends[i]
                                        i += 1
                                    if s + l_i >= best_t:
                                        continue
                                ts = earliest_slot((up, g.down), t_g, l_n)
                                slots[server] = (ts, l_n)
                            else:
                                ts, l_n = cached
                            nic = True
                        s = ts + l_n
                        if s + l_i >= best_t:
                            continue  # its input arrives too late to beat the best
                        tab = g.table
                        ends = tab.ends
                        if ends and ends[-1] > s + eps:
                            i = bisect_right(ends, s + eps)
                            starts = tab.starts
                            n = len(ends)
                            lim = l_i - eps
                            while i < n and starts[i] < s + lim:
                                if ends[i] > s:
                                    s = ends[i]
                                i += 1
                        f = s + l_i
                        if f < best_t:
                            best_t, b_g, b_ts, b_ln, b_nic, b_s = f, g, ts, l_n, nic, s
                            if f <= bound + eps:
                                break
                    if b_g is not None:
                        best = Hop(b_g, b_ts, b_ln, b_nic, last, b_s, l_i)
                if best is None:
                    best = seed
            if best is None:
                raise RuntimeError(f"pipeline {pipeline.model}/{pipeline.index}: pool {pool.index} has no live vGPU")
            busy += best.transfer_us + l_i
            hops.append(best)
            t_g = best_t
            last = best.vgpu
            bits = pool.out_bits * bs
        return ProbeResult(pipeline, bs, t0, t_g, t_g - t0 - busy, hops)

    def _scan_lookahead(self, pool, nxt, bs: int, t0: float, t_g: float, last: VGpu | None, bits: float, l_i: float,
                        local_us: float, bound: float, tau: float | None = None) -> tuple[Hop, float]:
        """The candidate of a non-last pool whose output can *leave* earliest (``probe_lookahead``).

        Score of a candidate finishing at ``f``: the earliest start ``L >= f`` of a free slot
        on its server's uplink for the next transfer (``L = f`` when the next pool has a
        vGPU on the same server: the copy may stay local). Candidates are compared by
        ``(L, f, uplink busy-until)``: leaving first, then finishing first, then the
        server whose NIC frees first (this spreads equal candidates over servers instead of
        piling them on the lowest ids). Every candidate of the pool is scored, except those
        that cannot beat the best so far (their input arrives, or they finish, after its
        ``L``); the scan stops at a candidate that meets the lower bound with an idle uplink.

        Only the vGPUs the pool's gap heap says could finish by the seed's ``L`` (plus 1 ns)
        are visited (:meth:`Pool.scan_set`), in id order: a vGPU left out finishes later
        than that, so the full scan would skip it too -- provided the best ``L`` never rose
        more than that 1 ns during the scan (a tie within EPS_US may replace the best by a
        marginally later ``L``). That is checked, and the full scan is run if it failed.
        """
        eps = EPS_US
        out_kbits = pool.out_bits * bs * 1e-3
        nxt_servers = nxt.servers
        nxt_bw = nxt.max_bw_gbps
        slots: dict[str, tuple[float, float]] = {}
        # Fast path (as in the greedy): the longest-idle vGPU, if it finishes at the lower
        # bound and its output can leave at once, cannot be beaten on (L, f).
        best: Hop | None = None
        best_L = best_f = best_u = _INF
        g = pool.longest_idle()
        if g is not None:
            f, hop = self._candidate(g, t_g, last, bits, l_i, local_us, slots)
            ends = g.up.ends
            u = ends[-1] if ends else -_INF
            if g.server in nxt_servers or u <= f:
                L = f
            else:
                bw = g.bw_gbps
                L = g.up.earliest(f, out_kbits / (nxt_bw if nxt_bw < bw else bw))
            if f <= bound + eps and L <= f + eps:
                return hop, f
            best, best_L, best_f, best_u = hop, L, f, u  # the scan starts from it
        seed = (best, best_L, best_f, best_u)
        scan = None
        limit = _INF
        if best is not None and tau is not None and len(pool.vgpus) >= _INDEX_MIN_VGPUS:
            limit = best_L + _LOOKAHEAD_CREEP_US
            scan = pool.scan_set(tau, l_i, limit)
            if scan and best.vgpu in scan:
                # The seed does not replace itself (no comparison of equals is strict).
                scan = () if len(scan) == 1 else [x for x in scan if x is not best.vgpu]
        if scan is None:
            scan, limit = pool.vgpus, _INF
        # The scan (hot: locals, the table search inlined).
        if last is not None:
            last_server = last.server
            last_bw = last.bw_gbps
            last_up = last.up
            kbits = bits * 1e-3
        top_L = best_L
        while True:
            for g in scan:
                server = g.server
                if last is None:
                    ts, l_n, nic = None, 0.0, False
                    ready = t_g
                elif server == last_server:
                    ts, l_n, nic = t_g, local_us, False
                    ready = t_g + l_n
                else:
                    cached = slots.get(server)
                    if cached is None:
                        bw = g.bw_gbps
                        l_n = kbits / (last_bw if last_bw < bw else bw)
                        s = t_g + l_n
                        if s + l_i > best_L + eps:
                            continue  # cannot leave before the best even without waiting
                        ends = g.table.ends
                        if ends and ends[-1] > s + eps:  # the GPU alone may rule it out (see probe)
                            i = bisect_right(ends, s + eps)
                            starts = g.table.starts
                            n = len(ends)
                            lim = l_i - eps
                            while i < n and starts[i] < s + lim:
                                if ends[i] > s:
                                    s = ends[i]
                                i += 1
                            if s + l_i > best_L + eps:
                                continue
                        ts = earliest_slot((last_up, g.down), t_g, l_n)
                        slots[server] = (ts, l_n)
                    else:
                        ts, l_n = cached
                    nic = True
                    ready = ts + l_n
                if ready + l_i > best_L + eps:
                    continue
                s = ready
                ends = g.table.ends
                if ends and ends[-1] > s + eps:
                    i = bisect_right(ends, s + eps)
                    starts = g.table.starts
                    n = len(ends)
                    lim = l_i - eps
                    while i < n and starts[i] < s + lim:
                        if ends[i] > s:
                            s = ends[i]
                        i += 1
                f = s + l_i
                if f > best_L + eps:
                    continue
                up = g.up
                ends = up.ends
                u = ends[-1] if ends else -_INF
                if u <= f or server in nxt_servers:
                    L = f
                else:
                    bw = g.bw_gbps
                    L = up.earliest(f, out_kbits / (nxt_bw if nxt_bw < bw else bw))
                if L < best_L - eps or (L <= best_L + eps and (f < best_f - eps or (f <= best_f + eps and u < best_u))):
                    best = Hop(g, ts, l_n, nic, last, s, l_i)
                    best_L, best_f, best_u = L, f, u
                    if L > top_L:
                        top_L = L
                    if L <= bound + eps and u <= t0:
                        break  # finishes at the lower bound and its uplink is idle now: nobody beats it
            if top_L + eps <= limit:
                break
            # The best L crept up by ties past the subset's limit: the subset may have left
            # out a vGPU the full scan would have compared. Start again over the whole pool.
            best, best_L, best_f, best_u = seed
            scan, limit, top_L = pool.vgpus, _INF, best_L
        if best is None:
            raise RuntimeError(f"pool {pool.index} has no live vGPU")
        return best, best_f

    @staticmethod
    def _candidate(g: VGpu, t_g: float, last: VGpu | None, bits: float, l_i: float, local_us: float, slots: dict) -> tuple[float, Hop]:
        """Finish time and hop of running the stage on ``g`` (transfer slot, then GPU slot)."""
        if last is None:
            ts, l_n, nic = None, 0.0, False
            ready = t_g
        elif g.server == last.server:
            ts, l_n, nic = t_g, local_us, False
            ready = t_g + l_n
        else:
            cached = slots.get(g.server)
            if cached is None:
                l_n = bits * 1e-3 / min(last.bw_gbps, g.bw_gbps)
                ts = earliest_slot((last.up, g.down), t_g, l_n)
                slots[g.server] = (ts, l_n)
            else:
                ts, l_n = cached
            nic = True
            ready = ts + l_n
        tab = g.table
        ends = tab.ends
        s = tab.earliest(ready, l_i) if ends and ends[-1] > ready + EPS_US else ready
        return s + l_i, Hop(g, ts, l_n, nic, last, s, l_i)
