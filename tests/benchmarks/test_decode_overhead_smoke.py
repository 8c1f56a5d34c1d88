"""Smoke run of benchmarks/decode_overhead.py (the tiny shape, a few repetitions), so the tool cannot rot; the
script itself asserts that the compiled layer loop's logits equal the eager ones bit for bit."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from engine import ops

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.skipif(ops.backend() is not ops.OpsBackend.COMPILED_CPU, reason="needs the compiled CPU ops")
@pytest.mark.parametrize("dtype,batch", [("float32", 1), ("bfloat16", 3)])
def test_decode_overhead_times_eager_and_compiled(tmp_path, dtype, batch):
    out = tmp_path / "overhead.json"
    proc = subprocess.run(
        [sys.executable, "benchmarks/decode_overhead.py", "--shapes", "tiny", "--reps", "3", "--dtype", dtype,
         "--batch", str(batch), "--output-json", str(out)],
        cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    report = json.loads(out.read_text())
    assert report["dtype"] == dtype and report["batch"] == batch
    assert report["tiny"]["eager_ms"] > 0 and report["tiny"]["compiled_ms"] > 0
    assert "compiled layer loop" in proc.stdout
