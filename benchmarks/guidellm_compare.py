"""guidellm against benchmarks/serving.py at the same load: do the two tools agree on TTFT and ITL?

Runs guidellm (the vLLM project's load tool, dev extra) with the openai_http backend on /v1/completions,
then benchmarks/serving.py with the same concurrency, request count, prompt and output lengths, against
a server already running. Prints the mean and median of both tools' figures and their ratio, and writes
JSON. Nothing is downloaded: guidellm's synthetic prompts are drawn with the served model's tokenizer.

    .venv/bin/pagedserve serve &
    .venv/bin/python benchmarks/guidellm_compare.py --concurrency 4 --num-prompts 32
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
OFFLINE_ENV = {"HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "DO_NOT_TRACK": "1"}


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--base-url", default="http://127.0.0.1:8000")
    p.add_argument("--model", default=None, help="served model name (default: the first of GET /v1/models)")
    p.add_argument("--tokenizer", default=None, help="tokenizer folder for guidellm (default: the default model)")
    p.add_argument("--concurrency", type=int, default=4)
    p.add_argument("--num-prompts", type=int, default=32)
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--output-json", default="benchmarks/results/guidellm_compare.json")
    return p.parse_args(argv)


def run_guidellm(args, model: str, tokenizer: str, work: Path) -> dict[str, float]:
    """TTFT and ITL (ms) of every successful request in guidellm's JSON report, as mean and median."""
    scenario = {"spec": {
        "backend": {"kind": "openai_http", "target": args.base_url, "model": model,
                    "request_format": "/v1/completions"},
        "profile": {"kind": "concurrent", "streams": args.concurrency},
        "tokenizer": {"kind": "huggingface_auto", "model": tokenizer},
        "data": [{"kind": "synthetic_text", "prompt_tokens": args.input_len, "output_tokens": args.output_len}],
        "constraints": [{"kind": "max_requests", "count": args.num_prompts}],
    }}
    (work / "scenario.json").write_text(json.dumps(scenario))
    report = work / "guidellm.json"
    guidellm = Path(sys.executable).parent / "guidellm"
    subprocess.run([str(guidellm), "run", "--scenario", str(work / "scenario.json"),
                    "--output", f"kind=json,path={report}", "--disable-console-interactive"],
                   cwd=work, env={**os.environ, **OFFLINE_ENV}, check=True)
    bench = json.loads(report.read_text())["benchmarks"][0]
    done = bench["requests"]["successful"]
    if len(done) != args.num_prompts:
        raise SystemExit(f"guidellm: {len(done)} of {args.num_prompts} requests succeeded")
    ttft = [r["time_to_first_token_ms"] for r in done]
    itl = [r["inter_token_latency_ms"] for r in done]
    return {"ttft_mean_ms": statistics.mean(ttft), "ttft_p50_ms": statistics.median(ttft),
            "itl_mean_ms": statistics.mean(itl), "itl_p50_ms": statistics.median(itl)}


def run_serving(args, model: str, work: Path) -> dict[str, float]:
    """The same load through benchmarks/serving.py; ITL per request (mean gap), as guidellm counts it."""
    out = work / "serving.json"
    subprocess.run([sys.executable, str(ROOT / "benchmarks" / "serving.py"), "--base-url", args.base_url,
                    "--model", model, "--concurrency", str(args.concurrency), "--num-prompts", str(args.num_prompts),
                    "--input-len", str(args.input_len), "--output-len", str(args.output_len),
                    "--prompt-kind", "text", "--output-json", str(out), "--strict"], check=True)
    run = json.loads(out.read_text())["runs"][0]
    return {"ttft_mean_ms": run["ttft_ms"]["mean"], "ttft_p50_ms": run["ttft_ms"]["p50"],
            "itl_mean_ms": run["tpot_ms"]["mean"], "itl_p50_ms": run["tpot_ms"]["p50"]}


def main(argv=None) -> int:
    args = parse_args(argv)
    args.base_url = args.base_url.rstrip("/")
    sys.path.insert(0, str(ROOT / "benchmarks"))
    sys.path.insert(0, str(ROOT))
    from serving import server_model

    model = args.model or server_model(args.base_url, 60.0)
    if args.tokenizer is None:
        from engine.model_executor.loader import default_model_path

        args.tokenizer = str(default_model_path())
    with tempfile.TemporaryDirectory() as tmp:
        # A cold server's first steps build its oneDNN primitives: without a warm-up the tool that runs
        # first reads ~30 % slower (seen on the Xeon of 2026-11-24). serving.py warms itself up as well.
        run_serving(argparse.Namespace(**{**vars(args), "num_prompts": args.concurrency}), model, Path(tmp))
        guide = run_guidellm(args, model, args.tokenizer, Path(tmp))
        ours = run_serving(args, model, Path(tmp))
    ratios = {k: guide[k] / ours[k] - 1.0 for k in guide}
    print(f"{'metric':<14}{'guidellm':>10}{'serving.py':>12}{'difference':>12}")
    for key in guide:
        print(f"{key:<14}{guide[key]:>10.1f}{ours[key]:>12.1f}{ratios[key]:>+11.1%}")
    report = {"machine": {"platform": platform.platform(), "processor": platform.processor()},
              "config": vars(args), "guidellm": guide, "serving_py": ours, "relative_difference": ratios}
    path = Path(args.output_json)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(report, indent=2))
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
