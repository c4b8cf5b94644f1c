"""The failure cut and the report deadline (ppipe.dataplane.failure), which both the
scheduler's mark_failed and the runtime's host apply."""

from __future__ import annotations

import pytest

from ppipe.dataplane.failure import failure_cut, report_deadline_us

ROUTE = ["a", "b", "c"]


@pytest.mark.parametrize("done, dead, cut", [
    ([False, False, False], "b", 1),  # a stage not run yet on the dead vGPU
    ([False, False, False], "a", 0),  # running on it
    ([True, False, False], "a", 1),  # a dead sender: its feature map may not have left
    ([True, False, False], "c", 2),
    ([True, True, False], "a", None),  # its output reached b, which reported: the batch goes on
    ([True, True, False], "b", 2),
    ([True, True, True], "c", None),  # done
    ([False, False, False], "z", None),  # not on its route
])
def test_the_failure_cut(done, dead, cut):
    assert failure_cut(ROUTE, done, dead) == cut


def test_a_vgpu_twice_on_a_route_is_cut_at_its_first_open_stage():
    assert failure_cut(["a", "b", "a"], [True, True, False], "a") == 2
    assert failure_cut(["a", "b", "a"], [True, False, False], "a") == 1  # the dead sender of stage 1


def test_the_report_deadline_is_the_planned_end_plus_the_larger_of_grace_and_slo():
    assert report_deadline_us(1000.0, 5e6, 2e5) == 1000.0 + 5e6
    assert report_deadline_us(1000.0, 1e5, 2e5) == 1000.0 + 2e5
