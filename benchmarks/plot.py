"""Plot serving.py sweep reports: output tokens/s and latency against concurrency, one line per server.

    .venv/bin/python benchmarks/plot.py benchmarks/results/ours.json benchmarks/results/hf.json -o docs/serving.png
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path


def plot_reports(reports: list[dict], path: str) -> None:
    """Left: output tokens/s (log-log); right: TTFT and TPOT p50 (ms) against concurrency."""
    import matplotlib

    matplotlib.use("Agg")  # no display on servers
    import matplotlib.pyplot as plt

    fig, (ax_tp, ax_lat) = plt.subplots(1, 2, figsize=(9, 3.6), dpi=90)
    for i, report in enumerate(reports):
        runs = sorted((r for r in report["runs"] if r["concurrency"]), key=lambda r: r["concurrency"])
        if not runs:
            continue
        color = f"C{i}"
        xs = [r["concurrency"] for r in runs]
        ax_tp.plot(xs, [r["output_throughput"] for r in runs], "o-", color=color, label=report["label"])
        ax_lat.plot(xs, [r["ttft_ms"]["p50"] for r in runs], "o-", color=color, label=f"{report['label']} TTFT p50")
        ax_lat.plot(xs, [r["tpot_ms"]["p50"] for r in runs], "s--", color=color, label=f"{report['label']} TPOT p50")
    for ax in (ax_tp, ax_lat):
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("concurrency (requests in flight)")
        ax.grid(True, which="both", alpha=0.3)
    ax_tp.set_ylabel("output tokens/s")
    ax_tp.set_title("throughput")
    ax_lat.set_ylabel("ms")
    ax_lat.set_title("latency")
    ax_tp.legend(fontsize=8)
    ax_lat.legend(fontsize=7)
    fig.tight_layout()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path)
    plt.close(fig)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("reports", nargs="+", help="JSON files written by benchmarks/serving.py")
    parser.add_argument("-o", "--output", default="benchmarks/results/serving.png")
    args = parser.parse_args()
    plot_reports([json.loads(Path(p).read_text()) for p in args.reports], args.output)
    print(f"wrote {args.output}")


if __name__ == "__main__":
    main()
