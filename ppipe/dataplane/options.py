"""Scheduler options: the ``**options`` of :func:`ppipe.dataplane.build_scheduler`.

A frozen pydantic model, as every other configuration of ppipe: the values are checked
once, when the scheduler is built (an unknown name is a :class:`~ppipe.errors.UserError`
with a "did you mean", a bad value one that names the field); the hot path then reads
plain attributes. Defaults follow the paper's Algorithm 1 and 2, except where a field
says otherwise; ``docs/benchmarks.md`` ("Data-plane options") has the measurements behind
the defaults that depart from it.
"""

from __future__ import annotations

import difflib
from typing import Any, Mapping

from pydantic import BaseModel, ConfigDict, Field, StrictInt, ValidationError, field_validator

from ppipe.errors import UserError


class SchedulerOptions(BaseModel):
    """Tunables of the data plane. The defaults follow the paper; those that do not say so.

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
            wakes early, then again). One probe() more per such wait; off by default,
            because arrivals end most waits before either moment.
        try_other_pipelines: not in the paper's Algorithm 1 (default on). When no batch size
            fits the oldest deadline on the pipeline step 1 chose, try the model's other
            pipelines (least waiting first) before dropping the request. Algorithm 1 drops
            the head as soon as the least-waiting pipeline cannot serve it, although a
            pipeline with a shorter path but more waiting could (a whole-model pipeline
            next to a longer two-partition one). The authors' simulator does the same in
            substance (its pipeline choice adds a full SLO of penalty to a pipeline whose
            batch-1 path misses the head's deadline). On because a request should be
            dropped only when no pipeline can serve it in time; it changes nothing for
            models with one pipeline and costs probes only where Algorithm 1 would drop.
            ``False`` = Algorithm 1 exactly.
        reevaluate_on_report: after feedback correction, re-run the batcher of models that
            are waiting (WakeAt pending), because a corrected table can move their last
            feasible moment earlier.
        propagate_delays: when a stage is reported to have ended late, move the batch's
            not yet reported downstream reservations (transfer, then inference) to when their
            input can really be there, pushing back what they now overlap. Off: only the
            reported resource is corrected (the paper's text says no more).
        inflight_grace_us: an in-flight batch is forgotten when its last stage is reported,
            or when its expected end (planned end, pushed back by reported delays) is more
            than this many us in the past.
        probe_lookahead: not in the paper (default on). In a pool that is not the
            pipeline's last, choose the vGPU whose *output can leave* earliest (the earliest
            free slot on its server's uplink at/after its finish) rather than the one that
            finishes earliest; ties go to the earlier finish, then to the server whose
            uplink frees first. The paper's greedy (off) ignores the next transfer, so with
            many equally fast candidates it keeps choosing the lowest ids and piles a pool's
            output on one or two servers' uplinks while the others idle. Off = Algorithm 2
            exactly.
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
        dispatch_lead_us: the fixed part of the dispatch lead, the time from a decision to
            the batch's first stage message at its worker. The batcher plans every decision
            of a model from ``now + lead``, so no reservation starts before the input can be
            there and every deadline test counts the lead (:mod:`ppipe.dataplane.margins`).
            Default 0 (the paper, whose decisions take effect at once); `ppipe serve` and
            `ppipe simulate` both set it, so the simulator runs the runtime's rule.
        input_transfer_lead: add the input's transfer to each model's dispatch lead: its
            largest planned batch of inputs over the slowest NIC of its first pools (the
            request's tensor travels from the frontend to the first worker). Default off
            (the paper does not model it).
        answer_budget_us: per model (a mapping) or for all, the time an answer still needs
            after the batch's last stage ends (the last report, the reply). The batcher
            plans for the deadline ``arrival + SLO - budget``; lateness is still judged at
            ``arrival + SLO``. Default 0 (the paper).
        drop_budget_us: per model (a mapping) or for all, the answer budget of the drop
            test, at most ``answer_budget_us`` (None: that budget). A head that no batch
            serves by ``arrival + SLO - answer budget`` but one does by ``arrival + SLO -
            drop budget`` is dispatched at once in the largest such batch of the queued
            requests instead of dropped: the answer budget plans (which batch, how long to
            wait), the drop budget decides what is hopeless. `ppipe serve` sets the answer
            budget from a high percentile of how late answers come and the drop budget
            from their median, so a request that would more likely than not be answered in
            time is served. Default None (the paper's one test).
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    max_queue: StrictInt | Mapping[str, StrictInt] | None = Field(
        default=None, description="Bound on the queued requests of a model (per model name, or one for all); None: unbounded."
    )
    local_transfer_gbps: float | None = Field(
        default=None, gt=0, description="Bandwidth of a same-server copy in Gbit/s; None: such a copy takes no time."
    )
    reuse_step1_probe: bool = Field(default=True, description="Reuse step 1's probe at the planned batch in step 2.")
    reevaluate_on_report: bool = Field(default=True, description="Re-run waiting models' batchers after a correction.")
    exact_last_moment: bool = Field(default=False, description="Wake a waiting batch at its exact latest feasible start.")
    try_other_pipelines: bool = Field(default=True, description="Try the model's other pipelines before dropping.")
    propagate_delays: bool = Field(default=True, description="Push a late stage's downstream reservations back.")
    inflight_grace_us: float = Field(default=0.0, ge=0, description="How long past its expected end an in-flight batch is kept, us.")
    probe_lookahead: bool = Field(default=True, description="In non-last pools, pick the vGPU whose output can leave earliest.")
    prune_threshold: int = Field(default=64, ge=1, description="Intervals a reservation table holds before it drops past ones.")
    late_drop: bool = Field(default=True, description="(reactive) drop a batch's requests once a report shows it will be late.")
    min_batch_on_overload: int = Field(default=0, ge=0, description="Shed the oldest requests to keep batches this large (0: off).")
    defer_small_batches: bool = Field(default=False, description="Hold a small batch whose first vGPU is busy until it frees.")
    wake_lead_us: float = Field(default=0.0, description="Wake this long before a waiting batch's last moment, us.")
    dispatch_lead_us: float = Field(default=0.0, ge=0, description="Time from a decision to its message at the first worker, us.")
    input_transfer_lead: bool = Field(default=False, description="Add the input's transfer to the first pool to the dispatch lead.")
    answer_budget_us: float | Mapping[str, float] = Field(
        default=0.0, description="Time an answer needs after the last stage, us (per model name, or one for all).")
    drop_budget_us: float | Mapping[str, float] | None = Field(
        default=None, description="The answer budget of the drop test, us, at most answer_budget_us (None: that budget).")

    @field_validator("max_queue")
    @classmethod
    def _positive_bounds(cls, v: int | Mapping[str, int] | None) -> int | Mapping[str, int] | None:
        bounds = v.values() if isinstance(v, Mapping) else ([] if v is None else [v])
        for b in bounds:
            if b < 1:
                raise ValueError(f"max_queue must be a positive integer per model, got {b!r}")
        return v

    @field_validator("answer_budget_us", "drop_budget_us")
    @classmethod
    def _non_negative_margins(cls, v: float | Mapping[str, float] | None, info) -> float | Mapping[str, float] | None:
        for m in v.values() if isinstance(v, Mapping) else ([] if v is None else [v]):
            if not m >= 0:
                raise ValueError(f"{info.field_name} must be >= 0 us per model, got {m!r}")
        return v

    def budget_us(self, model: str) -> float:
        """The model's answer budget (0 for a model a mapping does not name)."""
        return float(_for_model(self.answer_budget_us, model, 0.0))

    def drop_budget(self, model: str) -> float:
        """The model's drop budget: at most its answer budget (:attr:`drop_budget_us`)."""
        budget, v = self.budget_us(model), self.drop_budget_us
        if v is None:
            return budget
        return min(budget, float(_for_model(v, model, budget)))

    def queue_bound(self, model: str) -> int | None:
        if self.max_queue is None:
            return None
        bound = _for_model(self.max_queue, model, None)
        return None if bound is None else int(bound)

    @classmethod
    def from_kwargs(cls, options: Mapping[str, Any]) -> "SchedulerOptions":
        """Build from ``build_scheduler(**options)``.

        Raises:
            UserError: an unknown option name (with the closest known one), or a value
                that fails its field's check (naming the field).
        """
        known = list(cls.model_fields)
        for name in options:
            if name not in known:
                close = difflib.get_close_matches(name, known, n=1)
                hint = f" (did you mean '{close[0]}'?)" if close else ""
                raise UserError(
                    f"unknown data-plane option '{name}'{hint}",
                    fix=f"use one of: {', '.join(sorted(known))}",
                )
        try:
            return cls(**dict(options))
        except ValidationError as err:
            raise UserError(
                "invalid data-plane option: " + "; ".join(_describe(e) for e in err.errors()),
                fix="correct the value named above (the fields of SchedulerOptions say what each takes)",
            ) from None


def _describe(error: Mapping[str, Any]) -> str:
    """One pydantic error as 'field: problem (got value)'."""
    if error["type"] == "value_error":  # our own validators name the field and the value
        return str(error["msg"]).removeprefix("Value error, ")
    field = str(error["loc"][0]) if error["loc"] else "options"
    return f"{field}: {error['msg']} (got {error['input']!r})"


def _for_model(value: Any, model: str, default: Any) -> Any:
    """A per-model option's value for ``model``: the one number for all models, or the
    mapping's entry (``default`` where it names none). (A number is tested first: an
    ``isinstance`` against ``typing.Mapping`` costs microseconds, and these run per request.)"""
    if isinstance(value, (int, float)):
        return value
    get = getattr(value, "get", None)  # (a number of another type, e.g. NumPy's, has none)
    return value if get is None else get(model, default)
