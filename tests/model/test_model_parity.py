"""Our model on the paged cache equals HF transformers: flattened prefill of mixed lengths, then paged decodes; for
every family the one decoder serves (its per-architecture spec: Llama, Mistral, Qwen2/3, Gemma 2/3, Phi-3), with
sliding windows shorter than the prompts and GQA."""
from __future__ import annotations

import math
import random

import pytest
import torch
from transformers import (AutoModelForCausalLM, Gemma2Config, Gemma3TextConfig, MistralConfig, Phi3Config, Qwen2Config,
                          Qwen3Config)

from tiny_models import save_random_model, tiny_llama_config
from engine.config import EngineConfig
from engine.model_executor.loader import load_model
from paged_batch import PagedBatch, append_greedy, hf_logits

ATOL = RTOL = 1e-4
TINY = dict(vocab_size=1024, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512)

SMALL_VOCAB = 1024  # random token ids; a small head keeps the HF reference cheap

CONFIGS = {
    "llama-gqa": lambda: tiny_llama_config(vocab_size=SMALL_VOCAB),
    "qwen2-attention-bias": lambda: Qwen2Config(**TINY, tie_word_embeddings=False),
    "mistral": lambda: MistralConfig(**TINY, sliding_window=None, tie_word_embeddings=False),
    # A window shorter than most prompts: prefill, prompt logprobs and decodes all cut at 8 tokens.
    "mistral-window-8": lambda: MistralConfig(**TINY, sliding_window=8, tie_word_embeddings=False),
    # Qwen2 windows only its layers from max_window_layers on: here layer 1, layer 0 reads everything.
    "qwen2-window-layer-1": lambda: Qwen2Config(**TINY, use_sliding_window=True, sliding_window=8, max_window_layers=1,
                                                tie_word_embeddings=False),
    "tied-embeddings": lambda: tiny_llama_config(vocab_size=SMALL_VOCAB, tie_word_embeddings=True),
    "rope-linear": lambda: tiny_llama_config(vocab_size=SMALL_VOCAB, rope_parameters={"rope_type": "linear", "factor": 2.0, "rope_theta": 10000.0}),
    "rope-llama3": lambda: tiny_llama_config(vocab_size=SMALL_VOCAB, rope_parameters={
        "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 32, "rope_theta": 500000.0}),
    "mha-head-dim-32": lambda: tiny_llama_config(vocab_size=SMALL_VOCAB, num_attention_heads=2, num_key_value_heads=2),
    # Qwen3: q/k norms before RoPE, an explicit head_dim (not hidden / heads), no bias.
    "qwen3": lambda: Qwen3Config(**TINY, head_dim=32, tie_word_embeddings=False),
    # Gemma 3: x * (1 + w) norms, four a layer, q/k norms, query_pre_attn_scalar, GELU-tanh, scaled and tied
    # embeddings; a sliding layer (window 8, its own RoPE base) before a global one (its own base and linear
    # scaling); a final soft-cap.
    "gemma3-window-8": lambda: Gemma3TextConfig(**TINY, head_dim=16, query_pre_attn_scalar=24, sliding_window=8,
                                                layer_types=["sliding_attention", "full_attention"],
                                                rope_parameters=GEMMA3_ROPE, final_logit_softcapping=30.0),
    # Gemma 2: attention and final logit soft-caps, a windowed layer; weights drawn 25x wider than HF's default so
    # that scores and logits reach the caps (tests that pass without the caps would prove nothing).
    "gemma2-softcaps": lambda: Gemma2Config(**TINY, head_dim=16, query_pre_attn_scalar=16, sliding_window=8,
                                            attn_logit_softcapping=2.0, final_logit_softcapping=3.0,
                                            initializer_range=0.5),
    # Phi-3: the checkpoint's fused qkv_proj and gate_up_proj, a window on every layer.
    "phi3-window-8": lambda: Phi3Config(**TINY, sliding_window=8, tie_word_embeddings=False, pad_token_id=0,
                                        eos_token_id=1, bos_token_id=1),
}
GEMMA3_ROPE = {"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
               "full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1000000.0}}


def _prompts(vocab: int, lengths: list[int], seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab) for _ in range(n)] for n in lengths]


def check_parity(loaded, hf_model, prompts: list[list[int]], decode_steps: int, atol=ATOL, rtol=RTOL) -> None:
    """Prefill all prompts in one flattened batch, then decode greedily; every logit row matches HF."""
    batch = PagedBatch(loaded, block_size=8, num_blocks=128)
    groups = [batch.add(p, prompt_logprobs=1) for p in prompts]
    logits, prompt_logits = batch.step(groups)
    assert logits.shape == (len(prompts), hf_model.config.get_text_config().vocab_size) and logits.dtype == torch.float32
    for g, p, row in zip(groups, prompts, logits):
        ref = hf_logits(hf_model, p)
        torch.testing.assert_close(prompt_logits[g.request_id], ref, atol=atol, rtol=rtol)
        torch.testing.assert_close(row, ref[-1], atol=atol, rtol=rtol)
    for _ in range(decode_steps):
        append_greedy(groups, logits)
        logits, prompt_logits = batch.step(groups)
        assert prompt_logits == {}
        for g, row in zip(groups, logits):
            torch.testing.assert_close(row, hf_logits(hf_model, g.seqs[0].all_token_ids)[-1], atol=atol, rtol=rtol)


@pytest.fixture(scope="module", params=sorted(CONFIGS))
def model_pair(request, tmp_path_factory, default_model_dir):
    folder = save_random_model(CONFIGS[request.param](), tmp_path_factory.mktemp(request.param), default_model_dir)
    _randomize_norms_and_biases(folder)
    loaded = load_model(EngineConfig(model=str(folder), device="cpu", dtype="float32"))
    hf_model = hf_eager(folder)
    return loaded, hf_model


def hf_eager(folder):
    """HF's model with its eager attention: the one that applies Gemma 2's soft-cap."""
    return AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32, attn_implementation="eager").eval()


