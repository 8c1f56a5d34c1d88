"""Steps that raise: a fault ends its step's requests (500); a fault that recurs, or one that breaks the block
invariants, resets the engine in-process (in-flight requests 503, /health back to 200, the server serving);
a fault that outlives MAX_RESETS resets stops the engine (/health 503, for the supervisor to restart it)."""
from __future__ import annotations

import asyncio
import threading

import httpx
import pytest

from engine.frontend.async_engine import MAX_RESETS
from engine.sampling_params import SamplingParams
from reliability_harness import leaked_blocks, metric, serve, stream_completion, wait_engine_idle

LONG = {"model": "tiny", "max_tokens": 60, "ignore_eos": True, "temperature": 0.8}
SHORT = {"model": "tiny", "prompt": "Hi", "max_tokens": 3, "ignore_eos": True}
NO_LEAK = {"device_blocks": 0, "cpu_blocks": 0, "block_tables": 0}


@pytest.fixture
def server(tiny_llama_dir):
    with serve(tiny_llama_dir, max_model_len=128, max_num_seqs=4, num_gpu_blocks_override=64) as s:
        yield s


def _counters(base: str) -> dict[str, float]:
    text = httpx.get(base + "/metrics", timeout=10).text
    return {"resets": metric(text, "pagedserve:engine_resets_total"),
            "step_fault": metric(text, "pagedserve:request_failures_total", 'reason="step_fault"'),
            "engine_reset": metric(text, "pagedserve:request_failures_total", 'reason="engine_reset"')}


async def _traffic_then_fault(base: str, engine, armed: threading.Event) -> list:
    """Streams, non-streamed requests and chats (some queued behind max_num_seqs), then the fault."""
    async with httpx.AsyncClient(timeout=60, limits=httpx.Limits(max_connections=32)) as client:
        url, chat = base + "/v1/completions", base + "/v1/chat/completions"
        tasks = [asyncio.create_task(stream_completion(client, url, {**LONG, "prompt": [1000 + i] * 8, "seed": i}))
                 for i in range(3)]
        tasks += [asyncio.create_task(stream_completion(
            client, chat, {**LONG, "messages": [{"role": "user", "content": f"Hi {i}"}], "n": 2, "seed": i}))
            for i in range(2)]
        tasks += [asyncio.create_task(client.post(url, json={**LONG, "prompt": [2000 + i] * 8, "seed": i}))
                  for i in range(3)]
        # Fault only once the engine holds running and queued requests, so both kinds see it.
        while len(engine.engine.scheduler.running) < 2 or not engine.engine.scheduler.waiting:
            await asyncio.sleep(0.01)
        armed.set()
        # A bounded wait: a request the engine forgot would hang here, and fail the test.
        return await asyncio.wait_for(asyncio.gather(*tasks), timeout=60)


def _errors(results: list) -> list[dict]:
    """(status the client saw, error object) per request: a body for a plain POST, the error event of a stream."""
    out = []
    for res in results:
        if isinstance(res, httpx.Response):
            out.append({"status": res.status_code, "error": res.json().get("error"), "streamed": False})
        else:
            assert res["status"] == 200 and res["done"], res  # the 200 went out before the fault; then [DONE]
            out.append({"status": 200, "error": res["error"], "streamed": True})
    return out


def _assert_serving(server) -> None:
    base = server.base_url
    assert httpx.get(base + "/health", timeout=10).status_code == 200
    for path, body in (("/v1/completions", SHORT), ("/v1/completions", {**SHORT, "stream": True}),
                       ("/v1/chat/completions", {**SHORT, "messages": [{"role": "user", "content": "Hi"}]})):
        body = {k: v for k, v in body.items() if not (path.endswith("chat/completions") and k == "prompt")}
        r = httpx.post(base + path, json=body, timeout=60)
        assert r.status_code == 200 and '"error"' not in r.text, r.text
    wait_engine_idle(server)
    assert leaked_blocks(server) == NO_LEAK


