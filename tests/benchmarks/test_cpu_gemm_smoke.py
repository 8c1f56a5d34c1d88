"""Smoke run of benchmarks/cpu_gemm.py (one layer, tiny row counts), so the GEMM-rate tool cannot rot."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="this torch has no oneDNN")
def test_cpu_gemm_reports_a_rate_for_every_library(tmp_path):
    out = tmp_path / "gemm.json"
    proc = subprocess.run(
        [sys.executable, "benchmarks/cpu_gemm.py", "--layers", "1", "--rows", "2", "16", "--min-time", "0",
         "--output-json", str(out)],
        cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    results = json.loads(out.read_text())["results"]
    libs = {r["lib"] for r in results}
    assert {"onednn", "f_linear"} <= libs
    assert {r["rows"] for r in results} == {2, 16}
    assert all(r["ms"] > 0 and r["gflops"] > 0 for r in results)
    assert "GFLOP/s" in proc.stdout
