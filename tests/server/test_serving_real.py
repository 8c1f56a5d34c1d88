"""Acceptance: a real uvicorn server with the real engine and the default SmolLM2, driven by the openai client."""
from __future__ import annotations

import httpx
import openai
import pytest
from bad_inputs import MODEL
from serving_harness import metric

PROMPT = "The capital of France is"
CHAT = [{"role": "user", "content": "Name three colors."}]


@pytest.fixture(scope="module")
def client(real_server):
    return openai.OpenAI(base_url=real_server.base_url + "/v1", api_key="unused", max_retries=0, timeout=120)


def test_models_health_version(real_server, client):
    models = client.models.list().data
    assert [m.id for m in models] == [MODEL] and models[0].max_model_len == 512
    assert httpx.get(real_server.base_url + "/health").status_code == 200
    assert httpx.get(real_server.base_url + "/version").json()["version"]


def test_greedy_completion_equals_offline_llm(client):
    from engine.llm import LLM
    from engine.sampling_params import SamplingParams

    served = client.completions.create(model=MODEL, prompt=[PROMPT, "Once upon a time"], max_tokens=8, temperature=0)
    llm = LLM(max_model_len=512, kv_cache_space=0.1, swap_space=0.1)
    offline = llm.generate([PROMPT, "Once upon a time"], SamplingParams(temperature=0, max_tokens=8), use_tqdm=False)
    del llm
    assert [c.text for c in served.choices] == [o.outputs[0].text for o in offline]
    assert [c.index for c in served.choices] == [0, 1]
    assert served.usage.completion_tokens == 16 and served.usage.prompt_tokens == sum(
        len(o.prompt_token_ids) for o in offline)


def test_streamed_completion_joins_to_non_streamed(client):
    kwargs = dict(model=MODEL, prompt=PROMPT, max_tokens=10, temperature=0.8, seed=7, n=2)
    full = client.completions.create(**kwargs)
    chunks = list(client.completions.create(**kwargs, stream=True, stream_options={"include_usage": True}))
    joined = {0: "", 1: ""}
    finishes = {0: 0, 1: 0}
    for ch in chunks[:-1]:
        assert len(ch.choices) == 1
        joined[ch.choices[0].index] += ch.choices[0].text
        finishes[ch.choices[0].index] += ch.choices[0].finish_reason is not None
    assert joined == {c.index: c.text for c in full.choices}
    assert finishes == {0: 1, 1: 1}
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == full.usage.completion_tokens


def test_streamed_chat_joins_to_non_streamed(client):
    full = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=12, temperature=0)
    stream = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=12, temperature=0, stream=True)
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant" and chunks[0].choices[0].delta.content == ""
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == full.choices[0].message.content and text
    assert [c.choices[0].finish_reason for c in chunks if c.choices[0].finish_reason] == [full.choices[0].finish_reason]
    assert full.object == "chat.completion" and full.choices[0].message.role == "assistant"


def test_chat_content_parts_same_as_string(client):
    parts = [{"role": "user", "content": [{"type": "text", "text": "Name three colors."}]}]
    a = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=6, temperature=0)
    b = client.chat.completions.create(model=MODEL, messages=parts, max_tokens=6, temperature=0)
    assert a.choices[0].message.content == b.choices[0].message.content
    assert a.usage.prompt_tokens == b.usage.prompt_tokens


def test_stop_string(client):
    greedy = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=12, temperature=0).choices[0].text
    assert "." in greedy, greedy  # " Paris.\n\n..." for SmolLM2
    stopped = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=12, temperature=0, stop=["."])
    choice = stopped.choices[0]
    assert choice.text == greedy[: greedy.index(".")] and choice.finish_reason == "stop"
    assert choice.model_extra.get("stop_reason") == "."


def test_seed_reproducible(client):
    kwargs = dict(model=MODEL, prompt="My favourite food is", max_tokens=10, temperature=1.0)
    a = client.completions.create(**kwargs, seed=1234).choices[0].text
    b = client.completions.create(**kwargs, seed=1234).choices[0].text
    assert a == b
    others = {client.completions.create(**kwargs, seed=s).choices[0].text for s in (1, 2, 3)}
    assert len(others | {a}) > 1  # the seed matters


def test_n2_usage_counts_and_token_ids_prompt(client, real_server):
    tokens = httpx.post(real_server.base_url + "/tokenize", json={"prompt": PROMPT}).json()["tokens"]
    r = client.completions.create(model=MODEL, prompt=tokens, max_tokens=5, n=2, temperature=0.9, seed=3,
                                  extra_body={"ignore_eos": True})
    assert [c.index for c in r.choices] == [0, 1]
    assert r.usage.prompt_tokens == len(tokens) and r.usage.completion_tokens == 10
    assert all(c.finish_reason == "length" for c in r.choices)
    assert httpx.post(real_server.base_url + "/detokenize", json={"tokens": tokens}).json()["prompt"] == PROMPT


def test_completion_logprobs_and_echo(client):
    r = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=3, temperature=0, logprobs=2, echo=True)
    choice = r.choices[0]
    lp = choice.logprobs
    n_prompt = r.usage.prompt_tokens
    assert choice.text.startswith(PROMPT) and "".join(lp.tokens) == choice.text
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == n_prompt + 3
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    for token, logprob, top in zip(lp.tokens[n_prompt:], lp.token_logprobs[n_prompt:], lp.top_logprobs[n_prompt:]):
        assert logprob <= 0 and top[token] == logprob and max(top.values()) == logprob  # greedy: the best token
        assert 2 <= len(top) <= 3


