"""Decode admission: a request whose input must be decoded before the scheduler sees it
(a JSON body decoded in a pool of processes, encoded images) is decoded only if the
decode can end in time; otherwise it is dropped ``deadline-unreachable`` at once.

A request of model ``m`` that arrives at ``a`` may spend a share ``q`` of its model's
decode slack ``D_m`` on decoding:

    latest_m(a) = a + q * D_m,     D_m = S_m - (L_m + A_m)

the slack ``S_m`` its plan leaves less the runtime's margins (dispatch lead and answer
budget, :mod:`ppipe.dataplane.margins`); ``q`` = :data:`DECODE_SHARE_OF_SLACK`. A pool of
``K`` workers that holds ``Q`` of decode work (submitted, not finished) is expected to end
a decode of cost ``c`` submitted at ``t`` at

    e = t + Q / K + c.

The request is admitted iff ``e <= latest_m(a)``, and dropped after its decode if that
ended later anyway (the estimate was short). Under overload the pool's queue thus stays
short enough that what it admits is served: a request decoded at the last moment would
find the pipeline's queue (and the estimate's error) in its way.

``ppipe serve``'s ingresses apply the rule to their pools with costs they measure (seconds
per byte, a moving average); ``ppipe simulate --decode-ms`` runs it with a fixed cost per
request on a pool of :class:`DecodePool` (``K`` workers, FIFO). Pure logic: no clock, no I/O.
"""

from __future__ import annotations

import heapq
from typing import Mapping

DECODE_SHARE_OF_SLACK = 0.5
"""``q``: the share of a model's decode slack that decoding may take."""


def decode_slack_us(margins: Mapping[str, object]) -> dict[str, float]:
    """``D_m`` per model from its :class:`~ppipe.dataplane.margins.ModelMargins` (the slack
    its plan leaves less the margins reserved for the dispatch lead and the answer)."""
    return {m: mm.slack_us - mm.reserved_us for m, mm in margins.items()}


def latest_end_us(arrival_us: float, slack_us: float) -> float:
    """``latest_m(a)``: the latest time a decode of a request that arrived at ``arrival_us`` may end."""
    return arrival_us + DECODE_SHARE_OF_SLACK * slack_us


def expected_end(now: float, queued: float, workers: int, cost: float) -> float:
    """``e``: when a decode of cost ``cost`` submitted at ``now`` to a pool of ``workers``
    that holds ``queued`` of work is expected to end (all four in one unit of time)."""
    return now + queued / max(1, workers) + cost


def refusal(expected_us: float, latest_us: float) -> float | None:
    """How late (us) an admission would be, or None if the request is admitted."""
    return expected_us - latest_us if expected_us > latest_us else None


class DecodePool:
    """``K`` decode workers, each taking the oldest request waiting (FIFO), as the
    simulator models an ingress's pool. Times in us."""

    def __init__(self, workers: int):
        if workers < 1:
            raise ValueError(f"a decode pool needs >= 1 worker, got {workers}")
        self.workers = workers
        self._free_us = [0.0] * workers  # a heap: when each worker is next free

    def queued_us(self, now_us: float) -> float:
        """``Q``: the work submitted and not finished at ``now_us``."""
        return sum(f - now_us for f in self._free_us if f > now_us)

    def expected_end_us(self, now_us: float, cost_us: float) -> float:
        return expected_end(now_us, self.queued_us(now_us), self.workers, cost_us)

    def submit(self, now_us: float, cost_us: float) -> float:
        """Queue a decode of ``cost_us``; returns when it ends."""
        start = max(now_us, self._free_us[0])
        end = start + cost_us
        heapq.heapreplace(self._free_us, end)
        return end
