"""What clients choose stays bounded on the server: unknown field names (a warning each for the first few per
endpoint, then one counting line), the walk that finds them (linear, capped), a body of a thousand messages with
forty unknown keys each (answered in seconds while /health answers at once), and the API key on /tokenize and
/detokenize."""
from __future__ import annotations

import asyncio
import json
import time

import httpx
import pytest

from bad_inputs import MODEL
from server.context import MAX_WARNED_FIELDS
from server.protocol import MAX_UNKNOWN_FIELDS, ChatCompletionRequest, unknown_fields

KEYS_PER_MESSAGE = 40


def many_keys_chat(num_messages: int = 1024) -> dict:
    """A chat body whose every message carries KEYS_PER_MESSAGE extra keys no other message has."""
    messages = [{"role": "user", "content": "hi", **{f"k_{i:04d}_{j:02d}": "v" for j in range(KEYS_PER_MESSAGE)}}
                for i in range(num_messages)]
    return {"model": MODEL, "messages": messages, "max_tokens": 1}


def test_the_unknown_field_walk_is_linear_and_capped():
    body = ChatCompletionRequest.model_validate(many_keys_chat())
    start = time.perf_counter()
    names = unknown_fields(body)
    took = time.perf_counter() - start
    assert len(names) == MAX_UNKNOWN_FIELDS and len(set(names)) == len(names)
    assert names[:2] == ["messages.k_0000_00", "messages.k_0000_01"]
    assert took < 0.05, f"the walk took {took:.3f} s"
    small = ChatCompletionRequest.model_validate({"messages": [{"role": "user", "content": "a", "x": 1},
                                                               {"role": "user", "content": "b", "x": 2}], "y": 0})
    assert unknown_fields(small) == ["y", "messages.x"]  # each name once


def test_unknown_field_warnings_are_bounded_per_endpoint(tiny_server, caplog):
    with caplog.at_level("WARNING", logger="server.context"):
        for r in range(3):
            body = {"prompt": "hi", **{f"field_{r}_{j}": j for j in range(30)}}
            assert httpx.post(tiny_server.base_url + "/tokenize", json=body, timeout=30).status_code == 200
    lines = [rec.getMessage() for rec in caplog.records if rec.getMessage().startswith("/tokenize:")]
    warned = [line for line in lines if "ignoring the unknown field" in line]
    counted = [line for line in lines if "request(s) so far carried unknown fields" in line]
    assert len(warned) == MAX_WARNED_FIELDS and len(counted) == 1, lines
    assert "1 request(s)" in counted[0]  # at the first; the next within UNKNOWN_FIELDS_LOG_S is only counted
    log = tiny_server.server.config.app.state.ctx.unknown_field_logs["/tokenize"]
    assert len(log.warned) == MAX_WARNED_FIELDS and log.unlisted_requests == 2


def test_a_big_body_of_unknown_keys_is_answered_while_health_answers(tiny_server):
    body = json.dumps(many_keys_chat()).encode()
    assert 0.6 * 2**20 < len(body) < 1 << 20

    async def scenario():
        async with httpx.AsyncClient(timeout=60) as client:
            start = time.monotonic()
            request = asyncio.create_task(client.post(tiny_server.base_url + "/v1/chat/completions", content=body,
                                                      headers={"content-type": "application/json"}))
            waits = []
            while not request.done():
                t = time.monotonic()
                assert (await client.get(tiny_server.base_url + "/health")).status_code == 200
                waits.append(time.monotonic() - t)
                await asyncio.sleep(0.02)
            r = await request
            return r, time.monotonic() - start, waits

    r, took, waits = asyncio.run(scenario())
    # 1024 messages render to far more than the 256-token context: a 400 naming it, in seconds.
    assert r.status_code == 400 and "context" in r.json()["error"]["message"], r.text
    assert took < 3.0, f"answered in {took:.1f} s"
    assert max(waits) < 1.0, f"/health waited {max(waits):.2f} s"


@pytest.fixture(scope="module")
def keyed_server(make_tiny_engine):
    from server.app import create_app
    from serving_harness import ServerThread

    with ServerThread(create_app(make_tiny_engine(), api_key="secret")) as server:
        yield server


@pytest.mark.parametrize("path, body", [("/tokenize", {"prompt": "hi"}), ("/detokenize", {"tokens": [1, 2]})])
def test_tokenize_and_detokenize_need_the_api_key(keyed_server, path, body):
    url = keyed_server.base_url + path
    for headers in ({}, {"Authorization": "Bearer wrong"}):
        r = httpx.post(url, json=body, headers=headers, timeout=30)
        assert r.status_code == 401, r.text
        assert r.json()["error"]["type"] == "AuthenticationError" and r.json()["error"]["code"] == 401
    assert httpx.post(url, json=body, headers={"Authorization": "Bearer secret"}, timeout=30).status_code == 200
    for open_path in ("/health", "/version", "/metrics"):  # probes and scrapers need no key
        assert httpx.get(keyed_server.base_url + open_path, timeout=30).status_code == 200
