"""scripts/gpu_check.sh's Python steps: random-weight models built on the machine, greedy parity with HF on them,
and the markdown report. Nothing here reads the default model's weights: only its tokenizer and config.

    python scripts/gpu_check.py model OUT --like TOKENIZER_DIR --size smol|1b|tiny --device cuda
    python scripts/gpu_check.py parity MODEL_DIR --device cuda
    python scripts/gpu_check.py report WORK OUT
"""
from __future__ import annotations

import argparse
import json
import shutil
import sys
from pathlib import Path

# The checkout's engine, where nothing installed it (the GPU machine runs this from a bare checkout).
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

# Random-weight Llamas: the default model's own shapes (its config.json), a 1B-class one (the served and offline
# benchmarks: hidden 2048, 16 layers, 32/8 heads of 64, MLP 8192, the default vocabulary), tiny ones (CPU runs).
SIZES = {
    "1b": dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
               num_key_value_heads=8, head_dim=64),
    "tiny": dict(hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, head_dim=64),
}
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "special_tokens_map.json",
                   "generation_config.json")
PROMPTS = ["The capital of France is", "def fibonacci(n):", "Hi",
           "Once upon a time, in a land far, far away, there lived"]


def make_model(out: Path, like: Path, size: str, device: str, dtype: str) -> None:
    """A Llama with seeded random weights saved as an HF folder, with `like`'s tokenizer files; size "smol" takes
    `like`'s config.json (the default model's shapes)."""
    import torch
    from transformers import AutoConfig, LlamaConfig, LlamaForCausalLM

    if size == "smol":
        config = AutoConfig.from_pretrained(str(like), local_files_only=True)
    else:
        config = LlamaConfig(vocab_size=49152, max_position_embeddings=4096, bos_token_id=1, eos_token_id=2,
                             pad_token_id=2, tie_word_embeddings=False, **SIZES[size])
    torch.manual_seed(0)
    with torch.device(device):
        model = LlamaForCausalLM(config).to(getattr(torch, dtype))
    model.save_pretrained(out)
    for name in TOKENIZER_FILES:
        if (like / name).exists():
            shutil.copy(like / name, out / name)
    params = f"{sum(p.numel() for p in model.parameters()) / 1e9:.3f}B"
    (out / "parameters.txt").write_text(params)
    print(f"{params} parameters ({size}, {dtype}) in {out}")


