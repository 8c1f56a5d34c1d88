"""The expert fields of an HF config (a mixture-of-experts model: Qwen3-MoE, Qwen2-MoE, Mixtral), checked once; None for a
dense model. No torch here: the engine's startup checks read them too."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional


@dataclass(frozen=True)
class MoEArgs:
    """The expert fields of an HF config."""

    num_experts: int
    top_k: int
    intermediate_size: int  # each expert's
    renormalize: bool  # the k chosen weights rescaled to sum to one (Mixtral; Qwen3-MoE's norm_topk_prob)
    round_weights: bool  # the routing weights rounded to the model's dtype before use (HF's Qwen3-MoE)
    sparse_layers: tuple[bool, ...]  # per layer: experts (True) or the dense MLP
    shared_intermediate_size: int = 0  # Qwen2-MoE's shared expert beside the routed ones (0: none)

    @classmethod
    def from_hf(cls, c) -> Optional["MoEArgs"]:
        """The config's experts, None for a dense model."""
        experts = getattr(c, "num_local_experts", None) or getattr(c, "num_experts", None) or 0
        if experts <= 0:
            return None
        model_type = getattr(c, "model_type", "")
        layers = c.num_hidden_layers
        if model_type == "mixtral":
            return cls(experts, c.num_experts_per_tok, c.intermediate_size, True, False, (True,) * layers)
        step = max(1, int(getattr(c, "decoder_sparse_step", 1) or 1))
        dense = set(getattr(c, "mlp_only_layers", None) or ())
        sparse = tuple(i not in dense and (i + 1) % step == 0 for i in range(layers))
        return cls(experts, c.num_experts_per_tok, c.moe_intermediate_size, bool(getattr(c, "norm_topk_prob", False)),
                   True, sparse, int(getattr(c, "shared_expert_intermediate_size", 0) or 0))

    def check_tensor_parallel(self, world_size: int) -> Optional[str]:
        """The reason world_size ranks cannot split the experts (each rank holds 1/N of every expert's
        intermediate), or None."""
        if self.intermediate_size % world_size:
            return f"the experts' intermediate size ({self.intermediate_size})"
        if self.shared_intermediate_size % world_size:
            return f"the shared expert's intermediate size ({self.shared_intermediate_size})"
        return None
