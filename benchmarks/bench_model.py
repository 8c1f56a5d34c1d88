"""A random-weight Llama at 1B shapes (or an A3B-like Qwen3-MoE), as an HF folder, for the memory-bound benchmarks.

    .venv/bin/python benchmarks/bench_model.py OUT_DIR     # ~2.4 GB of bfloat16 safetensors, SmolLM2's tokenizer
    .venv/bin/python benchmarks/bench_model.py --arch qwen3moe OUT_DIR   # ~8 GB bfloat16 (issue 55)

1.17B parameters: hidden 2048, 16 layers, 32 query and 8 key/value heads (head 64), MLP 8192, SmolLM2's vocabulary
(49152), an untied head; Llama 3.2 1B's layer shapes. Weights are N(0, 0.02) (norms one), drawn in-process from a
fixed seed: nothing is downloaded. One decode step at one stream reads 2.35 GB of bfloat16 weights (1.25 GB as
Q8_0), so the linears are bound by the memory's speed, unlike the 135M default model. benchmarks/peers.sh
(MODEL=llama1b) converts the folder to GGUF bf16 and Q8_0 for llama.cpp.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
from pathlib import Path

import torch

CONFIG = dict(
    architectures=["LlamaForCausalLM"], model_type="llama", hidden_size=2048, intermediate_size=8192,
    num_hidden_layers=16, num_attention_heads=32, num_key_value_heads=8, head_dim=64, vocab_size=49152,
    max_position_embeddings=8192, rms_norm_eps=1e-5, rope_theta=500000.0, tie_word_embeddings=False,
    hidden_act="silu", bos_token_id=1, eos_token_id=2, torch_dtype="bfloat16", attention_bias=False,
    mlp_bias=False,
)
LAYERS_PER_SHARD = 4
# Qwen3-30B-A3B's proportions at a size this 24 GiB / 2-vCPU machine holds (issue 55): hidden 2048, 24 layers, 32/4
# heads, experts of intermediate 768 with 8 active, but 32 experts (A3B: 128 in 48 layers). 4.05B parameters, ~4.3 GB
# as Q8_0; a token reads ~1.24B of them (attention, 8 experts a layer, the routers and the head).
MOE_CONFIG = dict(
    architectures=["Qwen3MoeForCausalLM"], model_type="qwen3_moe", hidden_size=2048, intermediate_size=6144,
    moe_intermediate_size=768, num_experts=32, num_experts_per_tok=8, norm_topk_prob=True, decoder_sparse_step=1,
    mlp_only_layers=[], num_hidden_layers=24, num_attention_heads=32, num_key_value_heads=4, head_dim=64,
    vocab_size=49152, max_position_embeddings=8192, rms_norm_eps=1e-6, rope_theta=1000000.0,
    tie_word_embeddings=False, hidden_act="silu", bos_token_id=1, eos_token_id=2, torch_dtype="bfloat16",
    attention_bias=False,
)


def _tensors(layers: range, gen: torch.Generator, c: dict) -> dict[str, torch.Tensor]:
    h, inter, q, kv = c["hidden_size"], c["intermediate_size"], c["num_attention_heads"] * c["head_dim"], \
        c["num_key_value_heads"] * c["head_dim"]
    out = {}
    for i in layers:
        p = f"model.layers.{i}."
        shapes = {"self_attn.q_proj": (q, h), "self_attn.k_proj": (kv, h), "self_attn.v_proj": (kv, h),
                  "self_attn.o_proj": (h, q), "mlp.gate_proj": (inter, h), "mlp.up_proj": (inter, h),
                  "mlp.down_proj": (h, inter)}
        if "num_experts" in c:  # every layer sparse: a router and the experts instead of the dense MLP
            m = c["moe_intermediate_size"]
            shapes = {k: v for k, v in shapes.items() if k.startswith("self_attn.")}
            shapes["mlp.gate"] = (c["num_experts"], h)
            for e in range(c["num_experts"]):
                shapes.update({f"mlp.experts.{e}.gate_proj": (m, h), f"mlp.experts.{e}.up_proj": (m, h),
                               f"mlp.experts.{e}.down_proj": (h, m)})
            out[p + "self_attn.q_norm.weight"] = torch.ones(c["head_dim"], dtype=torch.bfloat16)
            out[p + "self_attn.k_norm.weight"] = torch.ones(c["head_dim"], dtype=torch.bfloat16)
        for name, shape in shapes.items():
            out[f"{p}{name}.weight"] = (torch.randn(shape, generator=gen) * 0.02).bfloat16()
        out[p + "input_layernorm.weight"] = torch.ones(h, dtype=torch.bfloat16)
        out[p + "post_attention_layernorm.weight"] = torch.ones(h, dtype=torch.bfloat16)
    return out


def build(target: Path, tokenizer_from: Path, seed: int = 0, config: dict = CONFIG) -> Path:
    """Write the model into `target` (atomically: a finished folder or none)."""
    from safetensors.torch import save_file

    if (target / "config.json").exists():
        return target
    tmp = target.with_name(target.name + f".tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    gen = torch.Generator().manual_seed(seed)
    c, weight_map, files = config, {}, []
    shards = [range(i, min(i + LAYERS_PER_SHARD, c["num_hidden_layers"]))
              for i in range(0, c["num_hidden_layers"], LAYERS_PER_SHARD)]
    for n, layers in enumerate(shards):
        tensors = _tensors(layers, gen, c)
        if n == 0:
            tensors["model.embed_tokens.weight"] = (torch.randn(c["vocab_size"], c["hidden_size"], generator=gen)
                                                    * 0.02).bfloat16()
        if n == len(shards) - 1:
            tensors["model.norm.weight"] = torch.ones(c["hidden_size"], dtype=torch.bfloat16)
            tensors["lm_head.weight"] = (torch.randn(c["vocab_size"], c["hidden_size"], generator=gen)
                                         * 0.02).bfloat16()
        name = f"model-{n + 1:05d}-of-{len(shards):05d}.safetensors"
        save_file(tensors, str(tmp / name), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(tensors, name))
        files.append(name)
        del tensors
    total = sum((tmp / f).stat().st_size for f in files)
    (tmp / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=1))
    (tmp / "config.json").write_text(json.dumps(c, indent=2) + "\n")
    for f in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja"):
        if (tokenizer_from / f).exists():
            shutil.copy(tokenizer_from / f, tmp / f)
    os.rename(tmp, target)
    return target


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--arch", choices=("llama", "qwen3moe"), default="llama")
    args = parser.parse_args(argv)
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from engine.model_executor.loader import default_model_path

    print(build(args.out, default_model_path(), args.seed, MOE_CONFIG if args.arch == "qwen3moe" else CONFIG))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
