"""Model architectures that run on the paged KV cache: every one is the one decoder (models/llama.py) driven by its
per-architecture spec (models/llama_args.py)."""
from __future__ import annotations

# HF `architectures` / `model_type` names -> our class, the one decoder. Gemma3ForConditionalGeneration: the text
# model inside the multimodal checkpoint (text_config below; its weights under language_model.). Mixtral and
# Qwen3-MoE: experts for MLPs (mlp_kind "experts", engine/model_executor/layers/moe.py).
_ARCHITECTURES = {"LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM",
                  "Gemma2ForCausalLM", "Gemma3ForCausalLM", "Gemma3ForConditionalGeneration", "Phi3ForCausalLM",
                  "MixtralForCausalLM", "Qwen3MoeForCausalLM", "Qwen2MoeForCausalLM"}
_MODEL_TYPES = {"llama", "mistral", "qwen2", "qwen3", "gemma2", "gemma3_text", "phi3", "mixtral", "qwen3_moe", "qwen2_moe"}


def text_config(hf_config):
    """The config the decoder reads: a multimodal checkpoint's text model's (Gemma 3's text_config, its
    architectures kept so that get_model_class names it), else the config itself."""
    archs = getattr(hf_config, "architectures", None) or []
    if "Gemma3ForConditionalGeneration" in archs and getattr(hf_config, "text_config", None) is not None:
        text = hf_config.text_config
        text.architectures = list(archs)
        return text
    return hf_config


def get_model_class(hf_config):
    """Our nn.Module class for an HF config; ValueError naming the architecture if unsupported."""
    from engine.model_executor.models.llama import LlamaForCausalLM

    archs = getattr(hf_config, "architectures", None) or []
    model_type = getattr(hf_config, "model_type", None)
    if any(a in _ARCHITECTURES for a in archs) or model_type in _MODEL_TYPES:
        return LlamaForCausalLM
    supported = ", ".join(sorted(_ARCHITECTURES))
    raise ValueError(f"Model architecture {archs or model_type!r} is not supported; supported: {supported}.")


__all__ = ["get_model_class", "text_config"]
