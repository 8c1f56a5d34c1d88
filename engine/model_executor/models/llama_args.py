"""The per-architecture spec of the one decoder (ModelArgs), read once from an HF config (or a GGUF's metadata through
the same HF-config fields): the model (engine/model_executor/models/llama.py), its checkpoint loading
(engine/model_executor/models/llama_weights.py), the compiled CPU step (compiled_decode.py) and the engine's startup
checks read it from here. A family is its values here plus its weight-name map, never a copy of the model (nor of
the compiled step's C++ loop)."""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

from engine.model_executor.layers.moe_args import MoEArgs

# HF model_type -> its family's spec reader below; the model_type of Gemma 3's text model inside a multimodal
# checkpoint is gemma3_text (engine/model_executor/models/__init__.py text_config).
FAMILIES = ("llama", "mistral", "qwen2", "qwen3", "gemma2", "gemma3_text", "phi3", "mixtral", "qwen3_moe", "qwen2_moe")
MLP_ACTS = ("silu", "gelu_tanh")  # a gated MLP's activation of its gate: silu(gate) * up, gelu_tanh(gate) * up
_ACT_NAMES = {"silu": "silu", "swish": "silu", "gelu_pytorch_tanh": "gelu_tanh", "gelu_new": "gelu_tanh"}


