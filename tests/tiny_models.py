"""Tiny random models for the tests: configs, HF folders with the default tokenizer."""
from __future__ import annotations

import functools
import shutil
from pathlib import Path

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "special_tokens_map.json")


def copy_tokenizer(src: Path, dst: Path) -> None:
    """Put the default model's tokenizer files into an HF folder, so its tokens decode to text."""
    for name in TOKENIZER_FILES:
        if (src / name).exists():
            shutil.copy(src / name, dst / name)


def save_random_model(hf_config, folder: Path, tokenizer_from: Path, seed: int = 0) -> Path:
    """An HF folder with random weights for hf_config (float32 safetensors) and the default tokenizer."""
    import torch
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(hf_config, dtype=torch.float32)
    model.save_pretrained(str(folder))
    copy_tokenizer(tokenizer_from, folder)
    return folder


def tiny_llama_config(**overrides):
    """A 2-layer Llama with GQA (4 query heads, 2 KV heads) and the default model's vocabulary."""
    from transformers import LlamaConfig

    fields = dict(
        vocab_size=49152, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
        bos_token_id=1, eos_token_id=2, pad_token_id=2, tie_word_embeddings=False,
    )
    fields.update(overrides)
    return LlamaConfig(**fields)


def tiny_llama_hd64_config(**overrides):
    """The tiny Llama with head_dim 64, a head size the CUDA paged kernel runs (GQA 4 query heads, 2 KV heads)."""
    return tiny_llama_config(**{"hidden_size": 256, "intermediate_size": 256, "head_dim": 64, **overrides})


def load_default_tokenizer():
    """The default SmolLM2 tokenizer: the converted cache folder if present, else straight from the GGUF."""
    from transformers import AutoTokenizer

    from engine.model_executor.loader import DEFAULT_MODEL_ID, cache_dir, default_gguf_path

    converted = cache_dir() / "models" / DEFAULT_MODEL_ID
    if (converted / "tokenizer_config.json").exists():
        return AutoTokenizer.from_pretrained(converted)
    gguf = default_gguf_path()  # reading only the tokenizer from the GGUF takes seconds, no conversion
    return AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)


def tiny_mixtral_config(**overrides):
    """A 2-layer Mixtral: 4 experts of intermediate 48 (not whole 16-column blocks: the unfused gate/up path),
    top-2, GQA 4/2 heads, hidden 64."""
    from transformers import MixtralConfig

    fields = dict(
        vocab_size=49152, hidden_size=64, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2, max_position_embeddings=512,
        bos_token_id=1, eos_token_id=2, pad_token_id=2, tie_word_embeddings=False, sliding_window=None,
    )
    fields.update(overrides)
    return MixtralConfig(**fields)


def tiny_qwen3_moe_config(**overrides):
    """A 3-layer Qwen3-MoE: 8 experts of intermediate 32, top-2 renormalised (norm_topk_prob), layer 1 dense
    (mlp_only_layers), q/k norms, head_dim 16, hidden 64."""
    from transformers import Qwen3MoeConfig

    fields = dict(
        vocab_size=49152, hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=3,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_experts=8, num_experts_per_tok=2,
        norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[1], max_position_embeddings=512,
        bos_token_id=1, eos_token_id=2, pad_token_id=2, tie_word_embeddings=False,
    )
    fields.update(overrides)
    return Qwen3MoeConfig(**fields)


def tiny_qwen2_moe_config(**overrides):
    """A 2-layer Qwen2-MoE: 8 experts of intermediate 32, top-2 without renormalising, a shared expert of
    intermediate 48 with its sigmoid gate on every sparse layer, q/k/v biases, hidden 64."""
    from transformers import Qwen2MoeConfig

    fields = dict(
        vocab_size=49152, hidden_size=64, intermediate_size=96, moe_intermediate_size=32,
        shared_expert_intermediate_size=48, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        num_experts=8, num_experts_per_tok=2, norm_topk_prob=False, decoder_sparse_step=1, mlp_only_layers=[],
        max_position_embeddings=512, bos_token_id=1, eos_token_id=2, pad_token_id=2, tie_word_embeddings=False,
    )
    fields.update(overrides)
    return Qwen2MoeConfig(**fields)


GGUF_PARTS = {"self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
              "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
              "mlp.down_proj": "ffn_down", "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm"}


