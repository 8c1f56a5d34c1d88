"""What quantized weights cost in quality (issue 42): pagedserve's int8 (or fp8) model against its bfloat16 model,
measured the way llama.cpp's llama-perplexity --kl-divergence measures its Q8_0 against its BF16, on the same text
and model.

    .venv/bin/python benchmarks/quant_quality.py [--quantization fp8] [--llama-cpp BUILD_DIR --bf16 X.gguf --q8 Y.gguf]
    .venv/bin/python benchmarks/quant_quality.py --model X-Q4_K_M.gguf --quantization native --dtype float32 \
        [--llama-cpp BUILD_DIR --bf16 X-Q4_K_M-as-F32.gguf --q8 X-Q4_K_M.gguf]

--quantization native (issue 53): a quantized GGUF served as its blocks, scored against the same file dequantized
to float32 (`--quantization none`); llama.cpp's side then compares the file with its own dequantization (llama-quantize
--allow-requantize X.gguf X-as-F32.gguf F32) the same way, so both are measured against the same float weights.
Also the greedy tokens of --greedy-tokens per prompt of GREEDY_PROMPTS, native against dequantized (issue 53 asks
>= 95 % equal).

Per scored token t (teacher-forced, chunks of --ctx tokens, the second half of each chunk scored, as
llama-perplexity does): Δlogp = logp_quant(t) - logp_base(t), Δp the same in probability, and whether both put the
same token first. Reported: mean |Δlogp|, mean Δlogp (= -ln(PPL ratio)), RMS Δp, same top-1 %. pagedserve's side
runs in-process (LLM.generate's prompt_logprobs); llama.cpp's (when --llama-cpp is given) is llama-perplexity's
own summary over the same text (it prints ln(PPL(Q)/PPL(base)), RMS Δp and same top p; |Δlogp| is not among them).
Also pagedserve's per-token log-likelihood changes on tests/compat/test_lm_eval.py's multiple-choice pairs.
"""
from __future__ import annotations

import argparse
import json
import math
import re
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
GREEDY_PROMPTS = ["The capital of France is", "Once upon a time, there", "def fibonacci(n):", "The three primary colors are",
                  "In 1969, astronauts", "To make bread, you need", "Photosynthesis is the process", "1, 2, 3, 4,"]
MC_PAIRS = [("The capital of France is", " Paris"), ("The capital of France is", " Berlin"),
            ("Two plus two equals", " four"), ("Two plus two equals", " five apples")]


def _chunks(ids: list[int], ctx: int, limit: int) -> list[list[int]]:
    return [ids[i:i + ctx] for i in range(0, len(ids) - ctx + 1, ctx)][:limit]


def _score(llm, prompts: list[list[int]]) -> list[list[dict]]:
    from engine import SamplingParams

    outs = llm.generate(prompt_token_ids=prompts, sampling_params=SamplingParams(
        temperature=0, max_tokens=1, prompt_logprobs=1), use_tqdm=False)
    return [o.prompt_logprobs for o in outs]


def _stats(base: list[list[dict]], quant: list[list[dict]], prompts: list[list[int]], first: int) -> dict:
    dlogp, dp, same = [], [], []
    for b, q, ids in zip(base, quant, prompts):
        for i in range(max(first, 1), len(ids)):
            t = ids[i]
            dlogp.append(q[i][t] - b[i][t])
            dp.append(math.exp(q[i][t]) - math.exp(b[i][t]))
            same.append(max(b[i], key=b[i].get) == max(q[i], key=q[i].get))
    n = len(dlogp)
    return {"tokens": n, "mean_abs_dlogp": sum(map(abs, dlogp)) / n, "mean_dlogp": sum(dlogp) / n,
            "ln_ppl_ratio": -sum(dlogp) / n, "rms_dp_pct": 100 * math.sqrt(sum(x * x for x in dp) / n),
            "same_top1_pct": 100 * sum(same) / n, "max_abs_dlogp": max(map(abs, dlogp))}


def _greedy(llm, tokens: int) -> list[list[int]]:
    from engine import SamplingParams

    outs = llm.generate(GREEDY_PROMPTS, SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=True),
                        use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outs]


