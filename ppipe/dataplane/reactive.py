"""The paper's reactive per-pool baseline (§7.4): batching without reservations.

In the paper, the reactive scheduler "performs adaptive batching independently for each
GPU pool ... it selects the largest possible batch size that meets the pool's SLO (as
determined by the MILP solver)"; it "lacks resource usage tracking, which leads to batches
being scheduled onto servers with saturated network links", and requests are dropped at
the second partition when they arrive too late.

How it maps onto the one :class:`~ppipe.dataplane.api.Scheduler` contract here (a
dispatch carries one batch along a whole path), and what is kept of the baseline:

* **No network tracking.** The probe assumes every transfer starts the moment the previous
  stage ends and takes its nominal time (``bs * bits / bandwidth``): NICs are neither
  checked nor reserved. The driver (simulator or runtime) meets the real contention.
* **Per-pool, local knowledge only.** Each pool sends the batch to its vGPU whose own queue
  frees first (FIFO: work is appended after the vGPU's last queued batch, no gap filling),
  i.e. what a pool-local load balancer sees. vGPU queues are corrected by the workers'
  reports (a pool knows its own GPUs).
* **Batch size from the plan's latencies.** Algorithm 1 runs at the entry with this probe,
  so the batch is the largest usable one whose *nominal* path (local queues + nominal
  transfers) meets the oldest deadline, and waiting follows the same rule.
* **Late drops downstream** (``late_drop``, default on). When a stage report shows that a
  batch's remaining path cannot finish by a request's deadline (its planned finish pushed
  back by the stage's delay), the pool drops those requests (DEADLINE_UNREACHABLE) — the
  baseline's "excessive request drops at the second partition".

Not modelled here: batches are not re-formed at each pool; a batch keeps the requests it
left the first pool with (minus late drops). The ``reactive-pool`` policy
(:mod:`ppipe.dataplane.reactive_pool`) re-batches at every pool, stage by stage, for
drivers that accept one-stage dispatches (the simulator); this one runs under any driver.
"""

from __future__ import annotations

from ppipe.dataplane.api import Decision, DropReason, StageReport
from ppipe.dataplane.batching import BatchingScheduler, Hop, InFlight, ProbeResult
from ppipe.dataplane.tables import EPS_US
from ppipe.dataplane.topology import Pipeline

_INF = float("inf")


class ReactiveScheduler(BatchingScheduler):
    """Per-pool reactive batching: local vGPU queues, nominal transfers, no NIC reservations."""

    policy_name = "reactive"
    tracks_nics = False

    def probe(self, pipeline: Pipeline, bs: int, t0: float | None = None) -> ProbeResult:
        """Path by local queues: per pool the vGPU whose queue frees first; transfers nominal."""
        self.counters.probes += 1
        if t0 is None:
            t0 = self.clock.now_us()
        local_gbps = self.options.local_transfer_gbps
        t_g = t0
        last = None
        hops: list[Hop] = []
        busy = 0.0
        prev_bits = 0.0
        for pool in pipeline.pools:
            l_i = pool.infer_us[bs]
            best_t = _INF
            best: Hop | None = None
            bits = prev_bits * bs
            for g in pool.vgpus:
                if last is None:
                    ts, l_n, nic = None, 0.0, False
                    ready = t_g
                elif g.server == last.server:
                    ts, nic = t_g, False
                    l_n = 0.0 if local_gbps is None else bits * 1e-3 / local_gbps
                    ready = t_g + l_n
                else:
                    ts, nic = t_g, True
                    l_n = bits * 1e-3 / min(last.bw_gbps, g.bw_gbps)
                    ready = t_g + l_n
                free = g.table.busy_until()
                s = ready if ready >= free else free
                f = s + l_i
                if f < best_t:
                    best_t = f
                    best = Hop(g, ts, l_n, nic, last, s, l_i)
            if best is None:
                raise RuntimeError(f"pipeline {pipeline.model}/{pipeline.index}: pool {pool.index} has no live vGPU")
            busy += best.transfer_us + l_i
            hops.append(best)
            t_g = best_t
            last = best.vgpu
            prev_bits = pool.out_bits
        return ProbeResult(pipeline, bs, t0, t_g, t_g - t0 - busy, hops)

    def reserve(self, result: ProbeResult, batch_id: int):
        """Queue the batch on each chosen vGPU; NICs are not tracked by this baseline."""
        keys = []
        limit = self.options.prune_threshold
        for d, h in enumerate(result.hops):
            if h.infer_us > 0:
                tab = h.vgpu.table
                if len(tab) > limit:
                    tab.prune(result.start)
                key = (batch_id, d, "i")
                tab.add(h.start, h.infer_us, key)
                keys.append((tab, key))
        return keys

    def _after_report(self, rec: InFlight, report: StageReport, now: float) -> list[Decision]:
        if not self.options.late_drop:
            return []
        expected = rec.expected_end
        out: list[Decision] = []
        keep = []
        for r in rec.live:
            if r.deadline_us + EPS_US < expected:
                out.append(
                    self._drop(r, DropReason.DEADLINE_UNREACHABLE, f"late after partition {report.partition} (reactive)")
                )
            else:
                keep.append(r)
        rec.live = keep
        if not keep:
            self._release(rec)
            self._forget(rec.dispatch.batch_id)
        return out
