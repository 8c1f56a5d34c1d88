"""A step that raises: every in-flight request ends with a clear error, /health says 503, nothing hangs."""
from __future__ import annotations

import asyncio
import threading

import httpx

from reliability_harness import serve, stream_completion

LONG = {"model": "tiny", "max_tokens": 100, "ignore_eos": True, "temperature": 0.8}


async def _in_flight_then_fault(base: str, engine, armed: threading.Event) -> tuple[list, list, list]:
    """Streams, non-streamed requests and chats (some queued behind max_num_seqs), then the fault."""
    async with httpx.AsyncClient(timeout=60, limits=httpx.Limits(max_connections=32)) as client:
        url, chat = base + "/v1/completions", base + "/v1/chat/completions"
        streams = [asyncio.create_task(stream_completion(client, url, {**LONG, "prompt": [1000 + i] * 8, "seed": i}))
                   for i in range(4)]
        chat_streams = [asyncio.create_task(stream_completion(
            client, chat, {**LONG, "messages": [{"role": "user", "content": f"Hi {i}"}], "n": 2, "seed": i}))
            for i in range(2)]
        posts = [asyncio.create_task(client.post(url, json={**LONG, "prompt": [2000 + i] * 8, "seed": i}))
                 for i in range(4)]
        # Fault only once the engine holds running and queued requests, so both kinds see it.
        while len(engine.engine.scheduler.running) < 2 or not engine.engine.scheduler.waiting:
            await asyncio.sleep(0.01)
        armed.set()
        # A bounded wait: a request the dead engine forgot would hang here, and fail the test.
        done = await asyncio.wait_for(asyncio.gather(*streams, *chat_streams, *posts), timeout=60)
    return done[:4], done[4:6], done[6:]


def test_step_fault_fails_in_flight_requests_and_health(tiny_llama_dir):
    with serve(tiny_llama_dir, max_model_len=256, max_num_seqs=4) as server:
        engine = server.engine
        armed = threading.Event()

        def fault() -> None:  # runs in the step thread, before each step
            if armed.is_set():
                raise RuntimeError("injected step fault")

        engine.fault_injector = fault
        streams, chats, posts = asyncio.run(_in_flight_then_fault(server.base_url, engine, armed))
        health = httpx.get(server.base_url + "/health", timeout=10)
        new_post = httpx.post(server.base_url + "/v1/completions", json={**LONG, "prompt": "Hi"}, timeout=10)
        new_stream = httpx.post(server.base_url + "/v1/completions", json={**LONG, "prompt": "Hi", "stream": True},
                                timeout=10)
        new_chat = httpx.post(server.base_url + "/v1/chat/completions", timeout=10,
                              json={**LONG, "messages": [{"role": "user", "content": "Hi"}]})
        metrics = httpx.get(server.base_url + "/metrics", timeout=10)
        models = httpx.get(server.base_url + "/v1/models", timeout=10)

    for res in streams + chats:  # the 200 went out before the fault: the error is the last event, then [DONE]
        assert res["status"] == 200 and res["done"], res
        assert res["error"]["code"] == 503 and "injected step fault" in res["error"]["message"], res["error"]
        assert res["error"]["type"] == "ServiceUnavailableError"
    for r in posts:  # not yet answered: a 503 with the OpenAI error body
        assert r.status_code == 503, r.text
        err = r.json()["error"]
        assert err["code"] == 503 and "injected step fault" in err["message"], err
    assert health.status_code == 503 and health.json()["error"]["code"] == 503  # the documented error body
    for r in (new_post, new_stream, new_chat):
        assert r.status_code == 503 and r.json()["error"]["code"] == 503, r.text
    assert metrics.status_code == 200 and models.status_code == 200  # the process still answers what it can
    assert not engine.is_ready and engine.errored
