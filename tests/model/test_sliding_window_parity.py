"""Tiny random models whose sliding window is shorter than their prompts: LLM.generate's greedy tokens equal HF's past
the window, under chunked prefill with prefix caching and under preemption by swap and by recompute. Mistral windows
every layer, so the block manager releases the blocks the window has left behind; Gemma 2 and 3 interleave windowed
layers with global ones (each kind with its own RoPE in Gemma 3, soft-caps in Gemma 2), so every block is kept
while each windowed layer's attention is still bounded by its window."""
from __future__ import annotations

import random

import pytest
import torch
from transformers import AutoModelForCausalLM, Gemma2Config, Gemma3TextConfig, MistralConfig

from engine.llm import LLM
from engine.sampling_params import SamplingParams
from tiny_models import save_random_model

WINDOW = 8  # tokens; the prompts run to 37 and the outputs to 37 + 24
MAX_TOKENS = 24
PROMPT_LENS = [5, 20, 37]
TINY = dict(vocab_size=1024, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=512, tie_word_embeddings=False)


GEMMA = dict(head_dim=16, query_pre_attn_scalar=16, sliding_window=WINDOW,
             layer_types=["sliding_attention", "full_attention"])
FAMILIES = {  # config, the window the block manager applies (None: a global layer reads every block)
    "mistral": (lambda: MistralConfig(**TINY, sliding_window=WINDOW), WINDOW),
    "gemma3": (lambda: Gemma3TextConfig(**TINY, **GEMMA, rope_parameters={
        "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
        "full_attention": {"rope_type": "default", "rope_theta": 1000000.0}}), None),
    "gemma2": (lambda: Gemma2Config(**TINY, **GEMMA, attn_logit_softcapping=2.0, final_logit_softcapping=3.0), None),
}


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def family(request):
    return request.param


@pytest.fixture(scope="module")
def model_dir(family, tmp_path_factory, default_model_dir):
    return save_random_model(FAMILIES[family][0](), tmp_path_factory.mktemp(f"{family}-window"), default_model_dir)


@pytest.fixture(scope="module")
def mistral_dir(tmp_path_factory, default_model_dir):
    return save_random_model(FAMILIES["mistral"][0](), tmp_path_factory.mktemp("mistral-window"), default_model_dir)


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    rng = random.Random(0)
    return [[rng.randrange(3, TINY["vocab_size"]) for _ in range(n)] for n in PROMPT_LENS]


@torch.no_grad()
def hf_greedy(model, prompt: list[int], max_new_tokens: int) -> list[int]:
    """Greedy tokens from a full forward per token: HF's own sliding-window mask, no cache involved."""
    ids = list(prompt)
    for _ in range(max_new_tokens):
        ids.append(int(model(torch.tensor([ids])).logits[0, -1].argmax()))
    return ids[len(prompt):]


def _hf_outputs(folder, prompts) -> list[list[int]]:
    model = AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32, attn_implementation="eager")
    assert model.config.sliding_window == WINDOW
    expected = [hf_greedy(model.eval(), p, MAX_TOKENS) for p in prompts]
    # The window must change HF's answer, or equal outputs would not show that ours applies it.
    model.config.sliding_window = 10**6
    assert [hf_greedy(model, p, MAX_TOKENS) for p in prompts] != expected
    return expected


@pytest.fixture(scope="module")
def hf_outputs(model_dir, prompts) -> list[list[int]]:
    return _hf_outputs(model_dir, prompts)


@pytest.fixture(scope="module")
def mistral_hf_outputs(mistral_dir, prompts) -> list[list[int]]:
    return _hf_outputs(mistral_dir, prompts)


@pytest.mark.parametrize("engine_kwargs,rounds", [
    ({}, 1),
    # Prompt chunks read a cached prefix through the window; the second round hits the prefix cache.
    (dict(enable_chunked_prefill=True, max_num_batched_tokens=16, max_num_seqs=4, enable_prefix_caching=True), 2),
    # 9 blocks of 8 for 3 sequences of up to 61 tokens: one is swapped out (released entries stay released
    # on the host) and back in.
    (dict(num_gpu_blocks_override=9, max_model_len=64, preemption_mode="swap"), 1),
    (dict(num_gpu_blocks_override=9, max_model_len=64, preemption_mode="recompute"), 1),
], ids=["plain", "chunked-prefix-cached", "swap-preempted", "recompute-preempted"])
def test_greedy_matches_hf_past_the_window(family, model_dir, prompts, hf_outputs, engine_kwargs, rounds):
    llm = LLM(str(model_dir), device="cpu", dtype="float32", block_size=8, **engine_kwargs)
    bm = llm.engine.scheduler.block_manager
    assert bm.sliding_window == FAMILIES[family][1]
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    for _ in range(rounds):
        outputs = llm.generate(prompt_token_ids=prompts, sampling_params=params, use_tqdm=False)
        for prompt, out, expected in zip(prompts, outputs, hf_outputs):
            assert out.outputs[0].token_ids == expected, f"prompt of {len(prompt)} tokens"
        assert bm.get_num_free_device_blocks() == bm.num_device_blocks and not bm.block_tables
        assert bm.get_num_free_cpu_blocks() == bm.num_cpu_blocks and not bm.cpu_block_tables
    if "preemption_mode" in engine_kwargs:
        assert getattr(llm.engine.get_stats(), f"num_preemptions_{engine_kwargs['preemption_mode']}") >= 1


def test_long_generation_holds_only_the_window(mistral_dir, prompts, mistral_hf_outputs):
    """Decoding 24 tokens past a 37-token prompt keeps about WINDOW / block_size blocks, not all 8."""
    llm = LLM(str(mistral_dir), device="cpu", dtype="float32", block_size=8)
    engine, bm = llm.engine, llm.engine.scheduler.block_manager
    engine.add_request("long", prompt_token_ids=prompts[-1],
                       params=SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True))
    held, tokens = [], []
    while engine.has_unfinished_requests():
        for output in engine.step():
            tokens = output.outputs[0].token_ids
        held.append(bm.num_device_blocks - bm.get_num_free_device_blocks())
    assert tokens == mistral_hf_outputs[-1]
    assert max(held[-5:]) <= WINDOW // 8 + 2 < -(-(PROMPT_LENS[-1] + MAX_TOKENS) // 8)
