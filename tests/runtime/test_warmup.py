"""The warm-up before ready: every vGPU runs a batch, and nothing of it shows afterwards.

In process (``inproc_serve``), the data plane's own scheduler (reservation policy) with the
runtime's margins, tinynet's two stages on emulated workers: three vGPUs, then two.
"""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

from ppipe.dataplane.margins import DEFAULT_ANSWER_BUDGET_US, DEFAULT_DISPATCH_LEAD_US
from ppipe.runtime.launch.deploy import load_deployment
from ppipe.runtime.launch.inproc import inproc_serve
from ppipe.runtime.scheduler.host import DroppedError
from ppipe.runtime.scheduler.warmup import MAX_ROUNDS
from ppipe.spec.cluster import load_cluster

from .conftest import THREE_CPUS, make_plan, write_cluster

MARGINS = dict(dispatch_lead_us=DEFAULT_DISPATCH_LEAD_US, answer_budget_us=DEFAULT_ANSWER_BUDGET_US)


@pytest.fixture(scope="module")
def pools_of_three_and_two(tinynet, tmp_path_factory):
    d = tmp_path_factory.mktemp("warmup")
    cluster = load_cluster(str(write_cluster(d / "cluster.yaml", THREE_CPUS)))
    plan = make_plan(tinynet, cluster, [(0, 1, "cpu", 2, 3), (2, 2, "cpu", 2, 2)], batch=1, slo_ms=200.0)
    plan.save(d / "plan.yaml")
    return load_deployment(d / "plan.yaml", str(d / "cluster.yaml"))


def _batches_run(serving) -> dict[str, int]:
    return {v: h.worker.batches for v, h in serving.workers.items()}


def test_every_vgpu_runs_a_batch_before_the_runtime_is_started_and_nothing_of_it_shows(pools_of_three_and_two, tinynet):
    x = np.zeros(tinynet.manifest.input.shape, np.float32)

    async def main():
        async with inproc_serve(pools_of_three_and_two, warm_up=True, keep_traces=100, **MARGINS) as s:
            rt = s.runtime
            warmed, ran = rt.warmed, _batches_run(s)
            seen = (list(rt.traces), rt.report_messages, dict(rt.metrics.batch_sizes), rt.metrics.render().decode(), dict(rt.budgets._seen),
                    len(rt._inflight))
            await rt.infer("tinynet", {"input": x})
            return rt.started, warmed, ran, seen, len(rt.traces)

    started, warmed, ran, (traces, reports, sizes, exposition, lateness_seen, in_flight), after = asyncio.run(main())
    assert started and warmed.cold == () and warmed.skipped == ()
    assert all(n >= 1 for n in ran.values()) and len(ran) == 5, ran
    assert 3 <= warmed.sent["tinynet"] <= MAX_ROUNDS * 3 and warmed.answered["tinynet"] >= 1
    # none of it in the traces, the report count, the metrics or the answer budgets' window
    assert traces == [] and reports == 0 and sizes == {} and lateness_seen == {}
    assert in_flight == 0  # every report of its batches came before it ended
    assert "ppipe_drops_total{" not in exposition and 'ppipe_batch_size_count{model="tinynet"}' not in exposition
    assert after == 1  # a served request is traced as before


def test_a_runtime_fed_by_ingresses_warms_up_with_zeros_of_its_own(pools_of_three_and_two, tinynet):
    x = np.ones(tinynet.manifest.input.shape, np.float32)

    async def main():
        async with inproc_serve(pools_of_three_and_two, ingresses=1, warm_up=True, **MARGINS) as s:
            warmed, ran = s.runtime.warmed, _batches_run(s)
            out = await s.ingresses[0].infer("tinynet", {"input": x})
            return warmed, ran, out

    warmed, ran, out = asyncio.run(main())
    assert warmed.cold == () and all(n >= 1 for n in ran.values()), (warmed, ran)
    assert set(out) == {o.name for o in tinynet.manifest.outputs}


def test_an_ingress_is_told_no_model_is_ready_and_refused_while_the_warm_up_runs(pools_of_three_and_two, tinynet):
    x = np.ones(tinynet.manifest.input.shape, np.float32)

    async def main():
        async with inproc_serve(pools_of_three_and_two, ingresses=1, warm_up=True, **MARGINS) as s:
            rt = s.runtime
            rt._warming = set()  # as while it runs: an ingress that came up early
            ready = rt._ready_models()
            with pytest.raises(DroppedError) as refused:
                await s.ingresses[0].infer("tinynet", {"input": x})
            rt._warming = None
            return ready, refused.value.reason, rt._ready_models()

    ready_warming, reason, ready_after = asyncio.run(main())
    assert ready_warming == () and reason == "starting" and ready_after == ("tinynet",)


def test_without_warm_up_no_batch_runs_at_start(pools_of_three_and_two):
    async def main():
        async with inproc_serve(pools_of_three_and_two, **MARGINS) as s:
            return s.runtime.warmed, _batches_run(s)

    warmed, ran = asyncio.run(main())
    assert warmed is None and set(ran.values()) == {0}
