"""A fault injected at each stage of a step costs at most the requests of that step, with the engine in the
server's process and with the engine core in a process of its own (`--engine-core-process`, the fault injected
there through the core's test hook).

Six requests decode while a seventh (the victim) arrives; the fault fires once, in a step the victim is part
of. The six finish with the tokens of a fault-free run, every KV block returns, /health is 200 within 1 s, and
the victim's client reads a 500 naming the stage and the exception (an error event once its stream started).
A fault that recurs in the next step resets the engine, and the server serves on.
"""
from __future__ import annotations

import asyncio
import time

import httpx
import pytest

from core_faults import fired as faults_fired
from engine.faults import STAGES
from reliability_harness import leaked_blocks, metric, record, serve, stream_completion, wait_engine_idle

BODY = {"model": "tiny", "max_tokens": 16, "ignore_eos": True, "temperature": 0.8}
INNOCENT = [{**BODY, "prompt": [1000 + 37 * i] * (5 + i), "seed": i} for i in range(6)]
VICTIM = {**BODY, "prompt": [777] * 6, "seed": 99}
# Per-request stages fail the victim in its 3rd decode, inside a batch with the others, and mid-stream;
# the batch stages in its prefill, a step the prompts-first scheduler gives to the victim alone.
PER_REQUEST = {"output_processor", "detokenizer"}
NO_LEAK = {"device_blocks": 0, "cpu_blocks": 0, "block_tables": 0}
results: dict[str, dict] = {}


@pytest.fixture(scope="module", params=["in-process", "core-process"])
def server(tiny_llama_dir, request):
    # The victim asks for its fault by its request_id (core_faults.py).
    with serve(tiny_llama_dir, core_process=request.param == "core-process", faults=True, max_model_len=64,
               max_num_seqs=8, num_gpu_blocks_override=64) as s:
        s.mode = request.param
        yield s


@pytest.fixture(scope="module")
def reference(server):
    """The innocent requests' texts with no fault anywhere."""
    return asyncio.run(_innocents(server, None))[0]


async def _all_decoding(server, count: int) -> None:
    """Until `count` requests run, each past its prefill (the figures of the latest step: the core's too)."""
    deadline = time.monotonic() + 60
    while server.engine.get_stats().num_running < count:
        assert time.monotonic() < deadline, f"{count} requests never ran together"
        await asyncio.sleep(0.005)


async def _innocents(server, stage, victim_body=None):
    """The six, then (with a stage) the victim once they all decode; texts of the six, the victim's result."""
    url = server.base_url + "/v1/completions"
    async with httpx.AsyncClient(timeout=60) as client:
        tasks = [asyncio.create_task(stream_completion(client, url, b) if i % 2 else client.post(url, json=b))
                 for i, b in enumerate(INNOCENT)]
        victim = None
        if stage is not None:
            await _all_decoding(server, len(INNOCENT))
            body = victim_body or {**VICTIM, "request_id": f"fault-{stage}-{3 if stage in PER_REQUEST else 1}"}
            if stage in PER_REQUEST:
                victim = await stream_completion(client, url, body)
            else:
                r = await client.post(url, json=body)
                victim = {"status": r.status_code, "error": r.json().get("error")}
            victim["health_after_s"] = await _health_back(client, server.base_url)
        done = await asyncio.gather(*tasks)
    texts = []
    for res in done:
        if isinstance(res, httpx.Response):
            assert res.status_code == 200, res.text
            texts.append(res.json()["choices"][0]["text"])
        else:
            assert res["status"] == 200 and res["error"] is None, res
            texts.append(res["texts"][0])
    return texts, victim


async def _health_back(client: httpx.AsyncClient, base: str) -> float:
    start = time.monotonic()
    while (await client.get(base + "/health")).status_code != 200:
        assert time.monotonic() - start < 1.0, "/health not 200 within 1 s of the fault"
        await asyncio.sleep(0.01)
    return time.monotonic() - start


def _counts(base: str) -> tuple[float, float]:
    text = httpx.get(base + "/metrics").text
    return (metric(text, "pagedserve:request_failures_total", 'reason="step_fault"'),
            metric(text, "pagedserve:engine_resets_total"))


