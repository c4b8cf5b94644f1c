"""Reservation tables: future busy intervals of every vGPU and every server NIC.

One :class:`ReservationTable` per resource (``vgpu:<id>``, ``up:<server>``,
``down:<server>``). A table holds non-overlapping half-open intervals ``[start, end)``
sorted by start, each tagged with a key (``(batch_id, partition, kind)``) so that feedback
correction can find the interval a worker reports on. Because the intervals never overlap,
their ends are sorted too, and "the first interval that ends after t" is one bisect.

:func:`earliest_slot` is the paper's ``earliestSlot(res, t, l)`` (Algorithm 2): the
earliest time ``>= t`` at which every resource in a list is free for ``l`` us. It fills
gaps between reservations (it does not only append after the last one).

Pruning: intervals that ended at or before the scheduler's "now" can never matter again
(every query starts at ``t >= now``), so :meth:`ReservationTable.prune` drops them. The
scheduler prunes a table lazily when it has grown past a threshold, which keeps tables
short (their length is the number of *future* reservations) without paying a list
deletion on every call.

Indexes over tables (the pools' gap heaps in :mod:`ppipe.dataplane.topology`) keep lower
bounds on a table's answers; a table bumps ``version`` on every change that can alter an
answer, and calls ``on_free`` after a change that can make an answer *earlier* (remove,
correct, delay), so such an index knows when its bound may no longer hold.

Correction (feedback): :meth:`ReservationTable.correct` replaces a reserved interval by the
one a worker reports. The truth wins over the plan: an interval before it that now overlaps
is cut short at the reported start, and later intervals that now overlap are pushed back
(cascade), each keeping its duration. This mirrors what a worker does: it runs its queued
work in order, so a batch that ran late delays every batch reserved behind it on the same
resource.
"""

from __future__ import annotations

from bisect import bisect_left, bisect_right
from typing import Callable, Hashable, Sequence

EPS_US = 1e-6
"""Tolerance for float comparisons of times (1 ps): sums of float latencies drift by ulps."""


