"""Offline throughput: pagedserve's LLM.generate against HF transformers' generate.

Same prompts (random token ids from a seed, nothing downloaded), same number of
new tokens (EOS ignored), same process. Prints output tokens/s and the ratios,
and writes JSON.

    .venv/bin/python benchmarks/throughput.py                   # default model, 64 x (128 in, 128 out)
    .venv/bin/python benchmarks/throughput.py --num-prompts 8 --output-len 16 --hf-batch-sizes 8
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import random
import sys
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run as a script from anywhere
from engine.platform.openmp import apply_serving_default  # noqa: E402  (no torch import)

apply_serving_default()  # as `pagedserve serve` does, before torch loads libgomp

import torch  # noqa: E402


def make_prompts(tokenizer, num: int, length: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    special = set(tokenizer.all_special_ids)
    vocab = [i for i in range(min(len(tokenizer), 40000)) if i not in special]
    return [[rng.choice(vocab) for _ in range(length)] for _ in range(num)]


def run_pagedserve(args, prompts) -> dict:
    from engine import LLM, SamplingParams

    llm = LLM(args.model or None, load_format=args.load_format, dtype=args.dtype, max_num_seqs=args.max_num_seqs,
              enable_prefix_caching=False)
    params = SamplingParams(temperature=0.0, max_tokens=args.output_len, ignore_eos=True)
    llm.generate(prompt_token_ids=prompts[:2], sampling_params=SamplingParams(temperature=0.0, max_tokens=2),
                 use_tqdm=False)  # warm-up: kernel build, allocator
    start = time.perf_counter()
    outputs = llm.generate(prompt_token_ids=prompts, sampling_params=params, use_tqdm=not args.quiet)
    elapsed = time.perf_counter() - start
    tokens = sum(len(c.token_ids) for o in outputs for c in o.outputs)
    assert tokens == len(prompts) * args.output_len, f"expected {len(prompts) * args.output_len} tokens, got {tokens}"
    return {"name": "pagedserve", "requests": len(prompts), "output_tokens": tokens, "seconds": elapsed,
            "output_tokens_per_s": tokens / elapsed}, llm


def run_hf(args, model, prompts, batch_size: int, dtype: str) -> dict:
    """HF generate over `prompts` in left-padded batches of `batch_size` (1 = one at a time)."""
    pad_id = 0
    tokens, start = 0, time.perf_counter()
    for i in range(0, len(prompts), batch_size):
        batch = prompts[i:i + batch_size]
        width = max(len(p) for p in batch)
        ids = torch.tensor([[pad_id] * (width - len(p)) + p for p in batch], device=model.device)
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in batch], device=model.device)
        with torch.inference_mode():
            out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=args.output_len,
                                 min_new_tokens=args.output_len, do_sample=False, pad_token_id=pad_id)
        tokens += (out.shape[1] - width) * len(batch)
    elapsed = time.perf_counter() - start
    name = "hf_sequential" if batch_size == 1 else f"hf_padded_batch_{batch_size}"
    return {"name": f"{name}_{dtype}", "hf_dtype": dtype, "batch_size": batch_size, "requests": len(prompts),
            "output_tokens": tokens, "seconds": elapsed,
            "output_tokens_per_s": tokens / elapsed}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="HF folder or .gguf; default: SmolLM2-135M-Instruct")
    parser.add_argument("--load-format", default="auto")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--num-prompts", type=int, default=64)
    parser.add_argument("--input-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--max-num-seqs", type=int, default=256)
    parser.add_argument("--hf-sequential-prompts", type=int, default=4,
                        help="prompts for the one-at-a-time HF baseline (it is slow; tokens/s is what counts)")
    parser.add_argument("--hf-batch-sizes", default="16,64", help="padded batch sizes for the HF batched baseline")
    parser.add_argument("--hf-dtypes", default="float32",
                        help="dtypes to run the HF baselines in, e.g. float32,bfloat16; the best of all is 'HF best'")
    parser.add_argument("--skip-hf", action="store_true")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--quiet", action="store_true")
    parser.add_argument("--output-json", default="benchmarks/results/throughput.json")
    args = parser.parse_args()

    from transformers import AutoModelForCausalLM, AutoTokenizer

    from engine.model_executor.loader import default_model_path

    model_dir = args.model or str(default_model_path())
    prompts = make_prompts(AutoTokenizer.from_pretrained(model_dir), args.num_prompts, args.input_len, args.seed)
    ours, llm = run_pagedserve(args, prompts)
    llm_device = llm.engine.device
    results = [ours]
    print(f"pagedserve: {ours['output_tokens_per_s']:.1f} output tokens/s "
          f"({ours['output_tokens']} tokens in {ours['seconds']:.1f} s)")

    if not args.skip_hf:
        del llm
        gc.collect()  # the KV cache goes back before HF's model arrives
        if llm_device.type == "cuda":
            torch.cuda.empty_cache()
        for dtype in [d for d in args.hf_dtypes.split(",") if d]:
            hf_model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=getattr(torch, dtype)).eval()
            hf_model.to(llm_device)  # HF runs where pagedserve ran
            if args.hf_sequential_prompts:
                results.append(run_hf(args, hf_model, prompts[:args.hf_sequential_prompts], 1, dtype))
            for bs in [int(b) for b in args.hf_batch_sizes.split(",") if b]:
                results.append(run_hf(args, hf_model, prompts[:bs] if bs < len(prompts) else prompts, bs, dtype))
            del hf_model
        for r in results[1:]:
            r["pagedserve_ratio"] = ours["output_tokens_per_s"] / r["output_tokens_per_s"]
            print(f"{r['name']}: {r['output_tokens_per_s']:.1f} output tokens/s -> pagedserve is "
                  f"{r['pagedserve_ratio']:.2f}x")
        batched = [r for r in results[1:] if r["batch_size"] > 1]
        if batched:
            best = max(batched, key=lambda r: r["output_tokens_per_s"])
            print(f"HF's best static batch: {best['name']} ({best['output_tokens_per_s']:.1f} tok/s) -> pagedserve "
                  f"({args.dtype}) is {best['pagedserve_ratio']:.2f}x")

    report = {"machine": {"cpu": platform.processor() or platform.machine(), "threads": torch.get_num_threads(),
                          "torch": torch.__version__, "device": str(llm_device),
                          "gpu": torch.cuda.get_device_name(llm_device) if llm_device.type == "cuda" else None},
              "config": vars(args), "results": results}
    Path(args.output_json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.output_json).write_text(json.dumps(report, indent=2))
    print(f"wrote {args.output_json}")


if __name__ == "__main__":
    main()
