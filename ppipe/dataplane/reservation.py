"""The paper's scheduler: resource reservation (§5.4; Algorithm 2 of Appendix A.3).

:class:`ReservationScheduler` is Algorithm 1 (adaptive batching, :mod:`ppipe.dataplane.batching`)
over this module's ``probe``; ``reserve`` (marking every interval of a probed path busy, keyed
by ``(batch_id, partition, kind)`` for feedback correction) is the batcher's.

What ``probe(pipeline, bs)`` computes (Algorithm 2). A batch of ``bs`` leaves at ``t0``
(now); pool ``k`` of the pipeline runs it for ``l_i = infer_us[bs]``. For a candidate vGPU
``g`` of pool ``k``, with ``p`` the vGPU chosen in pool ``k - 1`` and ``t_p`` the time
its inference ends (``t0`` for the first pool, where there is no transfer):

* transfer time ``l_n(g) = bs * bits_{k-1} / min(bw_p, bw_g)``, and the transfer needs
  ``p``'s server uplink and ``g``'s server downlink free at once:
  ``T(g) = earliestSlot([up_p, down_g], t_p, l_n(g))``;
* the inference starts in the first gap of ``g``'s table that fits it,
  ``S(g) = earliestSlot([gpu_g], T(g) + l_n(g), l_i)``, and finishes at
  ``F(g) = S(g) + l_i``;
* the pool's choice is ``argmin_g F(g)``; the next pool starts from it.

``earliestSlot`` is :meth:`ReservationTable.earliest` (one table: the first gap of at least
``l`` at or after ``t``) and :func:`~ppipe.dataplane.tables.earliest_slot` (several tables
at once). The result's ``wait`` is ``F_last - t0 - sum(l_n + l_i)`` over the path:
the time the batch spends waiting for resources, which Algorithm 1 minimises in its step 1.

Two vGPUs on one server (a case the paper leaves open: its example puts every GPU on its
own node): the feature map crosses no NIC, so no NIC is reserved, and ``l_n`` is 0, or
``bytes * 8 / local_transfer_gbps`` with that option set. ``l_n`` may thus differ between
the candidates of a pool (local or remote, servers of different NIC speeds), a
generalisation of Algorithm 2's one ``l_n`` per partition.

Tie-break (deterministic): the pool's longest-idle vGPU (:meth:`Pool.longest_idle`; ties:
lower id) is tried first, then the others in id order; a later candidate replaces the best
only if it finishes strictly earlier, and a candidate that meets the lower bound
``t_p + min_g l_n(g) + l_i`` (no waiting, the fastest transfer) ends the search. Among
equals the longest-idle vGPU wins, which spreads work over the pool.

Look-ahead (``probe_lookahead``, on by default; off = Algorithm 2 as above). In a pool that
is not the pipeline's last, candidates are compared by when their output can *leave*,
``D(g) = earliestSlot([up_g], F(g), l_n')`` with ``l_n'`` the next transfer at the
fastest NIC of the next pool (``D(g) = F(g)`` when ``up_g`` is free from ``F(g)`` on, or
the next pool has a vGPU on ``g``'s server); then by ``F``; then by ``U(g)``, the end of
``up_g``'s last reservation. Each comparison but the last allows ``EPS_US``. The search
ends at a candidate that meets the lower bound and whose uplink is idle at ``t0``
(the longest-idle vGPU: that meets the bound and leaves at once). A pool's work so
spreads over its servers' uplinks instead of piling on the servers with the lowest ids.

Speed (the runtime's per-request hot path and the simulator's): the choice is the one the
rules above give when every vGPU is evaluated (``tests/dataplane/test_probe_reference.py``
checks it), but candidates that cannot be chosen are not evaluated in full:

* only the vGPUs that could finish by the best so far (the longest-idle vGPU's ``F``, or
  ``D`` with look-ahead) are scanned: each pool keeps a lazy heap of lower bounds on when
  each vGPU can next start (:meth:`Pool.scan_set`), used for pools of at least
  ``_INDEX_MIN_VGPUS`` vGPUs;
* in the scan, a candidate is dropped as soon as a lower bound on its ``F`` (its input's
  arrival without waiting; its GPU alone from that arrival) shows it cannot beat the best,
  before its NIC slot is searched; the NIC slot depends only on the receiving server, so
  it is searched once per server per probe.

The scan (:func:`_scan`) is the probe's one inlined loop: the gap search of
:meth:`ReservationTable.earliest` is written out in it, so a candidate costs no call.
"""