def _permute(w, heads: int):  # llama.cpp convert_hf_to_gguf's LlamaModel.permute (q / k rows for its RoPE)
    return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _blocks(w, kind: str, seed: int):
    """w [N, K] (numpy float32) as `kind`'s GGUF bytes: gguf-py's quantizer where it has one, else pagedserve's
    (Q4_K, Q5_K, Q6_K); a type neither writes (Q2_K, Q3_K) gets random blocks with a small float16 d (the test
    compares against the file dequantized, so what the blocks hold does not matter, only that they are valid)."""
    import gguf
    import numpy as np
    import torch

    qtype = gguf.GGMLQuantizationType[kind]
    if kind in ("Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0"):
        return gguf.quants.quantize(w, qtype)
    if kind in ("Q4_K", "Q5_K", "Q6_K"):
        from engine.model_executor.layers.ggml_quantize import quantize_rows

        return quantize_rows(torch.from_numpy(w), kind).numpy()
    block, nbytes = gguf.GGML_QUANT_SIZES[qtype]
    raw = np.random.default_rng(seed).integers(0, 256, (w.shape[0], w.shape[1] // block, nbytes), dtype=np.uint8)
    d = np.array([2e-4], dtype=np.float16).view(np.uint8)
    d_at = {"Q2_K": nbytes - 4, "Q3_K": nbytes - 2}[kind]  # Q2_K: d, dmin last; Q3_K: d last
    raw[..., d_at:d_at + 2] = d
    if kind == "Q2_K":
        raw[..., nbytes - 2:] = d
    return raw.reshape(w.shape[0], -1)


@functools.lru_cache(maxsize=8)
def gguf_reader(path: Path):
    """gguf-py's reader of a GGUF file, one a session a file: each reader parses the 49k-token vocabulary the
    default model's and the tests' GGUFs hold (seconds). Read only."""
    import gguf

    return gguf.GGUFReader(str(path))


@functools.lru_cache(maxsize=1)
def default_tokenizer_metadata() -> tuple:
    """The default model's GGUF tokenizer.* keys as (key, contents, type, array item type or None), for the GGUFs
    the tests write: one gguf-py reader a session (each parses the 49k-token vocabulary: seconds)."""
    import gguf

    from engine.model_executor.loader import default_gguf_path

    reader = gguf_reader(default_gguf_path())
    return tuple((key, field.contents(), field.types[0],
                  field.types[-1] if field.types[0] == gguf.GGUFValueType.ARRAY else None)
                 for key, field in reader.fields.items() if key.startswith("tokenizer."))


def write_llama_gguf(hf_dir: Path, out: Path, tensor_type=lambda name, shape: "Q8_0", file_type: int = 7) -> Path:
    """hf_dir's Llama (float32 safetensors) as a GGUF laid out as llama.cpp's convert_hf_to_gguf.py + llama-quantize
    lay one out: q_proj / k_proj rows permuted for its RoPE, the default model's tokenizer metadata, each 2-D tensor
    in tensor_type(gguf_name, shape) (a GGML type name, or F32 / F16), 1-D tensors F32."""
    import json

    import gguf
    from safetensors.torch import load_file

    cfg = json.loads((hf_dir / "config.json").read_text())
    writer = gguf.GGUFWriter(str(out), "llama")
    writer.add_block_count(cfg["num_hidden_layers"])
    writer.add_context_length(cfg["max_position_embeddings"])
    writer.add_embedding_length(cfg["hidden_size"])
    writer.add_feed_forward_length(cfg["intermediate_size"])
    writer.add_head_count(cfg["num_attention_heads"])
    writer.add_head_count_kv(cfg["num_key_value_heads"])
    writer.add_rope_freq_base(float(cfg.get("rope_theta", 10000.0)))
    writer.add_layer_norm_rms_eps(float(cfg["rms_norm_eps"]))
    writer.add_rope_dimension_count(cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"])
    if cfg.get("head_dim"):
        writer.add_key_length(cfg["head_dim"])
        writer.add_value_length(cfg["head_dim"])
    writer.add_vocab_size(cfg["vocab_size"])
    writer.add_file_type(file_type)
    for key, value, kind, sub in default_tokenizer_metadata():  # the default model's tokenizer, as metadata
        writer.add_key_value(key, value, kind, sub)
    state = load_file(str(hf_dir / "model.safetensors"))
    for i, (name, t) in enumerate(state.items()):
        w = t.float().numpy()
        top = {"model.embed_tokens.weight": "token_embd.weight", "lm_head.weight": "output.weight",
               "model.norm.weight": "output_norm.weight"}
        if name in top:
            gname = top[name]
        else:
            layer, part = name.removeprefix("model.layers.").split(".", 1)
            part, suffix = part.rsplit(".", 1)
            gname = f"blk.{layer}.{GGUF_PARTS[part]}.{suffix}"
            if part == "self_attn.q_proj":
                w = _permute(w, cfg["num_attention_heads"])
            elif part == "self_attn.k_proj":
                w = _permute(w, cfg["num_key_value_heads"])
        kind = tensor_type(gname, w.shape) if w.ndim == 2 else "F32"
        if kind in ("F32", "F16"):
            writer.add_tensor(gname, w.astype("float32" if kind == "F32" else "float16"))
        else:
            writer.add_tensor(gname, _blocks(w, kind, i), raw_dtype=gguf.GGMLQuantizationType[kind])
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return out