@torch.no_grad()
def _randomize_norms_and_biases(folder) -> None:
    """HF initialises norms and biases to constants (Gemma's norm weights to 0): make them count."""
    model = AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32)
    for name, p in model.named_parameters():
        if name.endswith("bias") or "norm" in name:
            p.add_(torch.randn_like(p) * 0.1)
    model.save_pretrained(str(folder))


def test_tiny_models_match_hf(model_pair):
    loaded, hf_model = model_pair
    # Lengths cross block boundaries (block_size 8); a 1-token prompt runs on the decode path.
    check_parity(loaded, hf_model, _prompts(hf_model.config.vocab_size, [5, 17, 1, 33, 8, 9]), decode_steps=4)


def test_mixed_prefill_and_decode_in_one_step(model_pair):
    loaded, hf_model = model_pair
    vocab = hf_model.config.vocab_size
    batch = PagedBatch(loaded)
    old = [batch.add(p) for p in _prompts(vocab, [12, 3], seed=1)]
    logits, _ = batch.step(old)
    append_greedy(old, logits)
    new = batch.add(_prompts(vocab, [20], seed=2)[0])
    logits, _ = batch.step([old[0], new, old[1]])  # decode, prefill, decode: rows stay in this order
    for g, row in zip([old[0], new, old[1]], logits):
        torch.testing.assert_close(row, hf_logits(hf_model, g.seqs[0].all_token_ids)[-1], atol=ATOL, rtol=RTOL)


def test_prefill_with_cached_prefix_equals_full_prefill(model_pair):
    loaded, hf_model = model_pair
    vocab = hf_model.config.vocab_size
    shared, tail_a, tail_b = _prompts(vocab, [24, 5, 11], seed=3)
    batch = PagedBatch(loaded, block_size=8)
    first = batch.add(shared + tail_a)
    batch.step([first])
    prefix_blocks = batch.tables[first.seqs[0].seq_id][:3]  # the 24 shared tokens fill 3 blocks
    hit = batch.add(shared + tail_b, prompt_logprobs=1, prefix_blocks=prefix_blocks, num_computed=24)
    fresh = batch.add(shared + tail_b, prompt_logprobs=1)
    logits, prompt_logits = batch.step([hit, fresh])
    assert prompt_logits[hit.request_id].shape[0] == len(tail_b)  # only the uncached tokens were computed
    torch.testing.assert_close(prompt_logits[hit.request_id], prompt_logits[fresh.request_id][24:], atol=ATOL, rtol=RTOL)
    torch.testing.assert_close(logits[0], hf_logits(hf_model, shared + tail_b)[-1], atol=ATOL, rtol=RTOL)
    append_greedy([hit, fresh], logits)
    logits, _ = batch.step([hit, fresh])  # decoding on top of shared blocks
    torch.testing.assert_close(logits[0], logits[1], atol=ATOL, rtol=RTOL)


