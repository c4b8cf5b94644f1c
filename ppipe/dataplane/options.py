"""Scheduler options: the ``**options`` of :func:`ppipe.dataplane.build_scheduler`.

A frozen dataclass rather than a pydantic model: the scheduler reads these on its hot path.
Unknown option names are a :class:`~ppipe.errors.UserError` with a "did you mean".
"""

from __future__ import annotations

import difflib
from dataclasses import dataclass, fields
from typing import Any, Mapping

from ppipe.errors import UserError


@dataclass(frozen=True)
class SchedulerOptions:
    """Tunables of the data plane. Every field has a default that follows the paper.

    Attributes:
        max_queue: admission control. Bound on the number of queued (not yet dispatched)
            requests of a model; a request that finds the queue full is dropped at once with
            ``QUEUE_FULL``. An int applies to every model; a mapping gives a bound per model
            name (models not named are unbounded). ``None``: unbounded (the paper).
        local_transfer_gbps: feature maps between two vGPUs on the same server do not use
            the NIC. ``None`` (default): such a transfer takes no time (a device-to-device
            or shared-memory copy is orders of magnitude faster than the 6-10 Gbit/s
            effective network of the paper's clusters). A number: the copy takes
            ``bytes * 8 / local_transfer_gbps``, still without reserving a NIC.
        reuse_step1_probe: Algorithm 1 step 2 starts at the planned batch, which step 1 has
            just probed on the same pipeline and the same tables; reuse that result instead
            of probing again (same decision, one probe() call fewer).
        exact_last_moment: when the batcher waits for more requests and the path it could
            take now itself waits for resources, wake at the latest start at which the path
            (probed from that start on the current tables) still meets the oldest deadline,
            rather than at ``now + slack`` (which assumes the path's waiting stays and so
            wakes early, then again). One probe() more per such wait. Off by default: on the
            NP plan of G2 on HC2-L (simulator, 3 s, loads 0.8 and 0.95) it changed no
            attainment and cost ~1 probe() per dispatch more, as arrivals end most waits.
        try_other_pipelines: not in the paper's Algorithm 1 (default on). When no batch size
            fits the oldest deadline on the pipeline step 1 chose, try the model's other
            pipelines (least waiting first) before dropping the request. Algorithm 1 drops
            the head as soon as the least-waiting pipeline cannot serve it, although a
            pipeline with a shorter path but more waiting could (googlenet-v3 on HC3-L: a
            whole-model V100 pipeline of 11.4 ms next to a V100+P4 one of 13.7 ms, SLO 23.4
            ms). The authors' simulator (``ReservationSlaLoadBalancer`` in their artifact)
            does the same in substance: its pipeline choice adds a full SLO of penalty to a
            pipeline whose batch-1 path misses the head's deadline. Default on because a
            request should be dropped only when no pipeline can serve it in time; it changes
            nothing for models with one pipeline and costs probes only where Algorithm 1
            would drop. Measured (simulator, seed 0, 10 s points, rates = planned capacity): googlenet-v3
            on HC3-L at load 0.85 attainment 0.9882 -> 0.9904, rtmdet_x at 0.9 0.9857 ->
            0.9885; no max load factor of G1/G2 changed. ``False`` = Algorithm 1 exactly.
        reevaluate_on_report: after feedback correction, re-run the batcher of models that
            are waiting (WakeAt pending), because a corrected table can move their last
            feasible moment earlier.
        propagate_delays: when a stage is reported to have ended late, move the batch's
            not yet reported downstream reservations (transfer, then inference) to when their
            input can really be there, pushing back what they now overlap. Off: only the
            reported resource is corrected (the paper's text says no more). In simulations
            with jitter the two differ by less than run-to-run noise.
        inflight_grace_us: an in-flight batch is forgotten when its last stage is reported,
            or when its expected end (planned end, pushed back by reported delays) is more
            than this many us in the past.
        probe_lookahead: not in the paper (default on). In a pool that is not the
            pipeline's last, choose the vGPU whose *output can leave* earliest (the earliest
            free slot on its server's uplink at/after its finish) rather than the one that
            finishes earliest; ties go to the earlier finish, then to the server whose
            uplink frees first. The paper's greedy (off) ignores the next transfer, so with
            many equally fast candidates it keeps choosing the lowest ids and piles a pool's
            output on one or two servers' uplinks while the others idle (colorization-v2 on
            HC2-L: 291 of 515 first-stage batches on one server). Off = Algorithm 2 exactly.
            Measured (simulator, 10 s points, seed 0, same plans): Fig. 10 ablation on six
            models alone on HC2-L, reservation 0.850 -> 0.950 (colorization-v2 0.35 ->
            0.95); Fig. 6 PPipe mean over the 24 cases 0.944 -> 0.947 (four models +0.05,
            none lower: the rest is bounded by queueing in the plans, not by placement).
        prune_threshold: a reservation table is pruned of past intervals when it holds more
            than this many (amortises the list deletion).
        late_drop: (reactive policy) when a stage report shows a batch can no longer meet
            its deadline on the rest of its path, drop its requests at once (the per-pool
            baseline drops at the downstream pool, paper §7.4).
        min_batch_on_overload: an optional fix for the paper's behaviour under overload
            (drop-oldest then shrinks batches toward 1 and throughput falls below plan).
            0 (default) keeps the paper's Algorithm 1. With k >= 1: when the oldest request
            cannot be served in a batch of at least ``min(k, planned batch)`` but at least
            that many requests are queued, drop requests from the head until the head can
            be served in such a batch (shed load by the oldest, but keep batches efficient).
            Under overload the tables fill far ahead, so combine it with
            ``defer_small_batches`` (otherwise a backlog never forms in the queue).
        defer_small_batches: another overload option (default off: the paper dispatches at
            once). A batch smaller than the planned one whose path would start later than
            now (its first vGPU is busy) is not committed yet: the batcher wakes when that
            vGPU frees and decides again with the requests that arrived meanwhile.
        wake_lead_us: wake this much before the last moment a waiting batch can still
            go (default 0: the paper's "until requests are about to miss the deadline").
            Under a wall clock a timer fires a little late, and a wake at the very last
            moment then turns the waiting head into a deadline drop; `ppipe serve` sets a
            few ms. Under the simulator's exact clock 0 is right.
    """

    max_queue: int | Mapping[str, int] | None = None
    local_transfer_gbps: float | None = None
    reuse_step1_probe: bool = True
    reevaluate_on_report: bool = True
    exact_last_moment: bool = False
    try_other_pipelines: bool = True
    propagate_delays: bool = True
    inflight_grace_us: float = 0.0
    probe_lookahead: bool = True
    prune_threshold: int = 64
    late_drop: bool = True
    min_batch_on_overload: int = 0
    defer_small_batches: bool = False
    wake_lead_us: float = 0.0

    def queue_bound(self, model: str) -> int | None:
        if self.max_queue is None:
            return None
        if isinstance(self.max_queue, Mapping):
            return self.max_queue.get(model)
        return int(self.max_queue)

    @classmethod
    def from_kwargs(cls, options: Mapping[str, Any]) -> "SchedulerOptions":
        """Build from ``build_scheduler(**options)``; unknown names raise UserError."""
        known = [f.name for f in fields(cls)]
        for name in options:
            if name not in known:
                close = difflib.get_close_matches(name, known, n=1)
                hint = f" (did you mean '{close[0]}'?)" if close else ""
                raise UserError(
                    f"unknown data-plane option '{name}'{hint}",
                    fix=f"use one of: {', '.join(sorted(known))}",
                )
        opts = cls(**dict(options))
        opts.validate()
        return opts

    def validate(self) -> None:
        bounds = (
            self.max_queue.values()
            if isinstance(self.max_queue, Mapping)
            else ([] if self.max_queue is None else [self.max_queue])
        )
        for b in bounds:
            if not isinstance(b, int) or isinstance(b, bool) or b < 1:
                raise UserError(f"max_queue must be a positive integer per model, got {b!r}", fix="set max_queue >= 1 or None")
        if self.local_transfer_gbps is not None and not self.local_transfer_gbps > 0:
            raise UserError(
                f"local_transfer_gbps must be > 0 or None, got {self.local_transfer_gbps!r}",
                fix="leave it unset for free same-server copies",
            )
        if self.inflight_grace_us < 0:
            raise UserError(f"inflight_grace_us must be >= 0, got {self.inflight_grace_us}", fix="use 0 or more")
        if self.prune_threshold < 1:
            raise UserError(f"prune_threshold must be >= 1, got {self.prune_threshold}", fix="use e.g. 64")
        if self.min_batch_on_overload < 0:
            raise UserError(
                f"min_batch_on_overload must be >= 0, got {self.min_batch_on_overload}",
                fix="0 keeps the paper's behaviour",
            )
