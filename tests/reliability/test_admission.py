"""What a request brings to its admission: a fault while the engine takes a request fails that request alone (a 500
in the OpenAI error shape) and the engine serves on; a grammar compiles off the event loop, so /health answers
while a slow one compiles. The same with the engine core in a process of its own (where the core refuses the add
after the server sent it)."""
from __future__ import annotations

import asyncio
import time

import httpx
import pytest

from core_faults import fired as faults_fired
from engine.faults import ADMISSION
from reliability_harness import leaked_blocks, metric, serve, stream_completion, wait_engine_idle

SHORT = {"model": "tiny", "prompt": "Hi", "max_tokens": 3, "ignore_eos": True}
NO_LEAK = {"device_blocks": 0, "cpu_blocks": 0, "block_tables": 0}
# ~1 s to compile on a Zen 5 core, more on slower ones (xgrammar's compile time grows faster than the schema; 100
# keys compiled in 0.4 s there, too fast for the stall the test needs).
SLOW_SCHEMA = {"type": "object", "properties": {
    f"k{j}": {"type": "array", "items": {"type": "object", "properties": {f"a{k}": {"type": "integer"}
                                                                         for k in range(20)}}}
    for j in range(200)}}


@pytest.fixture(scope="module", params=["in-process", "core-process"])
def server(tiny_llama_dir, request):
    # No grammar is kept: a spec compiles wherever the server asks for it (as one that fell out of the cache).
    # A request asks for an admission fault by its request_id (core_faults.py).
    with serve(tiny_llama_dir, core_process=request.param == "core-process", faults=True, max_model_len=128,
               max_num_seqs=4, num_gpu_blocks_override=64, grammar_cache_mb=0) as s:
        yield s


def test_a_fault_admitting_one_request_fails_it_alone(server):
    """Three victims: one alone, then two at once (admitted together: two faults in a row are still no step's)."""
    engine, base = server.engine, server.base_url

    async def scenario():
        async with httpx.AsyncClient(timeout=60) as client:
            url = base + "/v1/completions"
            other = asyncio.create_task(stream_completion(client, url, {**SHORT, "max_tokens": 40, "prompt": [7] * 8}))
            while not engine.get_stats().num_running:  # the other request is decoding when the victims arrive
                await asyncio.sleep(0.005)
            plain = await client.post(url, json={**SHORT, "request_id": "fault-admission-1-a"})
            streamed, plain2 = await asyncio.gather(
                stream_completion(client, url, {**SHORT, "request_id": "fault-admission-1-b"}),
                client.post(url, json={**SHORT, "request_id": "fault-admission-1-c"}))
            return plain, plain2, streamed, await other

    plain, plain2, streamed, other = asyncio.run(scenario())
    for r in (plain, plain2):
        assert r.status_code == 500, r.text
        err = r.json()["error"]
        assert err["type"] == "InternalServerError" and err["code"] == 500
        assert "admitting this request: KeyError" in err["message"] and "injected fault at admission" in err["message"]
    assert streamed["status"] == 200 and streamed["done"] and streamed["error"]["code"] == 500, streamed
    assert other["status"] == 200 and other["error"] is None and other["usage"]["completion_tokens"] == 40, other
    assert engine.is_ready and not engine.errored
    assert httpx.get(base + "/health", timeout=10).status_code == 200
    r = httpx.post(base + "/v1/completions", json=SHORT, timeout=60)
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 3
    text = httpx.get(base + "/metrics", timeout=10).text
    assert metric(text, "pagedserve:request_failures_total", 'reason="admission_fault"') == 3
    assert metric(text, "pagedserve:engine_resets_total") == 0
    assert [stage for stage, _ in faults_fired(server.fault_log)] == [ADMISSION] * 3
    wait_engine_idle(server)
    assert leaked_blocks(server) == NO_LEAK


def test_health_answers_while_a_slow_grammar_compiles(server):
    body = {**SHORT, "max_tokens": 2, "response_format": {
        "type": "json_schema", "json_schema": {"name": "slow", "schema": SLOW_SCHEMA}}}

    async def scenario():
        async with httpx.AsyncClient(timeout=120) as client:
            request = asyncio.create_task(client.post(server.base_url + "/v1/completions", json=body))
            waits = []
            while not request.done():
                start = time.monotonic()
                assert (await client.get(server.base_url + "/health")).status_code == 200
                waits.append(time.monotonic() - start)
                await asyncio.sleep(0.01)
            return await request, waits

    start = time.monotonic()
    r, waits = asyncio.run(scenario())
    took = time.monotonic() - start
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 2, r.text
    assert took > 0.5, f"the schema compiled in {took:.2f} s: too fast to show a stall"
    assert max(waits) < 0.25, f"/health waited {max(waits):.2f} s while the grammar compiled ({took:.2f} s)"
