"""Smoke run of benchmarks/serving.py against a real `pagedserve serve`, so the benchmark tool cannot rot."""
from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
STAT_FIELDS = ("ttft_ms", "tpot_ms", "itl_ms", "e2e_ms")
sys.path.insert(0, str(ROOT / "scripts"))
from soak import start_server  # noqa: E402  (the one CLI-server start the tests share)


@pytest.fixture(scope="module")
def server():
    """`python -m server.cli serve` with the default model and a small cache, on a free port: (process, url)."""
    proc, url = start_server(["--max-model-len", "256", "--kv-cache-space", "0.05", "--swap-space", "0.05",
                              "--disable-log-stats", "--log-level", "warning"], timeout_s=180)
    try:
        yield proc, url
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            proc.kill()


@pytest.fixture(scope="module")
def server_url(server):
    return server[1]


def _run(url: str, tmp_path: Path, *extra: str) -> dict:
    out = tmp_path / "serving.json"
    cmd = [sys.executable, "benchmarks/serving.py", "--base-url", url, "--input-len", "8", "--output-len", "5",
           "--warmup", "1", "--strict", "--output-json", str(out), *extra]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return json.loads(out.read_text())


def test_fixed_concurrency_every_request_gets_its_tokens(server_url, tmp_path):
    report = _run(server_url, tmp_path, "--num-prompts", "6", "--concurrency", "3", "--output-len-range", "0.5")
    assert report["model"] == "SmolLM2-135M-Instruct"
    (run,) = report["runs"]
    assert run["num_requests"] == run["completed"] == 6 and run["failed"] == 0 and run["all_tokens_received"]
    # Random output lengths in [2, 7]: the total is what the server reported, request by request.
    assert 6 * 2 <= run["total_output_tokens"] <= 6 * 7
    assert run["total_input_tokens"] == 6 * 8  # token-id prompts: the server counts exactly 8 each
    assert run["output_throughput"] > 0 and run["request_throughput"] > 0
    for key in STAT_FIELDS:
        assert set(run[key]) == {"mean", "p50", "p99"}
        assert run[key]["p99"] >= run[key]["p50"] > 0
    assert run["e2e_ms"]["p50"] >= run["ttft_ms"]["p50"]


@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="reads /proc (Linux)")
def test_server_pid_reports_the_server_processes_cpu(server, tmp_path):
    """--server-pid: the CPU the server process used over the timed run, in the JSON and per token on stdout."""
    proc, url = server
    out = tmp_path / "serving.json"
    cmd = [sys.executable, "benchmarks/serving.py", "--base-url", url, "--input-len", "8", "--output-len", "5",
           "--num-prompts", "8", "--concurrency", "4", "--warmup", "1", "--strict", "--server-pid", str(proc.pid),
           "--output-json", str(out)]
    done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr
    (run,) = json.loads(out.read_text())["runs"]
    assert run["server_cpu_s"][str(proc.pid)] > 0  # it served 8 requests: at least a clock tick of work
    assert f"pid {proc.pid} " in done.stdout and "us a token" in done.stdout and "cores busy of" in done.stdout


def test_sweep_with_poisson_arrivals_writes_json_and_plot(server_url, tmp_path):
    png = tmp_path / "serving.png"
    report = _run(server_url, tmp_path, "--sweep", "1,2", "--rounds", "2", "--num-prompts-min", "2",
                  "--request-rate", "50", "--prompt-kind", "text", "--plot", str(png))
    assert [r["concurrency"] for r in report["runs"]] == [1, 2]
    assert [r["completed"] for r in report["runs"]] == [2, 4]
    assert all(r["total_output_tokens"] == r["completed"] * 5 for r in report["runs"])
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_token_count_from_logprobs(server_url, tmp_path):
    """For servers without include_usage: one logprobs entry per streamed token."""
    report = _run(server_url, tmp_path, "--num-prompts", "2", "--concurrency", "2", "--count-tokens", "logprobs")
    (run,) = report["runs"]
    assert run["completed"] == 2 and run["total_output_tokens"] == 10


