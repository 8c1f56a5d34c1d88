"""The offline API as vLLM's users call it: dict prompts (TextPrompt / TokensPrompt) and LLM.chat, on the default
model, against the same prompts given as strings and token ids; bad inputs are refused with the prompt named."""
from __future__ import annotations

import pytest

from e2e_helpers import PROMPTS, greedy, token_ids

CHAT = [{"role": "user", "content": "What is the capital of France?"}]


def test_dict_prompts_give_the_tokens_of_strings_and_token_ids(make_llm, prompt_ids, smol_greedy_outputs):
    llm = make_llm("smol")
    mixed = [PROMPTS[1], {"prompt": PROMPTS[2]}, {"prompt_token_ids": prompt_ids[3]},
             {"prompt": "reported as given", "prompt_token_ids": prompt_ids[4]}]
    outputs = llm.generate(mixed, greedy(), use_tqdm=False)
    assert token_ids(outputs) == token_ids(smol_greedy_outputs[1:5])
    assert [o.prompt for o in outputs] == [PROMPTS[1], PROMPTS[2], None, "reported as given"]
    assert outputs[2].prompt_token_ids == prompt_ids[3]
    one = llm.generate({"prompt_token_ids": prompt_ids[3]}, greedy(), use_tqdm=False)  # a single dict, not a list
    assert token_ids(one) == token_ids(smol_greedy_outputs[3:4])


def test_chat_renders_the_tokenizers_template_and_generates_from_it(make_llm):
    llm = make_llm("smol")
    tokenizer = llm.get_tokenizer()
    ids = tokenizer.apply_chat_template(CHAT, add_generation_prompt=True, tokenize=True)
    ids = list(ids["input_ids"] if hasattr(ids, "keys") else ids)  # transformers 5 returns a BatchEncoding
    expected = llm.generate(None, greedy(), prompt_token_ids=[ids], use_tqdm=False)
    (out,) = llm.chat(CHAT, greedy(), use_tqdm=False)
    assert out.prompt_token_ids == list(ids)
    assert out.prompt.endswith("<|im_start|>assistant\n")  # SmolLM2's template, with the generation prompt
    assert token_ids([out]) == token_ids(expected) and out.outputs[0].text.strip()
    # A batch of conversations comes back in order; text parts are joined for a template that takes strings.
    parts = [{"role": "user", "content": [{"type": "text", "text": "What is the capital"},
                                          {"type": "text", "text": "of France?"}]}]
    joined = [{"role": "user", "content": "What is the capital\nof France?"}]
    batch = llm.chat([CHAT, parts], greedy(), use_tqdm=False)
    assert token_ids(batch[:1]) == token_ids([out])
    assert token_ids(batch[1:]) == token_ids(llm.chat(joined, greedy(), use_tqdm=False))


def test_chat_continues_the_final_assistant_message(make_llm):
    llm = make_llm("smol")
    partial = CHAT + [{"role": "assistant", "content": "The capital of France is"}]
    (out,) = llm.chat(partial, greedy(), add_generation_prompt=False, continue_final_message=True, use_tqdm=False)
    assert out.prompt.endswith("The capital of France is")  # the turn left open, not closed with <|im_end|>
    assert "Paris" in out.outputs[0].text


@pytest.mark.parametrize("call, error, words", [
    (lambda llm: llm.generate([PROMPTS[0], 123], greedy()), TypeError, "prompt 1: expected a string or a dict"),
    (lambda llm: llm.generate([{"prompt": "x", "multi_modal_data": {}}], greedy()), ValueError, "multi_modal_data"),
    (lambda llm: llm.generate([{"text": "x"}], greedy()), ValueError, "text not supported"),
    (lambda llm: llm.generate([{}], greedy()), ValueError, "needs 'prompt' or 'prompt_token_ids'"),
    (lambda llm: llm.chat(CHAT, greedy(), continue_final_message=True), ValueError, "cannot both be true"),
    (lambda llm: llm.chat([], greedy()), ValueError, "at least one message"),
    (lambda llm: llm.chat([{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}],
                          greedy()), ValueError, "text-only"),
])
def test_bad_offline_inputs_are_refused_naming_the_problem(make_llm, call, error, words):
    llm = make_llm("smol")
    with pytest.raises(error, match=words):
        call(llm)
    assert not llm.engine.has_unfinished_requests()  # nothing of a refused batch stays queued (and blocks: fixture)


def test_vllm_structured_outputs_and_bad_words_offline(make_llm):
    """SamplingParams(structured_outputs=StructuredOutputsParams(...)) (and its older name, guided_decoding with
    GuidedDecodingParams) constrain the output; bad_words as words, tokenized by the engine, are never produced."""
    import json

    from engine import GuidedDecodingParams, SamplingParams, StructuredOutputsParams

    llm = make_llm("smol")
    prompt = "The capital of France is"
    choice = SamplingParams(temperature=0, max_tokens=8,
                            structured_outputs=StructuredOutputsParams(choice=["London", "Berlin", "Madrid"]))
    assert llm.generate(prompt, choice, use_tqdm=False)[0].outputs[0].text in ("London", "Berlin", "Madrid")
    schema = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12}}, "required": ["city"],
              "additionalProperties": False}
    params = SamplingParams(temperature=0, max_tokens=40, guided_decoding=GuidedDecodingParams(json=schema))
    (out,) = llm.generate(prompt, params, use_tqdm=False)
    assert set(json.loads(out.outputs[0].text)) == {"city"}, out.outputs[0].text

    free = llm.generate(prompt, greedy(max_tokens=8), use_tqdm=False)[0].outputs[0]
    word = free.text.split()[0].strip(".,;:!?")  # the word greedy decoding writes first (Paris)
    tokenizer = llm.get_tokenizer()
    banned = llm.generate(prompt, greedy(max_tokens=8, bad_words=[word]), use_tqdm=False)[0].outputs[0]
    ids = banned.token_ids
    for seq in (tokenizer.encode(w, add_special_tokens=False) for w in (word, " " + word)):
        assert not any(ids[i:i + len(seq)] == seq for i in range(len(ids))), (word, banned.text)
    assert banned.token_ids != free.token_ids


def test_generation_config_gives_the_default_sampling_params(tmp_path, tiny_llama_dir):
    """vLLM's LLM.get_default_sampling_params(): the folder's generation_config.json values, what generate() uses
    when given no SamplingParams; generation_config="vllm" leaves SamplingParams' own defaults."""
    import json
    import shutil

    from engine import LLM, SamplingParams
    from e2e_helpers import ROOMY, assert_all_blocks_free

    folder = tmp_path / "model"
    shutil.copytree(tiny_llama_dir, folder)
    (folder / "generation_config.json").write_text(json.dumps({"top_k": 1, "max_new_tokens": 5, "temperature": 0.7}))
    llm = LLM(model=str(folder), **ROOMY)
    params = llm.get_default_sampling_params()
    assert (params.top_k, params.max_tokens, params.temperature) == (1, 5, 0.7)
    outputs = llm.generate(["Hello there", "Hello there"], use_tqdm=False)
    assert all(1 <= len(o.outputs[0].token_ids) <= 5 for o in outputs)  # max_new_tokens (an EOS may come first)
    assert outputs[0].outputs[0].token_ids == outputs[1].outputs[0].token_ids  # top_k 1
    assert_all_blocks_free(llm.engine)
    plain = LLM(model=str(folder), generation_config="vllm", **ROOMY).get_default_sampling_params()
    assert (plain.top_k, plain.max_tokens) == (SamplingParams().top_k, SamplingParams().max_tokens)
