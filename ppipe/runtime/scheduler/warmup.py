"""A fresh server's first batches, run before it says it is ready.

A vGPU's first batches cost more than its later ones: in a freshly started worker the stage's
code runs for the first time, each connection carries its first feature map (its buffers
grow), the first slots of a map or an input are mapped. A request that meets a cold vGPU
takes several ms longer, past the SLO of a tight pipeline. So :meth:`WarmUpMixin.warm_up`
sends each model requests of zeros (its declared input) through the data plane, as served
requests go, at the model's planned rate (so that its pools fill and every vGPU gets work),
until every vGPU of the model has been dispatched a batch or ``MAX_ROUNDS`` times its largest
pool's worth of batches were sent; then it waits for their answers (or drops).

While it runs the runtime is not ``started`` (``/v2/health/ready`` answers 503, infer
requests 503), and afterwards nothing of it shows: its counts went to a scratch
:class:`~ppipe.runtime.scheduler.metrics.RuntimeMetrics`, it kept no traces and counted no
report messages, it logged no arrivals for the re-planner, and its answers' lateness moved
neither the answer budgets nor the wake lead (a cold answer is late for reasons a served one
is not). The scheduler's tables keep the warm-up's reservations, all in the past by then.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections import Counter
from dataclasses import dataclass

import numpy as np

from ppipe.runtime.scheduler.inflight import Pending
from ppipe.runtime.scheduler.metrics import RuntimeMetrics

log = logging.getLogger("ppipe.runtime")

MAX_ROUNDS = 4
"""At most this many times a model's largest pool's worth of batches are sent to warm it up."""
REPORTS_WAIT_US = 1e6
"""How long the warm-up waits, once every answer came, for its batches' last reports."""


@dataclass(frozen=True)
class WarmUp:
    """What a warm-up did: per model, the requests sent and those answered (not dropped),
    the vGPUs that ran no batch, and how long it took (s)."""

    sent: dict[str, int]
    answered: dict[str, int]
    cold: tuple[str, ...]
    took_s: float
    skipped: tuple[str, ...] = ()  # models without a declared input of fixed shape

    def describe(self) -> str:
        n = sum(self.sent.values())
        line = f"warmed up in {self.took_s:.2f} s: {n} requests of zeros, {sum(self.answered.values())} answered"
        if self.cold:
            line += f"; vGPUs given no batch: {', '.join(self.cold)}"
        if self.skipped:
            line += f"; not warmed (no input of fixed shape declared): {', '.join(self.skipped)}"
        return line


class WarmUpMixin:
    """The :class:`~ppipe.runtime.scheduler.host.Runtime`'s warm-up (mixed into it); see the module."""

    async def warm_up(self) -> WarmUp:
        """Run every model's warm-up at once (see the module); returns what it did."""
        t0 = self.clock.true_now_us()
        models = [m for m in self.plan.models if _zeros(self.profiles[m.name]) is not None]
        skipped = tuple(m.name for m in self.plan.models if m not in models)
        with self._warming_apart() as seen:
            done = await asyncio.gather(*(self._warm_model(m, seen) for m in models))
            await self._last_reports_in(self.clock.true_now_us() + REPORTS_WAIT_US)
        live = [v for v in self.workers if v not in self.failed]
        result = WarmUp({m.name: s for m, (s, _) in zip(models, done)}, {m.name: a for m, (_, a) in zip(models, done)},
                        tuple(v for v in live if v not in seen and self._placement[v].model not in skipped),
                        (self.clock.true_now_us() - t0) / 1e6, skipped)
        log.log(logging.WARNING if result.cold else logging.INFO, "%s", result.describe())
        return result

    async def _warm_model(self, mp, seen: set[str]) -> tuple[int, int]:
        """Send model ``mp`` zeros at its planned rate until each of its vGPUs was dispatched a
        batch (or the rounds run out); returns (sent, answered) once every answer came."""
        mine = {p.vgpu_id for p in self.plan.placement if p.model == mp.name and p.vgpu_id not in self.failed}
        pools = Counter((p.pipeline, p.partition) for p in self.plan.placement if p.model == mp.name)
        limit = MAX_ROUNDS * max(pools.values(), default=1) * max(pl.batch for pl in mp.pipelines)
        inputs = _zeros(self.profiles[mp.name])
        gap_us = 1e6 / mp.throughput_rps if mp.throughput_rps > 0 else 1e3
        pending: list[Pending] = []
        t0 = self.clock.now_us()
        while len(pending) < limit and not mine <= seen:
            pending.append(self._submit(mp.name, inputs, None))
            await self._until(t0 + len(pending) * gap_us)
        outcomes = await asyncio.gather(*(p.future for p in pending), return_exceptions=True)
        for p in pending:
            self._settle(p)
        return len(pending), sum(not isinstance(o, BaseException) for o in outcomes)

    async def _last_reports_in(self, until_us: float) -> None:
        """Wait (until ``until_us`` at most) for the reports of the warm-up's batches that come
        after their answer (an earlier stage's, when reports cross), so that none is counted
        once the warm-up has ended. Only warm-up batches are in flight while it runs."""
        while self._inflight and self.clock.true_now_us() < until_us:
            await self._until(self.clock.now_us() + 1e3)

    async def _until(self, t_us: float) -> None:
        """Wait on the host's clock until its time ``t_us``."""
        reached = self._loop.create_future()
        self.clock.call_at(t_us, lambda: reached.done() or reached.set_result(None))
        await reached

    @contextlib.contextmanager
    def _warming_apart(self):
        """Mark the runtime warming (``_warming``: the vGPUs dispatched to so far) and keep
        what the warm-up does out of its metrics, traces, report count and arrival log."""
        kept = (self.metrics, self.keep_traces, self.report_messages, self.arrival_log)
        self.metrics, self.keep_traces, self.arrival_log = RuntimeMetrics(), 0, None
        self._warming = seen = set()
        try:
            yield seen
        finally:
            self.metrics, self.keep_traces, self.report_messages, self.arrival_log = kept
            self._warming = None


def _zeros(profile) -> dict[str, np.ndarray] | None:
    """A sample of zeros of the model's declared input; None where it declares none of fixed shape."""
    spec = profile.manifest.input
    if spec is None or not spec.fixed:
        return None
    return {spec.name: np.zeros(spec.shape, dtype=spec.dtype)}
