"""SIGTERM to `pagedserve serve`: no new requests, in-flight ones finish or end within the timeout, exit 0."""
from __future__ import annotations

import asyncio
import signal
import time

import httpx

from reliability_harness import record, start_cli_server
from serving_harness import sse_events

SHUTDOWN_TIMEOUT_S = 3


async def _stream(client: httpx.AsyncClient, url: str, body: dict, started: asyncio.Event) -> dict:
    """Read a stream to its end, however it ends: [DONE], an error event, or a dropped connection."""
    lines: list[str] = []
    status, dropped = None, None
    try:
        async with client.stream("POST", url, json={**body, "stream": True,
                                                    "stream_options": {"include_usage": True}}) as r:
            status = r.status_code
            async for line in r.aiter_lines():
                lines.append(line)
                if line.startswith("data:"):
                    started.set()
    except httpx.HTTPError as exc:  # the server closed the connection mid-stream
        dropped = type(exc).__name__
    events = sse_events(lines)
    usage = next((e["usage"] for e in events if isinstance(e, dict) and e.get("usage")), None)
    error = next((e["error"] for e in events if isinstance(e, dict) and "error" in e), None)
    return {"status": status, "done": "[DONE]" in events, "usage": usage, "error": error, "dropped": dropped}


async def _scenario(base: str, proc) -> dict:
    url = base + "/v1/completions"
    short = {"model": "tiny", "prompt": [1000, 2000, 3000], "max_tokens": 6, "ignore_eos": True, "temperature": 0.0}
    long = {"model": "tiny", "prompt": [1000, 2000, 3000], "max_tokens": 480, "ignore_eos": True, "temperature": 0.0}
    async with httpx.AsyncClient(timeout=120) as client:
        short_started = [asyncio.Event() for _ in range(2)]
        shorts = [asyncio.create_task(_stream(client, url, short, e)) for e in short_started]
        await asyncio.gather(*[e.wait() for e in short_started])
        long_started = [asyncio.Event() for _ in range(2)]
        longs = [asyncio.create_task(_stream(client, url, long, e)) for e in long_started]
        # max_num_seqs=2: these two wait in the queue behind the long ones.
        queued = [asyncio.create_task(_stream(client, url, long, asyncio.Event())),
                  asyncio.create_task(client.post(url, json=long))]
        await asyncio.gather(*[e.wait() for e in long_started])
        await asyncio.gather(*shorts)  # done before SIGTERM: these must not be touched by it

        proc.send_signal(signal.SIGTERM)
        t_sigterm = time.monotonic()
        refused = None
        for _ in range(200):  # the listener closes at once; then a new client is refused
            try:
                r = await client.post(url, json=short, headers={"connection": "close"})
                if r.status_code == 503:
                    refused = "503"
                    break
            except httpx.HTTPError as exc:
                refused = type(exc).__name__
                break
            await asyncio.sleep(0.05)
        ended = await asyncio.wait_for(asyncio.gather(*longs, *queued, return_exceptions=True),
                                       timeout=SHUTDOWN_TIMEOUT_S * 2 + 30)
    return {"shorts": [s.result() for s in shorts], "ended": ended, "refused": refused, "t_sigterm": t_sigterm,
            "t_ended": time.monotonic()}


def test_sigterm_stops_accepting_ends_in_flight_and_exits_0(tiny_llama_dir, tmp_path):
    log = tmp_path / "server.log"
    proc, base = start_cli_server([str(tiny_llama_dir), "--max-model-len", "512", "--num-gpu-blocks-override", "128",
                                   "--max-num-seqs", "2", "--served-model-name", "tiny", "--shutdown-timeout",
                                   str(SHUTDOWN_TIMEOUT_S), "--disable-log-stats"], log)
    try:
        result = asyncio.run(_scenario(base, proc))
        code = proc.wait(timeout=SHUTDOWN_TIMEOUT_S * 2 + 30)
        t_exit = time.monotonic()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    ended = result["ended"]
    record("graceful_shutdown", {"finished_before": len(result["shorts"]), "in_flight_at_sigterm": len(ended),
                                 "new_request": result["refused"], "exit_code": code,
                                 "s_sigterm_to_requests_ended": round(result["t_ended"] - result["t_sigterm"], 1),
                                 "s_sigterm_to_exit": round(t_exit - result["t_sigterm"], 1),
                                 "in_flight_outcomes": [_outcome(e) for e in ended]})
    assert code == 0, log.read_text()[-3000:]
    for s in result["shorts"]:
        assert s["status"] == 200 and s["done"] and s["usage"]["completion_tokens"] == 6, s
    assert result["refused"] is not None, "the server kept accepting after SIGTERM"
    for e in ended:  # each ended one way or another, none hung (wait_for above), none got a 5xx
        if isinstance(e, dict):
            assert e["status"] in (200, 503, None), e
        elif isinstance(e, httpx.Response):  # a 200 is the whole completion, never a cut one
            assert e.status_code in (200, 503), e.text
            if e.status_code == 200:
                assert e.json()["usage"]["completion_tokens"] == 480 and len(e.json()["choices"]) == 1, e.text
        else:
            assert isinstance(e, httpx.HTTPError), repr(e)
    assert "Traceback" not in log.read_text(), log.read_text()[-3000:]


def _outcome(e) -> str:
    if isinstance(e, httpx.Response):
        if e.status_code != 200:
            return f"non-streamed: HTTP {e.status_code} {e.json()['error']['message']}"
        choices = e.json()["choices"]
        return f"non-streamed: HTTP 200, {e.json()['usage']['completion_tokens']} tokens, {[c['finish_reason'] for c in choices]}"
    if isinstance(e, dict):
        if e["done"]:
            return f"stream: [DONE], {e['usage']['completion_tokens'] if e['usage'] else '?'} tokens, error={e['error']}"
        return f"stream: HTTP {e['status']}, then connection closed ({e['dropped']})"
    return type(e).__name__
