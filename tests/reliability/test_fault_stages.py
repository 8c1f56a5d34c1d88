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
    if stage in PER_REQUEST:  # it had streamed: the 200 and its first tokens (one chunk when its reader fell
        # behind by a step: the outputs a reader has not taken merge, engine/frontend/async_engine.py _RequestStream)
        assert victim["status"] == 200 and victim["done"] and victim["chunks"] >= 1, victim
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
            finished += [o for o in core.step() or [] if o.finished]
        return stats, problems, finished

    wait_engine_idle(server)
    stats, problems, finished = server.engine._executor.submit(sequence).result(60)
    assert problems == [] and stats.device_cache_usage == 0 and stats.num_waiting == 0, (problems, stats)
    assert [(o.request_id, len(o.outputs[0].token_ids)) for o in finished] == [("seq-b", 4)]
    assert leaked_blocks(server) == NO_LEAK


def _core_only(server) -> None:
    if server.mode != "core-process":
        pytest.skip("the engine core's client only")


def test_two_resets_after_faults_with_idle_and_slow_steps_then_the_text_streams_whole(server, reference):
    """Twice: a request whose forward raises, then (the engine idle between) another whose faulty step takes longer
    than the core client's 100 ms poll, which once counted as a good step between the two: two faulty steps in a
    row, so the engine resets. After each reset the innocent requests, half of them streamed, get the text of the
    fault-free run (through a core process, text its API server decodes: once dropped, or decoded by the core)."""
    before = _counts(server.base_url)
    url = server.base_url + "/v1/completions"
    for round_ in (1, 2):
        for plan in (f"fault-forward-1-r{round_}", f"fault-forward-1s300-r{round_}"):
            r = httpx.post(url, json={**VICTIM, "request_id": plan}, timeout=60)
            assert r.status_code == 500 and "(forward): RuntimeError: injected fault at forward" in r.text, r.text
        failures, resets = (a - b for a, b in zip(_counts(server.base_url), before))
        assert (failures, resets) == (2 * round_, round_)
        texts, _ = asyncio.run(_innocents(server, None))
        assert texts == reference
    assert httpx.get(server.base_url + "/health").status_code == 200
    wait_engine_idle(server)
    assert leaked_blocks(server) == NO_LEAK


def test_a_reset_drops_the_faults_the_core_sent_before_it(server, reference):
    """Straight on the core's client, in the step thread: a request whose forward raises, and a reset asked for
    before that fault was read (as the server resets while the core's steps go on). The fault belongs to the engine
    that was reset: the next step is the new engine's (replayed, it once counted as a new fault, toward the limit
    of resets that ends the server). Then the server serves the text of the fault-free run."""
    from engine.sampling_params import SamplingParams

    _core_only(server)
    core = server.engine.engine
    victim = "fault-forward-1-before-reset"

    def sequence():  # in the step thread, the one that talks to the engine (the server is idle)
        core.add_request(victim, prompt_token_ids=[5, 6, 7], params=SamplingParams(max_tokens=4))
        deadline = time.monotonic() + 30
        while ("forward", victim) not in faults_fired(server.fault_log):  # (the fault goes out right after)
            assert time.monotonic() < deadline, "the fault never fired"
            time.sleep(0.01)
        core.reset()
        return core.step()  # the new engine holds nothing: no step ends within the poll

    wait_engine_idle(server)
    assert server.engine._executor.submit(sequence).result(60) is None
    texts, _ = asyncio.run(_innocents(server, None))
    assert texts == reference


def test_a_request_a_fault_took_off_every_queue_gets_a_500_not_a_hang(server):
    """A schedule that raises after it took the victim off the waiting queue (half a schedule), naming no request:
    the victim's client gets a 500, not a wait for ever. A core process's client learns from the fault's message
    which requests the core still holds (it once read its own list, where the victim stayed)."""
    r = httpx.post(server.base_url + "/v1/completions", json={**VICTIM, "request_id": "fault-lose-1"}, timeout=30)
    assert r.status_code == 500 and "(schedule): RuntimeError: injected fault at schedule" in r.text, r.text
    wait_engine_idle(server)
    assert leaked_blocks(server) == NO_LEAK


async def _error_of(engine, request_id: str, params) -> BaseException:
    try:
        async for _ in engine.generate(request_id, prompt_token_ids=[5, 6, 7], params=params):
            pass
    except Exception as exc:
        return exc
    raise AssertionError("the request was served")


def test_bad_input_the_engine_finds_is_a_400_and_nothing_of_it_is_kept(server):
    """A ValueError of any kind that admission raises (GrammarError here) is the request's bad input: a 400, through
    a core process too (only the exact name ValueError once was); there, so is params that no longer validate when
    the core rebuilds them (msgspec's ValidationError: a Python API caller changed them after they were checked).
    The API server keeps nothing of a request the core refused (its text decoder's registration once stayed)."""
    from engine.sampling_params import SamplingParams

    url = server.base_url + "/v1/completions"
    r = httpx.post(url, json={**VICTIM, "request_id": "bad-input-1"}, timeout=60)
    assert r.status_code == 400 and r.json()["error"]["message"] == "injected bad input", r.text
    if server.mode == "core-process":
        params = SamplingParams(max_tokens=2)
        params.temperature = 5.0
        exc = asyncio.run_coroutine_threadsafe(_error_of(server.engine, "changed-params", params),
                                               server.engine._loop).result(60)
        assert isinstance(exc, ValueError) and "temperature must be in [0, 2]" in str(exc), repr(exc)
        r = httpx.post(url, json={**VICTIM, "request_id": "fault-admission-1"}, timeout=60)
        assert r.status_code == 500 and "KeyError" in r.text, r.text
        assert httpx.post(url, json={**VICTIM, "max_tokens": 2}, timeout=60).status_code == 200  # (a decode)
        assert server.engine.engine._outputs._here == {}


def test_the_event_loop_never_waits_for_the_core(server):
    """The loop's figures, refreshed when the engine goes idle, are asked for in the step thread, and an answer is
    waited for a bounded time: /health answers while the core does not (stopped here, as a core in a long prefill
    or a hung collective answers late; the refresh once waited on the event loop, with no timeout). The refresh is
    started straight on the loop: it runs there whenever the engine goes idle, after the step thread's own ask."""
    import os
    import signal

    _core_only(server)
    wait_engine_idle(server)
    pid = server.engine.engine.proc.pid
    os.kill(pid, signal.SIGSTOP)
    try:
        refresh = asyncio.run_coroutine_threadsafe(server.engine._refresh_stats(), server.engine._loop)
        assert httpx.get(server.base_url + "/health", timeout=10).status_code == 200
        assert not refresh.done()  # /health was answered while the refresh waited (for _STATS_TIMEOUT_S, 1 s)
        refresh.result(30)  # then it gave up: the core is still stopped
    finally:
        os.kill(pid, signal.SIGCONT)
    r = httpx.post(server.base_url + "/v1/completions", json={**VICTIM, "max_tokens": 2}, timeout=60)
    assert r.status_code == 200, r.text
