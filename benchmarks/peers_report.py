"""The table and plot of benchmarks/peers.sh: pagedserve against llama.cpp's llama-server, per dtype and concurrency.

Reads the per-run reports peers.sh leaves in a folder (peers_<server>_<dtype>_c<C>[_r<N>].json, each a serving.py
report with the server's peak RSS added), prints a markdown table with pagedserve's output-throughput ratio over
llama.cpp in the same dtype, writes it all as one JSON and plots throughput and latency (benchmarks/plot.py).

With repeats (peers.sh's REPEAT=N: pair N is llama.cpp's run _rN and pagedserve's run _rN, back to back) a point's
ratio is the median of its pairs' ratios, each pair's ratio is listed beside it, and the throughput, TTFT and ITL
shown are the medians of the runs (peak RSS: the largest).

    .venv/bin/python benchmarks/peers_report.py benchmarks/results --output-json benchmarks/results/peers.json \\
        --plot benchmarks/results/peers.png
"""
from __future__ import annotations

import argparse
import json
import re
import statistics
from collections import defaultdict
from pathlib import Path

from plot import plot_reports

_NAME = re.compile(r"peers_(llamacpp|pagedserve)_(\w+?)_c(\d+)(?:_r(\d+))?\.json$")


def collect(folder: Path) -> dict:
    """{(server, dtype): {concurrency: {repeat: run}}} with each run's server_peak_rss_mib and label."""
    found: dict = defaultdict(lambda: defaultdict(dict))
    for path in sorted(folder.glob("peers_*_c*.json")):
        match = _NAME.search(path.name)
        if not match:
            continue
        report = json.loads(path.read_text())
        run = dict(report["runs"][-1], label=report["label"], server_peak_rss_mib=report.get("server_peak_rss_mib"))
        found[(match[1], match[2])][int(match[3])][int(match[4] or 1)] = run
    return found


def summarize(runs: dict, peers: dict) -> dict:
    """One point: the median of the runs' figures, and each pair's ratio over the llama.cpp run of its repeat."""
    ordered = [runs[r] for r in sorted(runs)]
    pairs = [runs[r]["output_throughput"] / peers[r]["output_throughput"] for r in sorted(runs) if r in peers]
    rss = [run["server_peak_rss_mib"] for run in ordered if run["server_peak_rss_mib"] is not None]
    return {
        "label": ordered[0]["label"],
        "repeats": len(ordered),
        "output_throughput": round(statistics.median(run["output_throughput"] for run in ordered), 1),
        "ratio_vs_llamacpp": round(statistics.median(pairs), 2) if pairs else None,
        "pair_ratios": [round(x, 2) for x in pairs],
        "ttft_p50_ms": round(statistics.median(run["ttft_ms"]["p50"] for run in ordered), 1),
        "itl_p50_ms": round(statistics.median(run["itl_ms"]["p50"] for run in ordered), 1),
        "server_peak_rss_mib": max(rss) if rss else None,
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("folder")
    p.add_argument("--output-json", default=None)
    p.add_argument("--plot", default=None)
    args = p.parse_args()
    found = collect(Path(args.folder))
    rows = []
    print("| server | C | output tok/s | vs llama.cpp | each pair | TTFT p50 ms | ITL p50 ms | peak RSS MiB |")
    print("|---|---|---|---|---|---|---|---|")
    for (server, dtype), points in sorted(found.items(), key=lambda kv: (kv[0][1], kv[0][0])):
        for c, runs in sorted(points.items()):
            row = {"server": server, "dtype": dtype, "concurrency": c,
                   **summarize(runs, found.get(("llamacpp", dtype), {}).get(c, {}))}
            rows.append(row)
            ratio = row["ratio_vs_llamacpp"]
            print(f"| {row['label']} | {c} | {row['output_throughput']} | {'' if ratio is None else f'{ratio:.2f}x'} | "
                  f"{' / '.join(f'{x:.2f}' for x in row['pair_ratios'])} | {row['ttft_p50_ms']} | "
                  f"{row['itl_p50_ms']} | {row['server_peak_rss_mib']} |")
    if args.output_json:
        Path(args.output_json).write_text(json.dumps({"rows": rows}, indent=2))
    if args.plot:  # the plot draws each server's first repeat
        reports = []
        for _, points in sorted(found.items()):
            runs = [repeats[min(repeats)] for _, repeats in sorted(points.items())]
            reports.append({"label": runs[0]["label"], "runs": runs})
        plot_reports(reports, args.plot)
        print(f"wrote {args.plot}")


if __name__ == "__main__":
    main()