from __future__ import annotations

from bisect import bisect_right

from ppipe.dataplane.batching import BatchingScheduler, Hop, ProbeResult
from ppipe.dataplane.tables import EPS_US, ReservationTable, earliest_slot
from ppipe.dataplane.topology import Pipeline, Pool, VGpu

_INF = float("inf")
_INDEX_MIN_VGPUS = 8
"""Pools smaller than this are scanned whole: most of their vGPUs would pass the gap heap's
test anyway, and the scan is cheaper than the heap walk (either way, the same decision)."""
_LOOKAHEAD_CREEP_US = 1e-3
"""How far (us) the best departure of a look-ahead scan may rise by ties (each within
``EPS_US``) before a scan of the gap heap's subset is redone over the whole pool."""


class ReservationScheduler(BatchingScheduler):
    """PPipe's data plane: Algorithm 1 over reservation-table probes (Algorithm 2)."""

    policy_name = "reservation"
    executes_as_planned = True  # every vGPU and NIC use is reserved (ppipe.dataplane.api)

    def probe(self, pipeline: Pipeline, bs: int, t0: float | None = None) -> ProbeResult:
        """The path through ``pipeline`` at batch ``bs`` that finishes earliest, pool by pool.

        Stateless: reads the tables, reserves nothing (the pools' lazy heaps are caches).

        Args:
            pipeline: the pooled pipeline to probe.
            bs: the batch size (one of ``pipeline.batches``).
            t0: when the batch leaves; defaults to now. Later than now for a probe "from
                later" (the batcher's ``exact_last_moment``).

        Raises:
            RuntimeError: a pool of the pipeline has no live vGPU (the batcher probes
                live pipelines only).
        """
        self.counters.probes += 1
        now = self.clock.now_us()
        if t0 is None:
            t0 = now
        # Every query of this probe starts at or after this time; the pools' gap heaps may
        # assume it (a probe "from later" must not tighten them past now).
        index_from = t0 if t0 < now else now
        local_gbps = self.options.local_transfer_gbps
        pools = pipeline.pools
        last = len(pools) - 1
        look = self.options.probe_lookahead
        prev: VGpu | None = None  # the vGPU chosen in the previous pool
        prev_finish = t0  # when its inference ends (t_p)
        in_bits = 0.0  # the feature map entering this pool, for the whole batch
        busy = 0.0  # sum of transfer and inference durations on the path
        hops: list[Hop] = []
        for k, pool in enumerate(pools):
            # a copy between two vGPUs of one server: no NIC, and no time unless configured
            local_us = 0.0 if prev is None or local_gbps is None else in_bits * 1e-3 / local_gbps
            next_pool = pools[k + 1] if look and k < last else None
            hop, prev_finish = _choose_vgpu(pool, next_pool, bs, prev, prev_finish, in_bits, local_us, t0, index_from)
            if hop is None:
                raise RuntimeError(f"pipeline {pipeline.model}/{pipeline.index}: pool {pool.index} has no live vGPU")
            busy += hop.transfer_us + hop.infer_us
            hops.append(hop)
            prev = hop.vgpu
            in_bits = pool.out_bits * bs
        return ProbeResult(pipeline, bs, t0, prev_finish, prev_finish - t0 - busy, hops)


