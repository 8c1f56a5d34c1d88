"""The fields of an HF config the Llama family reads (ModelArgs), checked once: the model (engine/model_executor/models/llama.py),
its checkpoint loading (engine/model_executor/models/llama_weights.py) and the engine's startup checks read them from here."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from engine.model_executor.models.moe_args import MoEArgs


@dataclass
class ModelArgs:
    """The fields of an HF config a Llama-family model reads, checked once."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    qkv_bias: bool  # Qwen2 always; Llama when attention_bias
    o_bias: bool  # Llama attention_bias only
    mlp_bias: bool
    tie_word_embeddings: bool
    layer_windows: tuple[Optional[int], ...]  # per layer: its sliding window in tokens, None for full attention
    moe: Optional[MoEArgs] = None  # a mixture-of-experts model's experts (which layers, how many, top-k)

    @classmethod
    def from_hf(cls, c) -> "ModelArgs":
        if getattr(c, "hidden_act", "silu") != "silu":
            raise ValueError(f"hidden_act {c.hidden_act!r} is not supported (only silu).")
        qwen2 = getattr(c, "model_type", "") == "qwen2"
        bias = bool(getattr(c, "attention_bias", False))
        return cls(
            vocab_size=c.vocab_size,
            hidden_size=c.hidden_size,
            intermediate_size=c.intermediate_size,
            num_layers=c.num_hidden_layers,
            num_heads=c.num_attention_heads,
            num_kv_heads=getattr(c, "num_key_value_heads", None) or c.num_attention_heads,
            head_dim=getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads,
            rms_norm_eps=c.rms_norm_eps,
            qkv_bias=qwen2 or bias,
            o_bias=bias and not qwen2,
            mlp_bias=bool(getattr(c, "mlp_bias", False)),
            tie_word_embeddings=bool(getattr(c, "tie_word_embeddings", False)),
            layer_windows=sliding_windows(c),
            moe=MoEArgs.from_hf(c),
        )

    def check_tensor_parallel(self, world_size: int) -> None:
        """ValueError, at startup, when the model cannot be split evenly over world_size ranks (Megatron-style:
        each rank holds 1/N of the heads, key/value heads, MLP columns and vocabulary)."""
        sizes = {"num_attention_heads": self.num_heads, "intermediate_size": self.intermediate_size,
                 "vocab_size": self.vocab_size}
        bad = [f"{name} ({n})" for name, n in sizes.items() if n % world_size]
        if self.moe is not None and self.moe.check_tensor_parallel(world_size):
            bad.append(self.moe.check_tensor_parallel(world_size))
        if self.num_kv_heads % world_size and world_size % self.num_kv_heads:
            bad.insert(1, f"num_key_value_heads ({self.num_kv_heads}; or be a multiple of it)")
        if bad:
            raise ValueError(f"--tensor-parallel-size {world_size} must divide the model's {', '.join(bad)}: "
                             "each rank holds an equal share of them. Choose a size that divides them.")

    def local_kv_heads(self, world_size: int) -> int:
        """Key/value heads each rank holds: its share, or one replicated head when the ranks outnumber them
        (vLLM's rule): ranks r * N / kv_heads ... hold key/value head r."""
        return max(1, self.num_kv_heads // world_size)


def sliding_windows(c) -> tuple[Optional[int], ...]:
    """Each layer's sliding window as HF applies it: Mistral's on every layer, Qwen2's on its
    "sliding_attention" layer_types (only with use_sliding_window), None elsewhere."""
    window = getattr(c, "sliding_window", None)
    if not window or not getattr(c, "use_sliding_window", True):
        return (None,) * c.num_hidden_layers
    layer_types = getattr(c, "layer_types", None)
    if layer_types is None:
        return (int(window),) * c.num_hidden_layers
    return tuple(int(window) if t == "sliding_attention" else None for t in layer_types)
