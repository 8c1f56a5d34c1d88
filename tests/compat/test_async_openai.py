"""The openai client's AsyncOpenAI with 64 streams at once: each gets every token, and the cache drains."""
from __future__ import annotations

import asyncio

import openai
from compat_helpers import MODEL
from serving_harness import wait_idle

STREAMS, TOKENS = 64, 8


async def _one(client: openai.AsyncOpenAI, i: int) -> tuple[str, int, str]:
    stream = await client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": f"Stream number {i}"}], max_tokens=TOKENS, stream=True,
        stream_options={"include_usage": True}, temperature=1.0, seed=i, extra_body={"ignore_eos": True})
    text, usage, reason = "", 0, ""
    async for chunk in stream:
        for choice in chunk.choices:
            text += choice.delta.content or ""
            reason = choice.finish_reason or reason
        if chunk.usage is not None:
            usage = chunk.usage.completion_tokens
    return text, usage, reason


async def _all(base_url: str) -> list[tuple[str, int, str]]:
    async with openai.AsyncOpenAI(base_url=base_url + "/v1", api_key="unused", max_retries=0, timeout=120) as client:
        return await asyncio.gather(*[_one(client, i) for i in range(STREAMS)])


def test_64_concurrent_streams(compat_server):
    results = asyncio.run(_all(compat_server.base_url))
    assert len(results) == STREAMS
    assert all(usage == TOKENS and reason == "length" and text for text, usage, reason in results)
    assert len({text for text, _, _ in results}) > STREAMS // 2  # different seeds, different streams
    waited, values = wait_idle(compat_server.base_url, timeout_s=10)
    assert values["num_requests_running"] == 0 and values["kv_cache_usage_perc"] == 0.0, values
