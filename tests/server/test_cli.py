"""`python -m server.cli serve` as users run it: real uvicorn in its own process, 64 streams, SIGTERM."""
from __future__ import annotations

import asyncio
import json
import pathlib
import signal
import subprocess
import sys
import time

import httpx
import pytest
from bad_inputs import MODEL

ROOT = pathlib.Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "scripts"))
from soak import start_server  # noqa: E402  (scripts/soak.py: the tests' CLI servers start there)

# GET /health every 50 ms until a line arrives on stdin; prints the latencies (s) as JSON.
PROBE = """
import json, sys, threading, time, httpx
done = threading.Event()
threading.Thread(target=lambda: (sys.stdin.readline(), done.set()), daemon=True).start()
out = []
with httpx.Client(timeout=5) as client:
    while not done.is_set():
        t0 = time.perf_counter()
        assert client.get(sys.argv[1]).status_code == 200
        out.append(time.perf_counter() - t0)
        time.sleep(0.05)
print(json.dumps(out))
"""


@pytest.fixture(scope="module")
def cli_server(tmp_path_factory):
    log = tmp_path_factory.mktemp("cli") / "server.log"
    proc, base = start_server(["--max-model-len", "512", "--kv-cache-space", "0.25", "--swap-space", "0.25",
                               "--max-num-seqs", "64", "--log-stats-interval", "1", "--shutdown-timeout", "5"],
                              str(log))
    yield proc, base, log
    if proc.poll() is None:
        proc.kill()
        proc.wait()


def test_cli_serves_default_model(cli_server):
    _, base, _ = cli_server
    assert httpx.get(base + "/v1/models").json()["data"][0]["id"] == MODEL
    r = httpx.post(base + "/v1/completions", json={"model": MODEL, "prompt": "Hi", "max_tokens": 3}, timeout=120)
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] >= 1


def test_64_concurrent_streams_and_health_latency(cli_server):
    _, base, _ = cli_server
    # The probe runs in its own process: in this one it would measure the 64 clients' GIL, not the server.
    probe = subprocess.Popen([sys.executable, "-c", PROBE, base + "/health"], stdin=subprocess.PIPE,
                             stdout=subprocess.PIPE, text=True)
    time.sleep(1.0)

    async def one(client: httpx.AsyncClient, i: int) -> tuple[int, list]:
        body = {"model": MODEL, "prompt": f"Request {i}: count to ten.", "max_tokens": 8, "ignore_eos": True,
                "temperature": 0.7, "seed": i, "stream": True, "stream_options": {"include_usage": True}}
        chunks = []
        async with client.stream("POST", base + "/v1/completions", json=body) as r:
            async for line in r.aiter_lines():
                if line.startswith("data:") and line != "data: [DONE]":
                    chunks.append(json.loads(line[5:]))
        finishes = [c["choices"][0]["finish_reason"] for c in chunks[:-1] if c["choices"][0]["finish_reason"]]
        return chunks[-1]["usage"]["completion_tokens"], finishes

    async def run():
        async with httpx.AsyncClient(timeout=300, limits=httpx.Limits(max_connections=100)) as client:
            return await asyncio.gather(*[one(client, i) for i in range(64)])

    try:
        results = asyncio.run(run())
    finally:
        latencies = json.loads(probe.communicate("stop\n", timeout=30)[0])
    assert results == [(8, ["length"])] * 64
    ordered = sorted(latencies)
    worst, median = ordered[-1], ordered[len(ordered) // 2]
    print(f"\n/health under 64 streams: {len(latencies)} probes, max {worst * 1000:.1f} ms, "
          f"median {median * 1000:.1f} ms")
    # The longest stall used to be a full garbage collection of the ~400k objects loading leaves
    # (~0.2 s, GIL held); the CLI freezes them (gc.freeze) before serving.
    assert worst < 0.100, f"/health took {worst * 1000:.0f} ms under load (median {median * 1000:.0f} ms)"


def test_stats_line_and_sigterm_exits_cleanly(cli_server):
    proc, base, log = cli_server
    r = httpx.post(base + "/v1/completions", json={"model": MODEL, "prompt": "Hi", "max_tokens": 40,
                                                   "ignore_eos": True}, timeout=120)
    assert r.status_code == 200
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=60) == 0
    text = log.read_text()
    assert "Avg prompt throughput:" in text and "KV cache usage:" in text and "Running:" in text, text[-2000:]


def test_help_says_what_enforce_eager_and_priority_do():
    from server.cli import build_parser

    parser = build_parser()
    serve = next(a for a in parser._subparsers._group_actions if a.dest == "command").choices["serve"]
    text = " ".join(serve.format_help().split())
    assert "--enforce-eager run every step op by op in Python (the reference path)" in text
    assert "lower `priority` runs first" in text
    readme = (ROOT / "README.md").read_text()
    assert "| `--enforce-eager` | off | every step op by op in Python, the reference path" in readme


