"""The table and plot of benchmarks/peers.sh: pagedserve against llama.cpp's llama-server, per dtype and concurrency.

Reads the per-run reports peers.sh leaves in a folder (peers_<server>_<dtype>_c<C>.json, each a serving.py report
with the server's peak RSS added), prints a markdown table with pagedserve's output-throughput ratio over
llama.cpp in the same dtype, writes it all as one JSON and plots throughput and latency (benchmarks/plot.py).

    .venv/bin/python benchmarks/peers_report.py benchmarks/results --output-json benchmarks/results/peers.json \
        --plot benchmarks/results/peers.png
"""
from __future__ import annotations

import argparse
import json
import re
from collections import defaultdict
from pathlib import Path

from plot import plot_reports

_NAME = re.compile(r"peers_(llamacpp|pagedserve)_(\w+?)_c(\d+)\.json$")


def collect(folder: Path) -> dict:
    """{(server, dtype): {concurrency: run}} with each run's server_peak_rss_mib and label."""
    found: dict = defaultdict(dict)
    for path in sorted(folder.glob("peers_*_c*.json")):
        match = _NAME.search(path.name)
        if not match:
            continue
        report = json.loads(path.read_text())
        run = dict(report["runs"][-1], label=report["label"], server_peak_rss_mib=report.get("server_peak_rss_mib"))
        found[(match[1], match[2])][int(match[3])] = run
    return found


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("folder")
    p.add_argument("--output-json", default=None)
    p.add_argument("--plot", default=None)
    args = p.parse_args()
    found = collect(Path(args.folder))
    rows = []
    print("| server | C | output tok/s | vs llama.cpp | TTFT p50 ms | ITL p50 ms | peak RSS MiB |")
    print("|---|---|---|---|---|---|---|")
    for (server, dtype), runs in sorted(found.items(), key=lambda kv: (kv[0][1], kv[0][0])):
        for c, run in sorted(runs.items()):
            peer = found.get(("llamacpp", dtype), {}).get(c)
            ratio = run["output_throughput"] / peer["output_throughput"] if peer else None
            row = {"server": server, "dtype": dtype, "concurrency": c, "label": run["label"],
                   "output_throughput": round(run["output_throughput"], 1),
                   "ratio_vs_llamacpp": None if ratio is None else round(ratio, 2),
                   "ttft_p50_ms": round(run["ttft_ms"]["p50"], 1), "itl_p50_ms": round(run["itl_ms"]["p50"], 1),
                   "server_peak_rss_mib": run["server_peak_rss_mib"]}
            rows.append(row)
            print(f"| {run['label']} | {c} | {row['output_throughput']} | "
                  f"{'' if ratio is None else f'{ratio:.2f}x'} | {row['ttft_p50_ms']} | {row['itl_p50_ms']} | "
                  f"{row['server_peak_rss_mib']} |")
    if args.output_json:
        Path(args.output_json).write_text(json.dumps({"rows": rows}, indent=2))
    if args.plot:
        reports = [{"label": next(iter(runs.values()))["label"], "runs": list(runs.values())}
                   for _, runs in sorted(found.items())]
        plot_reports(reports, args.plot)
        print(f"wrote {args.plot}")


if __name__ == "__main__":
    main()
