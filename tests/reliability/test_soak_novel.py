"""scripts/soak_novel.py, short: requests that each bring a new schema and new unknown field names are served, and
the ~0.7 MiB body of 40 960 unknown keys is answered within 3 s while /health answers within 1 s. (The RSS verdict
needs the full rounds: `python scripts/soak_novel.py`, docs/reliability.md.)"""
from __future__ import annotations

import json
import os
import subprocess
import sys

from reliability_harness import ROOT, record


def test_novel_input_soak_short(tiny_llama_dir, tmp_path):
    report_path = tmp_path / "soak_novel.json"
    cmd = [sys.executable, str(ROOT / "scripts" / "soak_novel.py"), "--model", str(tiny_llama_dir),
           "--requests", "16", "--schemas", "unbounded", "--trim-wait-s", "0", "--max-rss-growth-mib", "64", "--json", str(report_path)]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1",
           "SOAK_SERVER_LOG": str(tmp_path / "server.log")}
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert report_path.exists(), proc.stdout[-3000:] + proc.stderr[-3000:]
    report = json.loads(report_path.read_text())
    record("soak_novel_short", report)
    assert proc.returncode == 0 and report["problems"] == [], report
    assert report["statuses"] == {"200": 32}, report["statuses"]
    big = report["big_body"]
    assert big["status"] == 400 and big["seconds"] < 3.0 and big["health_max_s"] < 1.0, big
