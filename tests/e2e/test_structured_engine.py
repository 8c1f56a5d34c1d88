"""Structured outputs in the engine: the grammar state survives preemption by recompute and by swap, forks with
n=2, ends with the request on abort, and wins over min_tokens; beam search with a grammar is refused."""
from __future__ import annotations

import re

import pytest

from e2e_helpers import MAX_MODEL_LEN, MAX_TOKENS, assert_all_blocks_free, blocks_for, greedy, seeded_pair, token_ids
from engine.sampling_params import GuidedSpec, SamplingParams

WORD = r"[a-z]{3,40}"  # long enough to keep every sequence decoding past the cache's limit
SPEC = GuidedSpec("regex", WORD)


def check(outputs) -> None:
    for out in outputs:
        assert out.error is None
        for c in out.outputs:
            assert (c.finish_reason == "stop" and re.fullmatch(WORD, c.text)) or (
                c.finish_reason == "length" and re.fullmatch(r"[a-z]*", c.text) and len(c.token_ids) == MAX_TOKENS), c


@pytest.fixture(scope="module")
def reference(make_llm, prompt_ids):
    llm = make_llm("tiny")
    return (token_ids(llm.generate(prompt_token_ids=prompt_ids, sampling_params=greedy(guided=SPEC), use_tqdm=False)),
            token_ids(llm.generate(prompt_token_ids=prompt_ids, sampling_params=seeded_pair(guided=SPEC),
                                   use_tqdm=False)))


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_constrained_outputs_survive_preemption(make_llm, prompt_ids, reference, mode):
    llm = make_llm("tiny", num_gpu_blocks_override=2 * blocks_for(MAX_MODEL_LEN) + 1, preemption_mode=mode)
    before = getattr(llm.engine.get_stats(), f"num_preemptions_{mode}")
    out_greedy = llm.generate(prompt_token_ids=prompt_ids, sampling_params=greedy(guided=SPEC), use_tqdm=False)
    out_seeded = llm.generate(prompt_token_ids=prompt_ids, sampling_params=seeded_pair(guided=SPEC), use_tqdm=False)
    assert getattr(llm.engine.get_stats(), f"num_preemptions_{mode}") > before, "nothing was preempted"
    check(out_greedy)
    check(out_seeded)
    assert (token_ids(out_greedy), token_ids(out_seeded)) == reference
    assert_all_blocks_free(llm.engine)


def test_abort_mid_grammar_frees_every_block(make_llm, prompt_ids):
    engine = make_llm("tiny").engine
    for i, ids in enumerate(prompt_ids):
        engine.add_request(f"g{i}", prompt_token_ids=ids, params=seeded_pair(guided=SPEC))
    for _ in range(3):
        engine.step()
    engine.abort_request([f"g{i}" for i in range(len(prompt_ids))])
    assert_all_blocks_free(engine)


def test_the_grammar_wins_over_min_tokens(make_llm, prompt_ids):
    # min_tokens holds back EOS, the only token the finished choice allows: the grammar ends the output.
    params = SamplingParams(temperature=0.0, max_tokens=10, min_tokens=8, guided=GuidedSpec.choice(["yes", "no"]))
    out = make_llm("tiny").generate(prompt_token_ids=prompt_ids[:2], sampling_params=params, use_tqdm=False)
    assert all(o.outputs[0].text in ("yes", "no") and o.outputs[0].finish_reason == "stop" for o in out)


def test_beam_search_with_a_grammar_is_refused():
    with pytest.raises(ValueError, match="use_beam_search"):
        SamplingParams(use_beam_search=True, best_of=2, temperature=0.0, guided=SPEC)


def test_an_invalid_grammar_names_the_problem(make_llm):
    engine = make_llm("tiny").engine
    with pytest.raises(ValueError, match="invalid regex"):
        engine.structured.compile(GuidedSpec("regex", "[a-"))
    with pytest.raises(ValueError, match="invalid JSON schema"):
        engine.structured.compile(GuidedSpec("json", '{"type": "no-such-type"}'))
