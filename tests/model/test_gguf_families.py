"""Qwen3, Gemma 3 and Phi-3 from GGUF files (issue 54): a tiny random HF checkpoint written as llama.cpp's converter
writes it (its metadata keys, its tensor names, Gemma's norms stored as 1 + w, no q/k row permutation: only the
llama architecture permutes) loads with the HF checkpoint's config (gguf_meta.gguf_config), and its Q8_0 weights,
served as they are (gguf_native.py), give the HF model's greedy tokens."""
from __future__ import annotations

import math
from pathlib import Path
from typing import Callable, Optional

import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM, Gemma3TextConfig, Phi3Config, Qwen3Config

from engine.model_executor.gguf_meta import gguf_config
from engine.model_executor.gguf_file import hf_name
from engine.model_executor.gguf_native import is_native_gguf
from engine.model_executor.layers import formats
from engine.model_executor.layers.ggml_quantize import quantize_rows
from engine.model_executor.models.llama_args import ModelArgs, layer_ropes, sliding_windows
from engine.model_executor.models.rope import rope_inv_freq
from tiny_models import default_tokenizer_metadata

TINY = dict(vocab_size=49152, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=512, rms_norm_eps=2.0**-20, bos_token_id=1, eos_token_id=2,
            pad_token_id=0)  # (an epsilon a float32 holds exactly: GGUF stores it as one)
CONFIGS = {
    # head_dim 32 is not hidden / heads (16): the file's key_length must reach the config
    "qwen3": lambda: Qwen3Config(**TINY, head_dim=32, tie_word_embeddings=False,
                                 rope_parameters={"rope_type": "default", "rope_theta": 500000.0}),
    # the HF default query_pre_attn_scalar is 256; llama.cpp scales by the head size, as this checkpoint does.
    # Seven layers: Gemma 3's pattern (llama.cpp's, HF's default) of five sliding, one global, then sliding again.
    "gemma3": lambda: Gemma3TextConfig(**{**TINY, "num_hidden_layers": 7}, head_dim=16, query_pre_attn_scalar=16,
                                       sliding_window=8, final_logit_softcapping=30.0,
                                       rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                                                        "full_attention": {"rope_type": "default", "rope_theta": 1e6}}),
    "phi3": lambda: Phi3Config(**TINY, sliding_window=8, tie_word_embeddings=False),
    # longrope (Phi-3.5's "su"): the converter writes the factors as tensors rope_factors_long / _short; a context of
    # 512 over an original 32 makes the long ones and HF's attention factor apply to the prompts past 32 tokens
    "phi3-longrope": lambda: Phi3Config(**TINY, sliding_window=8, tie_word_embeddings=False,
                                        original_max_position_embeddings=32,
                                        rope_parameters={"rope_type": "longrope", "rope_theta": 10000.0,
                                                         "original_max_position_embeddings": 32,
                                                         "short_factor": [1.0 + 0.1 * i for i in range(8)],
                                                         "long_factor": [1.0 + 0.7 * i for i in range(8)]}),
}
# HF name -> GGUF name part, as gguf-py's tensor map has them (llama.cpp's convert_hf_to_gguf.py writes these)
_PARTS = {"input_layernorm": "attn_norm", "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k",
          "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output", "self_attn.q_norm": "attn_q_norm",
          "self_attn.k_norm": "attn_k_norm", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
          "mlp.down_proj": "ffn_down", "self_attn.qkv_proj": "attn_qkv", "mlp.gate_up_proj": "ffn_up",
          # a mixture of experts (its experts split and stacked as _moe_state makes them)
          "mlp.gate": "ffn_gate_inp", "mlp.experts.gate_proj": "ffn_gate_exps", "mlp.experts.up_proj": "ffn_up_exps",
          "mlp.experts.down_proj": "ffn_down_exps", "mlp.shared_expert.gate_proj": "ffn_gate_shexp",
          "mlp.shared_expert.up_proj": "ffn_up_shexp", "mlp.shared_expert.down_proj": "ffn_down_shexp",
          "mlp.shared_expert_gate": "ffn_gate_inp_shexp"}
_ARCH_PARTS = {"gemma3": {"post_attention_layernorm": "post_attention_norm",
                          "pre_feedforward_layernorm": "ffn_norm", "post_feedforward_layernorm": "post_ffw_norm"},
               "qwen3": {"post_attention_layernorm": "ffn_norm"}, "phi3": {"post_attention_layernorm": "ffn_norm"},
               "qwen2moe": {"post_attention_layernorm": "ffn_norm"}, "qwen3moe": {"post_attention_layernorm": "ffn_norm"}}
