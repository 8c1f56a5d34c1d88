"""48 concurrent requests into a KV cache of a few dozen blocks: nothing lost, outputs unchanged, swap exhaustion contained."""
from __future__ import annotations

import asyncio
import random
from typing import Any

import httpx
import pytest

from reliability_harness import gauges, leaked_blocks, record, serve, stream_completion, wait_engine_idle
from serving_harness import metric

MAX_MODEL_LEN = 128
PRESSURED_BLOCKS = 36  # 16-token blocks: a best_of=3 group at full length alone takes 24
NUM_REQUESTS = 48


def make_requests(seed: int, count: int) -> list[dict[str, Any]]:
    """Greedy n=1, seeded n=2 and seeded best_of=3 bodies; random prompt ids and lengths, ignore_eos for exact counts."""
    rng = random.Random(seed)
    bodies = []
    for i in range(count):
        prompt_len = rng.randint(3, 60)
        body: dict[str, Any] = {
            "model": "tiny", "prompt": [rng.randrange(100, 40000) for _ in range(prompt_len)],
            "max_tokens": rng.randint(8, MAX_MODEL_LEN - prompt_len - 20), "ignore_eos": True,
        }
        kind = i % 4
        if kind in (0, 1):
            body["temperature"] = 0.0
        elif kind == 2:
            body.update(n=2, temperature=0.8, seed=1000 + i)
        else:
            body.update(best_of=3, n=1, temperature=0.8, seed=1000 + i)
        body["_stream"] = kind in (1, 2)  # best_of != n cannot stream
        bodies.append(body)
    return bodies


def reference_texts(tiny_llama_dir, bodies: list[dict[str, Any]]) -> list[list[str]]:
    """The same requests through the offline LLM with a cache big enough that nothing is preempted."""
    from engine import LLM
    from engine.sampling_params import SamplingParams

    llm = LLM(model=str(tiny_llama_dir), max_model_len=MAX_MODEL_LEN, block_size=16, num_gpu_blocks_override=1024,
              num_cpu_blocks_override=0, seed=0)
    params = [SamplingParams(n=b.get("n", 1), best_of=b.get("best_of"), temperature=b["temperature"],
                             seed=b.get("seed"), max_tokens=b["max_tokens"], ignore_eos=True) for b in bodies]
    outs = llm.generate(prompt_token_ids=[b["prompt"] for b in bodies], sampling_params=params, use_tqdm=False)
    stats = llm.engine.get_stats()
    assert stats.num_preemptions_recompute == stats.num_preemptions_swap == 0
    return [[c.text for c in sorted(o.outputs, key=lambda c: c.index)] for o in outs]


async def send(client: httpx.AsyncClient, base: str, body: dict[str, Any]) -> dict[str, Any]:
    """One request, streamed or not; texts per choice, token count, or the error the client saw."""
    url = base + "/v1/completions"
    payload = {k: v for k, v in body.items() if not k.startswith("_")}
    if body["_stream"]:
        res = await stream_completion(client, url, payload)
        tokens = res["usage"]["completion_tokens"] if res["usage"] else None
        return {"status": res["status"], "texts": res.get("texts"), "tokens": tokens, "error": res["error"]}
    r = await client.post(url, json=payload)
    if r.status_code != 200:
        return {"status": r.status_code, "texts": None, "tokens": None, "error": r.json()["error"]}
    data = r.json()
    return {"status": 200, "texts": [c["text"] for c in sorted(data["choices"], key=lambda c: c["index"])],
            "tokens": data["usage"]["completion_tokens"], "error": None}


async def send_all(base: str, bodies: list[dict[str, Any]]) -> list[dict[str, Any]]:
    async with httpx.AsyncClient(timeout=90, limits=httpx.Limits(max_connections=NUM_REQUESTS + 8)) as client:
        return await asyncio.gather(*[send(client, base, b) for b in bodies])


def expected_tokens(body: dict[str, Any]) -> int:
    # Usage counts the returned choices: n of them, whatever best_of was.
    return body["max_tokens"] * body.get("n", 1)


@pytest.fixture(scope="module")
def bodies():
    return make_requests(seed=8, count=NUM_REQUESTS)


@pytest.fixture(scope="module")
def reference(tiny_llama_dir, bodies):
    return reference_texts(tiny_llama_dir, bodies)