@pytest.mark.parametrize("stage", STAGES)
def test_fault_at_stage_costs_only_its_step(server, reference, stage):
    before = _counts(server.base_url)
    texts, victim = asyncio.run(_innocents(server, stage))
    wait_engine_idle(server)
    failures, resets = (a - b for a, b in zip(_counts(server.base_url), before))
    leaks = leaked_blocks(server)
    lost = 0 if victim["error"] is None else 1
    fired = [s for s, request_id in faults_fired(server.fault_log) if f"fault-{stage}-" in request_id]
    results.setdefault(server.mode, {})[stage] = {
        "fired": bool(fired), "others_identical": texts == reference, "requests_lost": lost, "resets": resets,
        "health_back_s": round(victim["health_after_s"], 3)}
    record("fault_stages", results)

    assert fired == [stage], f"the fault at {stage} fired {len(fired)} times"
    assert texts == reference  # the other six: every token as in the fault-free run
    assert leaks == NO_LEAK
    assert resets == 0
    assert httpx.get(server.base_url + "/health").status_code == 200
    if stage == "schedule":
        # No request belonged to the step yet: nothing is ended, the next step runs the victim as well.
        assert victim["status"] == 200 and victim["error"] is None, victim
        assert failures == 0
        return
    assert failures == 1
    err = victim["error"]
    assert err is not None and err["code"] == 500 and err["type"] == "InternalServerError", victim
    assert f"({stage}): RuntimeError: injected fault at {stage}" in err["message"], err
    if stage in PER_REQUEST:
        assert victim["status"] == 200 and victim["done"] and victim["chunks"] >= 2, victim  # it had streamed
    else:
        assert victim["status"] == 500, victim


def test_a_recurring_fault_resets_the_engine_and_it_serves_on(server, reference):
    """The victim's prefill raises at the forward, and so does the next step, the others' decode: the victim and
    that step's requests get a 500, the engine resets; then the server serves as before, and no block is left."""
    before = _counts(server.base_url)

    async def run():
        async with httpx.AsyncClient(timeout=60) as client:
            url = server.base_url + "/v1/completions"
            tasks = [asyncio.create_task(client.post(url, json={**b, "max_tokens": 40})) for b in INNOCENT]
            await _all_decoding(server, len(INNOCENT))
            victim = await client.post(url, json={**VICTIM, "request_id": "fault-forward-1x2"})
            return victim, await asyncio.gather(*tasks)

    victim, others = asyncio.run(run())
    assert victim.status_code == 500 and "(forward): RuntimeError: injected fault at forward" in victim.text
    failed = [r for r in others if r.status_code != 200]  # (a request may finish before the victim arrives)
    assert failed and all(r.status_code == 500 and "injected fault at forward" in r.text for r in failed), others
    failures, resets = (a - b for a, b in zip(_counts(server.base_url), before))
    assert (failures, resets) == (1 + len(failed), 1)
    assert [s for s, request_id in faults_fired(server.fault_log) if "forward-1x2" in request_id] == ["forward"]
    assert httpx.get(server.base_url + "/health").status_code == 200
    texts, _ = asyncio.run(_innocents(server, None))  # the reset engine serves: the same tokens
    assert texts == reference
    wait_engine_idle(server)
    assert leaked_blocks(server) == NO_LEAK


def test_an_abort_then_the_block_check_leave_the_next_step_whole(server):
    """What the server's step thread may do around a fault, straight on the engine (LLMEngine, or the client of the
    core process): an abort that empties it, its figures, the block check, then the next request's steps. Each reply
    of the core answers its own ask (the figures an abort sends were once taken for the figures asked for, and that
    reply, kept for the next step, ended the engine as if the core had died)."""
    from engine.sampling_params import SamplingParams

    core = server.engine.engine
    params = SamplingParams(max_tokens=4, ignore_eos=True)

    def sequence():  # in the step thread, the one that talks to the engine (the server is idle)
        core.add_request("seq-a", prompt_token_ids=[5, 6, 7], params=params)
        core.abort_request("seq-a")
        stats, problems = core.get_stats(), core.block_problems()
        core.add_request("seq-b", prompt_token_ids=[5, 6, 7], params=params)
        finished, deadline = [], time.monotonic() + 30
        while core.has_unfinished_requests() and time.monotonic() < deadline:
            finished += [o for o in core.step() if o.finished]
        return stats, problems, finished

    wait_engine_idle(server)
    stats, problems, finished = server.engine._executor.submit(sequence).result(60)
    assert problems == [] and stats.device_cache_usage == 0 and stats.num_waiting == 0, (problems, stats)
    assert [(o.request_id, len(o.outputs[0].token_ids)) for o in finished] == [("seq-b", 4)]
    assert leaked_blocks(server) == NO_LEAK