def _choose_vgpu(pool: Pool, next_pool: Pool | None, bs: int, prev: VGpu | None, prev_finish: float, in_bits: float,
                 local_us: float, t0: float, index_from: float) -> tuple[Hop | None, float]:
    """The pool's choice and its finish time ``F``; ``(None, inf)`` for a pool without a live vGPU.

    ``next_pool``: compare candidates by departure (look-ahead) with that pool next; None:
    by finish (Algorithm 2). The longest-idle vGPU is evaluated first (the seed); if
    nothing can beat it, it is the choice; otherwise the vGPUs the gap heap says could
    beat it are scanned, in id order (:func:`_scan`).
    """
    infer_us = pool.infer_us[bs]
    # A lower bound on every candidate's F: no waiting, the fastest transfer into the pool.
    if prev is None:
        finish_bound = prev_finish + infer_us
    elif prev.server in pool.servers:
        finish_bound = prev_finish + local_us + infer_us
    else:
        finish_bound = prev_finish + in_bits * 1e-3 / min(prev.bw_gbps, pool.max_bw_gbps) + infer_us
    nic_slots: dict[str, tuple[float, float]] = {}
    seed_vgpu = pool.longest_idle()
    if seed_vgpu is None:
        return None, _INF
    seed_finish, seed = _candidate(seed_vgpu, prev, prev_finish, in_bits, local_us, infer_us, nic_slots)
    out_kbits = pool.out_bits * bs * 1e-3  # the feature map leaving this pool
    if next_pool is None:
        if seed_finish <= finish_bound + EPS_US:
            return seed, seed_finish  # nobody finishes earlier
        seed_leave, seed_uplink_free = -_INF, _INF  # (no departures: no second scan below)
        limit = seed_finish
    else:
        seed_leave, seed_uplink_free = _departure(seed_vgpu, seed_finish, next_pool, out_kbits)
        if seed_finish <= finish_bound + EPS_US and seed_leave <= seed_finish + EPS_US:
            return seed, seed_finish  # finishes first and its output leaves at once
        limit = seed_leave + _LOOKAHEAD_CREEP_US
    # The vGPUs that could finish by the limit: every other one fails the scan's own tests.
    scan = pool.scan_set(index_from, infer_us, limit) if len(pool.vgpus) >= _INDEX_MIN_VGPUS else None
    if scan is None:
        scan, limit = pool.vgpus, _INF
    if not scan or (len(scan) == 1 and scan[0] is seed_vgpu):
        return seed, seed_finish  # nobody else could beat it (the usual case under load)
    hop, finish, top_leave = _scan(scan, next_pool, out_kbits, prev, prev_finish, in_bits, local_us, infer_us, t0, finish_bound,
                                   nic_slots, seed, seed_finish, seed_leave, seed_uplink_free)
    if top_leave + EPS_US > limit:
        # Look-ahead only: the best departure rose by ties past the subset's limit, so the
        # subset may have left out a vGPU the whole pool's scan would compare: scan it all.
        hop, finish, _ = _scan(pool.vgpus, next_pool, out_kbits, prev, prev_finish, in_bits, local_us, infer_us, t0,
                               finish_bound, nic_slots, seed, seed_finish, seed_leave, seed_uplink_free)
    return hop, finish


def _candidate(g: VGpu, prev: VGpu | None, prev_finish: float, in_bits: float, local_us: float, infer_us: float,
               nic_slots: dict[str, tuple[float, float]]) -> tuple[float, Hop]:
    """``F(g)`` and the hop of running the stage on ``g``: Algorithm 2 for one vGPU.

    ``nic_slots`` caches the transfer slot per receiving server, ``(T, l_n)``.
    """
    if prev is None:
        transfer_start, transfer_us, uses_nic = None, 0.0, False
        arrival = prev_finish
    elif g.server == prev.server:
        transfer_start, transfer_us, uses_nic = prev_finish, local_us, False
        arrival = prev_finish + transfer_us
    else:
        slot = nic_slots.get(g.server)
        if slot is None:
            transfer_us = in_bits * 1e-3 / min(prev.bw_gbps, g.bw_gbps)
            transfer_start = earliest_slot((prev.up, g.down), prev_finish, transfer_us)
            nic_slots[g.server] = (transfer_start, transfer_us)
        else:
            transfer_start, transfer_us = slot
        uses_nic = True
        arrival = transfer_start + transfer_us
    table = g.table
    ends = table.ends
    start = table.earliest(arrival, infer_us) if ends and ends[-1] > arrival + EPS_US else arrival
    return start + infer_us, Hop(g, transfer_start, transfer_us, uses_nic, prev, start, infer_us)


def _departure(g: VGpu, finish: float, next_pool: Pool, out_kbits: float) -> tuple[float, float]:
    """``(D(g), end of g's uplink's last reservation)``: when ``g``'s output can leave (look-ahead)."""
    up: ReservationTable = g.up
    ends = up.ends
    uplink_free = ends[-1] if ends else -_INF
    if uplink_free <= finish or g.server in next_pool.servers:
        return finish, uplink_free
    bw = g.bw_gbps
    nxt_bw = next_pool.max_bw_gbps
    return up.earliest(finish, out_kbits / (nxt_bw if nxt_bw < bw else bw)), uplink_free


