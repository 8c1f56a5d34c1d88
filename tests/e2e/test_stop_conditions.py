"""Stop conditions end to end on the default model: stop strings, stop tokens, max_tokens, EOS, too-long prompts."""
from __future__ import annotations

import pytest

from e2e_helpers import MAX_MODEL_LEN, MAX_TOKENS, greedy, hf_logprobs



@pytest.fixture(scope="module")
def capped(smol_greedy_outputs):
    """A reference completion that ran to max_tokens, with a word in its middle to stop at."""
    for out in smol_greedy_outputs:
        completion = out.outputs[0]
        words = completion.text.split()
        if completion.finish_reason == "length" and len(set(completion.token_ids[:8])) >= 6 and len(words) >= 4:
            return out
    pytest.fail("no greedy reference ran to max_tokens")


@pytest.mark.parametrize("include", [False, True])
def test_stop_string_cuts_the_text(make_llm, capped, include):
    full = capped.outputs[0].text
    stop = full.split()[2]
    cut = full.index(stop)
    params = greedy(stop=[stop], include_stop_str_in_output=include)
    out = make_llm("smol").generate(prompt_token_ids=[capped.prompt_token_ids], sampling_params=params,
                                    use_tqdm=False)[0].outputs[0]
    assert out.text == (full[: cut + len(stop)] if include else full[:cut])
    assert (out.finish_reason, out.stop_reason) == ("stop", stop)
    assert out.token_ids == capped.outputs[0].token_ids[: len(out.token_ids)]
    assert len(out.token_ids) < MAX_TOKENS


def test_stop_token_ids_end_the_output_at_that_token(make_llm, capped):
    ref = capped.outputs[0].token_ids
    at = next(i for i in range(3, len(ref)) if ref[i] not in ref[:i])
    params = greedy(stop_token_ids=[ref[at]])
    out = make_llm("smol").generate(prompt_token_ids=[capped.prompt_token_ids], sampling_params=params,
                                    use_tqdm=False)[0].outputs[0]
    assert out.token_ids == ref[: at + 1]
    assert (out.finish_reason, out.stop_reason) == ("stop", ref[at])


def test_max_tokens_and_eos(make_llm, smol_tokenizer):
    chat = smol_tokenizer.apply_chat_template(
        [{"role": "user", "content": "What is 2+2? Reply with just the number."}], tokenize=False,
        add_generation_prompt=True,
    )
    llm = make_llm("smol")
    short, full = llm.generate([chat, chat], [greedy(max_tokens=3), greedy()], use_tqdm=False)
    assert len(short.outputs[0].token_ids) == 3 and short.outputs[0].finish_reason == "length"
    eos = smol_tokenizer.eos_token_id
    assert full.outputs[0].token_ids[-1] == eos and len(full.outputs[0].token_ids) < MAX_TOKENS
    assert (full.outputs[0].finish_reason, full.outputs[0].stop_reason) == ("stop", None)
    assert "4" in full.outputs[0].text and smol_tokenizer.eos_token not in full.outputs[0].text


def test_too_long_prompt_ends_with_an_error_and_max_model_len_caps(make_llm, prompt_ids):
    too_long = (prompt_ids[-1] * 2)[: MAX_MODEL_LEN + 1]
    near_cap = (prompt_ids[-1] * 2)[: MAX_MODEL_LEN - 5]
    outputs = make_llm("tiny").generate(
        prompt_token_ids=[too_long, near_cap, prompt_ids[1]], sampling_params=greedy(ignore_eos=True), use_tqdm=False
    )
    bad, capped_len, fine = outputs
    assert bad.finished and "too long" in bad.error
    assert [c.token_ids for c in bad.outputs] in ([], [[]])
    assert len(capped_len.outputs[0].token_ids) == 5 and capped_len.outputs[0].finish_reason == "length"
    assert fine.error is None and len(fine.outputs[0].token_ids) == MAX_TOKENS


def test_a_bad_prompt_refuses_the_whole_batch_and_queues_nothing(make_llm, prompt_ids):
    llm = make_llm("tiny")
    bad = [llm.engine.vocab_size]  # out of vocabulary: the third prompt is refused
    with pytest.raises(ValueError, match="out of vocabulary"):
        llm.generate(prompt_token_ids=[prompt_ids[1], prompt_ids[2], bad], sampling_params=greedy(), use_tqdm=False)
    assert not llm.engine.has_unfinished_requests(), "the prompts before the bad one stayed queued"
    before = llm.engine.get_stats().prompt_tokens_total
    (out,) = llm.generate(prompt_token_ids=[prompt_ids[3]], sampling_params=greedy(), use_tqdm=False)
    assert out.error is None and out.prompt_token_ids == prompt_ids[3]
    assert llm.engine.get_stats().prompt_tokens_total - before == len(prompt_ids[3]), "it ran the refused batch too"


def test_prompt_logprobs_for_echo(make_llm, hf_smol, prompt_ids):
    prompt = prompt_ids[2]
    out = make_llm("smol").generate(prompt_token_ids=[prompt], sampling_params=greedy(max_tokens=1, prompt_logprobs=3),
                                    use_tqdm=False)[0]
    assert len(out.prompt_logprobs) == len(prompt) and out.prompt_logprobs[0] is None
    ref = hf_logprobs(hf_smol, prompt)
    for i, (token, logprobs) in enumerate(zip(prompt[1:], out.prompt_logprobs[1:])):
        assert logprobs[token] == pytest.approx(ref[i, token].item(), abs=1e-3)
        assert set(ref[i].topk(3).indices.tolist()) <= set(logprobs)
