"""Speculative decoding benchmark (issue 56): tokens/s with and without --speculative-config, in-process.

Two workloads, each run with and without speculation on two engines loaded side by side, alternating (A, B, B, A,
...: a request at a time at C=1, a round of 2 x C requests in a closed loop at C) so that a shared machine's load
falls on both alike:

- input-grounded (benchmarks/data/spec_decode_tasks.json: rewrite, fix, summarise a text or code of 300-800
  tokens, SmolLM2's chat template, greedy, --max-tokens 256): one request at a time (C=1);
- free prose: benchmarks/serving.py's random-token prompts (its make_requests, seed 0), closed loop at each
  --prose-concurrency (8 x C requests by default), the same prompts both ways.

Greedy outputs must be identical with and without speculation (checked on every request; a difference is
reported and fails the run).

    .venv/bin/python benchmarks/spec_decode.py --dtype bfloat16 --json benchmarks/results/spec_decode.json
    .venv/bin/python benchmarks/spec_decode.py --spec '{"model": "<SmolLM2 folder>", "num_speculative_tokens": 3,
        "draft_num_layers": 8}' --skip-prose
"""
from __future__ import annotations

import argparse
import json
import platform
import random
import sys
import time
from collections import deque
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

NGRAM = '{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4, "prompt_lookup_min": 2}'


def cpu_name() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return platform.processor()


def run(engine, prompts: list[list[int]], params, concurrency: int) -> tuple[float, int, list[list[int]]]:
    """Closed loop: `concurrency` requests in flight until every prompt is done; (seconds, output tokens, ids)."""
    pending = deque(enumerate(prompts))
    results: list[list[int]] = [[] for _ in prompts]
    in_flight = 0
    start = time.perf_counter()
    while pending or engine.has_unfinished_requests():
        while pending and in_flight < concurrency:
            i, ids = pending.popleft()
            engine.add_request(f"r{i}-{time.monotonic_ns()}", prompt_token_ids=ids, params=params)
            results[i] = None  # type: ignore[call-overload]
            in_flight += 1
        for out in engine.step():
            if out.finished:
                in_flight -= 1
                i = int(out.request_id[1:].split("-")[0])
                results[i] = out.outputs[0].token_ids
    seconds = time.perf_counter() - start
    return seconds, sum(len(r) for r in results), results


def compare(name: str, engines, prompts, params, concurrency: int, rows: list[dict], group_size: int) -> bool:
    """Both engines on the same prompts, alternating a group of group_size prompts at a time (which engine goes
    first alternating too, so a drift of the machine's load falls on both alike); appends a result row."""
    totals = {key: [0.0, 0] for key in ("plain", "spec")}
    same = True
    groups = [prompts[i:i + group_size] for i in range(0, len(prompts), group_size)]
    for g, group in enumerate(groups):
        outs = {}
        for key in ("plain", "spec") if g % 2 == 0 else ("spec", "plain"):
            seconds, tokens, outs[key] = run(engines[key].engine, group, params, concurrency)
            totals[key][0] += seconds
            totals[key][1] += tokens
        same &= outs["plain"] == outs["spec"]
    spec = engines["spec"].engine.get_stats()
    row = {"workload": name, "concurrency": concurrency, "requests": len(prompts),
           "plain_tok_s": totals["plain"][1] / totals["plain"][0], "spec_tok_s": totals["spec"][1] / totals["spec"][0],
           "output_tokens": totals["plain"][1], "identical": same,
           "drafts": spec.spec_decode_num_drafts, "draft_tokens": spec.spec_decode_num_draft_tokens,
           "accepted_tokens": spec.spec_decode_num_accepted_tokens}
    row["speedup"] = row["spec_tok_s"] / row["plain_tok_s"]
    rows.append(row)
    print(json.dumps(row), flush=True)
    return same


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="default: the default SmolLM2")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--spec", default=NGRAM, help="--speculative-config JSON")
    p.add_argument("--max-tokens", type=int, default=256)
    p.add_argument("--tasks", type=int, default=6, help="how many of the input-grounded tasks")
    p.add_argument("--prose-concurrency", default="1,8,32")
    p.add_argument("--prose-prompts", type=int, default=0, help="requests per concurrency (default: 8 x C, >= 8; in rounds of 2 x C, >= 4)")
    p.add_argument("--prose-output-len", type=int, default=128)
    p.add_argument("--skip-prose", action="store_true")
    p.add_argument("--skip-grounded", action="store_true")
    p.add_argument("--warmup-always", action="store_true", help="spec.always: verify every proposal (no cost model)")
    p.add_argument("--json", default=None)
    args = p.parse_args()

    from engine import LLM, SamplingParams
    from serving import make_requests

    common = dict(model=args.model, dtype=args.dtype, max_model_len=2048, kv_cache_space=0.5, swap_space=0.5)
    engines = {"plain": LLM(**common), "spec": LLM(speculative_config=args.spec, **common)}
    engines["spec"].engine.spec.always = args.warmup_always
    tok = engines["plain"].get_tokenizer()
    for llm in engines.values():  # first steps (kernel warm-up, the cost model's first points)
        llm.generate(["Hello there, how are"], SamplingParams(temperature=0, max_tokens=16), use_tqdm=False)
    rows: list[dict] = []
    ok = True
    greedy = SamplingParams(temperature=0, max_tokens=args.max_tokens, final_only=True)
    if not args.skip_grounded:
        tasks = json.loads((ROOT / "benchmarks/data/spec_decode_tasks.json").read_text())["tasks"][: args.tasks]
        texts = [tok.apply_chat_template([{"role": "user", "content": f"{t['instruction']}\n\n{t['text']}"}],
                                         add_generation_prompt=True, tokenize=False) for t in tasks]
        prompts = [tok(text, add_special_tokens=False).input_ids for text in texts]
        ok &= compare("input-grounded", engines, prompts, greedy, 1, rows, group_size=1)
    if not args.skip_prose:
        prose = SamplingParams(temperature=0, max_tokens=args.prose_output_len, ignore_eos=True, final_only=True)
        for c in [int(x) for x in args.prose_concurrency.split(",")]:
            n = args.prose_prompts or max(8, 8 * c)
            ns = argparse.Namespace(num_prompts=n, input_len=128, output_len=args.prose_output_len, input_len_range=0.0,
                                    output_len_range=0.0, prompt_kind="tokens", token_id_low=1000, token_id_high=10000)
            prompts = [list(prompt) for prompt, _, _ in make_requests(ns, random.Random(0))]
            ok &= compare("free-prose", engines, prompts, prose, c, rows, group_size=max(4, 2 * c))
    report = {"cpu": cpu_name(), "spec": json.loads(args.spec), "dtype": args.dtype, "rows": rows}
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(report, indent=1))
    if not ok:
        print("outputs differ with and without speculation", file=sys.stderr)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