def _scan(scan, next_pool: Pool | None, out_kbits: float, prev: VGpu | None, prev_finish: float, in_bits: float, local_us: float,
          infer_us: float, t0: float, finish_bound: float, nic_slots: dict[str, tuple[float, float]],
          seed: Hop, seed_finish: float, seed_leave: float, seed_uplink_free: float) -> tuple[Hop, float, float]:
    """The best of ``seed`` and the vGPUs of ``scan`` (in order); returns it, its ``F`` and the
    highest departure that was ever the best (look-ahead; ``-inf`` without).

    Per candidate: 1. the arrival of its input (as :func:`_candidate`), 2. its inference
    start (:meth:`ReservationTable.earliest`, written out), 3. its score. A candidate is
    dropped as soon as a lower bound on its ``F`` exceeds ``cutoff``, beyond which it cannot
    be chosen: the best ``F`` (greedy), or the best ``D`` plus ``EPS_US`` (look-ahead;
    ``D >= F``).
    """
    eps = EPS_US
    greedy = next_pool is None
    best_vgpu = None  # None: the seed is still the best
    best_transfer_start = best_transfer_us = best_start = 0.0
    best_uses_nic = False
    best_finish, best_leave, best_uplink_free = seed_finish, seed_leave, seed_uplink_free
    top_leave = seed_leave
    cutoff = best_finish if greedy else best_leave + eps
    if prev is not None:
        prev_server = prev.server
        prev_bw = prev.bw_gbps
        prev_up = prev.up
        in_kbits = in_bits * 1e-3
    seed_vgpu = seed.vgpu
    for g in scan:
        if g is seed_vgpu:
            continue  # it cannot beat itself
        server = g.server
        # 1. the arrival of its input
        if prev is None:
            transfer_start, transfer_us, uses_nic = None, 0.0, False
            arrival = prev_finish
        elif server == prev_server:
            transfer_start, transfer_us, uses_nic = prev_finish, local_us, False
            arrival = prev_finish + transfer_us
        else:
            uses_nic = True
            slot = nic_slots.get(server)
            if slot is None:
                # Before both NICs are searched: the earliest possible arrival (NICs free at
                # once), then the GPU alone from it, may already rule the candidate out.
                bw = g.bw_gbps
                transfer_us = in_kbits / (prev_bw if prev_bw < bw else bw)
                arrival = prev_finish + transfer_us
                if arrival + infer_us > cutoff:
                    continue
                table = g.table
                ends = table.ends
                if ends and ends[-1] > arrival + eps and table.earliest(arrival, infer_us) + infer_us > cutoff:
                    continue
                transfer_start = earliest_slot((prev_up, g.down), prev_finish, transfer_us)
                nic_slots[server] = (transfer_start, transfer_us)
            else:
                transfer_start, transfer_us = slot
            arrival = transfer_start + transfer_us
        finish = arrival + infer_us
        if finish > cutoff:
            continue
        # 2. its inference start: the first gap of its table at or after the arrival that
        # fits the inference (ReservationTable.earliest, written out)
        start = arrival
        ends = g.table.ends
        if ends and ends[-1] > start + eps:
            i = bisect_right(ends, start + eps)
            starts = g.table.starts
            n = len(ends)
            fit = infer_us - eps
            while i < n and starts[i] < start + fit:
                if ends[i] > start:
                    start = ends[i]
                i += 1
            finish = start + infer_us
            if finish > cutoff:
                continue
        # 3. the score
        if greedy:
            if finish < best_finish:
                best_vgpu, best_transfer_start, best_transfer_us, best_uses_nic, best_start = g, transfer_start, transfer_us, uses_nic, start
                best_finish = cutoff = finish
                if finish <= finish_bound + eps:
                    break  # nobody finishes earlier
        else:
            leave, uplink_free = _departure(g, finish, next_pool, out_kbits)
            if leave < best_leave - eps or (leave <= best_leave + eps and (
                    finish < best_finish - eps or (finish <= best_finish + eps and uplink_free < best_uplink_free))):
                best_vgpu, best_transfer_start, best_transfer_us, best_uses_nic, best_start = g, transfer_start, transfer_us, uses_nic, start
                best_leave, best_finish, best_uplink_free = leave, finish, uplink_free
                cutoff = leave + eps
                if leave > top_leave:
                    top_leave = leave
                if leave <= finish_bound + eps and uplink_free <= t0:
                    break  # finishes first and its output leaves at once: nobody beats it
    if best_vgpu is None:
        return seed, seed_finish, top_leave
    hop = Hop(best_vgpu, best_transfer_start, best_transfer_us, best_uses_nic, prev, best_start, infer_us)
    return hop, best_finish, top_leave
