"""RoPE of the one decoder: the inverse frequencies HF computes for a config (per layer type where the config has
one RoPE per kind of layer, Gemma 3), and the cos/sin table the rotary kernels read."""
from __future__ import annotations

from typing import Optional

import torch
from torch import nn

from engine import ops

SUPPORTED_ROPE_TYPES = ("default", "linear", "dynamic", "llama3", "yarn", "longrope")


def rope_params(hf_config, layer_type: Optional[str] = None) -> dict:
    """The config's RoPE parameters (of one layer type where it has one per type)."""
    params = getattr(hf_config, "rope_parameters", None) or getattr(hf_config, "rope_scaling", None) or {}
    if layer_type is not None:
        if layer_type in params:
            return dict(params[layer_type])
        # Gemma 3 configs in the older form: rope_local_base_freq for the sliding layers, rope_theta (and its
        # rope_scaling) for the global ones.
        if layer_type == "sliding_attention":
            return {"rope_type": "default", "rope_theta": getattr(hf_config, "rope_local_base_freq")}
    return dict(params)


def rope_inv_freq(hf_config, head_dim: int, max_len: int, layer_type: Optional[str] = None,
                  serve_len: Optional[int] = None) -> tuple[torch.Tensor, float]:
    """RoPE inverse frequencies [head_dim // 2] and the cos/sin scale, as HF computes them for the config (for one
    layer type's RoPE where the config has one per type: Gemma 3's sliding and global layers).

    longrope (Phi-3 "su"): HF switches from the short to the long factors per forward, once the batch's longest
    sequence passes original_max_position_embeddings; a KV cache cannot follow that (the keys written before hold
    the short rotation). As vLLM does, the choice is made once for the server: the long factors when it serves
    sequences longer than original_max_position_embeddings (serve_len, --max-model-len, defaulting to the model's
    max_position_embeddings), the short ones otherwise: HF's numbers in both cases wherever HF's whole sequence
    is on the same side of that length."""
    params = rope_params(hf_config, layer_type)
    rope_type = params.get("rope_type", params.get("type", "default"))
    rope_type = "longrope" if rope_type == "su" else rope_type
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise ValueError(f"rope scaling type {rope_type!r} is not supported; supported: {', '.join(SUPPORTED_ROPE_TYPES)}.")
    if float(params.get("partial_rotary_factor", getattr(hf_config, "partial_rotary_factor", 1.0)) or 1.0) != 1.0:
        raise ValueError("partial_rotary_factor < 1 (RoPE over part of each head, e.g. Phi-4-mini) is not supported.")
    with torch.device("cpu"):  # the model may be built under torch.device("meta")
        return _inv_freq(hf_config, rope_type, params, head_dim, max_len, layer_type, serve_len)


def _inv_freq(hf_config, rope_type: str, params: dict, head_dim: int, max_len: int, layer_type: Optional[str],
              serve_len: Optional[int]) -> tuple[torch.Tensor, float]:
    if rope_type == "default":
        base = params.get("rope_theta", getattr(hf_config, "rope_theta", 10000.0))
        exponent = torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim
        return 1.0 / (base**exponent), 1.0
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    kwargs = {} if layer_type is None else {"layer_type": layer_type}
    if rope_type == "longrope":
        original = params.get("original_max_position_embeddings",
                              getattr(hf_config, "original_max_position_embeddings", None))
        serve_len = serve_len or getattr(hf_config, "max_position_embeddings", max_len)
        seq_len = serve_len if original is not None and serve_len > original else None
    elif rope_type == "dynamic":
        # dynamic NTK is frozen at the longest length we serve (HF rescales per batch, which a cache cannot follow).
        seq_len = max(max_len, getattr(hf_config, "max_position_embeddings", max_len))
    else:
        seq_len = None
    inv_freq, scale = ROPE_INIT_FUNCTIONS[rope_type](hf_config, torch.device("cpu"), seq_len=seq_len, **kwargs)
    return inv_freq.float(), float(scale)


class RotaryEmbedding(nn.Module):
    """Neox-style RoPE (rotate halves) from a cos/sin table built on first use on the model's device."""

    def __init__(self, inv_freq: torch.Tensor, scale: float, max_len: int) -> None:
        super().__init__()
        self.inv_freq, self.scale, self.max_len = inv_freq, scale, max_len
        self._cos_sin: Optional[torch.Tensor] = None  # [max_len, head_dim] float32: cos halves | sin halves

    def table(self, device: torch.device) -> torch.Tensor:  # [max_len, head_dim] float32
        if self._cos_sin is None or self._cos_sin.device != device:
            t = torch.arange(self.max_len, dtype=torch.float32, device="cpu")
            freqs = torch.outer(t, self.inv_freq)  # [max_len, head_dim // 2]
            self._cos_sin = torch.cat([freqs.cos() * self.scale, freqs.sin() * self.scale], dim=-1).to(device)
        return self._cos_sin

    def forward(self, positions: torch.Tensor, x: torch.Tensor) -> None:
        # positions: [num_tokens]; x: [num_tokens, heads, head_dim], rotated in place with HF's arithmetic.
        ops.rotary_embedding(positions, x, self.table(x.device))
