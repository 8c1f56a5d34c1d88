"""A fault injected at each stage of a step costs at most the requests of that step.

Six requests decode while a seventh (the victim) arrives; the fault fires once, in a step the victim is part
of. The six finish with the tokens of a fault-free run, every KV block returns, /health is 200 within 1 s, and
the victim's client reads a 500 naming the stage and the exception (an error event once its stream started).
"""
from __future__ import annotations

import asyncio
import threading
import time

import httpx
import pytest

from engine.faults import STAGES
from reliability_harness import leaked_blocks, metric, record, serve, stream_completion, wait_engine_idle

VICTIM_TOKEN = 777
BODY = {"model": "tiny", "max_tokens": 16, "ignore_eos": True, "temperature": 0.8}
INNOCENT = [{**BODY, "prompt": [1000 + 37 * i] * (5 + i), "seed": i} for i in range(6)]
VICTIM = {**BODY, "prompt": [VICTIM_TOKEN] * 6, "seed": 99}
# Per-request stages fail the victim in its 3rd decode, inside a batch with the others, and mid-stream;
# the batch stages in its prefill, a step the prompts-first scheduler gives to the victim alone.
PER_REQUEST = {"output_processor", "detokenizer"}
results: dict[str, dict] = {}


@pytest.fixture(scope="module")
def server(tiny_llama_dir):
    with serve(tiny_llama_dir, max_model_len=64, max_num_seqs=8, num_gpu_blocks_override=64) as s:
        yield s


@pytest.fixture(scope="module")
def reference(server):
    """The innocent requests' texts with no fault anywhere."""
    return asyncio.run(_innocents(server, None))[0]


def _victim_ids(engine) -> set[str]:
    sch = engine.scheduler  # read in the step thread, where the injector runs
    return {g.request_id for q in (sch.waiting, sch.running, sch.swapped) for g in q
            if g.prompt_token_ids[0] == VICTIM_TOKEN}


def _injector(engine, stage: str, fired: threading.Event):
    calls = {"n": 0}

    def inject(at: str, request_ids: list[str]) -> None:
        if at != stage or fired.is_set() or not _victim_ids(engine) & set(request_ids):
            return
        calls["n"] += 1
        if stage in PER_REQUEST and calls["n"] < 3:
            return
        fired.set()
        raise RuntimeError(f"injected fault at {stage}")

    return inject


async def _innocents(server, stage):
    """The six, then (with a stage) the victim once they all decode; texts of the six, the victim's result."""
    engine = server.engine.engine
    url = server.base_url + "/v1/completions"
    async with httpx.AsyncClient(timeout=60) as client:
        tasks = [asyncio.create_task(stream_completion(client, url, b) if i % 2 else client.post(url, json=b))
                 for i, b in enumerate(INNOCENT)]
        victim = None
        if stage is not None:
            while sum(1 for g in list(engine.scheduler.running) if g.seqs[0].get_output_len() > 0) < len(INNOCENT):
                await asyncio.sleep(0.005)
            if stage in PER_REQUEST:
                victim = await stream_completion(client, url, VICTIM)
            else:
                r = await client.post(url, json=VICTIM)
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


@pytest.mark.parametrize("stage", STAGES)
def test_fault_at_stage_costs_only_its_step(server, reference, stage):
    engine = server.engine.engine
    fired = threading.Event()
    before = httpx.get(server.base_url + "/metrics").text
    engine.fault_injector = _injector(engine, stage, fired)
    try:
        texts, victim = asyncio.run(_innocents(server, stage))
    finally:
        engine.fault_injector = None
    wait_engine_idle(server)
    after = httpx.get(server.base_url + "/metrics").text
    failures = (metric(after, "pagedserve:request_failures_total", 'reason="step_fault"')
                - metric(before, "pagedserve:request_failures_total", 'reason="step_fault"'))
    resets = metric(after, "pagedserve:engine_resets_total") - metric(before, "pagedserve:engine_resets_total")
    leaks = leaked_blocks(server)
    lost = 0 if victim["error"] is None else 1
    results[stage] = {"fired": fired.is_set(), "others_identical": texts == reference, "requests_lost": lost,
                      "resets": resets, "health_back_s": round(victim["health_after_s"], 3)}
    record("fault_stages", results)

    assert fired.is_set(), f"the fault at {stage} never fired"
    assert texts == reference  # the other six: every token as in the fault-free run
    assert leaks == {"device_blocks": 0, "cpu_blocks": 0, "block_tables": 0}
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
