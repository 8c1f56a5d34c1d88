"""scripts/gpu_check.py, the Python half of scripts/gpu_check.sh: a random-weight model built from the default
model's tokenizer and config alone, greedy parity with HF on it, and the report. The whole script runs on CPU
with GPU_CHECK_CPU=1 (minutes: not part of the suite)."""
from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
_spec = importlib.util.spec_from_file_location("gpu_check", ROOT / "scripts" / "gpu_check.py")
gpu_check = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(gpu_check)


@pytest.mark.slow
def test_a_random_model_from_tokenizer_and_config_alone_matches_hf(tmp_path, default_model_dir):
    like = tmp_path / "like"  # what the GPU machine gets: no weights
    like.mkdir()
    for name in ("config.json", "tokenizer.json", "tokenizer_config.json"):
        (like / name).write_bytes((default_model_dir / name).read_bytes())
    folder = tmp_path / "tiny"
    gpu_check.make_model(folder, like, "tiny", "cpu", "float32")
    assert (folder / "tokenizer.json").exists() and (folder / "parameters.txt").read_text().endswith("B")
    assert gpu_check.parity(folder, "cpu") == 0


def test_the_report_has_every_step_and_the_benchmarks(tmp_path):
    (tmp_path / "about.txt").write_text("NVIDIA H100 80GB HBM3, 79 GiB, 132 SMs; torch 2.11.0+cu130 (CUDA 13.0)\n")
    (tmp_path / "steps.tsv").write_text("build\tpass\t31\t\ncpu-kernel-suite\tFAIL\t140\t1 failed, 820 passed\n")
    (tmp_path / "serving.json").write_text(json.dumps({"runs": [
        {"concurrency": 256, "output_throughput": 4855.2, "tpot_ms": {"p50": 40.1}, "itl_ms": {"p50": 39.0},
         "ttft_ms": {"p50": 310.0}, "failed": 0}]}))
    (tmp_path / "profile-256.json").write_text(json.dumps(
        {"batch": 256, "step_ms": 8.72, "stages_ms": {"forward": 2.67, "sampling": 0.95}}))
    out = tmp_path / "report.md"
    gpu_check.report(tmp_path, out)
    text = out.read_text()
    assert text.startswith("## GPU check: NVIDIA H100")
    assert "| build | pass | 31 |" in text and "| cpu-kernel-suite | FAIL: 1 failed, 820 passed | 140 |" in text
    assert "| 256 | 4855.2 | 40.1 | 39.0 | 310.0 | 0 |" in text
    assert "decode step at batch 256: 8.72 ms (forward 2.67, sampling 0.95)" in text
