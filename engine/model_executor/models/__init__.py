"""Model architectures that run on the paged KV cache."""
from __future__ import annotations

# HF `architectures` / `model_type` names -> our class. All are the Llama family.
# Mixtral: the Llama decoder with experts for MLPs (engine/model_executor/layers/moe.py).
_ARCHITECTURES = {"LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "MixtralForCausalLM"}
_MODEL_TYPES = {"llama", "mistral", "qwen2", "mixtral"}


def get_model_class(hf_config):
    """Our nn.Module class for an HF config; ValueError naming the architecture if unsupported."""
    from engine.model_executor.models.llama import LlamaForCausalLM

    archs = getattr(hf_config, "architectures", None) or []
    model_type = getattr(hf_config, "model_type", None)
    if any(a in _ARCHITECTURES for a in archs) or model_type in _MODEL_TYPES:
        return LlamaForCausalLM
    supported = ", ".join(sorted(_ARCHITECTURES))
    raise ValueError(f"Model architecture {archs or model_type!r} is not supported; supported: {supported}.")


__all__ = ["get_model_class"]