_ROUTERS = ("ffn_gate_inp.weight", "ffn_gate_inp_shexp.weight")  # llama.cpp keeps them F32


def _gguf_name(name: str, arch: str) -> str:
    if not name.startswith("model.layers."):
        return {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
                "lm_head.weight": "output.weight"}[name]
    layer, rest = name.removeprefix("model.layers.").split(".", 1)
    part, suffix = rest.rsplit(".", 1)
    return f"blk.{layer}.{_ARCH_PARTS[arch].get(part) or _PARTS[part]}.{suffix}"


def write_family_gguf(c, state: dict[str, torch.Tensor], out: Path, q8: bool = True,
                      kinds: Optional[Callable[[str, tuple], str]] = None) -> Path:
    """The metadata keys llama.cpp's converter writes for this family (conversion/qwen.py, gemma.py, phi.py), the
    default model's tokenizer (its GGUF's tokenizer.* keys), and the weights (2-D ones Q8_0 when q8; of the type
    kinds(GGUF name, shape) names when given, made by the engine's quantizer: llama.cpp's quantize_row_*_ref)."""
    import gguf

    arch = {"qwen3": "qwen3", "gemma3_text": "gemma3", "phi3": "phi3", "qwen2_moe": "qwen2moe",
            "qwen3_moe": "qwen3moe"}[c.model_type]
    w = gguf.GGUFWriter(str(out), arch)
    w.add_name("tiny")
    w.add_block_count(c.num_hidden_layers)
    w.add_context_length(c.max_position_embeddings)
    w.add_embedding_length(c.hidden_size)
    w.add_feed_forward_length(c.intermediate_size)
    w.add_head_count(c.num_attention_heads)
    w.add_head_count_kv(c.num_key_value_heads)
    w.add_layer_norm_rms_eps(c.rms_norm_eps)
    rope = c.rope_parameters
    if arch == "gemma3":
        w.add_key_length(c.head_dim)
        w.add_value_length(c.head_dim)
        w.add_rope_freq_base(rope["full_attention"]["rope_theta"])
        w.add_rope_freq_base_swa(rope["sliding_attention"]["rope_theta"])
        w.add_final_logit_softcapping(c.final_logit_softcapping)
        w.add_sliding_window(c.sliding_window)
    else:
        w.add_rope_freq_base(rope["rope_theta"])
    if arch in ("qwen3", "qwen3moe"):
        w.add_key_length(c.head_dim)
        w.add_value_length(c.head_dim)
    if arch.endswith("moe"):  # conversion/qwen.py Qwen2MoeModel / Qwen3MoeModel
        w.add_expert_count(c.num_experts)
        w.add_expert_used_count(c.num_experts_per_tok)
        w.add_expert_feed_forward_length(c.moe_intermediate_size)
        if getattr(c, "shared_expert_intermediate_size", 0):
            w.add_expert_shared_feed_forward_length(c.shared_expert_intermediate_size)
    if arch == "phi3":
        w.add_rope_scaling_orig_ctx_len(c.original_max_position_embeddings)
        w.add_rope_dimension_count(c.hidden_size // c.num_attention_heads)
        w.add_sliding_window(c.sliding_window or 0)
        if rope.get("long_factor"):  # conversion/phi.py generate_extra_tensors
            orig = c.original_max_position_embeddings
            w.add_rope_scaling_attn_factors(math.sqrt(1 + math.log(c.max_position_embeddings / orig) / math.log(orig)))
            w.add_tensor("rope_factors_long.weight", np.array(rope["long_factor"], dtype=np.float32))
            w.add_tensor("rope_factors_short.weight", np.array(rope["short_factor"], dtype=np.float32))
    for key, value, kind, sub in default_tokenizer_metadata():
        if not key.endswith("_token_id"):
            w.add_key_value(key, value, kind, sub)
    w.add_bos_token_id(c.bos_token_id)
    w.add_eos_token_id(c.eos_token_id)
    w.add_pad_token_id(c.pad_token_id)
    for name, t in state.items():
        if name == "lm_head.weight" and c.tie_word_embeddings:
            continue  # a tied head is not in the checkpoint (nor the file)
        t = t.float()
        if arch == "gemma3" and name.endswith("norm.weight"):
            t = t + 1.0  # Gemma3Model.modify_tensors: the file holds 1 + w
        data = t.numpy()
        if _gguf_name(name, arch).endswith(_ROUTERS):
            w.add_tensor(_gguf_name(name, arch), data)
        elif kinds is not None and data.ndim == 2:
            kind = kinds(_gguf_name(name, arch), tuple(data.shape))
            w.add_tensor(_gguf_name(name, arch), quantize_rows(t, kind).numpy(),
                         raw_dtype=gguf.GGMLQuantizationType[kind])
        elif q8 and data.ndim in (2, 3):
            w.add_tensor(_gguf_name(name, arch), gguf.quants.quantize(data, gguf.GGMLQuantizationType.Q8_0),
                         raw_dtype=gguf.GGMLQuantizationType.Q8_0)
        else:
            w.add_tensor(_gguf_name(name, arch), data)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return out


def _view(c) -> dict:
    """What the engine builds from a config: the spec, the per-layer windows and RoPE tables."""
    args = ModelArgs.from_hf(c)
    ropes = {key: rope_inv_freq(c, args.head_dim, 64, key)[0].tolist() for key in set(layer_ropes(c))}
    return {"args": args, "windows": sliding_windows(c), "ropes": ropes, "eos": c.eos_token_id, "bos": c.bos_token_id}


PROMPTS = [[5, 17, 99, 3, 250, 7, 7, 31, 400, 12], [9, 8, 7]]


def _hf_greedy(model, prompts: list[list[int]]) -> list[list[int]]:
    """HF's 8 greedy tokens after each prompt."""
    return [model.generate(torch.tensor([p]), max_new_tokens=8, do_sample=False, min_new_tokens=8,
                           pad_token_id=0)[0, len(p):].tolist() for p in prompts]


def _hf_model(name: str):
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(CONFIGS[name](), dtype=torch.float32).eval()
    for n, p in model.named_parameters():
        if n.endswith("norm.weight"):  # HF starts norms at 1 (Gemma: 0): random ones make the test mean more
            p.data.normal_(0.0 if "gemma" in model.config.model_type else 1.0, 0.1)
    return model


@pytest.mark.parametrize("name", list(CONFIGS))
def test_config_from_gguf_metadata_is_the_checkpoints(name, tmp_path):
    model = _hf_model(name)
    path = write_family_gguf(model.config, model.state_dict(), tmp_path / f"{name}.gguf", q8=False)
    ours = gguf_config(path)
    assert _view(ours) == _view(model.config)
    assert ours.tie_word_embeddings == model.config.tie_word_embeddings


@pytest.mark.parametrize("name", list(CONFIGS))
def test_tensor_names_map_back_to_the_checkpoints(name, tmp_path):
    model = _hf_model(name)
    arch = name.split("-")[0]
    for hf in model.state_dict():
        assert hf_name(_gguf_name(hf, arch), arch) == hf


@pytest.mark.parametrize("name", list(CONFIGS))
def test_q8_gguf_serves_the_checkpoints_tokens(name, tmp_path):
    """The file's Q8_0 weights served natively (no q/k un-permuting for these architectures, Gemma's stored norms
    shifted back): greedy tokens equal HF's on the same weights quantized the same way (Q8_0 round trip)."""
    import gguf

    from engine.llm import LLM
    from engine.sampling_params import SamplingParams

    model = _hf_model(name)
    state = model.state_dict()
    path = write_family_gguf(model.config, state, tmp_path / f"{name}.gguf")
    assert is_native_gguf(path)
    for n, t in state.items():  # the reference: HF on the Q8_0-rounded weights
        if t.dim() == 2:
            q = gguf.quants.quantize(t.numpy(), gguf.GGMLQuantizationType.Q8_0)
            t.copy_(torch.from_numpy(gguf.quants.dequantize(q, gguf.GGMLQuantizationType.Q8_0)))
    prompts = PROMPTS
    if "longrope" in name:  # past original_max_position_embeddings (32): HF's long factors from the first token
        prompts = [list(range(100, 140)), [9, 8, 7] * 12]
    want = _hf_greedy(model, prompts)
    llm = LLM(str(path), max_model_len=64, num_gpu_blocks_override=32, block_size=16,
              enforce_eager=True, dtype="float32")
    try:
        outs = llm.generate(prompt_token_ids=prompts, use_tqdm=False,
                            sampling_params=SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))
    finally:
        llm.shutdown()
    assert [o.outputs[0].token_ids for o in outs] == want


