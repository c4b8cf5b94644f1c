"""The OpenAPI 3.1 description of the HTTP frontend, served at ``GET /v2/openapi.json``.

It describes the Open Inference Protocol v2 (KServe v2 REST) as ppipe serves it: the
endpoints, their bodies (JSON Schema 2020-12, which OpenAPI 3.1 uses), the error body
``{"error": ...}`` of every failure, the bearer token, and the models this server serves
(an enum of ``model_name``). Generic clients and fuzzers (schemathesis, hypothesis-jsonschema)
read it; ``tests/runtime/test_openapi.py`` checks the server's answers against it.

The binary tensor extension (a JSON header followed by raw bytes, its length in the
``Inference-Header-Content-Length`` header) is described in prose: JSON Schema cannot say
"JSON, then bytes".
"""

from __future__ import annotations

from typing import Any

DATATYPES = ["BOOL", "UINT8", "UINT16", "UINT32", "UINT64", "INT8", "INT16", "INT32", "INT64", "FP16", "FP32", "FP64", "BYTES"]

_PARAMETERS = {"type": "object", "additionalProperties": {"type": ["string", "number", "integer", "boolean"]}}
_SHAPE = {"type": "array", "items": {"type": "integer", "minimum": 0}}
_DATA = {"type": "array", "description": "The tensor's elements, row-major, flattened (nested lists are accepted too); "
                                          "for BYTES (encoded images, models with a preprocess), base64 strings."}

REQUEST_INPUT = {
    "type": "object",
    "required": ["name", "shape", "datatype"],
    "properties": {
        "name": {"type": "string"},
        "shape": _SHAPE,
        "datatype": {"type": "string", "enum": DATATYPES},
        "parameters": {
            "type": "object",
            "properties": {"binary_data_size": {"type": "integer", "minimum": 0}},
            "additionalProperties": {"type": ["string", "number", "integer", "boolean"]},
        },
        "data": _DATA,
    },
}
REQUEST_OUTPUT = {
    "type": "object",
    "required": ["name"],
    "properties": {
        "name": {"type": "string"},
        "parameters": {"type": "object", "properties": {"binary_data": {"type": "boolean"}},
                       "additionalProperties": {"type": ["string", "number", "integer", "boolean"]}},
    },
}
INFERENCE_REQUEST = {
    "type": "object",
    "required": ["inputs"],
    "properties": {
        "id": {"type": "string"},
        "parameters": {"type": "object", "properties": {"binary_data_output": {"type": "boolean"}},
                       "additionalProperties": {"type": ["string", "number", "integer", "boolean"]}},
        "inputs": {"type": "array", "items": REQUEST_INPUT},
        "outputs": {"type": "array", "items": REQUEST_OUTPUT},
    },
}
RESPONSE_OUTPUT = {
    "type": "object",
    "required": ["name", "shape", "datatype"],
    "properties": {"name": {"type": "string"}, "shape": _SHAPE, "datatype": {"type": "string", "enum": DATATYPES},
                   "parameters": _PARAMETERS, "data": _DATA},
}
INFERENCE_RESPONSE = {
    "type": "object",
    "required": ["model_name", "outputs"],
    "properties": {"model_name": {"type": "string"}, "model_version": {"type": "string"}, "id": {"type": "string"},
                   "parameters": _PARAMETERS, "outputs": {"type": "array", "items": RESPONSE_OUTPUT}},
}
ERROR = {"type": "object", "required": ["error"], "properties": {"error": {"type": "string"}}}
TENSOR_METADATA = {"type": "object", "required": ["name", "datatype", "shape"],
                   "properties": {"name": {"type": "string"}, "datatype": {"type": "string"},
                                  "shape": {"type": "array", "items": {"type": "integer"}}}}
MODEL_METADATA = {
    "type": "object",
    "required": ["name", "platform", "inputs", "outputs"],
    "properties": {"name": {"type": "string"}, "versions": {"type": "array", "items": {"type": "string"}},
                   "platform": {"type": "string"}, "inputs": {"type": "array", "items": TENSOR_METADATA},
                   "outputs": {"type": "array", "items": TENSOR_METADATA}, "parameters": {"type": "object"}},
}
SERVER_METADATA = {"type": "object", "required": ["name", "version", "extensions"],
                   "properties": {"name": {"type": "string"}, "version": {"type": "string"},
                                  "extensions": {"type": "array", "items": {"type": "string"}}}}


