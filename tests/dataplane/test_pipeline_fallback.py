"""Default data plane: a request is dropped only when no pipeline of its model can serve it in time."""

from __future__ import annotations

from ppipe.dataplane import Dispatch, Drop, DropReason, Request, build_scheduler
from ppipe.dataplane.options import SchedulerOptions
from ppipe.dataplane.testing import ManualClock, ToyModel, ToyPartition, ToyPipeline, toy_cluster, toy_plan, toy_profile


def _two_pipelines():
    """A slow pipeline on S (900 us) and a fast one on F (100 us), one vGPU each."""
    cluster = toy_cluster([("s", "S", 1, 1, 8.0), ("f", "F", 1, 1, 8.0)])
    prof = toy_profile("m", {"S": [900.0], "F": [100.0]}, out_bytes=[10], batches=(1,))
    plan = toy_plan(cluster, [ToyModel("m", 5.0, [
        ToyPipeline(1, [ToyPartition(0, 0, "S", 1, [("s-0", 0, 0)])]),
        ToyPipeline(1, [ToyPartition(0, 0, "F", 1, [("f-0", 0, 0)])]),
    ])])
    return plan, {"m": prof}, cluster


def _serve(**options):
    plan, profiles, cluster = _two_pipelines()
    s = build_scheduler(plan, profiles, cluster, ManualClock(), **options)
    s.topology.vgpus["f-0/gpu0/s0"].table.add(0.0, 300.0, "busy")  # the fast pipeline waits 300 us
    # 500 us left: the idle slow pipeline (least waiting, step 1) finishes at 900, the fast one at 400
    return s.submit(Request(0, "m", -4500.0, 500.0))


def test_default_tries_the_other_pipeline_before_dropping():
    assert SchedulerOptions().try_other_pipelines is True
    (d,) = _serve()
    assert isinstance(d, Dispatch) and d.pipeline == 1 and d.finish_us == 400.0


def test_paper_exact_mode_drops_after_the_least_waiting_pipeline():
    (d,) = _serve(try_other_pipelines=False)
    assert isinstance(d, Drop) and d.reason is DropReason.DEADLINE_UNREACHABLE


def test_no_pipeline_in_time_still_drops():
    plan, profiles, cluster = _two_pipelines()
    s = build_scheduler(plan, profiles, cluster, ManualClock())
    s.topology.vgpus["f-0/gpu0/s0"].table.add(0.0, 450.0, "busy")  # fast now ends at 550 > 500
    (d,) = s.submit(Request(0, "m", -4500.0, 500.0))
    assert isinstance(d, Drop) and d.reason is DropReason.DEADLINE_UNREACHABLE