# The same families at shapes whose rows are whole 256-weight super-blocks, written as a llama.cpp K-quant mix
KQ = dict(hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2)
KQ_CONFIGS = {
    "qwen3": lambda: Qwen3Config(**{**TINY, **KQ}, head_dim=64, tie_word_embeddings=False),
    "gemma3": lambda: Gemma3TextConfig(**{**TINY, **KQ}, head_dim=64, query_pre_attn_scalar=64, sliding_window=8,
                                       final_logit_softcapping=30.0),
    "phi3": lambda: Phi3Config(**{**TINY, **KQ}, sliding_window=8, tie_word_embeddings=False),
}


TIE = 0.5  # logits: how far below HF's top a token of ours may be (a near-tie the int8 activations flip)


def k_quant_mix(name: str, shape: tuple) -> str:
    """A Q4_K_M-like mix (llama-quant.cpp: Q6_K for the head and attn_v) plus the 32-weight types: layer 0's
    ffn_down Q5_0, layer 1's attn_output Q4_0, the token embedding Q8_0 (the tied head of Gemma reads it)."""
    if name == "token_embd.weight":
        return "Q8_0"
    if name == "blk.0.ffn_down.weight":
        return "Q5_0"
    if name == "blk.1.attn_output.weight":
        return "Q4_0"
    return "Q6_K" if name == "output.weight" or ".attn_v." in name else "Q4_K"