def test_recurring_fault_resets_the_engine_and_serving_goes_on(server):
    """A forward that raises in two steps in a row: the first step's requests get a 500, then the engine resets
    and what was still in flight gets a 503 (retry); afterwards every kind of request is served."""
    engine = server.engine
    armed, fired = threading.Event(), []

    def fault(stage: str, request_ids: list[str]) -> None:
        if stage == "forward" and armed.is_set() and len(fired) < 2:
            fired.append(request_ids)
            raise RuntimeError("injected forward fault")

    engine.engine.fault_injector = fault
    results = _errors(asyncio.run(_traffic_then_fault(server.base_url, engine, armed)))
    counters = _counters(server.base_url)

    assert len(fired) == 2
    statuses = [(r["error"] or {}).get("code", 200) for r in results]
    assert 500 in statuses and 503 in statuses, results
    for r in results:
        err = r["error"]
        if err is None:
            continue  # queued behind the reset: served by the new engine
        if err["code"] == 500:
            assert "(forward): RuntimeError: injected forward fault" in err["message"], err
            assert err["type"] == "InternalServerError"
        else:
            assert err["code"] == 503 and err["type"] == "ServiceUnavailableError", err
            assert "reset" in err["message"] and "retry" in err["message"], err
        if not r["streamed"]:
            assert r["status"] == err["code"]
    assert counters["resets"] == 1
    assert counters["step_fault"] == len(fired[0]) + len(fired[1])  # both faulted steps' requests: a 500 each
    assert counters["engine_reset"] >= 1
    assert server.engine.is_ready and not server.engine.errored
    _assert_serving(server)


def test_broken_block_invariants_reset_at_the_first_fault(server):
    """A fault that leaves a block referenced by nobody (as a half-done allocation would): reset at once."""
    engine = server.engine
    armed = threading.Event()

    def fault(stage: str, request_ids: list[str]) -> None:
        if stage == "sampler" and armed.is_set():
            armed.clear()
            engine.engine.scheduler.block_manager.gpu.allocate()  # a block no table holds
            raise RuntimeError("injected fault after a leak")

    engine.engine.fault_injector = fault
    results = _errors(asyncio.run(_traffic_then_fault(server.base_url, engine, armed)))
    counters = _counters(server.base_url)
    assert counters["resets"] == 1, counters
    assert {(r["error"] or {}).get("code") for r in results} >= {500, 503}, results
    _assert_serving(server)  # the leaked block went with the old block manager


def test_request_a_failed_schedule_dropped_gets_a_500_not_a_hang(server):
    """A scheduler fault after it took a request off the waiting queue (and before it queued it elsewhere): that
    request's reader is told (500), not left waiting; the invariants hold, so no reset; the rest are served."""
    engine = server.engine
    armed = threading.Event()

    def fault(stage: str, request_ids: list[str]) -> None:
        sch = engine.engine.scheduler
        if stage == "schedule" and armed.is_set() and sch.waiting:
            armed.clear()
            sch.waiting.popleft()  # half a schedule: the group is in no queue now
            raise RuntimeError("injected fault inside the scheduler")

    engine.engine.fault_injector = fault
    results = _errors(asyncio.run(_traffic_then_fault(server.base_url, engine, armed)))
    errors = [r["error"] for r in results if r["error"] is not None]
    assert len(errors) == 1 and errors[0]["code"] == 500, results
    assert "(schedule): RuntimeError: injected fault inside the scheduler" in errors[0]["message"]
    assert _counters(server.base_url) == {"resets": 0, "step_fault": 1, "engine_reset": 0}
    _assert_serving(server)