def _json(schema: dict, description: str) -> dict:
    return {"description": description, "content": {"application/json": {"schema": schema}}}


def _errors(*codes: int) -> dict:
    words = {400: "malformed request (the error names the field)", 401: "missing or wrong bearer token", 403: "refused",
             404: "unknown model", 408: "headers or body not sent in time", 409: "conflict", 413: "body too large",
             503: "dropped: 'dropped: <reason>: ...', reason also in the Ppipe-Drop-Reason header", 504: "no decision within SLO + grace"}
    return {str(c): _json(ERROR, words[c]) for c in codes}


def openapi_document(models: list[str], version: str) -> dict[str, Any]:
    """The OpenAPI 3.1 document of a server that serves ``models``."""
    name = {"name": "model_name", "in": "path", "required": True, "schema": {"type": "string", "enum": list(models)}}
    secured = [{"bearer": []}]
    health = {"type": "object", "properties": {"live": {"type": "boolean"}, "ready": {"type": "boolean"},
                                               "started": {"type": "boolean", "description": "the server's runtime is up"}}}

    def get(summary, ok, *errors, params=(), security=secured):
        op = {"summary": summary, "responses": {"200": ok, **_errors(*errors)}, "security": security}
        if params:
            op["parameters"] = list(params)
        return {"get": op}

    infer_body = {"required": True, "content": {
        "application/json": {"schema": INFERENCE_REQUEST},
        "application/octet-stream": {"description": "Binary tensor extension: the JSON request, then each input's raw bytes "
                                                    "(row-major, little-endian); the JSON's length in Inference-Header-Content-Length.",
                                     "schema": {"type": "string", "format": "binary"}}}}
    return {
        "openapi": "3.1.0",
        "info": {"title": "ppipe serve: Open Inference Protocol v2 (KServe v2 REST)", "version": version},
        "components": {
            "securitySchemes": {"bearer": {"type": "http", "scheme": "bearer",
                                           "description": "`ppipe serve --token`: every endpoint but /v2/health/live|ready; "
                                                          "the admin endpoint always needs one."}},
            "schemas": {"InferenceRequest": INFERENCE_REQUEST, "InferenceResponse": INFERENCE_RESPONSE, "Error": ERROR,
                        "ModelMetadata": MODEL_METADATA, "ServerMetadata": SERVER_METADATA},
        },
        "paths": {
            "/v2": get("Server metadata", _json(SERVER_METADATA, "name, version, extensions"), 401),
            "/v2/health/live": get("Liveness", _json(health, "the process serves"), security=[]),
            "/v2/health/ready": get("Readiness", _json(health, "ready"), 503, security=[]),
            "/v2/openapi.json": get("This document", _json({"type": "object"}, "OpenAPI 3.1"), 401),
            "/v2/models/{model_name}": get("Model metadata", _json(MODEL_METADATA, "inputs, outputs, SLO"), 401, 404, params=[name]),
            "/v2/models/{model_name}/ready": get("Model readiness", _json(health, "ready"), 401, 404, 503, params=[name]),
            "/v2/models/{model_name}/infer": {"post": {
                "summary": "Inference: one request may carry N samples (shape [N, ...]); each is scheduled on its own",
                "parameters": [name], "security": secured, "requestBody": infer_body,
                "responses": {"200": _json(INFERENCE_RESPONSE, "the outputs"), **_errors(400, 401, 404, 408, 413, 503, 504)},
            }},
            "/metrics": get("Prometheus metrics", {"description": "text exposition format",
                                                   "content": {"text/plain": {"schema": {"type": "string"}}}}, 401),
            "/v2/admin/plan": {
                **get("The plan served and the switches made", _json({"type": "object"}, "models, vGPUs, switches"), 401, 403, 409),
                "post": {"summary": "Switch to the plan.yaml in the body, live (ppipe apply)", "security": secured,
                         "parameters": [{"name": "as_placed", "in": "query", "required": False, "schema": {"type": "string"},
                                         "description": "1: serve the placement as written (default: rename GPUs within a "
                                                        "server group to keep running workers)"}],
                         "requestBody": {"required": True, "content": {"application/yaml": {"schema": {"type": "string"}}}},
                         "responses": {"200": _json({"type": "object"}, "what the switch did"), **_errors(400, 401, 403, 409, 413)}},
            },
        },
    }
