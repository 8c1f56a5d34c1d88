"""LLM.generate equals HF transformers: greedy tokens on a batch of mixed lengths, and logprobs."""
from __future__ import annotations

import pytest

from e2e_helpers import MAX_TOKENS, greedy, hf_greedy, hf_logprobs
from engine.sampling_params import SamplingParams

LOGPROB_ATOL = 1e-3


def test_default_model_greedy_matches_hf(smol_greedy_outputs, hf_smol, prompt_ids):
    eos = hf_smol.generation_config.eos_token_id
    for prompt, out in zip(prompt_ids, smol_greedy_outputs):
        ours = out.outputs[0].token_ids
        # HF stops at EOS too and includes it: the lists must be equal, EOS and all.
        assert ours == hf_greedy(hf_smol, prompt, MAX_TOKENS, eos), f"prompt of {len(prompt)} tokens"
        expected_reason = "stop" if ours[-1] == eos else "length"
        assert out.outputs[0].finish_reason == expected_reason


def test_tiny_llama_greedy_matches_hf(make_llm, hf_tiny, prompt_ids):
    outputs = make_llm("tiny").generate(
        prompt_token_ids=prompt_ids, sampling_params=greedy(ignore_eos=True), use_tqdm=False
    )
    for prompt, out in zip(prompt_ids, outputs):
        expected = hf_greedy(hf_tiny, prompt, MAX_TOKENS, eos_token_id=None)
        assert len(expected) == MAX_TOKENS
        assert out.outputs[0].token_ids == expected, f"prompt of {len(prompt)} tokens"
        assert out.outputs[0].finish_reason == "length"


@pytest.mark.parametrize("temperature", [0.0, 1.0], ids=["greedy", "sampled"])
def test_logprobs_match_hf_log_softmax(make_llm, hf_smol, prompt_ids, temperature):
    params = SamplingParams(temperature=temperature, seed=7, max_tokens=12, logprobs=5, ignore_eos=True)
    prompts = prompt_ids[1:5] + prompt_ids[-1:]
    outputs = make_llm("smol").generate(prompt_token_ids=prompts, sampling_params=params, use_tqdm=False)
    for prompt, out in zip(prompts, outputs):
        completion = out.outputs[0]
        assert len(completion.logprobs) == len(completion.token_ids) == 12
        # One HF forward over prompt + output; row len(prompt) - 1 + i predicts output token i.
        ref = hf_logprobs(hf_smol, prompt + completion.token_ids)[len(prompt) - 1 : -1]
        total = 0.0
        for i, (token, logprobs) in enumerate(zip(completion.token_ids, completion.logprobs)):
            assert logprobs[token] == pytest.approx(ref[i, token].item(), abs=LOGPROB_ATOL)
            total += logprobs[token]
            top_vals, top_ids = ref[i].topk(5)
            # The top-5 dict holds the 5 largest (and the sampled token, if it is not among them).
            assert set(top_ids.tolist()) <= set(logprobs)
            assert set(logprobs) <= set(top_ids.tolist()) | {token}
            for value, tid in zip(top_vals.tolist(), top_ids.tolist()):
                assert logprobs[tid] == pytest.approx(value, abs=LOGPROB_ATOL)
        assert completion.cumulative_logprob == pytest.approx(total, abs=1e-4)
