"""The gateway's OpenAPI 3 schema (GET /openapi.json): the Moondream API and OpenAI chat completions as this gateway
serves them, every error in one JSON shape. The fuzz tests drive the real gateway from it."""

from __future__ import annotations

from .moondream_api import ENDPOINTS

ERROR = {"type": "object", "required": ["error"], "properties": {"error": {
    "type": "object", "required": ["message", "type", "code"],
    "properties": {"message": {"type": "string"}, "type": {"type": "string"}, "code": {"type": "string"}}}}}
ERROR_STATUSES = {"400": "bad input", "401": "no valid API key", "404": "unknown model, adapter or path",
                  "405": "method not taken", "408": "the body did not arrive in time",
                  "413": "body or image too large", "429": "overloaded, or the key's limits (Retry-After)",
                  "500": "internal error", "502": "a server failed mid-request",
                  "503": "draining or no ready replica (Retry-After)", "504": "no answer in time"}
SETTINGS = {"type": "object", "properties": {
    "temperature": {"type": "number"}, "top_p": {"type": "number"}, "max_tokens": {"type": "integer"},
    "max_objects": {"type": "integer"}, "seed": {"type": "integer"}, "adapter": {"type": "string"},
    "variant": {"type": "string"}, "priority": {"type": "string", "enum": ["interactive", "batch"]}},
    "additionalProperties": False}
METRICS = {"type": "object", "properties": {"input_tokens": {"type": "integer"}, "output_tokens": {"type": "integer"},
                                            "prefill_time_ms": {"type": "number"}, "decode_time_ms": {"type": "number"},
                                            "ttft_ms": {"type": "number"}, "cached_tokens": {"type": "integer"}}}
COMMON = {"image_url": {"type": "string", "description": "a data URL, base64, or (where enabled) an http(s) link"},
          "stream": {"type": "boolean"}, "model": {"type": "string"}, "variant": {"type": "string"},
          "settings": SETTINGS,
          "spatial_refs": {"type": "array", "items": {"type": "array", "items": {"type": "number"}}}}
# each skill's result as the Moondream API answers it, by the result's key (skills/catalog.py)
RESULTS = {"answer": {"answer": {"type": "string"}}, "caption": {"caption": {"type": "string"}},
           "objects": {"objects": {"type": "array"}}, "points": {"points": {"type": "array"}},
           "segments": {"path": {"type": "string"}, "bbox": {"type": "object", "nullable": True}}}
CHAT_REQUEST = {"type": "object", "required": ["messages"], "properties": {
    "model": {"type": "string"}, "stream": {"type": "boolean"},
    "stream_options": {"type": "object", "properties": {"include_usage": {"type": "boolean"}}},
    "max_tokens": {"type": "integer"}, "max_completion_tokens": {"type": "integer"},
    "temperature": {"type": "number"}, "top_p": {"type": "number"}, "seed": {"type": "integer"},
    "n": {"type": "integer"}, "reasoning": {"oneOf": [{"type": "boolean"}, {"type": "object"}]},
    "messages": {"type": "array", "items": {"type": "object", "required": ["role", "content"], "properties": {
        "role": {"type": "string", "enum": ["system", "user", "assistant"]},
        "content": {"oneOf": [{"type": "string"}, {"type": "array", "items": {"type": "object"}}]}}}}}}
CHAT_RESPONSE = {"type": "object", "required": ["id", "object", "choices", "usage"], "properties": {
    "id": {"type": "string"}, "object": {"type": "string"}, "created": {"type": "integer"},
    "model": {"type": "string"}, "choices": {"type": "array"}, "usage": {"type": "object"}}}


def _responses(ok: dict, streams: bool = False) -> dict:
    content = {"application/json": {"schema": ok}}
    if streams:
        content["text/event-stream"] = {"schema": {"type": "string"}}
    out = {"200": {"description": "the answer", "content": content}}
    for status, why in ERROR_STATUSES.items():
        out[status] = {"description": why, "content": {"application/json": {"schema": ERROR}}}
    return out


def _post(summary: str, request: dict, ok: dict, streams: bool) -> dict:
    return {"post": {"summary": summary, "requestBody": {"required": True, "content": {
        "application/json": {"schema": request}}}, "responses": _responses(ok, streams)}}


def schema(served: list[str]) -> dict:
    paths = {}
    for skill in ENDPOINTS:
        text = {"type": "string", **({"enum": list(skill.text_choices)} if skill.text_choices else {})}
        fields, answer = {skill.text: text}, dict(RESULTS[skill.result])
        if skill.reasoning:
            fields["reasoning"], answer["reasoning"] = {"type": "boolean"}, {"type": "object"}
        required = ["image_url"] * (skill.image == "required") + [skill.text] * skill.text_required
        request = {"type": "object", "required": required, "properties": {**COMMON, **fields},
                   "additionalProperties": False}
        ok = {"type": "object", "properties": {**answer, "request_id": {"type": "string"},
                                               "finish_reason": {"type": "string"}, "metrics": METRICS}}
        paths[f"/v1/{skill.name}"] = _post(f"Moondream API: {skill.name}", request, ok, streams=skill.api_streams)
    paths["/v1/chat/completions"] = _post("OpenAI chat completions", CHAT_REQUEST, CHAT_RESPONSE, streams=True)
    paths["/v1/models"] = {"get": {"summary": "the served model names", "responses": _responses(
        {"type": "object", "properties": {"object": {"type": "string"}, "data": {"type": "array"}}})}}
    for path, what in (("/healthz", "the process"), ("/readyz", "a tritonserver replica is ready")):
        paths[path] = {"get": {"summary": what, "responses": {
            "200": {"description": "yes", "content": {"application/json": {"schema": {"type": "object"}}}},
            "503": {"description": "no", "content": {"application/json": {"schema": {"type": "object"}}}}}}}
    return {"openapi": "3.0.3", "info": {"title": "Kestrel-Triton gateway", "version": "1",
                                         "description": f"Serves {', '.join(served)}."},
            "components": {"securitySchemes": {
                "moondreamKey": {"type": "apiKey", "in": "header", "name": "X-Moondream-Auth"},
                "bearer": {"type": "http", "scheme": "bearer"}}},
            "security": [{"moondreamKey": []}, {"bearer": []}], "paths": paths}