def test_engine_sampler_overflow_fails_only_its_request(server):
    """Issue #17's seed overflow, reaching the engine past the HTTP validation (the Python API): the sampler
    raises in the poisoned request's step; that step's requests end with a 500, the engine serves on."""
    engine = server.engine
    poisoned = SamplingParams(max_tokens=4, temperature=0.8, seed=2**64)

    async def run_poisoned() -> BaseException:
        try:
            async for _ in engine.generate("poisoned", prompt_token_ids=[5, 6, 7], params=poisoned):
                pass
        except Exception as exc:
            return exc
        raise AssertionError("the poisoned request finished")

    exc = asyncio.run_coroutine_threadsafe(run_poisoned(), engine._loop).result(timeout=60)
    assert type(exc).__name__ == "RequestFailedError" and "(sampler)" in str(exc) and "Overflow" in str(exc), exc
    assert _counters(server.base_url)["resets"] == 0
    _assert_serving(server)


def test_fault_that_outlives_the_resets_stops_the_engine(server):
    """Every forward raises: after MAX_RESETS resets within the window the engine stops; /health is 503 for
    the supervisor (docs/reliability.md), new requests get a 503, /metrics still answers."""
    engine = server.engine

    def fault(stage: str, request_ids: list[str]) -> None:
        if stage == "forward":
            raise RuntimeError("injected permanent fault")

    engine.engine.fault_injector = fault
    base = server.base_url
    for _ in range(4 * (MAX_RESETS + 1)):
        if not engine.is_ready:
            break
        asyncio.run(_burst(base))
    assert engine.errored and not engine.is_ready
    health = httpx.get(base + "/health", timeout=10)
    assert health.status_code == 503 and "resets" in health.json()["error"]["message"], health.text
    r = httpx.post(base + "/v1/completions", json=SHORT, timeout=10)
    assert r.status_code == 503 and r.json()["error"]["code"] == 503
    assert _counters(base)["resets"] == MAX_RESETS
    assert httpx.get(base + "/v1/models", timeout=10).status_code == 200


async def _burst(base: str) -> None:
    async with httpx.AsyncClient(timeout=60) as client:
        await asyncio.gather(*[client.post(base + "/v1/completions", json={**SHORT, "prompt": [100 + i] * 4})
                               for i in range(3)])


# `pagedserve serve` whose forward always raises (the test hook, set on every LLMEngine the CLI builds).
_FAULTY_CLI = """
import sys
import engine.llm_engine as le
from server import cli
build = le.LLMEngine.__init__
def faulty(self, *args, **kwargs):
    build(self, *args, **kwargs)
    def fault(stage, request_ids):
        if stage == "forward":
            raise RuntimeError("injected permanent fault")
    self.fault_injector = fault
le.LLMEngine.__init__ = faulty
sys.exit(cli.main(sys.argv[1:]))
"""


@pytest.mark.slow  # a server process of its own: ~30 s on 2 cores
def test_cli_exits_with_status_1_when_the_engine_stops(tiny_llama_dir, tmp_path):
    """A supervisor restarts a process, not an engine: once the resets do not help, `pagedserve serve` exits 1."""
    import subprocess
    import sys
    import time

    from reliability_harness import ROOT
    from serving_harness import free_port

    port = free_port()
    log = open(tmp_path / "server.log", "wb")
    proc = subprocess.Popen([sys.executable, "-c", _FAULTY_CLI, "serve", str(tiny_llama_dir), "--host", "127.0.0.1",
                             "--port", str(port), "--served-model-name", "tiny", "--max-model-len", "64",
                             "--num-gpu-blocks-override", "32",
                             "--disable-log-stats"], cwd=ROOT, stdout=log, stderr=subprocess.STDOUT)
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 120
        while True:
            assert proc.poll() is None and time.monotonic() < deadline, (tmp_path / "server.log").read_text()[-2000:]
            try:
                if httpx.get(base + "/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        while proc.poll() is None and time.monotonic() < deadline:
            try:
                asyncio.run(_burst(base))
            except httpx.HTTPError:
                pass  # the server is going down
        assert proc.wait(timeout=30) == 1
    finally:
        if proc.poll() is None:
            proc.kill()
    text = (tmp_path / "server.log").read_text()
    assert "engine reset" in text and "exiting with status 1" in text, text[-2000:]
