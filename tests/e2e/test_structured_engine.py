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


def test_a_token_the_grammar_refuses_ends_its_request_with_an_error(make_llm, prompt_ids, smol_tokenizer):
    # The mask makes a refused token impossible; one forced past it (here: the sampler's pick replaced by a digit,
    # which WORD never allows) ends that request with an error instead of letting it go on unconstrained.
    engine = make_llm("tiny").engine
    digit = smol_tokenizer.convert_tokens_to_ids("7")
    real_sampler, forced = engine.sampler, []

    def sampler(logits, rows):
        samples = real_sampler(logits, rows)
        for (group, _), group_samples in zip(rows, samples):
            if group.request_id == "forced" and len(group.seqs[0].output_token_ids) == 2 and not forced:
                forced.append(group_samples[0].token_id)
                group_samples[0] = group_samples[0]._replace(token_id=digit, logprobs={digit: -1.0})
        return samples

    engine.sampler = sampler
    try:
        engine.add_request("forced", prompt_token_ids=prompt_ids[1], params=greedy(guided=SPEC))
        engine.add_request("other", prompt_token_ids=prompt_ids[2], params=greedy(guided=SPEC))
        finals = {}
        while engine.has_unfinished_requests():
            finals.update({out.request_id: out for out in engine.step() if out.finished})
    finally:
        engine.sampler = real_sampler
    assert forced, "the forced token was never sampled"
    bad = finals["forced"]
    assert bad.outputs[0].finish_reason == "error" and "grammar" in bad.error, bad
    assert bad.outputs[0].token_ids[-1] == digit and len(bad.outputs[0].token_ids) == 3
    check([finals["other"]])


def test_a_grammar_no_token_can_start_is_refused_when_compiled(make_llm):
    # SmolLM2's byte-level vocabulary has no token for the byte 0x04: nothing could ever be sampled (a 400 at once).
    with pytest.raises(ValueError, match="invalid regex: no token of this model's vocabulary can start it"):
        make_llm("tiny").engine.structured.compile(GuidedSpec("regex", "\x04"))


@pytest.mark.parametrize("make_params", [greedy, seeded_pair], ids=["greedy", "seeded-n2"])
def test_a_grammar_at_a_dead_end_ends_its_request_as_the_clients_error(make_llm, prompt_ids, make_params):
    # "ab" can be written; the 0x04 that must follow cannot (no token spells it): every row of the request ends
    # there with a client's error (FINISHED_IGNORED: the server answers 400, not 503), the other request goes on.
    engine = make_llm("tiny").engine
    engine.add_request("dead", prompt_token_ids=prompt_ids[1], params=make_params(guided=GuidedSpec("regex", "ab\x04")))
    engine.add_request("other", prompt_token_ids=prompt_ids[2], params=greedy(guided=SPEC))
    finals = {}
    while engine.has_unfinished_requests():
        finals.update({out.request_id: out for out in engine.step() if out.finished})
    bad = finals["dead"]
    assert bad.error is not None and "allows no token of this model's vocabulary" in bad.error, bad
    assert all(c.finish_reason == "length" and c.text.startswith("ab") for c in bad.outputs), bad
    check([finals["other"]])
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
