"""guidellm (the vLLM project's load tool) against the server: `guidellm run` with the openai_http backend."""
from __future__ import annotations

import json
import subprocess

import pytest
from compat_helpers import MODEL, client_env, venv_bin

REQUESTS, CONCURRENCY, PROMPT_TOKENS, OUTPUT_TOKENS = 8, 4, 32, 16
# guidellm spawns a worker process a stream (up to 10), each importing guidellm and its tokenizer stack: on 2 cores
# that start-up was most of the run. One worker process still keeps CONCURRENCY streams in flight (its asyncio loop
# holds them), so the server sees the same concurrent traffic.
WORKER_ENV = {"GUIDELLM__MAX_WORKER_PROCESSES": "1"}


@pytest.mark.parametrize("route", ["/v1/chat/completions", "/v1/completions"])
def test_guidellm_run_every_request_succeeds(compat_server, tmp_path, route):
    scenario = {"spec": {
        "backend": {"kind": "openai_http", "target": compat_server.base_url, "model": MODEL, "request_format": route},
        "profile": {"kind": "concurrent", "streams": CONCURRENCY},
        "tokenizer": {"kind": "huggingface_auto", "model": str(compat_server.model_dir)},
        "data": [{"kind": "synthetic_text", "prompt_tokens": PROMPT_TOKENS, "output_tokens": OUTPUT_TOKENS}],
        "constraints": [{"kind": "max_requests", "count": REQUESTS}],
    }}
    (tmp_path / "scenario.json").write_text(json.dumps(scenario))
    report = tmp_path / "report.json"
    run = subprocess.run([venv_bin("guidellm"), "run", "--scenario", str(tmp_path / "scenario.json"),
                          "--output", f"kind=json,path={report}", "--disable-console-interactive"],
                         cwd=tmp_path, env={**client_env(), **WORKER_ENV}, capture_output=True, text=True, timeout=150)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    bench = json.loads(report.read_text())["benchmarks"][0]
    assert bench["metrics"]["request_totals"] == {"successful": REQUESTS, "errored": 0, "incomplete": 0,
                                                  "total": REQUESTS}
    assert bench["metrics"]["request_concurrency"]["successful"]["max"] == CONCURRENCY  # (one worker process)
    done = bench["requests"]["successful"]
    prefix = "chatcmpl-" if route == "/v1/chat/completions" else "cmpl-"
    assert all(r["response_id"].startswith(prefix) for r in done)
    # guidellm asks for ignore_eos and continuous usage stats (vLLM's extensions): the count is exact.
    assert [r["output_tokens"] for r in done] == [OUTPUT_TOKENS] * REQUESTS
    assert all(r["prompt_tokens"] > 0 and r["time_to_first_token_ms"] > 0 and r["inter_token_latency_ms"] > 0
               for r in done)
