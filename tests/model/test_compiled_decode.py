"""The compiled step (csrc/cpu/decode_layers.cpp) against the eager layers: the same tokens and bit-identical
logprobs on every family the one decoder serves (GQA, Qwen2's qkv bias, Llama's attention and MLP biases,
Mistral's sliding window, Qwen3's q/k norms, Gemma 3's four norms, GELU-tanh MLP, interleaved windows and per-layer
RoPE, Phi-3's fused checkpoint), in float32 and bfloat16, for decode steps, prefills (with and without a cached prefix)
and chunked prefill's mixed steps, with the MLP's gate/up linear and activation fused or (a width off the 16-column
blocks) not; and the eager path taken wherever the compiled one does not serve."""
from __future__ import annotations

import random

import pytest
import torch
from transformers import Gemma2Config, Gemma3TextConfig, LlamaConfig, MistralConfig, Phi3Config, Qwen2Config, Qwen3Config

from engine import ops
from engine.llm import LLM
from engine.sampling_params import SamplingParams
from tiny_models import save_random_model

pytestmark = pytest.mark.skipif(ops.backend() is not ops.OpsBackend.COMPILED_CPU, reason="needs the compiled CPU ops")

TINY = dict(vocab_size=1024, hidden_size=64, intermediate_size=128, num_hidden_layers=3, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=512, tie_word_embeddings=False)
ARCHITECTURES = {
    "llama-gqa": lambda: LlamaConfig(**TINY),
    "llama-biases": lambda: LlamaConfig(**TINY, attention_bias=True, mlp_bias=True),
    "qwen2-qkv-bias": lambda: Qwen2Config(**TINY, use_sliding_window=False),
    "mistral-window": lambda: MistralConfig(**TINY, sliding_window=8),
    "qwen3-qk-norm": lambda: Qwen3Config(**TINY, head_dim=32),
    "gemma3-interleaved": lambda: Gemma3TextConfig(
        **TINY, head_dim=16, query_pre_attn_scalar=24, sliding_window=8, final_logit_softcapping=30.0,
        layer_types=["sliding_attention", "full_attention", "sliding_attention"],
        rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                         "full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1000000.0}}),
    "phi3-fused": lambda: Phi3Config(**TINY, pad_token_id=0, eos_token_id=1, bos_token_id=1),
}
PROMPT_LENS = [1, 5, 13, 30]  # a decode batch of 4 rows, contexts crossing the 8-token window and 16-token blocks


@pytest.fixture(scope="module", params=sorted(ARCHITECTURES))
def model_dir(request, tmp_path_factory, default_model_dir):
    from transformers import AutoModelForCausalLM

    folder = save_random_model(ARCHITECTURES[request.param](), tmp_path_factory.mktemp(request.param),
                               default_model_dir, seed=3)
    model = AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32)
    with torch.no_grad():  # HF initialises biases and norms to constants: make them count
        for name, p in model.named_parameters():
            if name.endswith("bias") or "norm" in name:
                p.add_(torch.randn_like(p) * 0.1)
    model.save_pretrained(str(folder))
    return folder


def _prompts() -> list[list[int]]:
    rng = random.Random(0)
    return [[rng.randrange(3, TINY["vocab_size"]) for _ in range(n)] for n in PROMPT_LENS]


def _run(model_dir, dtype: str, enforce_eager: bool, prompts=None, rounds: int = 1, **kwargs):
    llm = LLM(model=str(model_dir), dtype=dtype, enforce_eager=enforce_eager, max_model_len=128, block_size=16,
              num_gpu_blocks_override=64, num_cpu_blocks_override=16, seed=0, **kwargs)
    params = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True, logprobs=3)
    for _ in range(rounds):
        outputs = llm.generate(prompt_token_ids=prompts or _prompts(), sampling_params=params, use_tqdm=False)
    return outputs, llm.engine.model_runner.model.compiled_plan(), llm


def _assert_bit_identical(compiled, eager) -> None:
    for a, b in zip(compiled, eager, strict=True):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        # The same kernels on the same buffers in the same order: not close, equal.
        assert a.outputs[0].logprobs == b.outputs[0].logprobs
        assert a.outputs[0].cumulative_logprob == b.outputs[0].cumulative_logprob


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_compiled_decode_equals_eager_bit_for_bit(model_dir, dtype):
    compiled, plan, _ = _run(model_dir, dtype, enforce_eager=False)
    eager, eager_plan, _ = _run(model_dir, dtype, enforce_eager=True)
    assert plan is not None and plan.steps_run >= 19, "every decode step ran compiled"
    if plan.max_rows >= sum(PROMPT_LENS):  # the small-row kernel serves the prefill's rows too (this CPU, dtype)
        assert plan.steps_run == 20, "the prefill step ran compiled too"
    assert eager_plan is None or eager_plan.steps_run == 0, "--enforce-eager ran no compiled step"
    _assert_bit_identical(compiled, eager)