def test_unsupported_rope_is_refused(tmp_path, default_model_dir):
    from engine.model_executor.models.llama import LlamaForCausalLM

    config = tiny_llama_config(rope_parameters={"rope_type": "proportional", "rope_theta": 10000.0, "factor": 2.0})
    with pytest.raises(ValueError, match="rope scaling type 'proportional' is not supported"):
        LlamaForCausalLM(config)
    partial = Phi3Config(**TINY, rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
                                                  "partial_rotary_factor": 0.75})
    with pytest.raises(ValueError, match="partial_rotary_factor"):
        LlamaForCausalLM(partial)


def test_llama3_rope_matches_hf_far_beyond_original_max_position_embeddings(tmp_path, default_model_dir):
    """llama3 RoPE scaling (original_max_position_embeddings 32): a 100-token prompt and its decodes, 3x past it."""
    folder = save_random_model(CONFIGS["rope-llama3"](), tmp_path, default_model_dir)
    loaded = load_model(EngineConfig(model=str(folder), device="cpu", dtype="float32"))
    check_parity(loaded, hf_eager(folder), _prompts(SMALL_VOCAB, [100], seed=5), decode_steps=3)


LONGROPE = {"rope_type": "longrope", "rope_theta": 10000.0, "original_max_position_embeddings": 32,
            "short_factor": [1.0 + 0.1 * i for i in range(8)], "long_factor": [1.0 + 0.5 * i for i in range(8)]}


@pytest.mark.parametrize("max_model_len,lengths", [(32, [5, 17, 27]), (None, [33, 40])], ids=["short", "long"])
def test_phi3_longrope_matches_hf(tmp_path, default_model_dir, max_model_len, lengths):
    """longrope (Phi-3.5's "su"): the short factors where the server serves at most original_max_position_embeddings
    (32) tokens, the long ones (and HF's attention factor) where it serves more, as vLLM chooses
    (engine/model_executor/models/rope.py): HF's numbers wherever HF's whole sequence is on the same side of 32."""
    config = Phi3Config(**TINY, rope_parameters=dict(LONGROPE), original_max_position_embeddings=32,
                        tie_word_embeddings=False, pad_token_id=0,
                        eos_token_id=1, bos_token_id=1)
    folder = save_random_model(config, tmp_path, default_model_dir)
    loaded = load_model(EngineConfig(model=str(folder), device="cpu", dtype="float32", max_model_len=max_model_len))
    check_parity(loaded, hf_eager(folder), _prompts(SMALL_VOCAB, lengths, seed=6), decode_steps=2)


@pytest.fixture(scope="module")
def smollm2(default_model_dir):
    loaded = load_model(EngineConfig(model=str(default_model_dir), device="cpu", dtype="float32"))
    hf_model = AutoModelForCausalLM.from_pretrained(str(default_model_dir), dtype=torch.float32).eval()
    return loaded, hf_model


@pytest.mark.slow
def test_default_smollm2_matches_hf(smollm2):
    loaded, hf_model = smollm2
    assert loaded.dtype == torch.float32
    tok = loaded.tokenizer
    texts = ["The capital of France is", "def fibonacci(n):", "Hi", "Once upon a time, in a land far, far away, there lived"]
    prompts = [tok(t).input_ids for t in texts]
    check_parity(loaded, hf_model, prompts, decode_steps=3, atol=5e-4, rtol=1e-4)


