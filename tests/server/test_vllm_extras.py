"""vLLM's server behaviour that its own clients and end-to-end tests count on (issue 52, part A), through a real
uvicorn server and the official openai client: token ids in responses, cached prompt tokens in usage, logprobs
of the whole vocabulary or of named tokens, token strings from /tokenize, continuous usage only with include_usage,
chat roles the template knows, and vLLM's words in errors. The tiny random Llama: only token ids matter here."""
from __future__ import annotations

import math

import httpx
import openai
import pytest
from bad_inputs import MODEL
from serving_harness import ServerThread, stream_events as stream

MESSAGES = [{"role": "user", "content": "Hi there"}]


def post(server, path, body, status=200):
    r = httpx.post(server.base_url + path, json=body, timeout=120)
    assert r.status_code == status, r.text
    return r.json()


@pytest.fixture(scope="module")
def client(tiny_server):
    return openai.OpenAI(base_url=tiny_server.base_url + "/v1", api_key="x", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def details_server(make_tiny_engine):
    """The tiny Llama with prefix caching, --enable-prompt-tokens-details and --max-logprobs -1 (no bound)."""
    from server.app import create_app

    engine = make_tiny_engine(enable_prefix_caching=True, max_logprobs=-1)
    with ServerThread(create_app(engine, enable_prompt_tokens_details=True)) as server:
        server.engine = engine
        yield server


def test_return_token_ids_completions(client, tiny_server):
    prompt = "The capital of France is"
    prompt_ids = post(tiny_server, "/tokenize", {"prompt": prompt})["tokens"]
    body = dict(model=MODEL, prompt=prompt, max_tokens=6, temperature=0, logprobs=0)
    extra = {"ignore_eos": True, "return_tokens_as_token_ids": True}
    r = client.completions.create(**body, extra_body={**extra, "return_token_ids": True})
    choice = r.choices[0]
    sampled = [int(t.split(":")[1]) for t in choice.logprobs.tokens]
    assert choice.prompt_token_ids == prompt_ids and choice.token_ids == sampled and len(sampled) == 6
    plain = client.completions.create(**body, extra_body=extra).choices[0]
    assert plain.model_extra.get("token_ids") is None and plain.model_extra.get("prompt_token_ids") is None
    # Streamed: the prompt's ids with each choice's first chunk, then every chunk's new ids.
    chunks = stream(tiny_server, "/v1/completions", {**body, **extra, "return_token_ids": True,
                                                      "prompt": [prompt, "Hello"]})
    for index, ids in ((0, prompt_ids), (1, post(tiny_server, "/tokenize", {"prompt": "Hello"})["tokens"])):
        mine = [c["choices"][0] for c in chunks if c["choices"][0]["index"] == index]
        assert mine[0]["prompt_token_ids"] == ids and all("prompt_token_ids" not in c for c in mine[1:])
        assert sum((c["token_ids"] for c in mine), []) == (sampled if index == 0 else
                                                           [int(t[9:]) for c in mine for t in c["logprobs"]["tokens"]])
    assert all("token_ids" not in c["choices"][0] for c in stream(tiny_server, "/v1/completions", {**body, **extra}))


def test_return_token_ids_chat(client, tiny_server):
    prompt_ids = post(tiny_server, "/tokenize", {"messages": MESSAGES})["tokens"]
    body = dict(model=MODEL, messages=MESSAGES, max_tokens=5, temperature=0)
    r = client.chat.completions.create(**body, extra_body={"ignore_eos": True, "return_token_ids": True})
    assert r.prompt_token_ids == prompt_ids and len(r.choices[0].token_ids) == r.usage.completion_tokens == 5
    chunks = list(client.chat.completions.create(**body, stream=True, extra_body={"ignore_eos": True,
                                                                                 "return_token_ids": True}))
    assert chunks[0].prompt_token_ids == prompt_ids and chunks[0].choices[0].delta.role == "assistant"
    assert all(getattr(c, "prompt_token_ids", None) is None for c in chunks[1:])
    assert sum((c.choices[0].token_ids for c in chunks[1:]), []) == r.choices[0].token_ids


@pytest.mark.parametrize("side,kept", [(None, slice(-10, None)), ("left", slice(-10, None)), ("right", slice(10))])
def test_truncation_side(tiny_server, side, kept):
    ids = list(range(100, 160))
    body = {"prompt": ids, "max_tokens": 1, "truncate_prompt_tokens": 10, "return_token_ids": True}
    out = post(tiny_server, "/v1/completions", {**body, **({"truncation_side": side} if side else {})})
    assert out["choices"][0]["prompt_token_ids"] == ids[kept] and out["usage"]["prompt_tokens"] == 10


def test_cached_tokens_in_usage(details_server, tiny_server):
    prompt = list(range(1000, 1040))  # 40 tokens: two full 16-token blocks the cache can serve the second time
    body = {"prompt": prompt, "max_tokens": 2, "ignore_eos": True}
    first = post(details_server, "/v1/completions", body)["usage"]
    assert first["prompt_tokens_details"] == {"cached_tokens": 0}
    again = post(details_server, "/v1/completions", body)["usage"]
    assert again["prompt_tokens_details"] == {"cached_tokens": 32} and again["prompt_tokens"] == 40
    chunks = stream(details_server, "/v1/completions", {**body, "stream_options": {"include_usage": True}})
    assert chunks[-1]["usage"]["prompt_tokens_details"] == {"cached_tokens": 32}
    assert all("prompt_tokens_details" not in (c["usage"] or {}) for c in chunks[:-1])
    chat = openai.OpenAI(base_url=details_server.base_url + "/v1", api_key="x", max_retries=0)
    usages = [chat.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "word " * 40}],
                                           max_tokens=1).usage for _ in range(2)]
    assert [u.prompt_tokens_details.cached_tokens for u in usages] == [0, (usages[0].prompt_tokens - 1) // 16 * 16]
    # Without --enable-prompt-tokens-details usage has no details, as in vLLM.
    assert "prompt_tokens_details" not in post(tiny_server, "/v1/completions", body)["usage"]


def test_logprobs_of_the_whole_vocabulary(details_server, tiny_server):
    vocab = tiny_server.engine.vocab_size
    body = {"prompt": "Hello world", "max_tokens": 2, "temperature": 0, "ignore_eos": True, "logprobs": -1,
            "return_tokens_as_token_ids": True}
    out = post(details_server, "/v1/completions", body)["choices"][0]["logprobs"]
    for token, top in zip(out["tokens"], out["top_logprobs"]):
        assert len(top) == vocab and token in top
        assert math.isclose(sum(math.exp(lp) for lp in top.values()), 1.0, rel_tol=1e-3)
    chat = post(details_server, "/v1/chat/completions", {"messages": MESSAGES, "max_tokens": 1, "logprobs": True,
                                                         "top_logprobs": -1, "return_tokens_as_token_ids": True})
    assert len(chat["choices"][0]["logprobs"]["content"][0]["top_logprobs"]) == vocab
    prompt = post(details_server, "/v1/completions", {**body, "logprobs": None, "prompt_logprobs": -1,
                                                      "max_tokens": 1})["choices"][0]["prompt_logprobs"]
    assert prompt[0] is None and all(len(entry) == vocab for entry in prompt[1:])
    # --max-logprobs 20 (the default) bounds -1 as any count, in vLLM's words.
    error = post(tiny_server, "/v1/completions", body, status=400)["error"]
    assert error["param"] == "logprobs" and "greater than max allowed: 20" in error["message"]


def test_logprob_token_ids(details_server):
    named = [5, 100, 2000]
    body = {"prompt": "Hello world", "max_tokens": 4, "temperature": 0, "ignore_eos": True,
            "return_tokens_as_token_ids": True}
    full = post(details_server, "/v1/completions", {**body, "logprobs": -1})["choices"][0]["logprobs"]
    out = post(details_server, "/v1/completions", {**body, "logprobs": 1,
                                                   "logprob_token_ids": named})["choices"][0]["logprobs"]
    assert out["tokens"] == full["tokens"]
    for token, top, want in zip(out["tokens"], out["top_logprobs"], full["top_logprobs"]):
        assert set(top) == {token} | {f"token_id:{t}" for t in named}  # the sampled token and the named ones
        assert all(math.isclose(lp, want[key], abs_tol=1e-4) for key, lp in top.items())
    chunks = stream(details_server, "/v1/completions", {**body, "logprobs": 1, "logprob_token_ids": named})
    assert sum((c["choices"][0]["logprobs"]["top_logprobs"] for c in chunks), []) == out["top_logprobs"]
    chat = post(details_server, "/v1/chat/completions", {"messages": MESSAGES, "max_tokens": 2, "logprobs": True,
                                                         "logprob_token_ids": named,
                                                         "return_tokens_as_token_ids": True})
    for entry in chat["choices"][0]["logprobs"]["content"]:
        assert {t["token"] for t in entry["top_logprobs"]} == {entry["token"]} | {f"token_id:{t}" for t in named}
    error = post(details_server, "/v1/completions", {**body, "logprob_token_ids": named}, status=400)["error"]
    assert error["param"] == "logprob_token_ids" and "`logprobs` must be set" in error["message"]


def test_tokenize_returns_token_strs(tiny_server):
    out = post(tiny_server, "/tokenize", {"prompt": "Hello world", "return_token_strs": True})
    assert out["token_strs"] == tiny_server.engine.tokenizer.convert_ids_to_tokens(out["tokens"])
    assert out["token_strs"][-1] == "Ġworld"
    assert post(tiny_server, "/tokenize", {"prompt": "Hello world"})["token_strs"] is None


def test_continuous_usage_only_with_include_usage(tiny_server):
    body = {"prompt": "Hi there", "max_tokens": 4, "ignore_eos": True}
    alone = stream(tiny_server, "/v1/completions", {**body, "stream_options": {"continuous_usage_stats": True}})
    assert alone and all(c["usage"] is None for c in alone)
    both = stream(tiny_server, "/v1/completions", {**body, "stream_options": {"continuous_usage_stats": True,
                                                                               "include_usage": True}})
    assert all(c["usage"] is not None for c in both)


def test_a_custom_role_reaches_the_chat_template(client, tiny_server):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "narrator", "content": "Once upon a time"},
                {"role": "user", "content": "Go on."}]
    prompt = post(tiny_server, "/tokenize", {"messages": messages})["tokens"]
    text = post(tiny_server, "/detokenize", {"tokens": prompt})["prompt"]
    assert "<|im_start|>narrator\nOnce upon a time<|im_end|>" in text  # SmolLM2's template writes any role
    r = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=2)
    assert r.usage.prompt_tokens == len(prompt)


@pytest.mark.parametrize("body,param,words", [
    ({"prompt": "Hi", "logprobs": -2}, "logprobs", "greater_than_equal"),
    ({"prompt": "Hi", "max_tokens": 0}, "max_tokens", "greater_than_equal"),
    ({"prompt": [1, 2, 10**7]}, "prompt", "out of vocabulary"),
    ({"prompt": "Hi", "logprobs": 1, "logprob_token_ids": [10**7]}, "logprob_token_ids", "out-of-vocab"),
])
def test_error_words_clients_match_on(tiny_server, body, param, words):
    error = post(tiny_server, "/v1/completions", body, status=400)["error"]
    assert error["param"] == param and words in error["message"], error