@pytest.mark.parametrize("name", list(KQ_CONFIGS))
def test_k_quant_gguf_is_served_as_its_blocks(name, tmp_path):
    """Each family's K-quant mix is served natively: every linear holds the file's blocks in the file's types
    (formats.format_of), and its greedy tokens are HF's on the same file dequantized (formats' dequantize of the same
    blocks): each token HF's top one, teacher-forced on our tokens, up to TIE logits.
    (The kernels round the activations to int8 per block, as llama.cpp does: ~0.5 % of a logit's size here, so a
    near-tie of this random model, 0.18 at Qwen3's second prompt's first token, flips and every later token differs; a
    wrong weight, norm or row order puts our tokens tens of logits below HF's top.) The head is scaled up so the
    logits spread over ~+-30 (the plain random model's are nearly flat)."""
    from engine.llm import LLM
    from engine.sampling_params import SamplingParams

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(KQ_CONFIGS[name](), dtype=torch.float32).eval()
    for n, p in model.named_parameters():
        if n.endswith("norm.weight"):
            p.data.normal_(0.0 if name == "gemma3" else 1.0, 0.1)
    model.lm_head.weight.data.mul_(20.0)  # (Gemma: tied, so the embedding too; its soft-cap bounds the logits)
    state = model.state_dict()
    path = write_family_gguf(model.config, state, tmp_path / f"{name}-kq.gguf", kinds=k_quant_mix)
    assert is_native_gguf(path)
    arch = name
    for n, t in state.items():  # the reference: HF on the file's blocks dequantized
        if t.dim() == 2 and not (n == "lm_head.weight" and model.config.tie_word_embeddings):
            fmt = formats.get_format(k_quant_mix(_gguf_name(n, arch), tuple(t.shape)))
            t.copy_(fmt.dequantize(quantize_rows(t, fmt.name))[:, :t.shape[1]])
    prompts = PROMPTS
    want = _hf_greedy(model, prompts)
    llm = LLM(str(path), max_model_len=64, num_gpu_blocks_override=32, block_size=16, dtype="float32")
    try:
        decoder = llm.engine.model_runner.model
        layer = decoder.layers[1]
        held = {"qkv": formats.format_of(layer.self_attn.qkv_proj), "o": formats.format_of(layer.self_attn.o_proj),
                "gate_up": formats.format_of(layer.mlp.gate_up_proj), "head": formats.format_of(decoder.lm_head),
                "down0": formats.format_of(decoder.layers[0].mlp.down_proj)}
        outs = llm.generate(prompt_token_ids=prompts, use_tqdm=False,
                            sampling_params=SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))
    finally:
        llm.shutdown()
    names = {k: [f.name for f, _ in v] for k, v in held.items()}
    assert names == {"qkv": ["Q4_K"] if name == "phi3" else ["Q4_K", "Q4_K", "Q6_K"], "o": ["Q4_0"],
                     "gate_up": ["Q4_K"] if name == "phi3" else ["Q4_K", "Q4_K"],
                     "head": ["Q8_0" if name == "gemma3" else "Q6_K"], "down0": ["Q5_0"]}
    ours = [list(o.outputs[0].token_ids) for o in outs]
    assert sum(a == b for o, w in zip(ours, want) for a, b in zip(o, w)) >= 8  # (not a run of near-ties)
    with torch.no_grad():
        for p, o in zip(prompts, ours):
            logits = model(torch.tensor([p + o])).logits[0, len(p) - 1:-1]  # [8, vocab]: the rows that chose o
            below = logits.max(-1).values - logits[torch.arange(len(o)), torch.tensor(o)]
            assert (below <= TIE).all(), (name, p, o, below.tolist())


