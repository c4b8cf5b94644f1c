"""GET /v2/openapi.json: the document covers every route, its schemas are valid JSON Schema,
the server's answers follow it, and requests generated from it never get a 500."""

from __future__ import annotations

import json
import os
import time

import jsonschema
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ppipe.runtime.ingress.openapi import INFERENCE_REQUEST
from ppipe.runtime.ingress.protocol import encode_infer_request

from .test_hardening import AUTH, TOKEN, AsgiHarness, StubRuntime, counted


@pytest.fixture
def served(tinynet):
    h = AsgiHarness(StubRuntime(tinynet), token=TOKEN, decode_workers=0)
    yield h
    h.close()


def _get(h, path, headers=AUTH):
    return h.run(h.client.get(path, headers=headers))


def test_the_document_covers_every_route_and_its_schemas_are_valid(served):
    assert _get(served, "/v2/openapi.json", headers={}).status_code == 401
    doc = _get(served, "/v2/openapi.json").json()
    assert doc["openapi"].startswith("3.1")
    routes = {(r.path.replace("{name}", "{model_name}"), m) for r in served.app.app.routes for m in r.methods if m != "HEAD"}
    documented = {(p, m.upper()) for p, ops in doc["paths"].items() for m in ops}
    assert routes == documented
    for name, schema in doc["components"]["schemas"].items():
        jsonschema.Draft202012Validator.check_schema(schema)
    assert doc["components"]["schemas"]["InferenceRequest"] == json.loads(json.dumps(INFERENCE_REQUEST))
    assert doc["paths"]["/v2/models/{model_name}/infer"]["post"]["parameters"][0]["schema"]["enum"] == ["tinynet"]


def test_answers_follow_the_document(served):
    schemas = _get(served, "/v2/openapi.json").json()["components"]["schemas"]

    def check(r, schema):
        jsonschema.validate(r.json(), schemas[schema])

    body, headers = encode_infer_request({"input": np.ones((2, 3, 8, 8), np.float32)}, binary_output=False)
    check(served.post(body, {**headers, **AUTH}), "InferenceResponse")
    check(served.post(b"{", AUTH), "Error")
    check(served.post(body, headers), "Error")  # no token
    check(_get(served, "/v2/models/tinynet"), "ModelMetadata")
    check(_get(served, "/v2"), "ServerMetadata")
    check(_get(served, "/v2/models/nope"), "Error")


_SCALARS = {"string": st.text(max_size=8), "integer": st.integers(-3, 2**63), "number": st.floats(allow_nan=True),
            "boolean": st.booleans(), "null": st.none()}


def from_schema(schema: dict) -> st.SearchStrategy:
    """Values that follow ``schema`` (the subset of JSON Schema the document uses: types,
    enum, minimum, properties, required, additionalProperties, items), with optional
    properties present or not. (hypothesis-jsonschema does this in general, but its 0.23
    relies on Hypothesis internals that current Hypothesis no longer has.)"""
    if "enum" in schema:
        return st.sampled_from(schema["enum"])
    kinds = schema.get("type", ["string", "integer", "number", "boolean", "null", "array", "object"])
    kinds = [kinds] if isinstance(kinds, str) else kinds
    return st.one_of([_of_type(k, schema) for k in kinds])


def _of_type(kind: str, schema: dict) -> st.SearchStrategy:
    if kind == "integer" and "minimum" in schema:
        return st.integers(schema["minimum"], 2**63)
    if kind == "array":
        items = from_schema(schema["items"]) if "items" in schema else st.one_of(_SCALARS["number"], _SCALARS["integer"])
        return st.lists(items, max_size=6)
    if kind == "object":
        props = schema.get("properties", {})
        required = {k: from_schema(props[k]) for k in schema.get("required", [])}
        optional = {k: from_schema(v) for k, v in props.items() if k not in required}
        fixed = st.fixed_dictionaries(required, optional=optional)
        extra = schema.get("additionalProperties")
        if not isinstance(extra, dict):
            return fixed
        return st.tuples(fixed, st.dictionaries(st.text(max_size=6), from_schema(extra), max_size=2)).map(lambda t: {**t[1], **t[0]})
    return _SCALARS[kind]


@settings(max_examples=int(os.environ.get("PPIPE_FUZZ_EXAMPLES", 150)), deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(request=from_schema(INFERENCE_REQUEST))
def test_requests_generated_from_the_document_never_get_a_500(served, request):
    before = counted(served.rt)
    t = time.perf_counter()
    r = served.post(json.dumps(request).encode(), AUTH)
    assert time.perf_counter() - t < 5.0
    assert r.status_code in (200, 400), (r.status_code, r.text[:300], request)
    assert counted(served.rt) == before + 1
    if r.status_code == 400:
        assert isinstance(r.json()["error"], str)
