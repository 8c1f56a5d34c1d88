"""Rounds of mixed traffic (finished, streamed, dropped): the server process holds no more Python objects after each.

RSS over a minute is a loose signal (the allocator keeps meeting new tensor shapes); an object count that stays
flat round after round is a tight one: nothing per request (streams, groups, sequences, generators) is kept.
"""
from __future__ import annotations

import asyncio
import gc
import random

import httpx

from reliability_harness import leaked_blocks, record, serve, wait_engine_idle

ROUNDS = 4  # the first two warm caches (tokenizer, prometheus children, torch); the last two are measured
PER_ROUND = 120
TOLERANCE = 200  # objects: asyncio and httpx keep a few bookkeeping entries that come and go


async def _round(base: str, seed: int) -> None:
    rng = random.Random(seed)
    sem = asyncio.Semaphore(8)
    async with httpx.AsyncClient(timeout=120) as client:
        async def one(i: int) -> None:
            body = {"model": "tiny", "prompt": [rng.randrange(100, 30000) for _ in range(rng.randint(4, 60))],
                    "max_tokens": rng.randint(4, 40), "ignore_eos": True, "temperature": 0.7, "seed": i,
                    "n": 2 if i % 5 == 0 else 1}
            async with sem:
                if i % 3:
                    r = await client.post(base + "/v1/completions", json=body)
                    assert r.status_code == 200, r.text
                    return
                async with client.stream("POST", base + "/v1/completions", json={**body, "stream": True}) as r:
                    seen = 0
                    async for line in r.aiter_lines():
                        seen += line.startswith("data:")
                        if i % 2 and seen > 2:
                            break  # a client that leaves mid-stream

        await asyncio.gather(*[one(i) for i in range(PER_ROUND)])


def test_object_count_flat_across_rounds(tiny_llama_dir):
    counts = []
    with serve(tiny_llama_dir, num_gpu_blocks_override=64, max_num_seqs=8) as server:
        for r in range(ROUNDS):
            asyncio.run(_round(server.base_url, seed=r))
            wait_engine_idle(server)
            gc.collect()
            counts.append(len(gc.get_objects()))
        leaks = leaked_blocks(server)
    growth = counts[-1] - counts[1]
    record("object_growth", {"requests": ROUNDS * PER_ROUND, "objects_per_round": counts, "growth_after_warmup": growth,
                             "blocks_leaked": sum(leaks.values())})
    assert growth <= TOLERANCE, counts  # a per-request leak would add >= 2 * PER_ROUND objects
    assert leaks == {"device_blocks": 0, "cpu_blocks": 0, "block_tables": 0}