def parity(folder: Path, device: str, max_tokens: int = 16) -> int:
    """pagedserve's greedy tokens on `device` against HF's float32 logits, teacher-forced on pagedserve's tokens:
    each token must be HF's argmax, or tie with it within float32 noise (random weights give flat logits, where
    either of two near-equal tokens is a correct greedy pick). 0 when every token passes."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from engine import LLM
    from engine.sampling_params import SamplingParams

    tok = AutoTokenizer.from_pretrained(str(folder))
    prompts = [tok(p).input_ids for p in PROMPTS]
    llm = LLM(model=str(folder), device=device, dtype="float32", max_model_len=128, num_gpu_blocks_override=256)
    outputs = llm.generate(prompt_token_ids=prompts, use_tqdm=False,
                           sampling_params=SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True))
    hf = AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32).to(device).eval()
    bad, worst = 0, 0.0
    for prompt, out in zip(prompts, outputs):
        ids = prompt + list(out.outputs[0].token_ids)
        with torch.no_grad():
            logits = hf(torch.tensor([ids], device=device)).logits[0, len(prompt) - 1:-1].float()
        top = logits.max(-1).values
        picked = logits.gather(-1, torch.tensor(out.outputs[0].token_ids, device=device)[:, None])[:, 0]
        gap = top - picked  # 0 where pagedserve picked HF's argmax
        allowed = 1e-4 + 1e-4 * top.abs()
        bad += int((gap > allowed).sum())
        worst = max(worst, float(gap.max()))
    total = sum(len(o.outputs[0].token_ids) for o in outputs)
    print(f"{total - bad} of {total} greedy tokens are HF's argmax (or tie with it); largest logit gap {worst:.2e}")
    return 1 if bad else 0


def report(work: Path, out: Path) -> None:
    """The markdown report from the steps' files in `work` (steps.tsv, about.txt and the benchmarks' JSON)."""
    lines = [f"## GPU check: {(work / 'about.txt').read_text().strip()}", ""]
    lines += ["| step | result | seconds |", "| --- | --- | --- |"]
    for row in (work / "steps.tsv").read_text().splitlines():
        name, status, seconds, summary = (row.split("\t") + [""] * 4)[:4]
        lines.append(f"| {name} | {status}{': ' + summary if summary else ''} | {seconds} |")
    lines.append("")
    lines += _kernels(work / "kernels.json") + _throughput(work) + _profile(work)
    for path in sorted(work.glob("serving*.json")):
        lines += _serving(path)
    out.write_text("\n".join(lines) + "\n")


def _load(path: Path):
    return json.loads(path.read_text()) if path.exists() else None


def _kernels(path: Path) -> list[str]:
    data = _load(path)
    if data is None:
        return []
    m = data["meta"]
    lines = [f"### Paged decode attention vs SDPA over a contiguous cache ({m['device']}, backend {m['backend']}, "
             f"{m['dtype']}, {m['num_heads']}/{m['num_kv_heads']} heads x {m['head_size']}, block {m['block_size']})",
             "", "| batch | context | paged ms | SDPA ms | paged/SDPA | KV GB/s |", "| --- | --- | --- | --- | --- | --- |"]
    lines += [f"| {r['batch']} | {r['context']} | {r['ms']:.4f} | {r['sdpa_ms']:.4f} | {r['ratio']:.2f} | {r['gb_s']:.0f} |"
              for r in data["results"] if r["op"] == "paged"]
    return lines + [""]


def _size(work: Path) -> str:
    params = work / "llama-1b" / "parameters.txt"
    return params.read_text() if params.exists() else "?"


def _throughput(work: Path) -> list[str]:
    data = _load(work / "throughput.json")
    if data is None:
        return []
    c = data["config"]
    lines = [f"### Offline: random-weight Llama of {_size(work)} parameters, {c['num_prompts']} prompts x "
             f"({c['input_len']} in, {c['output_len']} out), bfloat16", "",
             "| run | output tokens/s | pagedserve is |", "| --- | --- | --- |"]
    for r in data["results"]:
        ratio = f"{r['pagedserve_ratio']:.2f}x" if "pagedserve_ratio" in r else ""
        lines.append(f"| {r['name']} | {r['output_tokens_per_s']:.0f} | {ratio} |")
    return lines + [""]


def _serving(path: Path) -> list[str]:
    data = _load(path)
    if data is None:
        return []
    runs, config = data.get("runs", []), data.get("config", {})
    flags = " --engine-core-process" if "core" in path.name else ""
    lines = [f"### Served: `pagedserve serve{flags}` on the same model, benchmarks/serving.py "
             f"({config.get('input_len', '?')} in, {config.get('output_len', '?')} out)", "",
             "| concurrency | output tokens/s | TPOT p50 ms | ITL p50 ms | TTFT p50 ms | failed |",
             "| --- | --- | --- | --- | --- | --- |"]
    for r in runs:
        lines.append(f"| {r.get('concurrency', '?')} | {_num(r, 'output_throughput')} | {_num(r, 'tpot_ms', 'p50')} "
                     f"| {_num(r, 'itl_ms', 'p50')} | {_num(r, 'ttft_ms', 'p50')} | {r.get('failed', '?')} |")
    return lines + [""]


def _num(record: dict, key: str, sub: str = "") -> str:
    value = record.get(key)
    if isinstance(value, dict):
        value = value.get(sub)
    return "?" if value is None else f"{value:.1f}" if isinstance(value, float) else str(value)


def _profile(work: Path) -> list[str]:
    lines = []
    for path in sorted(work.glob("profile-*.json")):
        data = json.loads(path.read_text())
        parts = ", ".join(f"{k} {v:.2f}" for k, v in data.get("stages_ms", {}).items())
        weights = " (fp8 weights)" if "fp8" in path.name else " (--enforce-eager)" if "eager" in path.name else ""
        lines.append(f"- decode step at batch {data.get('batch', '?')}{weights}: "
                     f"{data.get('step_ms', float('nan')):.2f} ms"
                     f"{' (' + parts + ')' if parts else ''}")
    return (["### Decode step (benchmarks/profile_step.py, same model)", ""] + lines + [""]) if lines else []


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="cmd", required=True)
    m = sub.add_parser("model")
    m.add_argument("out", type=Path)
    m.add_argument("--like", type=Path, required=True, help="a folder with the tokenizer files (and config.json)")
    m.add_argument("--size", choices=["smol", *SIZES], required=True)
    m.add_argument("--device", default="cuda")
    m.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    q = sub.add_parser("parity")
    q.add_argument("folder", type=Path)
    q.add_argument("--device", default="cuda")
    r = sub.add_parser("report")
    r.add_argument("work", type=Path)
    r.add_argument("out", type=Path)
    args = p.parse_args()
    if args.cmd == "model":
        make_model(args.out, args.like, args.size, args.device, args.dtype)
    elif args.cmd == "parity":
        return parity(args.folder, args.device)
    else:
        report(args.work, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