def _moe_state(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """transformers' fused experts (gate_up_proj [E, 2I, H], down_proj [E, H, I]) as llama.cpp's converter writes
    them: gate and up split, each a 3-D tensor [E, rows, K]."""
    out = {}
    for name, t in state.items():
        if name.endswith("mlp.experts.gate_up_proj"):
            half = t.shape[1] // 2
            out[name.replace("gate_up_proj", "gate_proj.weight")] = t[:, :half].contiguous()
            out[name.replace("gate_up_proj", "up_proj.weight")] = t[:, half:].contiguous()
        elif name.endswith("mlp.experts.down_proj"):
            out[name + ".weight"] = t
        else:
            out[name] = t
    return out


@pytest.mark.parametrize("name", ["qwen2moe", "qwen3moe"])
def test_moe_q8_gguf_serves_the_checkpoints_tokens(name, tmp_path):
    """A Qwen2-MoE (shared expert and its sigmoid gate, q/k/v biases, top-2 not renormalised) and a Qwen3-MoE
    (q/k norms, renormalised top-2) written as llama.cpp's converter writes them (qwen2moe / qwen3moe: the
    experts as ffn_*_exps [E, rows, K], the shared expert as ffn_*_shexp, routers F32): the file's config is the
    checkpoint's, its Q8_0 experts and linears are served as their blocks (the compiled step), and the greedy
    tokens equal HF's on the same weights rounded through Q8_0."""
    import gguf

    from engine.llm import LLM
    from engine.model_executor.layers.moe import MoEMLP
    from engine.sampling_params import SamplingParams
    from tiny_models import tiny_qwen2_moe_config, tiny_qwen3_moe_config

    eps = TINY["rms_norm_eps"]
    config = (tiny_qwen2_moe_config(shared_expert_intermediate_size=64, rms_norm_eps=eps) if name == "qwen2moe" else
              tiny_qwen3_moe_config(mlp_only_layers=[], rms_norm_eps=eps))  # (llama.cpp's qwen3moe: all sparse)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    for n, p in model.named_parameters():
        if n.endswith("norm.weight"):
            p.data.normal_(1.0, 0.1)
    model.lm_head.weight.data.mul_(20.0)  # spread logits: a near-tie would test the int8 rounding, not the load
    state = _moe_state(model.state_dict())
    path = write_family_gguf(model.config, state, tmp_path / f"{name}.gguf")
    assert is_native_gguf(path)
    assert _view(gguf_config(path)) == _view(model.config)
    with torch.no_grad():
        for n, t in model.state_dict().items():  # the reference: HF on the Q8_0-rounded weights
            if t.dim() >= 2 and not n.endswith(("mlp.gate.weight", "shared_expert_gate.weight")):
                q = gguf.quants.quantize(t.numpy(), gguf.GGMLQuantizationType.Q8_0)
                t.copy_(torch.from_numpy(gguf.quants.dequantize(q, gguf.GGMLQuantizationType.Q8_0)))
    prompts = PROMPTS
    want = _hf_greedy(model, prompts)
    llm = LLM(str(path), max_model_len=64, num_gpu_blocks_override=32, block_size=16, dtype="float32")
    try:
        decoder = llm.engine.model_runner.model
        mlps = [layer.mlp for layer in decoder.layers]
        assert all(isinstance(m, MoEMLP) and m.packed is not None for m in mlps)
        assert [f.name for f, _ in formats.format_of(decoder.layers[0].self_attn.qkv_proj)] == ["Q8_0"] * 3
        if name == "qwen2moe":
            assert [f.name for f, _ in formats.format_of(mlps[0].shared_expert.gate_up_proj)] == ["Q8_0"] * 2
        outs = llm.generate(prompt_token_ids=prompts, use_tqdm=False,
                            sampling_params=SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))
        compiled = decoder._compiled_plan
    finally:
        llm.shutdown()
    assert [list(o.outputs[0].token_ids) for o in outs] == want
    assert compiled is not None and compiled.steps_run > 0  # (the eager MoE path: tests/e2e/test_moe_models.py)
