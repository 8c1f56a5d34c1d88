"""Smoke run of benchmarks/profile_step.py on the tiny random Llama (a few steps), so the tool cannot rot: the
decode stage table, and --compare-eager for decode steps and for prefills (each mode timed, in the JSON)."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from engine import ops

ROOT = Path(__file__).resolve().parents[2]


def _profile(tmp_path, model_dir, *args: str) -> tuple[str, dict]:
    out = tmp_path / "profile.json"
    proc = subprocess.run(
        [sys.executable, "benchmarks/profile_step.py", "--model", str(model_dir), "--input-len", "24", *args,
         "--output-json", str(out)],
        cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    return proc.stdout, json.loads(out.read_text())


def test_profile_step_times_each_stage_of_a_decode_step(tmp_path, tiny_llama_dir):
    stdout, report = _profile(tmp_path, tiny_llama_dir, "--batch", "3", "--steps", "8")
    assert "decode step at batch 3" in stdout and "forward" in stdout
    assert report["batch"] == 3 and report["step_ms"] > 0


@pytest.mark.skipif(ops.backend() is not ops.OpsBackend.COMPILED_CPU, reason="needs the compiled CPU ops")
def test_profile_step_compares_compiled_and_eager_prefills(tmp_path, tiny_llama_dir):
    stdout, report = _profile(tmp_path, tiny_llama_dir, "--prefill", "--compare-eager", "--steps", "4")
    assert "tokens compiled" in stdout and "tokens eager" in stdout
    assert report["mode"] == "prefill"
    for mode in ("compiled", "eager"):
        assert len(report[mode]["forward_ms"]) == 2 and min(report[mode]["step_ms"]) > 0


@pytest.mark.skipif(ops.backend() is not ops.OpsBackend.COMPILED_CPU, reason="needs the compiled CPU ops")
def test_torch_profile_lists_the_compiled_kernels(tmp_path, tiny_llama_dir):
    # The kernels are pybind calls torch.profiler cannot see by itself: the table once held only the aten glue.
    stdout, _ = _profile(tmp_path, tiny_llama_dir, "--batch", "2", "--steps", "4", "--torch-profile",
                         "--enforce-eager")
    table = {line.split()[0]: line.split() for line in stdout.splitlines() if line.strip().startswith("ops.")}
    assert {"ops.small_gemm", "ops.paged_attention", "ops.rms_norm"} <= set(table), stdout
    layers = 2  # tiny_llama's
    assert int(table["ops.paged_attention"][-1]) == 8 * layers  # all 8 profiled steps still decode