def test_chunked_prefill_mixed_steps_equal_eager_bit_for_bit(model_dir):
    """Chunked prefill: steps of prompt chunks beside decode tokens (spans starting mid-prompt, over the cached
    chunks before them) run compiled, and equal the eager chunked run bit for bit."""
    chunking = dict(enable_chunked_prefill=True, max_num_batched_tokens=16, max_num_seqs=4)
    eager, _, _ = _run(model_dir, "float32", enforce_eager=True, **chunking)
    chunked, plan, _ = _run(model_dir, "float32", enforce_eager=False, **chunking)
    assert plan.steps_run >= 20, "the chunked prompts' steps (mixed prefill + decode, at most 16 rows) compiled"
    _assert_bit_identical(chunked, eager)


def test_prefill_over_a_cached_prefix_equals_eager_bit_for_bit(model_dir):
    """Prefix caching: the second round's prompts read two cached blocks back and prefill only their tails."""
    rng = random.Random(1)
    prefix = [rng.randrange(3, TINY["vocab_size"]) for _ in range(32)]
    prompts = [prefix + [rng.randrange(3, TINY["vocab_size"]) for _ in range(n)] for n in (1, 6, 17)]
    runs = {}
    for eager in (False, True):
        outputs, plan, llm = _run(model_dir, "float32", enforce_eager=eager, prompts=prompts, rounds=2,
                                  enable_prefix_caching=True)
        assert llm.engine.get_stats().prefix_cache_hit_rate > 0
        runs[eager] = outputs
        if not eager and plan.max_rows >= 3 * 17:
            assert plan.steps_run == 40, "both rounds' prefills ran compiled"
    _assert_bit_identical(runs[False], runs[True])


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_an_mlp_width_off_the_16_column_blocks_equals_eager_bit_for_bit(tmp_path, default_model_dir, dtype):
    """An intermediate size that is not a multiple of 16: gate and up columns meet inside a packed block, so the
    compiled step runs gate_up and the activation as two kernels instead of the fused tiles (small_gemm_glu
    declines); still equal to eager. (TINY's 128 runs the fused tiles on an AVX-512 CPU.)"""
    folder = save_random_model(LlamaConfig(**{**TINY, "intermediate_size": 120}), tmp_path, default_model_dir, seed=4)
    compiled, plan, _ = _run(folder, dtype, enforce_eager=False)
    eager, _, _ = _run(folder, dtype, enforce_eager=True)
    assert plan is not None and plan.steps_run >= 19
    _assert_bit_identical(compiled, eager)


def test_linears_left_to_onednn_run_eagerly(model_dir, monkeypatch):
    """PAGEDSERVE_SMALL_ROW_LINEAR=0 packs the linears for oneDNN only: no plan, every step eager, same tokens."""
    reference, _, _ = _run(model_dir, "float32", enforce_eager=True)
    monkeypatch.setenv("PAGEDSERVE_SMALL_ROW_LINEAR", "0")
    outputs, plan, _ = _run(model_dir, "float32", enforce_eager=False)
    assert plan is None
    assert [o.outputs[0].token_ids for o in outputs] == [o.outputs[0].token_ids for o in reference]


def test_a_prefill_longer_than_the_mlps_row_pass_equals_eager_bit_for_bit(model_dir):
    """A 600-token prefill step: the compiled MLP runs it 512 rows at a time (decode_layers.cpp's kMlpRows)."""
    rng = random.Random(2)
    prompts = [[rng.randrange(3, TINY["vocab_size"]) for _ in range(100)] for _ in range(6)]
    compiled, plan, _ = _run(model_dir, "float32", enforce_eager=False, prompts=prompts)
    eager, _, _ = _run(model_dir, "float32", enforce_eager=True, prompts=prompts)
    if plan.max_rows >= 600:  # the small-row kernel serves the prefill's rows (float32 on AVX-512)
        assert plan.steps_run == 20, "the 600-token prefill step ran compiled"
    _assert_bit_identical(compiled, eager)


def test_gemma2_attention_softcaps_run_eagerly(tmp_path, default_model_dir):
    """Gemma 2's attention soft-cap has no kernel in the compiled loop (the ops' reference runs it): no plan, every
    step eager, the same tokens as --enforce-eager."""
    config = Gemma2Config(**TINY, head_dim=16, query_pre_attn_scalar=16, sliding_window=8,
                          attn_logit_softcapping=2.0, final_logit_softcapping=3.0)
    folder = save_random_model(config, tmp_path, default_model_dir, seed=5)
    outputs, plan, _ = _run(folder, "float32", enforce_eager=False)
    eager, _, _ = _run(folder, "float32", enforce_eager=True)
    assert plan is None
    _assert_bit_identical(outputs, eager)


def test_an_engine_reset_frees_the_old_kv_cache_after_compiled_steps(model_dir):
    """LLMEngine.reset drops the old cache before allocating the new one; the plan must not keep it alive."""
    import gc
    import weakref

    _, plan, llm = _run(model_dir, "float32", enforce_eager=False)
    assert plan.steps_run > 0
    old_key_cache = weakref.ref(llm.engine.cache_engine.device_cache[0][0])
    llm.engine.reset()
    gc.collect()
    assert old_key_cache() is None, "the old KV cache is still referenced after the reset"
