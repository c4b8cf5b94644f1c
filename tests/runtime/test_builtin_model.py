"""End to end with a built-in model of the profiler: ResNet-50 in two partitions on local-cpu.

The answer of the partitioned model (fp16 feature map between the two workers) must equal
the unpartitioned model's within fp16 tolerance. The two ``ort`` workers run in this
process (:func:`ppipe.runtime.launch.inproc.inproc_serve`, no Ray): what is checked is the
partitioning's arithmetic, the same whichever launcher started the workers
(test_serve_local.py serves a partitioned model on Ray workers).
"""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

from ppipe.spec.cluster import load_cluster
from .conftest import make_plan

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def resnet50():
    from ppipe.spec.profile import load_profile

    prof = load_profile("resnet50")  # shipped with ppipe: a failure to load it is a bug, not a skip
    assert "cpu" in prof.gpus(), "the built-in resnet50 profile lost its 'cpu' timings"
    return prof


def test_resnet50_two_partitions_equal_the_whole_model(resnet50, tmp_path):
    import onnxruntime as ort

    from ppipe.profiler.blocks import ensure_reference_model
    from ppipe.runtime.launch.deploy import load_deployment
    from ppipe.runtime.launch.inproc import inproc_serve
    from ppipe.runtime.ingress.protocol import decode_infer_response, encode_infer_request

    half = resnet50.num_blocks // 2
    plan = make_plan(
        resnet50, load_cluster("local-cpu"), [(0, half - 1, "cpu", 2, 1), (half, resnet50.num_blocks - 1, "cpu", 2, 1)],
        batch=2, slo_ms=20_000.0, profile_ref="resnet50",
    )
    plan.save(tmp_path / "plan.yaml")
    dep = load_deployment(tmp_path / "plan.yaml")
    spec = resnet50.manifest.input
    x = np.random.default_rng(0).normal(size=(2, *spec.shape)).astype(np.float32)

    async def main():
        async with inproc_serve(dep, backend="ort", http=True, keep_traces=10) as s:
            body, headers = encode_infer_request({spec.name: x}, binary=True, binary_output=True)
            r = await s.client.post("/v2/models/resnet50/infer", content=body, headers=headers)
            return r, list(s.runtime.traces)

    r, traces = asyncio.run(asyncio.wait_for(main(), 300))
    assert r.status_code == 200, r.text
    out_name = resnet50.manifest.outputs[0].name
    got = decode_infer_response(r.content, r.headers.get("inference-header-content-length"))[out_name]
    ref_sess = ort.InferenceSession(str(ensure_reference_model(resnet50)), providers=["CPUExecutionProvider"])
    want = ref_sess.run([out_name], {spec.name: x})[0]
    assert got.shape == want.shape == (2, 1000)
    # softmax over 1000 classes of a random-weight net: values ~1e-3, so compare relatively
    np.testing.assert_allclose(got, want, rtol=2e-2, atol=1e-5)
    assert (got.argmax(1) == want.argmax(1)).all()
    assert traces and all(len(t.reports) == 2 and t.error is None for t in traces)
