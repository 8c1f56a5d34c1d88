"""openapi.yaml (repo root) and the app's generated schema must agree on routes and fields."""
from __future__ import annotations

import pathlib
from typing import Any

import pytest
import yaml

ROOT = pathlib.Path(__file__).resolve().parents[2]


def _resolve(spec: dict, schema: dict) -> dict:
    while "$ref" in schema:
        schema = spec["components"]["schemas"][schema["$ref"].split("/")[-1]]
    return schema


def _fields(spec: dict, schema: dict, depth: int = 0) -> Any:
    """A schema's shape: field names (with nested object fields), required set; types reduced to names."""
    schema = _resolve(spec, schema)
    if depth > 6:
        return "..."
    if "contentSchema" in schema:  # an SSE event's `data`: JSON of a documented model
        return {"json": _fields(spec, schema["contentSchema"], depth + 1)}
    for key in ("anyOf", "oneOf", "allOf"):
        if key in schema:
            return {key: sorted((repr(_fields(spec, s, depth + 1)) for s in schema[key]))}
    if schema.get("type") == "array":
        return {"array": _fields(spec, schema.get("items", {}), depth + 1)}
    if "properties" in schema:
        return {
            "properties": {name: _fields(spec, sub, depth + 1) for name, sub in sorted(schema["properties"].items())},
            "required": sorted(schema.get("required", [])),
            "extra": schema.get("additionalProperties", True) is not False,
        }
    return schema.get("type", "any")


def surface(spec: dict) -> dict:
    """(path, method) -> request body fields and, per status, response fields."""
    out = {}
    for path, methods in spec["paths"].items():
        for method, op in methods.items():
            body = op.get("requestBody", {}).get("content", {}).get("application/json", {}).get("schema")
            responses = {}
            for code, resp in op.get("responses", {}).items():
                content = resp.get("content", {})
                responses[code] = {ctype: _fields(spec, c.get("schema", {})) for ctype, c in sorted(content.items())}
            out[f"{method.upper()} {path}"] = {"request": body and _fields(spec, body), "responses": responses}
    return out


@pytest.fixture(scope="module")
def generated(make_tiny_engine) -> dict:
    from server.app import create_app

    return create_app(make_tiny_engine()).openapi()


def test_the_generator_writes_the_committed_file():
    """scripts/openapi.py writes openapi.yaml from the app without loading a model."""
    import runpy

    render = runpy.run_path(str(ROOT / "scripts" / "openapi.py"))["render"]
    assert render() == (ROOT / "openapi.yaml").read_text(), "openapi.yaml is stale: run python scripts/openapi.py"


def test_openapi_yaml_matches_app(generated):
    committed = yaml.safe_load((ROOT / "openapi.yaml").read_text())
    want, got = surface(committed), surface(generated)
    assert sorted(want) == sorted(got), "routes/methods differ between openapi.yaml and the app"
    for route in want:
        assert want[route] == got[route], f"{route} differs between openapi.yaml and the app"


def test_openapi_documents_the_api(generated):
    routes = surface(generated)
    assert {"POST /v1/completions", "POST /v1/chat/completions", "GET /v1/models", "GET /health", "GET /version",
            "POST /tokenize", "POST /detokenize", "GET /metrics", "POST /v1/responses",
            "GET /v1/responses/{response_id}", "DELETE /v1/responses/{response_id}"} <= set(routes)
    completion = routes["POST /v1/completions"]
    assert {"prompt", "echo", "logprobs", "stream_options", "best_of"} <= set(completion["request"]["properties"])
    assert completion["request"]["extra"] is True  # unknown fields are accepted and ignored, and documented so
    assert "422" not in completion["responses"] and "400" in completion["responses"]
    # A step or an admission that raised on the request: the 500 RequestFailedError becomes (server/streaming.py).
    for route in ("POST /v1/completions", "POST /v1/chat/completions", "POST /v1/responses"):
        assert "500" in routes[route]["responses"], route
    # The API key guards /v1/*, /tokenize and /detokenize (server/app.py); probes and scrapers need none.
    for route in ("POST /v1/completions", "POST /tokenize", "POST /detokenize"):
        assert "401" in routes[route]["responses"], route
    for route in ("GET /health", "GET /version", "GET /metrics"):
        assert "401" not in routes[route]["responses"], route
    choice = completion["responses"]["200"]["application/json"]["properties"]["choices"]["array"]
    assert {"index", "text", "logprobs", "finish_reason"} <= set(choice["properties"])


@pytest.mark.parametrize("path,body", [
    ("/v1/completions", {"prompt": ["Hi", "Yo"], "n": 2, "logprobs": 1, "echo": True, "return_token_ids": True,
                         "stream_options": {"include_usage": True, "continuous_usage_stats": True}}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"}], "logprobs": True, "top_logprobs": 1,
                              "return_token_ids": True, "stream_options": {"include_usage": True}}),
    ("/v1/responses", {"input": "Hi", "instructions": "Be brief."}),
])
def test_stream_chunks_match_their_documented_schemas(tiny_server, path, body):
    """Every `data:` JSON of a stream validates against the chunk schema openapi.yaml documents for its route."""
    import httpx
    import jsonschema_rs
    from serving_harness import sse_events

    spec = yaml.safe_load((ROOT / "openapi.yaml").read_text())
    event = spec["paths"][path]["post"]["responses"]["200"]["content"]["text/event-stream"]["schema"]
    json_data, done = event["properties"]["data"]["anyOf"]
    assert done == {"const": "[DONE]"}
    validator = jsonschema_rs.validator_for({**json_data["contentSchema"], "components": spec["components"]})
    limit = {"max_output_tokens": 4} if path == "/v1/responses" else {"max_tokens": 4, "ignore_eos": True}
    with httpx.stream("POST", tiny_server.base_url + path, json={**body, **limit, "stream": True}, timeout=60) as r:
        chunks = [e for e in sse_events(r.read().decode().splitlines()) if e != "[DONE]"]
    assert len(chunks) > 3
    for chunk in chunks:
        validator.validate(chunk)
    with pytest.raises(jsonschema_rs.ValidationError):  # the schema is not vacuous
        validator.validate({**chunks[-1], "id": 5} if "id" in chunks[-1] else {**chunks[-1], "type": "bogus"})
