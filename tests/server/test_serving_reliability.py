"""Acceptance, real engine + default model: disconnects free the cache, bad input never 5xx, load, engine death."""
from __future__ import annotations

import asyncio
import time

import httpx
from bad_inputs import BAD_INPUTS, MODEL
from serving_harness import metric, wait_idle

LONG = {"model": MODEL, "prompt": "Write a long story about a dragon.", "max_tokens": 400, "ignore_eos": True,
        "temperature": 0.8}


def _gauge(base_url: str, name: str) -> float:
    return metric(httpx.get(f"{base_url}/metrics").text, f"pagedserve:{name}")


async def _stream_then_close(client: httpx.AsyncClient, url: str, body: dict, events: int) -> int:
    """Read `events` data events of a stream, then drop the connection."""
    seen = 0
    async with client.stream("POST", url, json=body) as r:
        assert r.status_code == 200
        async for line in r.aiter_lines():
            if line.startswith("data:"):
                seen += 1
                if seen >= events:
                    break
    return seen


async def _post_then_close(client: httpx.AsyncClient, url: str, body: dict) -> None:
    await client.post(url, json=body)  # cancelled from outside: the connection is closed mid-request


async def _while_busy_then_cancel(base_url: str, make_coros, busy_gauge: str = "num_requests_running") -> None:
    async with httpx.AsyncClient(timeout=120, limits=httpx.Limits(max_connections=100)) as client:
        tasks = [asyncio.create_task(c) for c in make_coros(client)]
        deadline = time.monotonic() + 60
        while _gauge(base_url, busy_gauge) == 0 and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        assert _gauge(base_url, busy_gauge) > 0, "requests never reached the engine"
        await asyncio.sleep(0.3)
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


def _assert_recovers(base_url: str) -> None:
    waited, values = wait_idle(base_url, timeout_s=2.0)
    assert values["num_requests_running"] == 0 and values["num_requests_waiting"] == 0, values
    assert values["kv_cache_usage_perc"] == 0.0, values
    assert waited <= 2.0, f"cache not freed within 2 s ({waited:.2f} s)"
    r = httpx.post(f"{base_url}/v1/completions", json={"prompt": "Hi", "max_tokens": 2}, timeout=60)
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] >= 1


def test_20_streaming_clients_disconnect(real_server):
    url = real_server.base_url + "/v1/completions"

    async def run():
        async with httpx.AsyncClient(timeout=120, limits=httpx.Limits(max_connections=100)) as client:
            seen = await asyncio.gather(*[_stream_then_close(client, url, {**LONG, "stream": True, "seed": i}, 4)
                                          for i in range(20)])
        assert seen == [4] * 20

    asyncio.run(run())
    _assert_recovers(real_server.base_url)


def test_20_non_streamed_clients_disconnect(real_server):
    url = real_server.base_url + "/v1/completions"
    asyncio.run(_while_busy_then_cancel(real_server.base_url, lambda c: [
        _post_then_close(c, url, {**LONG, "seed": i}) for i in range(20)]))
    _assert_recovers(real_server.base_url)


def test_n2_clients_disconnect_stream_and_not(real_server):
    url = real_server.base_url + "/v1/completions"
    chat = real_server.base_url + "/v1/chat/completions"
    body = {**LONG, "n": 2}
    chat_body = {"model": MODEL, "messages": [{"role": "user", "content": "Tell a story."}], "max_tokens": 400,
                 "ignore_eos": True, "n": 2, "temperature": 0.8}
    asyncio.run(_while_busy_then_cancel(real_server.base_url, lambda c: (
        [_post_then_close(c, url, body) for _ in range(3)]
        + [_stream_then_close(c, url, {**body, "stream": True}, 10**6) for _ in range(3)]
        + [_stream_then_close(c, chat, {**chat_body, "stream": True}, 10**6) for _ in range(3)]
        + [_post_then_close(c, chat, chat_body) for _ in range(3)])))
    _assert_recovers(real_server.base_url)


def test_queued_clients_disconnect(tiny_batch_server):
    base = tiny_batch_server.base_url
    url = base + "/v1/completions"
    asyncio.run(_while_busy_then_cancel(base, lambda c: (
        [_stream_then_close(c, url, {**LONG, "stream": True}, 10**6) for _ in range(4)]
        + [_post_then_close(c, url, LONG) for _ in range(4)]), busy_gauge="num_requests_waiting"))
    _assert_recovers(base)


def test_bad_input_matrix_real_engine(real_server):
    assert len(BAD_INPUTS) >= 30
    for name, path, body, status, _ in BAD_INPUTS:
        if isinstance(body, (bytes, str)):
            r = httpx.post(real_server.base_url + path, content=body, headers={"content-type": "application/json"})
        else:
            r = httpx.post(real_server.base_url + path, json=body, timeout=60)
        assert r.status_code == status, (name, r.status_code, r.text)
        err = r.json()["error"]
        assert err["code"] == status and isinstance(err["message"], str) and err["type"], name
    assert httpx.get(real_server.base_url + "/health").status_code == 200
    r = httpx.post(real_server.base_url + "/v1/completions", json={"prompt": "Hi", "max_tokens": 2}, timeout=60)
    assert r.status_code == 200


def test_step_fault_ends_its_stream_with_a_500_and_serving_goes_on(tiny_batch_server):
    """A step that raises mid-stream: that stream ends with a 500 error event naming the stage, the engine serves on."""
    base, engine = tiny_batch_server.base_url, tiny_batch_server.engine.engine
    calls = {"n": 0}

    def fault(stage, request_ids):
        if stage == "forward":
            calls["n"] += 1
            if calls["n"] == 4:  # let the stream start first
                raise RuntimeError("injected step fault")

    engine.fault_injector = fault
    try:
        with httpx.stream("POST", base + "/v1/completions", json={**LONG, "stream": True}, timeout=60) as r:
            assert r.status_code == 200
            lines = [line for line in r.iter_lines() if line.startswith("data:")]
    finally:
        engine.fault_injector = None
    assert lines[-1] == "data: [DONE]" and '"error"' in lines[-2] and "injected step fault" in lines[-2]
    assert '"code": 500' in lines[-2] and "(forward)" in lines[-2], lines[-2]
    assert httpx.get(base + "/health").status_code == 200
    _assert_recovers(base)
