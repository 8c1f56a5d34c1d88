"""Smoke run of benchmarks/serving.py against a real `pagedserve serve`, so the benchmark tool cannot rot."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
STAT_FIELDS = ("ttft_ms", "tpot_ms", "itl_ms", "e2e_ms")
sys.path.insert(0, str(ROOT / "scripts"))
from soak import start_server  # noqa: E402  (the one CLI-server start the tests share)


@pytest.fixture(scope="module")
def server_url():
    """`python -m server.cli serve` with the default model and a small cache, on a free port."""
    proc, url = start_server(["--max-model-len", "256", "--kv-cache-space", "0.05", "--swap-space", "0.05",
                              "--disable-log-stats", "--log-level", "warning"], timeout_s=180)
    try:
        yield url
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            proc.kill()


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
