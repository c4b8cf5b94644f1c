"""End-to-end smoke test of build_scheduler on a Fig. 5-like toy world."""

from ppipe.dataplane import Dispatch, Request, WakeAt, build_scheduler
from ppipe.dataplane.testing import ManualClock, ToyModel, ToyPartition, ToyPipeline, toy_cluster, toy_plan, toy_profile


def test_build_scheduler_waits_then_dispatches_a_full_batch():
    c = toy_cluster([("a", "A", 1, 3, 8.0)])
    prof = toy_profile("m", {"A": [100.0, 200.0]}, out_bytes=[10000, 10])
    plan = toy_plan(c, [ToyModel("m", 5.0, [ToyPipeline(2, [ToyPartition(0, 0, "A", 1, [("a-0", 0, 0)]), ToyPartition(1, 1, "A", 1, [("a-1", 0, 0), ("a-2", 0, 0)])])])])
    clk = ManualClock()
    s = build_scheduler(plan, {"m": prof}, c, clk)
    first = s.submit(Request(0, "m", 0.0, 5000.0))
    # batch 1 alone: 100 us + 10 us transfer (10000 B at 8 Gbit/s) + 200 us -> 4690 us of slack
    assert first == [WakeAt(4690.0)]
    clk.t_us = 10.0
    (d,) = s.submit(Request(1, "m", 10.0, 5010.0))
    assert isinstance(d, Dispatch) and d.batch == 2
    assert [st.vgpu_id for st in d.stages] == ["a-0/gpu0/s0", "a-1/gpu0/s0"]
    # batch 2: 150 us, then 2 x 10000 B x 8 / 8 Gbit/s = 20 us transfer, then 300 us
    assert d.finish_us == 10.0 + 150.0 + 20.0 + 300.0
