"""The compiled decode step and the eager reference (--enforce-eager) on the real model: both equal HF transformers'
greedy output, and each other bit for bit, with a roomy cache, under preemption by swap and by recompute, and with
prefix caching. (The rest of the e2e suite runs with the compiled step on, its default.)"""
from __future__ import annotations

import pytest

from e2e_helpers import MAX_MODEL_LEN, MAX_TOKENS, blocks_for, greedy, hf_greedy, seeded_pair, token_ids
from engine import ops
from engine.sampling_params import SamplingParams

pytestmark = pytest.mark.skipif(ops.backend() is not ops.OpsBackend.COMPILED_CPU, reason="needs the compiled CPU ops")

CONDITIONS = {
    "roomy": {},
    "swap": dict(num_gpu_blocks_override=2 * blocks_for(MAX_MODEL_LEN) + 1, preemption_mode="swap"),
    "recompute": dict(num_gpu_blocks_override=2 * blocks_for(MAX_MODEL_LEN) + 1, preemption_mode="recompute"),
    "prefix_caching": dict(enable_prefix_caching=True),
}


def _steps_run(llm) -> int:
    plan = llm.engine.model_runner.model.compiled_plan()
    return 0 if plan is None else plan.steps_run


def test_default_model_compiled_equals_eager_and_both_equal_hf(make_llm, hf_smol, prompt_ids):
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, logprobs=3)
    runs = {}
    for eager in (False, True):
        llm = make_llm("smol", enforce_eager=eager)
        before = _steps_run(llm)
        runs[eager] = llm.generate(prompt_token_ids=prompt_ids, sampling_params=params, use_tqdm=False)
        ran = _steps_run(llm) - before
        assert (ran == 0) if eager else (ran >= MAX_TOKENS - 1), f"enforce_eager={eager}: {ran} compiled steps"
    eos = hf_smol.generation_config.eos_token_id
    for prompt, fast, eager in zip(prompt_ids, runs[False], runs[True]):
        assert fast.outputs[0].token_ids == eager.outputs[0].token_ids == hf_greedy(hf_smol, prompt, MAX_TOKENS, eos)
        assert fast.outputs[0].logprobs == eager.outputs[0].logprobs  # bit-identical, not close


@pytest.mark.parametrize("condition", sorted(CONDITIONS))
def test_tiny_model_compiled_equals_eager_under(make_llm, hf_tiny, prompt_ids, condition):
    kwargs = CONDITIONS[condition]
    outputs = {}
    for eager in (False, True):
        llm = make_llm("tiny", enforce_eager=eager, **kwargs)
        before = llm.engine.get_stats()
        rounds = 2 if condition == "prefix_caching" else 1  # the second round's prompts hit the prefix cache
        for _ in range(rounds):
            out_greedy = llm.generate(prompt_token_ids=prompt_ids, sampling_params=greedy(ignore_eos=True),
                                      use_tqdm=False)
            out_seeded = llm.generate(prompt_token_ids=prompt_ids, sampling_params=seeded_pair(ignore_eos=True),
                                      use_tqdm=False)
        stats = llm.engine.get_stats()
        if condition in ("swap", "recompute"):
            counter = f"num_preemptions_{condition}"
            assert getattr(stats, counter) > getattr(before, counter), "the pressured cache never preempted"
        if condition == "prefix_caching":
            assert stats.prefix_cache_hit_rate > 0
        outputs[eager] = (token_ids(out_greedy), token_ids(out_seeded))
    assert outputs[False] == outputs[True]
    for prompt, completions in zip(prompt_ids, outputs[False][0]):
        assert completions[0] == hf_greedy(hf_tiny, prompt, MAX_TOKENS, eos_token_id=None)
