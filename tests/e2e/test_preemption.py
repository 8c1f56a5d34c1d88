"""Outputs do not change when the KV cache is too small and the scheduler preempts by recompute or by swap."""
from __future__ import annotations

import pytest

from e2e_helpers import MAX_MODEL_LEN, MAX_TOKENS, blocks_for, greedy, seeded_pair, token_ids


def _pressured_blocks(n: int = 1) -> int:
    """Just enough device blocks for n sequences of max_model_len tokens, and one to spare."""
    return n * blocks_for(MAX_MODEL_LEN) + 1


@pytest.fixture(scope="module")
def tiny_reference(make_llm, prompt_ids):
    """Greedy and seeded n=2 outputs of the tiny model with a roomy cache: what every condition must give."""
    llm = make_llm("tiny")
    ref_greedy = llm.generate(prompt_token_ids=prompt_ids, sampling_params=greedy(ignore_eos=True), use_tqdm=False)
    ref_seeded = llm.generate(prompt_token_ids=prompt_ids, sampling_params=seeded_pair(ignore_eos=True),
                              use_tqdm=False)
    assert llm.engine.get_stats().num_preemptions_recompute == llm.engine.get_stats().num_preemptions_swap == 0
    return token_ids(ref_greedy), token_ids(ref_seeded)


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_tiny_model_outputs_survive_preemption(make_llm, prompt_ids, tiny_reference, mode):
    ref_greedy, ref_seeded = tiny_reference
    # n=2 groups need room for both sequences at full length once a recompute un-shares their prompt.
    llm = make_llm("tiny", num_gpu_blocks_override=_pressured_blocks(n=2), preemption_mode=mode)
    stats_before = llm.engine.get_stats()
    out_greedy = llm.generate(prompt_token_ids=prompt_ids, sampling_params=greedy(ignore_eos=True), use_tqdm=False)
    stats_greedy = llm.engine.get_stats()
    out_seeded = llm.generate(prompt_token_ids=prompt_ids, sampling_params=seeded_pair(ignore_eos=True),
                              use_tqdm=False)
    stats_seeded = llm.engine.get_stats()

    counter = f"num_preemptions_{mode}"
    other = "num_preemptions_swap" if mode == "recompute" else "num_preemptions_recompute"
    assert getattr(stats_greedy, counter) > getattr(stats_before, counter), "the greedy run never preempted"
    assert getattr(stats_seeded, counter) > getattr(stats_greedy, counter), "the n=2 run never preempted"
    assert getattr(stats_seeded, other) == getattr(stats_before, other)
    assert all(out.error is None for out in out_greedy + out_seeded)
    assert token_ids(out_greedy) == ref_greedy
    assert token_ids(out_seeded) == ref_seeded
    assert all(len(c) == MAX_TOKENS for req in token_ids(out_seeded) for c in req)


def test_default_model_greedy_survives_recompute(make_llm, prompt_ids, smol_greedy_outputs):
    # The longest prompt and three others: enough to overflow a cache of one max-length sequence.
    chosen = [1, 2, 3, len(prompt_ids) - 1]
    reference = [smol_greedy_outputs[i] for i in chosen]
    llm = make_llm("smol", num_gpu_blocks_override=_pressured_blocks(), preemption_mode="recompute")
    outputs = llm.generate(prompt_token_ids=[prompt_ids[i] for i in chosen], sampling_params=greedy(), use_tqdm=False)
    assert llm.engine.get_stats().num_preemptions_recompute > 0
    assert token_ids(outputs) == token_ids(reference)
    assert [o.outputs[0].finish_reason for o in outputs] == [o.outputs[0].finish_reason for o in reference]