@pytest.mark.parametrize("mode", ["in-process", "core-process"])
def test_48_requests_under_pressure_match_unpressured_run(tiny_llama_dir, bodies, reference, mode):
    """Also with the engine core in a process of its own: preempted by recompute and by swap there, the same texts."""
    with serve(tiny_llama_dir, core_process=mode == "core-process", max_model_len=MAX_MODEL_LEN,
               num_gpu_blocks_override=PRESSURED_BLOCKS, num_cpu_blocks_override=256, max_num_seqs=64) as server:
        results = asyncio.run(send_all(server.base_url, bodies))
        wait_engine_idle(server)
        text = httpx.get(server.base_url + "/metrics").text
        leaks = leaked_blocks(server)
        idle = gauges(server.base_url)
    by_mode = {mode: metric(text, "pagedserve:num_preemptions_by_mode_total", f'mode="{mode}"')
               for mode in ("recompute", "swap")}
    record("memory_pressure" + ("_core_process" if mode == "core-process" else ""), {"requests": len(bodies), "device_blocks": PRESSURED_BLOCKS,
                               "completed": sum(r["status"] == 200 and r["error"] is None for r in results),
                               "preemptions": by_mode, "blocks_leaked": sum(leaks.values())})
    assert [r["status"] for r in results] == [200] * len(bodies), [r["error"] for r in results if r["error"]]
    assert [r["error"] for r in results] == [None] * len(bodies)
    assert [r["tokens"] for r in results] == [expected_tokens(b) for b in bodies]
    for i, (res, ref) in enumerate(zip(results, reference)):
        assert res["texts"] == ref, f"request {i} ({ {k: v for k, v in bodies[i].items() if k != 'prompt'} })"
    assert by_mode["recompute"] > 0 and by_mode["swap"] > 0, by_mode
    assert metric(text, "pagedserve:num_preemptions_total") == by_mode["recompute"] + by_mode["swap"]
    assert leaks == {"device_blocks": 0, "cpu_blocks": 0, "block_tables": 0}
    assert idle["kv_cache_usage_perc"] == 0 and idle["cpu_cache_usage_perc"] == 0 and idle["num_requests_running"] == 0


def test_swap_exhaustion_ends_only_the_affected_requests(tiny_llama_dir, bodies, reference):
    """Host swap of 3 blocks: a preempted n=2 / best_of=3 group that does not fit ends with an error; the rest run."""
    with serve(tiny_llama_dir, max_model_len=MAX_MODEL_LEN, num_gpu_blocks_override=PRESSURED_BLOCKS,
               num_cpu_blocks_override=3, max_num_seqs=64) as server:
        results = asyncio.run(send_all(server.base_url, bodies))
        wait_engine_idle(server)
        after_leaks = leaked_blocks(server)
        health = httpx.get(server.base_url + "/health").status_code
        # The engine keeps serving: the whole batch again, now with nothing else on its mind but the same pressure.
        again = asyncio.run(send_all(server.base_url, [b for b in bodies if b.get("n", 1) == 1
                                                       and b.get("best_of") is None][:8]))
        wait_engine_idle(server)
        final_leaks = leaked_blocks(server)

    failed = [i for i, r in enumerate(results) if r["error"] is not None]
    record("swap_exhaustion", {"requests": len(bodies), "cpu_blocks": 3, "ended_out_of_swap": len(failed),
                               "completed": len(bodies) - len(failed), "blocks_leaked": sum(after_leaks.values()),
                               "failed_statuses": sorted(results[i]["status"] for i in failed)})
    assert failed, "no request ran out of swap space: the test did not exercise exhaustion"
    for i in failed:
        body, res = bodies[i], results[i]
        assert body.get("n", 1) > 1 or body.get("best_of"), f"single-sequence request {i} failed: {res['error']}"
        assert "swap space" in res["error"]["message"] and "--swap-space" in res["error"]["message"], res["error"]
        if body["_stream"]:
            assert res["status"] == 200  # the stream had started: the error travels as an event
        else:
            # Server-side capacity, retryable: 503 with the OpenAI error body, never a 500.
            assert res["status"] == 503 and res["error"]["code"] == 503, res
            assert res["error"]["type"] == "ServiceUnavailableError", res
    for i, (res, ref) in enumerate(zip(results, reference)):
        if i not in failed:
            assert res["status"] == 200 and res["texts"] == ref, f"request {i}: {res}"
            assert res["tokens"] == expected_tokens(bodies[i])
    assert health == 200
    assert [r["status"] for r in again] == [200] * len(again)
    assert after_leaks == final_leaks == {"device_blocks": 0, "cpu_blocks": 0, "block_tables": 0}