@dataclass
class ModelArgs:
    """The fields of an HF config the decoder reads, checked once. The spec fields after layer_windows default to
    Llama's, so a Llama-family config needs none of them."""

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
    # ---- the per-architecture spec ----
    family: str = "llama"  # the HF model_type it was read as (FAMILIES)
    # RMSNorm scales by (norm_offset + w): Gemma's x * (1 + w) is 1.0. The loader adds it to every norm weight
    # (q/k norms too), so every path runs one norm kernel; GGUF files of Gemma hold w + 1 already (llama.cpp adds it).
    norm_offset: float = 0.0
    sandwich_norms: bool = False  # Gemma: attention and MLP outputs normed before their residual add (4 norms a layer)
    qk_norm: bool = False  # Qwen3, Gemma 3: per-head RMSNorm of q and k (over head_dim) before RoPE
    mlp_kind: str = "dense"  # "dense": a gated MLP; "experts": a mixture of experts on moe.sparse_layers
    mlp_act: str = "silu"  # MLP_ACTS
    # per layer: the key of its RoPE parameters (Gemma 3's layer types: "sliding_attention" / "full_attention" each
    # with their own base and scaling), None for the config's one RoPE
    layer_rope: tuple[Optional[str], ...] = ()
    embed_scale: Optional[float] = None  # Gemma: embeddings times sqrt(hidden), rounded to the model's dtype as HF does
    attn_softcap: Optional[float] = None  # Gemma 2: scores = tanh(scores / cap) * cap before the mask and softmax
    final_softcap: Optional[float] = None  # Gemma 2/3: logits = tanh(logits / cap) * cap
    attn_scale: float = 0.0  # the scores' scale: head_dim ** -0.5, Gemma's query_pre_attn_scalar ** -0.5
    moe: Optional[MoEArgs] = None  # a mixture-of-experts model's experts (which layers, how many, top-k)

    def __post_init__(self) -> None:
        if not self.layer_rope:
            self.layer_rope = (None,) * self.num_layers
        if not self.attn_scale:
            self.attn_scale = self.head_dim**-0.5

    @classmethod
    def from_hf(cls, c) -> "ModelArgs":
        family = getattr(c, "model_type", None) or "llama"
        if family not in FAMILIES:
            family = "llama"  # configs without a model_type of ours were mapped by architecture (models/__init__.py)
        act = getattr(c, "hidden_activation", None) or getattr(c, "hidden_act", "silu")
        if act not in _ACT_NAMES:
            raise ValueError(f"hidden_act {act!r} is not supported (supported: {', '.join(sorted(_ACT_NAMES))}).")
        if getattr(c, "use_bidirectional_attention", None):
            raise ValueError("use_bidirectional_attention (an embedding model) is not supported: pagedserve serves "
                             "causal language models.")
        qwen2 = family == "qwen2" or (family == "qwen2_moe" and bool(getattr(c, "qkv_bias", True)))
        gemma = family in ("gemma2", "gemma3_text")
        bias = bool(getattr(c, "attention_bias", False))
        head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
        scalar = getattr(c, "query_pre_attn_scalar", None) if gemma else None
        return cls(
            vocab_size=c.vocab_size,
            hidden_size=c.hidden_size,
            intermediate_size=c.intermediate_size,
            num_layers=c.num_hidden_layers,
            num_heads=c.num_attention_heads,
            num_kv_heads=getattr(c, "num_key_value_heads", None) or c.num_attention_heads,
            head_dim=head_dim,
            rms_norm_eps=c.rms_norm_eps,
            qkv_bias=qwen2 or bias,
            o_bias=bias and not qwen2,
            mlp_bias=bool(getattr(c, "mlp_bias", False)),
            tie_word_embeddings=bool(getattr(c, "tie_word_embeddings", False)),
            layer_windows=sliding_windows(c),
            family=family,
            norm_offset=1.0 if gemma and not getattr(c, "norm_weights_offset_applied", False) else 0.0,
            sandwich_norms=gemma,
            qk_norm=family in ("qwen3", "qwen3_moe", "gemma3_text"),
            mlp_act=_ACT_NAMES[act],
            layer_rope=layer_ropes(c),
            embed_scale=math.sqrt(c.hidden_size) if gemma else None,
            attn_softcap=getattr(c, "attn_logit_softcapping", None) if gemma else None,
            final_softcap=getattr(c, "final_logit_softcapping", None) if gemma else None,
            attn_scale=float(scalar) ** -0.5 if scalar else head_dim**-0.5,
            mlp_kind="experts" if MoEArgs.from_hf(c) is not None else "dense",
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
    """Each layer's sliding window as HF applies it: Mistral's (and Phi-3's) on every layer, on the
    "sliding_attention" layer_types of Qwen2 (only with use_sliding_window) and Gemma 2/3, None elsewhere."""
    window = getattr(c, "sliding_window", None)
    if not window or not getattr(c, "use_sliding_window", True):
        return (None,) * c.num_hidden_layers
    layer_types = _layer_types(c)
    if layer_types is None:
        return (int(window),) * c.num_hidden_layers
    return tuple(int(window) if t == "sliding_attention" else None for t in layer_types)


def layer_ropes(c) -> tuple[Optional[str], ...]:
    """Per layer the key of its RoPE parameters where the config has one RoPE per layer type (Gemma 3:
    rope_parameters {"sliding_attention": {...}, "full_attention": {...}}); None for the config's single RoPE."""
    params = getattr(c, "rope_parameters", None)
    layer_types = _layer_types(c)
    if isinstance(params, dict) and layer_types is not None and all(t in params for t in set(layer_types)):
        return tuple(layer_types)
    if getattr(c, "model_type", None) == "gemma3_text" and layer_types is not None \
            and getattr(c, "rope_local_base_freq", None):
        return tuple(layer_types)  # a config in the older form: rope_local_base_freq for the sliding layers
    return (None,) * c.num_hidden_layers


def _layer_types(c) -> Optional[list[str]]:
    layer_types = getattr(c, "layer_types", None)
    if layer_types is None and getattr(c, "model_type", None) in ("gemma2", "gemma3_text"):
        pattern = getattr(c, "sliding_window_pattern", None) or getattr(c, "_sliding_window_pattern", None) or 2
        layer_types = ["full_attention" if (i + 1) % pattern == 0 else "sliding_attention"
                       for i in range(c.num_hidden_layers)]
    return layer_types
