"""End to end on the CPU with local worker processes: a two-partition plan of a real (tiny) CNN.

Uses the test double of the scheduler (tests/runtime/fakes.py) to pin the driver's
contract; test_dataplane_integration.py runs the data plane's real scheduler.
"""

from __future__ import annotations

import json

import httpx
import numpy as np
import pytest

from ppipe.runtime.ingress.protocol import decode_infer_response, encode_infer_request
from .conftest import tinynet_served
from .tinynet import reference


@pytest.fixture(scope="module")
def served(tinynet, tmp_path_factory):
    with tinynet_served(tinynet, tmp_path_factory) as url_rt:
        yield url_rt


def test_two_partitions_answer_like_the_whole_model(served, tinynet):
    url, rt = served
    rng = np.random.default_rng(1)
    xs = rng.normal(size=(6, 3, 8, 8)).astype(np.float32)
    with httpx.Client(base_url=url, timeout=30) as c:
        for i, x in enumerate(xs):
            body, headers = encode_infer_request({"input": x[None]}, binary=bool(i % 2), binary_output=bool(i % 2))
            r = c.post("/v2/models/tinynet/infer", content=body, headers=headers)
            assert r.status_code == 200, r.text
            got = decode_infer_response(r.content, r.headers.get("inference-header-content-length"))["logits"]
            np.testing.assert_allclose(got, reference(tinynet.directory, x[None]), rtol=2e-2, atol=2e-2)
        # a batch of samples in one request: each is a request to the scheduler
        body, headers = encode_infer_request({"input": xs})
        r = c.post("/v2/models/tinynet/infer", content=body, headers=headers)
        assert r.status_code == 200, r.text
        got = decode_infer_response(r.content)["logits"]
        np.testing.assert_allclose(got, reference(tinynet.directory, xs), rtol=2e-2, atol=2e-2)
    # batches really went through both partitions' workers, worker to worker
    done = [t for t in rt.traces if t.error is None]
    assert done and all([r.stage for r in t.reports] == [0, 1] for t in done)
    assert max(len(t.request_ids) for t in done) > 1  # the 6-sample request was batched
    # the feature map crossed as a transfer: the second stage's report has transfer stamps
    assert all(t.reports[1].transfer_start_us <= t.reports[1].transfer_end_us for t in done)
    # a stage starts after its call reached the worker
    assert all(r.received_us <= r.start_us for t in done for r in t.reports)


def test_reports_reach_the_scheduler_on_its_timeline(served):
    url, rt = served
    reps = rt.scheduler.reports
    assert reps, "no StageReport reached the scheduler"
    now = rt.clock.now_us()
    for r in reps:
        assert 0 <= r.start_us <= r.end_us <= now


def test_health_and_metadata(served):
    url, _ = served
    with httpx.Client(base_url=url, timeout=30) as c:
        assert c.get("/v2/health/live").status_code == 200
        assert c.get("/v2/health/ready").json() == {"ready": True, "started": True}
        meta = c.get("/v2/models/tinynet").json()
        assert meta["inputs"] == [{"name": "input", "datatype": "FP32", "shape": [-1, 3, 8, 8]}]
        assert meta["outputs"][0]["name"] == "logits"
        assert c.get("/v2/models/tinynet/ready").status_code == 200
        assert c.get("/v2/models/nope").status_code == 404


@pytest.mark.parametrize(
    "body,status,match",
    [
        ({"inputs": [{"name": "x", "shape": [1, 3, 8, 8], "datatype": "FP32", "data": [0.0] * 192}]}, 400, "has input 'input'"),
        ({"inputs": [{"name": "input", "shape": [1, 3, 8, 7], "datatype": "FP32", "data": [0.0] * 168}]}, 400, r"shape \[N, 3, 8, 8\]"),
        ({"inputs": [{"name": "input", "shape": [1, 3, 8, 8], "datatype": "INT32", "data": [0] * 192}]}, 400, "datatype FP32"),
        ({"inputs": [{"name": "input", "shape": [1, 3, 8, 8], "datatype": "FP32", "data": [0.0] * 192}], "outputs": [{"name": "zz"}]}, 400, "no output 'zz'"),
        (b"{oops", 400, "not valid JSON"),
        (b"x" * (2 << 20), 413, "exceeds the limit"),
    ],
)
def test_bad_requests_get_4xx_and_the_server_stays_healthy(served, body, status, match):
    url, _ = served
    with httpx.Client(base_url=url, timeout=30) as c:
        content = body if isinstance(body, bytes) else json.dumps(body).encode()
        r = c.post("/v2/models/tinynet/infer", content=content)
        assert r.status_code == status
        assert match in r.json()["error"] or __import__("re").search(match, r.json()["error"])
        assert c.post("/v2/models/unknown/infer", content=b"{}").status_code == 404
        assert c.get("/v2/health/ready").status_code == 200


def test_metrics_are_exported(served):
    url, _ = served
    with httpx.Client(base_url=url, timeout=30) as c:
        text = c.get("/metrics").text
    for name in ("ppipe_requests_total", "ppipe_request_latency_seconds_bucket", "ppipe_batch_size_bucket",
                 "ppipe_queue_length", "ppipe_vgpu_busy_seconds_total", "ppipe_drops_total"):
        assert name in text, name
    assert 'ppipe_requests_total{code="200",model="tinynet"}' in text
