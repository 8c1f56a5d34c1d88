"""benchmarks/peers_report.py on serving.py-shaped reports: one run per point, and peers.sh's REPEAT pairs."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _report(folder: Path, name: str, label: str, tok_s: float, ttft: float, rss: float) -> None:
    run = {"concurrency": int(name.split("_c")[1].split("_")[0]), "output_throughput": tok_s,
           "ttft_ms": {"p50": ttft}, "itl_ms": {"p50": 10.0}}
    (folder / f"{name}.json").write_text(json.dumps({"label": label, "runs": [run], "server_peak_rss_mib": rss}))


def _rows(folder: Path, tmp_path: Path) -> dict:
    out = tmp_path / "peers.json"
    proc = subprocess.run([sys.executable, "benchmarks/peers_report.py", str(folder), "--output-json", str(out)],
                          cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return {(r["server"], r["concurrency"]): r for r in json.loads(out.read_text())["rows"]}


def test_one_run_per_point_gives_its_ratio(tmp_path):
    folder = tmp_path / "one"
    folder.mkdir()
    _report(folder, "peers_llamacpp_bfloat16_c8", "llama.cpp (bfloat16 GGUF)", 100.0, 150.0, 400.0)
    _report(folder, "peers_pagedserve_bfloat16_c8", "pagedserve (bfloat16)", 150.0, 120.0, 700.0)
    row = _rows(folder, tmp_path)[("pagedserve", 8)]
    assert row["ratio_vs_llamacpp"] == 1.5 and row["pair_ratios"] == [1.5] and row["repeats"] == 1


def test_repeats_give_the_median_of_each_pairs_ratio(tmp_path):
    folder = tmp_path / "repeats"
    folder.mkdir()
    # The VM slows down in pair 2: both servers' figures drop, the pair's ratio does not.
    for rep, (peer, ours, ttft, rss) in enumerate([(180, 360, 130, 990), (120, 150, 200, 1010), (170, 350, 140, 1000)],
                                                  start=1):
        _report(folder, f"peers_llamacpp_bfloat16_c32_r{rep}", "llama.cpp (bfloat16 GGUF)", peer, 150.0, 880.0)
        _report(folder, f"peers_pagedserve_bfloat16_c32_r{rep}", "pagedserve (bfloat16)", ours, ttft, rss)
    rows = _rows(folder, tmp_path)
    ours = rows[("pagedserve", 32)]
    assert ours["pair_ratios"] == [2.0, 1.25, 2.06]
    assert ours["ratio_vs_llamacpp"] == 2.0  # the median pair, not the ratio of the medians (350 / 170 = 2.06)
    assert ours["output_throughput"] == 350 and ours["ttft_p50_ms"] == 140 and ours["server_peak_rss_mib"] == 1010
    assert ours["repeats"] == 3 and rows[("llamacpp", 32)]["ratio_vs_llamacpp"] == 1.0