def test_the_engine_core_process_is_the_default_on_cuda_only():
    """--engine-core-process as given; unset, on for a CUDA engine (it served ~1.4x one process's tokens at 64 and
    256 streams on a 16-core GPU host) and off on the CPU and under torchrun."""
    import torch

    from engine.config import EngineConfig
    from server.cli import build_parser, wants_core_process

    def flag(*argv):
        return build_parser().parse_args(["serve", *argv]).engine_core_process

    assert flag() is None and flag("--engine-core-process") is True and flag("--no-engine-core-process") is False
    cuda, cpu = EngineConfig(device="cuda"), EngineConfig(device="cpu")
    assert wants_core_process(None, cpu, torchrun=False) is False
    assert wants_core_process(True, cpu, torchrun=False) is True
    assert wants_core_process(False, cuda, torchrun=False) is False
    assert wants_core_process(None, cuda, torchrun=True) is False
    for config in (cuda, EngineConfig(device="auto")):  # without a GPU the engine fails in-process, saying why
        assert wants_core_process(None, config, torchrun=False) is torch.cuda.is_available()


def test_a_vllm_command_line_serves_as_it_is(tmp_path):
    """`vllm serve`'s usual flags start pagedserve unchanged: --model (its api_server's), and the flags with nothing
    to change here; tool_choice auto answers with a tool call. What they cannot mean here is refused by name."""
    from engine.model_executor.loader import default_gguf_path
    from server.cli import parse_args

    model = str(default_gguf_path())  # the package's Q4_1 file, as a user would name it
    vllm_flags = ["--trust-remote-code", "--enable-auto-tool-choice", "--tool-call-parser", "hermes",
                  "--disable-log-requests", "--kv-cache-dtype", "auto", "--tokenizer-mode", "auto",
                  "--gpu-memory-utilization", "0.9", "--max-model-len", "512"]
    proc, base = start_server(["--model", model, *vllm_flags, "--kv-cache-space", "0.25", "--swap-space", "0"],
                              str(tmp_path / "server.log"))
    try:
        served = httpx.get(base + "/v1/models").json()["data"][0]["id"]
        tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {
            "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]
        r = httpx.post(base + "/v1/chat/completions", timeout=120, json={
            "model": served, "messages": [{"role": "user", "content": "Weather in Paris?"}], "tools": tools,
            "tool_choice": "auto", "max_tokens": 48, "temperature": 0})
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["finish_reason"] in ("stop", "length", "tool_calls")
    finally:
        proc.terminate()
        proc.wait(timeout=60)
    assert parse_args(["serve", model, "--model", model]).model == model
    for argv, words in ((["serve", "/a", "--model", "/b"], "name different models"),
                        (["serve", "--kv-cache-dtype", "fp8"], "invalid choice: 'fp8'"),
                        (["serve", "--tokenizer-mode", "mistral"], "invalid choice: 'mistral'")):
        run = subprocess.run([sys.executable, "-m", "server.cli", *argv], cwd=ROOT, capture_output=True, text=True,
                             timeout=120)
        assert run.returncode == 2 and words in run.stderr, run.stderr


def test_generation_config_defaults_fill_what_a_request_leaves_unset(tmp_path, tiny_llama_dir):
    """--generation-config auto (vLLM's default): the model folder's generation_config.json sets the sampling fields
    a request leaves unset (top_k 1: greedy; max_new_tokens caps the default max_tokens), with
    --override-generation-config laid over it; what a request sets wins."""
    import shutil

    folder = tmp_path / "model"
    shutil.copytree(tiny_llama_dir, folder)
    (folder / "generation_config.json").write_text(json.dumps({"top_k": 1, "max_new_tokens": 9, "top_p": 1.0}))
    proc, base = start_server([str(folder), "--max-model-len", "128", "--kv-cache-space", "0.05", "--swap-space", "0",
                               "--override-generation-config", '{"max_new_tokens": 5}'], str(tmp_path / "server.log"))
    try:
        name = httpx.get(base + "/v1/models").json()["data"][0]["id"]
        messages = [{"role": "user", "content": "Say something."}]

        def chat(**fields):
            r = httpx.post(base + "/v1/chat/completions", timeout=60,
                           json={"model": name, "messages": messages, **fields})
            assert r.status_code == 200, r.text
            return r.json()

        unset = [chat(seed=seed) for seed in (1, 2)]  # top_k 1 from the file: the seeds cannot matter
        assert [u["usage"]["completion_tokens"] for u in unset] == [5, 5]
        assert unset[0]["choices"][0]["finish_reason"] == "length"
        assert unset[0]["choices"][0]["message"]["content"] == unset[1]["choices"][0]["message"]["content"]
        assert chat(max_tokens=7, ignore_eos=True)["usage"]["completion_tokens"] == 7  # the request's own wins
        assert chat(temperature=0, max_tokens=5)["choices"][0]["message"] == unset[0]["choices"][0]["message"]
    finally:
        proc.terminate()
        proc.wait(timeout=60)
    assert "generation_config.json" in (tmp_path / "server.log").read_text()  # the start-up line says so
