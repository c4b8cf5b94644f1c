"""Reservation tables: gap filling, several resources at once, pruning, correction."""

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ppipe.dataplane.tables import ReservationTable, earliest_slot


def table(*intervals):
    t = ReservationTable("r")
    for s, e in intervals:
        t.add(s, e - s, (s, e))
    return t


def test_earliest_fills_a_gap_that_is_long_enough():
    t = table((10, 20), (30, 40), (60, 70))
    assert t.earliest(0, 10) == 0  # fits before the first
    assert t.earliest(0, 11) == 40  # 20..30 is too short; 40..60 fits
    assert t.earliest(15, 5) == 20  # inside a reservation -> its end, and 20..25 is free
    assert t.earliest(41, 19) == 41
    assert t.earliest(41, 20) == 70  # appends after the last one


def test_touching_intervals_are_not_overlaps():
    t = table((10, 20))
    assert t.earliest(0, 10) == 0
    t.add(0, 10)
    t.add(20, 5)
    t.check()
    with pytest.raises(ValueError, match="overlaps"):
        t.add(19, 2)


def test_two_resources_must_be_free_at_the_same_time():
    up = table((0, 10), (25, 40))
    down = table((12, 30))
    # up free at 10..25 but down busy 12..30; down free from 30 but up busy until 40.
    assert earliest_slot([up, down], 0, 5) == 40
    assert earliest_slot([up, down], 0, 2) == 10  # 10..12 is free on both
    assert earliest_slot([down, up], 0, 2) == 10  # order of the list does not matter


def test_prune_drops_only_intervals_that_ended():
    t = table((0, 10), (10, 20), (25, 30))
    assert t.prune(10) == 1
    assert [(s, e) for s, e, _ in t.intervals()] == [(10, 20), (25, 30)]
    assert t.prune(24.9) == 1
    assert t.earliest(0, 100) == 30


def test_correct_late_end_pushes_later_reservations_back_in_cascade():
    t = table((0, 10), (10, 20), (25, 30), (50, 60))
    moved = t.correct((0, 10), 0, 18)
    assert moved == 2
    assert [(s, e) for s, e, _ in t.intervals()] == [(0, 18), (18, 28), (28, 33), (50, 60)]
    t.check()


def test_correct_early_end_frees_the_gap():
    t = table((0, 10), (20, 30))
    t.correct((20, 30), 20, 25)
    assert [(s, e) for s, e, _ in t.intervals()] == [(0, 10), (20, 25)]
    assert t.earliest(0, 10) == 10


def test_correct_moves_an_earlier_unrun_reservation_behind_the_reported_one():
    # (0,10) was reserved first, but its input came late: the worker ran (20,30)'s batch at 5.
    t = table((0, 10), (20, 30), (30, 40))
    moved = t.correct((20, 30), 5, 15)
    assert [(s, e, k) for s, e, k in t.intervals()] == [(5, 15, (20, 30)), (15, 25, (0, 10)), (30, 40, (30, 40))]
    assert moved == 1
    t.check()


def test_correct_of_an_unknown_key_inserts_the_truth():
    t = table((0, 10))
    t.correct("ghost", 10, 15)
    assert [(s, e) for s, e, _ in t.intervals()] == [(0, 10), (10, 15)]


def test_correct_to_an_empty_interval_frees_the_key_and_stores_nothing():
    # A report of no time (start == end, or within EPS_US) occupied nothing: were it stored,
    # a query at its start would pass over it and the reservation it returns would overlap it.
    t = table((0, 50))
    t.correct((0, 50), 2.2e-16 / 2, 2.2e-16 / 2)
    assert t.intervals() == []
    assert t.earliest(0.0, 50.0) == 0.0
    t.add(0.0, 50.0, "next")
    t.correct("ghost", 60.0, 60.0 + 1e-7)
    assert [(s, e) for s, e, _ in t.intervals()] == [(0.0, 50.0)]
    t.check()


def test_confirm_answers_without_changing_the_table():
    t = table((0, 10), (20, 30))
    calls = []
    t.on_free = lambda: calls.append(1)
    v = t.version
    assert t.confirm((20, 30), 20, 30, now=15)  # ran as reserved: only the past is pruned
    assert [(s, e) for s, e, _ in t.intervals()] == [(20, 30)] and t.version == v and not calls
    assert not t.confirm((20, 30), 20, 31)  # ran longer: the caller must correct
    assert not t.confirm("ghost", 20, 30)  # unknown key: the caller must correct (it inserts the truth)
    assert [(s, e) for s, e, _ in t.intervals()] == [(20, 30)]


@settings(max_examples=200, deadline=None)
@given(
    st.lists(st.lists(st.tuples(st.integers(0, 100), st.integers(1, 20)), max_size=8), min_size=1, max_size=3),
    st.integers(0, 120),
    st.integers(1, 30),
)
def test_earliest_slot_is_free_on_all_and_minimal(specs, t0, dur):
    tables = []
    for spec in specs:
        tab = ReservationTable()
        for s, d in spec:
            if tab.earliest(s, d) == s:  # keep only non-overlapping intervals
                tab.add(s, d)
        tables.append(tab)

    def free(t):
        return all(not (s < t + dur and t < e) for tab in tables for s, e, _ in tab.intervals())

    got = earliest_slot(tables, t0, dur)
    assert got >= t0 and free(got)
    # Minimal: the earliest free start is t0 or the end of some interval.
    cands = sorted({t0} | {e for tab in tables for _s, e, _ in tab.intervals() if e >= t0})
    assert got == next(c for c in cands if free(c))


def test_a_report_of_a_finished_interval_still_pushes_back_what_follows():
    t = table((0, 10), (10, 20))
    moved = t.correct((0, 10), 0, 15, now=15)  # reported after the fact, at its end
    assert moved == 1
    assert [(s, e) for s, e, _ in t.intervals()] == [(15, 25)]  # the past one is pruned


def test_delay_moves_late_work_behind_what_is_already_due_and_cascades():
    t = table((0, 10), (12, 20), (20, 30), (40, 50))
    # (0,10)'s input arrives only at 15: (12,20) is due first, so it goes to 20, pushing (20,30)
    assert t.delay((0, 10), 15) == (20, 30)
    assert [(s, e) for s, e, _ in t.intervals()] == [(12, 20), (20, 30), (30, 40), (40, 50)]
    assert t.delay((40, 50), 10) == (40, 50)  # already late enough: unchanged
    assert t.delay("missing", 0) is None
    t.check()
