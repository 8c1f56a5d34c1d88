"""Tiny random models for the tests: configs, HF folders with the default tokenizer."""
from __future__ import annotations

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