def test_chat_logprobs(client):
    r = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=4, temperature=0, logprobs=True,
                                       top_logprobs=3)
    content = r.choices[0].logprobs.content
    assert len(content) == r.usage.completion_tokens
    assert all(len(t.top_logprobs) == 3 and t.top_logprobs[0].logprob == t.logprob for t in content)
    assert "".join(t.token for t in content) == r.choices[0].message.content


# vLLM's per-request phases (vllm:request_queue_time_seconds, ...): one observation per finished request.
PHASES = [f"request_{phase}_time_seconds_count" for phase in ("queue", "prefill", "decode", "inference")]


def test_metrics_count_a_request_exactly(client, real_server):
    def scrape():
        text = httpx.get(real_server.base_url + "/metrics").text
        return {name: metric(text, f"pagedserve:{name}") for name in (
            "prompt_tokens_total", "generation_tokens_total", "e2e_request_latency_seconds_count",
            "iteration_tokens_total_sum", "inter_token_latency_seconds_count", "request_params_n_count",
            "request_params_n_sum", "request_params_max_tokens_sum", "prefix_cache_queries_total",
            "inter_token_latency_seconds_sum", "request_decode_time_seconds_sum", *PHASES)}

    before = scrape()
    r = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=4, temperature=0,
                                  extra_body={"ignore_eos": True})
    one = scrape()
    # One choice: its gaps add up to its decode time, first token to last (timestamps of the same steps; the
    # bound only absorbs the microseconds between two clock reads in a step).
    gaps = one["inter_token_latency_seconds_sum"] - before["inter_token_latency_seconds_sum"]
    decode = one["request_decode_time_seconds_sum"] - before["request_decode_time_seconds_sum"]
    assert gaps > 0 and abs(gaps - decode) < 0.01, (gaps, decode)
    two = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=3, n=2, temperature=0.8, seed=1,
                                    extra_body={"ignore_eos": True})
    after = scrape()
    delta = {name: after[name] - before[name] for name in after}
    assert delta["prompt_tokens_total"] == r.usage.prompt_tokens + two.usage.prompt_tokens
    assert delta["generation_tokens_total"] == 4 + 6  # n=2: both choices' tokens
    assert delta["e2e_request_latency_seconds_count"] == 2
    # Every token a step computed, prompt or generated: what the two usages add up to (no prefix cache here).
    assert delta["iteration_tokens_total_sum"] == r.usage.total_tokens + two.usage.total_tokens
    # One gap per token after a choice's first: 3 for the first request, 2 for each choice of the second.
    assert delta["inter_token_latency_seconds_count"] == 3 + 2 * 2
    assert (delta["request_params_n_count"], delta["request_params_n_sum"]) == (2, 1 + 2)
    assert delta["request_params_max_tokens_sum"] == 4 + 3
    assert [delta[name] for name in PHASES] == [2, 2, 2, 2]
    assert delta["prefix_cache_queries_total"] == 0  # (the cache is off)
    text = httpx.get(real_server.base_url + "/metrics").text
    assert metric(text, "pagedserve:cache_config_info", 'block_size="128"') == 1.0  # the CPU default


LONG_PROMPT = ("Photosynthesis is the process by which green plants, algae and some bacteria convert light energy "
               "into chemical energy. During this process, carbon dioxide and water are turned into glucose and "
               "oxygen. In summary, photosynthesis produces")


@pytest.fixture(scope="module")
def chunked_client(chunked_real_server):
    # A 16-token budget: the long prompt (41 tokens) takes three steps, decoding the other streams meanwhile.
    return openai.OpenAI(base_url=chunked_real_server.base_url + "/v1", api_key="unused", max_retries=0,
                         timeout=120)


def test_chunked_prefill_server_streams_the_same_tokens(client, chunked_client):
    import concurrent.futures

    prompts = [LONG_PROMPT, PROMPT, "Once upon a time", LONG_PROMPT + " sugar and"]
    kwargs = dict(model=MODEL, max_tokens=12, temperature=0)
    expected = [client.completions.create(prompt=p, **kwargs).choices[0].text for p in prompts]

    def streamed(prompt: str) -> str:
        stream = chunked_client.completions.create(prompt=prompt, stream=True, **kwargs)
        return "".join(chunk.choices[0].text for chunk in stream if chunk.choices)

    with concurrent.futures.ThreadPoolExecutor(len(prompts)) as pool:  # in flight together
        served = list(pool.map(streamed, prompts))
    assert served == expected
    # Prompt logprobs (echo) come from three chunks of the long prompt and equal the unchunked ones.
    echo = dict(model=MODEL, prompt=LONG_PROMPT, max_tokens=1, temperature=0, logprobs=1, echo=True)
    ours, ref = chunked_client.completions.create(**echo), client.completions.create(**echo)
    assert ours.usage.prompt_tokens == ref.usage.prompt_tokens > 32
    assert ours.choices[0].logprobs.tokens == ref.choices[0].logprobs.tokens
    assert ours.choices[0].logprobs.token_logprobs[1:] == pytest.approx(ref.choices[0].logprobs.token_logprobs[1:],
                                                                        abs=1e-3)