class ReservationTable:
    """Busy intervals of one resource, sorted, non-overlapping, each longer than ``EPS_US``
    (a shorter one occupies nothing at the tables' resolution: queries pass over it, so it
    is never stored).

    Attributes:
        name: resource id, for messages.
        starts, ends: parallel sorted lists of interval bounds (us).
        keys: the key of each interval (``None`` for anonymous reservations).
    """

    __slots__ = ("name", "starts", "ends", "keys", "on_free", "version")

    def __init__(self, name: str = "") -> None:
        self.name = name
        self.starts: list[float] = []
        self.ends: list[float] = []
        self.keys: list[Hashable] = []
        # Called (no arguments) after an update that may leave the resource free *earlier*
        # than before (remove, correct, delay): an index of lower bounds on its free time
        # (Pool's gap heap) must hear of it. ``add`` and ``prune`` never make it freer for
        # a query at or after now, so they do not call it.
        self.on_free: Callable[[], None] | None = None
        # Bumped by every update that can change a query's answer at or after now (all but
        # prune): a cached answer computed at the same version is still the answer.
        self.version = 0

    def __len__(self) -> int:
        return len(self.starts)

    def intervals(self) -> list[tuple[float, float, Hashable]]:
        """All intervals as (start, end, key), in order."""
        return list(zip(self.starts, self.ends, self.keys))

    # ---- queries -----------------------------------------------------------------
    def earliest(self, t: float, duration: float) -> float:
        """Earliest start ``>= t`` of a free gap of ``duration`` us in this table.

        The gap search of the paper's ``earliestSlot`` for one resource. The probe's scan
        (:func:`ppipe.dataplane.reservation._scan`) writes this loop out for speed: a change
        here is a change there.
        """
        ends = self.ends
        i = bisect_right(ends, t + EPS_US)  # first interval that ends after t
        n = len(ends)
        if i == n:
            return t
        starts = self.starts
        while i < n and starts[i] < t + duration - EPS_US:
            if ends[i] > t:
                t = ends[i]
            i += 1
        return t

    def busy_until(self) -> float:
        """End of the last reservation (``-inf`` if empty)."""
        return self.ends[-1] if self.ends else float("-inf")

    # ---- updates -----------------------------------------------------------------
    def add(self, start: float, duration: float, key: Hashable = None) -> None:
        """Mark ``[start, start + duration)`` busy. The caller found it free (earliest_slot)."""
        if duration <= EPS_US:
            return
        end = start + duration
        starts, ends = self.starts, self.ends
        i = bisect_right(starts, start)
        n = len(starts)
        # Guard the invariant cheaply: a reservation must fit in the gap it was probed in.
        if (i > 0 and ends[i - 1] > start + EPS_US) or (i < n and starts[i] < end - EPS_US):
            raise ValueError(
                f"{self.name}: [{start:.3f}, {end:.3f}) overlaps an existing reservation; "
                "reservations must come from a probe on the current tables"
            )
        if i == n:  # the usual case: after every reservation there is
            starts.append(start)
            ends.append(end)
            self.keys.append(key)
        else:
            starts.insert(i, start)
            ends.insert(i, end)
            self.keys.insert(i, key)
        self.version += 1

    def prune(self, now: float) -> int:
        """Drop intervals that ended at or before ``now``; returns how many."""
        k = bisect_right(self.ends, now)
        if k:
            del self.starts[:k], self.ends[:k], self.keys[:k]
        return k

    def find(self, key: Hashable, hint_start: float | None = None) -> int:
        """Index of the interval with ``key`` or -1.

        ``hint_start``: where the interval was reserved. Corrections only push intervals
        later, so the search starts there and looks a few places ahead before falling
        back to a linear search.
        """
        keys = self.keys
        if hint_start is not None:
            i = bisect_left(self.starts, hint_start - EPS_US)
            for j in range(i, min(i + 4, len(keys))):
                if keys[j] == key:
                    return j
        try:
            return keys.index(key)
        except ValueError:
            return -1

    def remove(self, key: Hashable, hint_start: float | None = None) -> bool:
        """Remove the interval with ``key``; returns whether there was one."""
        i = self.find(key, hint_start)
        if i < 0:
            return False
        del self.starts[i], self.ends[i], self.keys[i]
        self.version += 1
        if self.on_free is not None:
            self.on_free()
        return True

    def confirm(self, key: Hashable, start: float, end: float, now: float | None = None, hint_start: float | None = None) -> bool:
        """Whether the interval ``key`` is exactly ``[start, end)`` already (then only prunes).

        The common report: the work ran as reserved. :meth:`correct` would remove and
        re-insert the same interval and tell the indexes the resource may be free earlier;
        this answers the question without changing anything (no version bump, no
        ``on_free``), so a caller does ``confirm(...) or correct(...)``. With ``now``, past
        intervals are pruned as :meth:`correct` would.
        """
        i = self.find(key, hint_start)
        if i < 0 or self.starts[i] != start or self.ends[i] != end:
            return False
        if now is not None:
            self.prune(now)
        return True

    def correct(self, key: Hashable, start: float, end: float, now: float | None = None, hint_start: float | None = None) -> int:
        """Replace the interval ``key`` by the observed ``[start, end)``.

        The reported interval is inserted even if its key was pruned or never reserved
        (the truth is what occupied the resource). An earlier interval that overlaps the
        reported start has not run yet (reports come in the order the work ran), so it is
        moved behind the reported one; later ones that now overlap are pushed back,
        cascading, each keeping its duration (a late report still pushes back what was reserved behind it,
        even when the reported interval itself is already over). With ``now``, past
        intervals are pruned afterwards. Returns how many later intervals moved. A reported
        interval of ``EPS_US`` or less occupied nothing: the key's interval is only removed.
        """
        self.remove(key, hint_start)
        if end - start <= EPS_US:
            if now is not None:
                self.prune(now)
            return 0
        i = bisect_left(self.starts, start)
        moved = 0
        if i > 0 and self.ends[i - 1] > start + EPS_US:
            # An earlier reservation still overlaps the reported start. Had it run, its own
            # report (sent when it ended, before this one) would have moved it before
            # `start`; so it has not run yet (its input came late, and the worker took this
            # one first): it now comes after the reported interval.
            i -= 1
            s0, e0, k0 = self.starts.pop(i), self.ends.pop(i), self.keys.pop(i)
            self.starts.insert(i, end)
            self.ends.insert(i, end + (e0 - s0))
            self.keys.insert(i, k0)
            moved += 1
        self.starts.insert(i, start)
        self.ends.insert(i, end)
        self.keys.insert(i, key)
        prev_end = self.ends[i + 1] if moved else end
        j = i + 2 if moved else i + 1
        n = len(self.starts)
        while j < n and self.starts[j] < prev_end - EPS_US:
            dur = self.ends[j] - self.starts[j]
            self.starts[j] = prev_end
            self.ends[j] = prev_end + dur
            prev_end = self.ends[j]
            moved += 1
            j += 1
        if now is not None:
            self.prune(now)  # a report usually comes after the fact: keep only what matters
        self.version += 1
        if self.on_free is not None:
            self.on_free()  # the reported interval may be shorter or earlier than the reserved one
        return moved

    def delay(self, key: Hashable, not_before: float, hint_start: float | None = None) -> tuple[float, float] | None:
        """Move the interval ``key`` so that it starts no earlier than ``not_before``.

        For work whose input is late (feedback from an upstream stage): it becomes ready at
        ``not_before``; work already due on this resource at that moment goes first (the
        worker serves in order of readiness), so the interval starts after any interval
        that overlaps ``not_before``; later ones that then overlap are pushed back.
        Returns the interval's new (start, end), or None if ``key`` is not in the table.
        """
        i = self.find(key, hint_start)
        if i < 0:
            return None
        s0, e0 = self.starts[i], self.ends[i]
        if s0 >= not_before - EPS_US:
            return s0, e0
        dur = e0 - s0
        del self.starts[i], self.ends[i], self.keys[i]
        start = not_before
        i = bisect_left(self.starts, start)
        if i > 0 and self.ends[i - 1] > start:
            start = self.ends[i - 1]
        self.starts.insert(i, start)
        self.ends.insert(i, start + dur)
        self.keys.insert(i, key)
        prev_end = start + dur
        j = i + 1
        n = len(self.starts)
        while j < n and self.starts[j] < prev_end - EPS_US:
            d = self.ends[j] - self.starts[j]
            self.starts[j] = prev_end
            self.ends[j] = prev_end + d
            prev_end = self.ends[j]
            j += 1
        self.version += 1
        if self.on_free is not None:
            self.on_free()  # its old place is free now
        return start, start + dur

    def check(self) -> None:
        """Raise AssertionError-free ValueError if the invariant is broken (tests)."""
        for a in range(1, len(self.starts)):
            if self.starts[a] < self.ends[a - 1] - EPS_US or self.starts[a] < self.starts[a - 1]:
                raise ValueError(f"{self.name}: intervals {a - 1} and {a} overlap or are out of order")


def earliest_slot(tables: Sequence[ReservationTable], t: float, duration: float) -> float:
    """Earliest time ``>= t`` at which all ``tables`` are free for ``duration`` us.

    The paper's ``earliestSlot(res, t, l)``. Iterates to a fixed point: each table moves
    the candidate start to its own earliest fit; when no table moves it, all are free.
    Terminates because every move jumps to the end of some reservation, and there are
    finitely many.
    """
    if duration <= 0 or not tables:
        return t
    if len(tables) == 1:
        return tables[0].earliest(t, duration)
    lim = t + EPS_US
    for tab in tables:
        ends = tab.ends
        if ends and ends[-1] > lim:
            break
    else:
        return t  # every table is free from t on (what the loop below would find at once)
    while True:
        t0 = t
        for tab in tables:
            t = tab.earliest(t, duration)
        if t <= t0 + EPS_US:
            return t