def pagedserve_side(model: str | None, text: str, ctx: int, chunks: int, dtype: str, quantization: str,
                    greedy_tokens: int = 32) -> dict:
    from engine import LLM

    results, greedy = {}, {}
    quant_flag = None if quantization == "native" else quantization  # native: the GGUF's own blocks
    for name, quant in (("base", "none"), ("quant", quant_flag)):
        llm = LLM(model, dtype=dtype, quantization=quant, max_model_len=max(ctx, 256), max_logprobs=20)
        tok = llm.get_tokenizer()
        ids = tok.encode(text, add_special_tokens=False)
        prompts = _chunks(ids, ctx, chunks)
        mc = [tok.encode(c + x, add_special_tokens=False) for c, x in MC_PAIRS]
        results[name] = (_score(llm, prompts), _score(llm, mc))
        greedy[name] = _greedy(llm, greedy_tokens)
        del llm
    mc_first = [len(tok.encode(c, add_special_tokens=False)) for c, _ in MC_PAIRS]
    mc_diffs = []
    for (b, q, ids, first) in zip(results["base"][1], results["quant"][1], mc, mc_first):
        ll_b = sum(b[i][ids[i]] for i in range(first, len(ids)))
        ll_q = sum(q[i][ids[i]] for i in range(first, len(ids)))
        mc_diffs.append({"per_token": [q[i][ids[i]] - b[i][ids[i]] for i in range(first, len(ids))],
                         "loglikelihood_base": ll_b, "loglikelihood_quant": ll_q})
    same = sum(a == b for p, q in zip(greedy["quant"], greedy["base"]) for a, b in zip(p, q))
    return {"dtype": dtype, "quantization": quantization,
            "text": _stats(results["base"][0], results["quant"][0], prompts, ctx // 2),
            "greedy_same_pct": 100 * same / sum(len(p) for p in greedy["base"]),
            "lm_eval_mc_pairs": mc_diffs}


def llama_cpp_side(build: Path, bf16: Path, q8: Path, text_file: Path, ctx: int, chunks: int) -> dict:
    tool = build / "bin" / "llama-perplexity"
    with tempfile.TemporaryDirectory() as tmp:
        base = Path(tmp) / "base.kld"
        # -nr (no weight repacking): on a VM whose CPU reports AMX without enabling its tiles, ggml's repacked
        # (AMX) Q8_0 path died of SIGILL; without it Q8_0 runs ggml's AVX-512 (VNNI) dot products.
        common = ["-f", str(text_file), "-c", str(ctx), "--chunks", str(chunks), "-t", "2", "-b", str(ctx), "-nr"]
        subprocess.run([str(tool), "-m", str(bf16), "--kl-divergence-base", str(base), *common], check=True,
                       capture_output=True, text=True)
        run = subprocess.run([str(tool), "-m", str(q8), "--kl-divergence-base", str(base), "--kl-divergence",
                              *common], check=True, capture_output=True, text=True)
    log = run.stdout + run.stderr
    found = {}
    for key, pattern in (("ln_ppl_ratio", r"Mean\s+ln\(PPL\(Q\)/PPL\(base\)\)\s*:\s*([-\d.e]+)"),
                         ("mean_kld", r"Mean\s+KLD:\s*([-\d.e]+)"), ("rms_dp_pct", r"RMS Δp\s*:\s*([-\d.e]+)"),
                         ("same_top1_pct", r"Same top p:\s*([-\d.e]+)")):
        m = re.search(pattern, log)
        found[key] = float(m.group(1)) if m else None
    found["log_tail"] = log[-2500:]
    return found


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="HF folder or GGUF file (default: the default SmolLM2)")
    parser.add_argument("--text", type=Path, default=ROOT / "README.md")
    parser.add_argument("--ctx", type=int, default=128)
    parser.add_argument("--chunks", type=int, default=16)
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--quantization", default="int8",
                        choices=["int8", "fp8", "native", "q4_k", "q4_0", "q4_1", "q5_0", "q5_1", "q5_k", "q6_k"],
                        help="the weights scored against --dtype's (fp8 on a CPU: torch's slow reference matmul; "
                             "native: a quantized GGUF's own blocks against the file dequantized)")
    parser.add_argument("--greedy-tokens", type=int, default=32)
    parser.add_argument("--llama-cpp", type=Path, default=None, help="llama.cpp build folder (bin/llama-perplexity)")
    parser.add_argument("--bf16", type=Path, default=None)
    parser.add_argument("--q8", type=Path, default=None)
    parser.add_argument("--output-json", type=Path, default=None)
    args = parser.parse_args(argv)
    sys.path.insert(0, str(ROOT))
    text = args.text.read_text()
    report = {"pagedserve": pagedserve_side(args.model, text, args.ctx, args.chunks, args.dtype,
                                                args.quantization, args.greedy_tokens)}
    if args.llama_cpp:
        report["llama.cpp"] = llama_cpp_side(args.llama_cpp, args.bf16, args.q8, args.text, args.ctx, args.chunks)
    out = json.dumps(report, indent=2)
    print(out)
    if args.output_json:
        args.output_json.write_text(out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