@pytest.mark.slow
def test_default_smollm2_bfloat16_tracks_hf_float32(smollm2, default_model_dir):
    """--dtype bfloat16 (the fast path on CPUs with AVX-512 BF16) keeps HF float32's next tokens and logprobs.

    bf16 has 8 bits of mantissa: logprobs move by up to ~0.1 nat here on a Zen 4 (0.09 seen over these 24 rows),
    so the check is on what a user sees (the greedy token where HF's top two are not a near tie, and its
    logprob), not on every logit. Where HF's top token is unlikely (p < 0.1: a flat row, where a logit's rounding
    moves its logprob most), its probability is checked instead: on a Xeon with AMX one such row (p = 0.037) moved
    0.251 nat (0.16 on the small-row kernel alone; HF's own bfloat16 model moved it 0.107), 0.008 in probability.
    """
    _, hf_model = smollm2
    loaded = load_model(EngineConfig(model=str(default_model_dir), device="cpu", dtype="bfloat16"))
    assert loaded.model.lm_head.weight.dtype == torch.bfloat16
    tok = loaded.tokenizer
    texts = ["The capital of France is", "def fibonacci(n):", "Hi", "Once upon a time, in a land far, far away, there lived",
             "Water boils at a temperature of", "import numpy as np\nimport"]
    prompts = [tok(t).input_ids for t in texts]
    batch = PagedBatch(loaded, block_size=8, num_blocks=128)
    groups = [batch.add(p) for p in prompts]
    logits, _ = batch.step(groups)
    for _ in range(4):  # a prefill, then decodes that read the bf16 KV cache
        for g, row in zip(groups, logits):
            ref = hf_logits(hf_model, g.seqs[0].all_token_ids)[-1].log_softmax(-1)
            ours = row.log_softmax(-1)
            top2 = ref.topk(2)
            if top2.values[0] - top2.values[1] > 0.15:
                assert int(ours.argmax()) == int(top2.indices[0]), tok.decode(g.seqs[0].all_token_ids)
            ours_top, ref_top = float(ours[top2.indices[0]]), float(top2.values[0])
            if ref_top >= math.log(0.1):
                assert abs(ours_top - ref_top) < 0.25
            else:
                assert abs(math.exp(ours_top) - math.exp(ref_top)) < 0.02
        append_greedy(groups, [torch.log_softmax(r, -1) for r in logits])
        logits, _ = batch.step(groups)


def test_gemma3_multimodal_checkpoints_text_model_matches_hf(tmp_path, default_model_dir):
    """Gemma3ForConditionalGeneration (the 4B-27B checkpoints): its text model under language_model., served as
    text; the vision tower and projector are skipped. Logits equal HF's multimodal model on text-only input."""
    from transformers import Gemma3Config

    text = CONFIGS["gemma3-window-8"]()
    vision = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2, image_size=28,
                  patch_size=14)
    config = Gemma3Config(text_config=text.to_dict(), vision_config=vision, mm_tokens_per_image=1,
                          image_token_index=1000, boi_token_index=1001, eoi_token_index=1002)
    folder = save_random_model(config, tmp_path, default_model_dir)
    _randomize_norms_and_biases(folder)
    loaded = load_model(EngineConfig(model=str(folder), device="cpu", dtype="float32"))
    assert loaded.hf_config.model_type == "gemma3_text"
    check_parity(loaded, hf_eager(folder), _prompts(SMALL_VOCAB - 30, [5, 17], seed=7), decode_steps=2)


def test_gemma3_spec_from_a_config_in_the_older_form():
    """A Gemma 3 config as GGUF metadata or transformers 4 state it (rope_local_base_freq, sliding_window_pattern, no
    layer_types): every 6th layer global with rope_theta, the others windowed with the local base."""
    from types import SimpleNamespace

    from engine.model_executor.models.llama_args import ModelArgs
    from engine.model_executor.models.rope import rope_inv_freq

    config = SimpleNamespace(model_type="gemma3_text", vocab_size=1024, hidden_size=64, intermediate_size=128,
                             num_hidden_layers=7, num_attention_heads=4, num_key_value_heads=1, head_dim=16,
                             rms_norm_eps=1e-6, rope_theta=1000000.0, rope_local_base_freq=10000.0,
                             sliding_window=512, sliding_window_pattern=6, query_pre_attn_scalar=16,
                             hidden_activation="gelu_pytorch_tanh", tie_word_embeddings=True)
    args = ModelArgs.from_hf(config)
    assert args.layer_windows == (512,) * 5 + (None, 512)
    assert args.layer_rope[5] == "full_attention" and args.layer_rope[0] == "sliding_attention"
    local, _ = rope_inv_freq(config, 16, 64, "sliding_attention")
    global_, _ = rope_inv_freq(config, 16, 64, "full_attention")
    exponent = torch.arange(0, 16, 2).float() / 16
    torch.testing.assert_close(local, 1.0 / 10000.0**exponent)
    torch.testing.assert_close(global_, 1.0 / 1000000.0**exponent)
    assert (args.norm_offset, args.embed_scale, args.mlp_act, args.attn_scale) == (1.0, 8.0, "gelu_tanh", 0.25)