def test_a_request_without_its_tokens_fails_the_run(server_url, tmp_path):
    """250 prompt tokens + 10 > max_model_len 256: the server refuses, and --strict exits 1."""
    out = tmp_path / "serving.json"
    cmd = [sys.executable, "benchmarks/serving.py", "--base-url", server_url, "--input-len", "250",
           "--output-len", "10", "--num-prompts", "2", "--warmup", "0", "--strict", "--output-json", str(out)]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    (run,) = json.loads(out.read_text())["runs"]
    assert run["completed"] == 0 and run["failed"] == 2 and not run["all_tokens_received"]
    assert "HTTP 400" in run["errors"][0]


def test_warm_ups_and_sweep_levels_never_repeat_a_timed_prompt():
    # A repeated prompt is a free prefill for a server with a prompt cache (llama-server keeps one by default):
    # with the warm-ups drawn from the timed list, llama.cpp's first token at one stream read ~40 % early.
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import serving

    args = serving.parse_args(["--num-prompts", "16", "--warmup", "2", "--input-len", "128"])
    warmups, timed = serving.plan_requests(args, 1)
    assert len(warmups) == 2 and len(timed) == 16
    prompts = {tuple(p) for p, _, _ in timed}
    assert len(prompts) == 16 and not prompts & {tuple(p) for p, _, _ in warmups}
    _, other_level = serving.plan_requests(args, 8)
    assert not prompts & {tuple(p) for p, _, _ in other_level}
    assert serving.plan_requests(args, 1) == (warmups, timed), "the same seed and level: the same prompts"


def test_raw_and_aiohttp_clients_agree(server_url, tmp_path):
    """The lean default client (--client raw) and aiohttp count the same requests and tokens."""
    runs = {}
    for client in ("raw", "aiohttp"):
        (runs[client],) = _run(server_url, tmp_path, "--num-prompts", "6", "--concurrency", "3",
                               "--output-len-range", "0.5", "--client", client)["runs"]
    for key in ("completed", "failed", "total_input_tokens", "total_output_tokens"):
        assert runs["raw"][key] == runs["aiohttp"][key], key
    assert runs["raw"]["completed"] == 6 and runs["raw"]["ttft_ms"]["p50"] > 0 and runs["raw"]["tpot_ms"]["p50"] > 0


def _serving():
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import serving

    return serving


def test_raw_client_stamps_every_text_event_the_server_sent(server_url):
    """One request through send_raw and the same one read by httpx: the same usage count, a stamp per text event."""
    import httpx

    serving = _serving()
    args = serving.parse_args(["--output-len", "6"])
    model = serving.server_model(server_url, 30)
    prompt = list(range(1000, 1008))
    body = serving.request_body(args, model, prompt, 6)
    with httpx.stream("POST", server_url + "/v1/completions", json=body, timeout=60) as r:
        events = [json.loads(line[5:]) for line in r.iter_lines() if line.startswith("data:") and "[DONE]" not in line]
    texts = [e for e in events if any(c.get("text") for c in e.get("choices") or [])]
    (usage,) = [e["usage"] for e in events if e.get("usage")]

    async def go():
        target = await serving.RawTarget.resolve(server_url)
        return await serving.send_raw(target, args, model, prompt, 8, 6)

    res = asyncio.run(go())
    assert res.ok and not res.error
    assert res.output_tokens == usage["completion_tokens"] == 6 and res.prompt_len == usage["prompt_tokens"]
    assert len(res.itl) + 1 == len(texts) and 0 < res.ttft <= res.e2e


class _Transport:
    """Stands in for the socket under RawStream: the bytes that arrive are handed to data_received below."""

    def close(self):
        pass


def _sse(*events: bytes) -> bytes:
    return b"".join(b"data: " + e + b"\n\n" for e in events)


def _chunked(*pieces: bytes) -> bytes:
    return b"".join(b"%x\r\n%s\r\n" % (len(p), p) for p in pieces) + b"0\r\n\r\n"


def _feed(response: bytes, cuts: list[int], count_tokens: str = "usage", max_tokens: int = 3):
    """The RequestResult send_raw would return for `response` arriving in pieces cut at `cuts`."""
    serving = _serving()
    args = serving.parse_args(["--count-tokens", count_tokens])

    async def go():
        res = serving.RequestResult(prompt_len=1, max_tokens=max_tokens)
        stream = serving.RawStream(res, time.perf_counter(), count_tokens == "logprobs")
        stream.connection_made(_Transport())
        for a, b in zip([0, *cuts], [*cuts, len(response)]):
            stream.data_received(response[a:b])
        stream.connection_lost(None)
        if res.error:
            return res
        return serving.conclude(res, args, stream.usage_tokens, stream.counted, stream.last is not None)

    return asyncio.run(go())


TEXT = b'{"choices":[{"index":0,"text":"%s","logprobs":{"tokens":["x"]},"finish_reason":null}],"usage":null}'
USAGE = b'{"choices":[],"usage":{"prompt_tokens":5,"completion_tokens":4,"total_tokens":9}}'
OK_HEAD = (b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\nTransfer-Encoding: chunked\r\n"
           b"connection: close\r\n\r\n")
# Texts the JSON-free check must read right: a '"text"' and a '"usage"' inside the text, a lone quote, and an
# empty text, which is no token; then the usage chunk (4 tokens) and [DONE].
EVENTS = [TEXT % b"Hello", TEXT % b'a\\"text', TEXT % b"", TEXT % b'a\\"usage', TEXT % b'\\"', USAGE, b"[DONE]"]


@pytest.mark.parametrize("count_tokens", ["usage", "logprobs"])
def test_raw_client_reads_a_stream_cut_anywhere(count_tokens):
    """TCP may cut a response at any byte: every cut reads the same 4 text events and token count."""
    tokens = 4 if count_tokens == "usage" else 5  # logprobs: one entry in each of the 5 choice chunks
    response = OK_HEAD + _chunked(*(_sse(e) for e in EVENTS))
    for cuts in [[], *([i] for i in range(1, len(response))), list(range(1, len(response)))]:
        res = _feed(response, cuts, count_tokens, tokens)
        assert res.ok and res.output_tokens == tokens and len(res.itl) == 3, (cuts, res.error)
        assert res.prompt_len == 5 and 0 < res.ttft <= res.e2e  # the usage chunk's prompt_tokens
    # The same events unchunked: ended by Content-Length, then by the close.
    body = _sse(*EVENTS)
    for head in (b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n" % len(body), b"HTTP/1.1 200 OK\r\n\r\n"):
        res = _feed(head + body, [len(head) + 7], count_tokens, tokens)
        assert res.ok and res.output_tokens == tokens and len(res.itl) == 3


def test_raw_client_counts_errors():
    """An error event mid-stream, a non-200 with its body (either framing), a stream the server dropped."""
    error = b'{"error":{"message":"step failed (forward)","type":"InternalServerError","code":500}}'
    res = _feed(OK_HEAD + _chunked(_sse(TEXT % b"Hi", error, b"[DONE]")), [len(OK_HEAD) + 3])
    assert not res.ok and "step failed (forward)" in res.error
    body = b'{"error":{"message":"too long","code":400}}'
    for framing in (b"Content-Length: %d\r\n\r\n" % len(body) + body,
                    b"Transfer-Encoding: chunked\r\n\r\n" + _chunked(body[:9], body[9:])):
        res = _feed(b"HTTP/1.1 400 Bad Request\r\n" + framing, [])
        assert not res.ok and res.error == f"HTTP 400: {body!r}"
    res = _feed(OK_HEAD + b"e1\r\ndata: {", [])
    assert not res.ok and "connection closed" in res.error
