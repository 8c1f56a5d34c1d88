"""vLLM's extra request parameters, each through a real uvicorn server: the tiny random Llama where only token ids
matter, the default SmolLM2 where the text does."""
from __future__ import annotations

import threading
import time

import httpx
import pytest
from serving_harness import ServerThread, metric, stream_events as stream

PROMPT = "The capital of France is"


def post(server, path, body, **kw):
    r = httpx.post(server.base_url + path, json=body, timeout=120, **kw)
    assert r.status_code == 200, r.text
    return r.json()


@pytest.mark.parametrize("path,body", [
    ("/v1/completions", {"prompt": "Hi there"}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"}]}),
])
def test_continuous_usage_stats_on_every_chunk(tiny_server, path, body):
    chunks = stream(tiny_server, path, {**body, "max_tokens": 5, "ignore_eos": True, "stream_options": {
        "include_usage": True, "continuous_usage_stats": True}})
    assert all(c["usage"] is not None for c in chunks)
    prompt = chunks[0]["usage"]["prompt_tokens"]
    counts = [c["usage"]["completion_tokens"] for c in chunks[:-1]]
    # The counts only grow, to 5 (a loaded server may send several tokens in one chunk, its first too).
    assert counts == sorted(counts) and counts[-1] == 5 and counts[0] >= 0
    assert all(c["usage"]["total_tokens"] == prompt + c["usage"]["completion_tokens"] for c in chunks)
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 5
    plain = stream(tiny_server, path, {**body, "max_tokens": 5, "ignore_eos": True})
    assert all(c["usage"] is None for c in plain)


def test_allowed_token_ids_and_tokens_as_ids(tiny_server):
    allowed = [17, 300, 4242]
    out = post(tiny_server, "/v1/completions", {
        "prompt": "Hello", "max_tokens": 12, "ignore_eos": True, "temperature": 1.0, "seed": 3, "logprobs": 1,
        "allowed_token_ids": allowed, "return_tokens_as_token_ids": True})
    tokens = out["choices"][0]["logprobs"]["tokens"]
    assert len(tokens) == 12 and all(t.startswith("token_id:") for t in tokens)
    ids = [int(t.split(":")[1]) for t in tokens]
    assert set(ids) <= set(allowed) and len(set(ids)) > 1  # sampled, yet only from the allowed ids
    free = post(tiny_server, "/v1/completions", {"prompt": "Hello", "max_tokens": 12, "ignore_eos": True,
                                                 "temperature": 1.0, "seed": 3, "logprobs": 1})
    assert not set(free["choices"][0]["logprobs"]["tokens"]) <= {"token_id:17", "token_id:300", "token_id:4242"}


def test_skip_special_tokens_and_spaces_between(tiny_server):
    tok = tiny_server.engine.tokenizer
    specials = [tok.convert_tokens_to_ids("<|im_start|>"), tok.convert_tokens_to_ids("<|im_end|>")]
    body = {"prompt": "Hello", "max_tokens": 6, "ignore_eos": True, "allowed_token_ids": specials, "logprobs": 0,
            "return_tokens_as_token_ids": True, "temperature": 1.0, "seed": 7}
    kept = post(tiny_server, "/v1/completions", {**body, "skip_special_tokens": False})["choices"][0]
    ids = [int(t.split(":")[1]) for t in kept["logprobs"]["tokens"]]
    assert kept["text"] == "".join(tok.convert_ids_to_tokens(ids)) and "<|im_" in kept["text"]
    assert post(tiny_server, "/v1/completions", {**body, "skip_special_tokens": True})["choices"][0]["text"] == ""
    # Byte-level BPE never puts spaces between special tokens: both values give the same text, as in vLLM.
    for spaces in (True, False):
        again = post(tiny_server, "/v1/completions", {**body, "skip_special_tokens": False,
                                                       "spaces_between_special_tokens": spaces})["choices"][0]
        assert again["text"] == kept["text"]


def test_truncate_prompt_tokens_keeps_the_last_tokens(tiny_server):
    ids = list(range(100, 160))
    out = post(tiny_server, "/v1/completions", {"prompt": ids, "max_tokens": 2, "ignore_eos": True, "echo": True,
                                                "logprobs": 0, "truncate_prompt_tokens": 10,
                                                "return_tokens_as_token_ids": True})
    assert out["usage"]["prompt_tokens"] == 10
    assert out["choices"][0]["logprobs"]["tokens"][:10] == [f"token_id:{t}" for t in ids[-10:]]
    # -1: the context length (256); this prompt fits, so nothing is cut.
    whole = post(tiny_server, "/v1/completions", {"prompt": ids, "max_tokens": 2, "truncate_prompt_tokens": -1})
    assert whole["usage"]["prompt_tokens"] == 60


def test_prompt_logprobs_match_echo_logprobs(tiny_server):
    body = {"prompt": "The quick brown fox jumps", "max_tokens": 1, "ignore_eos": True}
    out = post(tiny_server, "/v1/completions", {**body, "prompt_logprobs": 2})
    echo = post(tiny_server, "/v1/completions", {**body, "echo": True, "logprobs": 2})
    prompt_ids = httpx.post(tiny_server.base_url + "/tokenize", json={"prompt": body["prompt"]}).json()["tokens"]
    entries = out["choices"][0]["prompt_logprobs"]
    assert len(entries) == len(prompt_ids) == out["usage"]["prompt_tokens"] and entries[0] is None
    echoed = echo["choices"][0]["logprobs"]["token_logprobs"][: len(prompt_ids)]
    tok = tiny_server.engine.tokenizer
    for token_id, entry, want in zip(prompt_ids[1:], entries[1:], echoed[1:]):
        own = entry[str(token_id)]
        assert own["logprob"] == pytest.approx(want, abs=1e-5) and own["decoded_token"] == tok.decode([token_id])
        ranked = sorted((e for e in entry.values() if e["rank"] is not None), key=lambda e: e["rank"])
        assert [e["rank"] for e in ranked][:2] == [1, 2]
        assert ranked[0]["logprob"] >= ranked[1]["logprob"] >= own["logprob"] - 1e-6 or own["rank"] in (1, 2)
    chat = post(tiny_server, "/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"}],
                                                      "max_tokens": 1, "prompt_logprobs": 0})
    assert len(chat["prompt_logprobs"]) == chat["usage"]["prompt_tokens"]


def test_request_id_names_the_response(tiny_server):
    body = {"prompt": "Hi", "max_tokens": 3, "ignore_eos": True, "request_id": "client-42"}
    results: list = []
    threads = [threading.Thread(target=lambda: results.append(post(tiny_server, "/v1/completions", body)))
               for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert [r["id"] for r in results] == ["cmpl-client-42"] * 2  # the same id twice at once still runs
    assert all(r["usage"]["completion_tokens"] == 3 for r in results)
    chat = post(tiny_server, "/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"}],
                                                      "max_tokens": 2, "request_id": "abc"})
    assert chat["id"] == "chatcmpl-abc"


TEMPLATE = ("{% if documents %}{% for d in documents %}[doc {{ d.title }}: {{ d.text }}]{% endfor %}{% endif %}"
            "{% if shout %}LOUD {% endif %}{% for m in messages %}<{{ m.role }}>{{ m.content }}{% endfor %}"
            "{% if add_generation_prompt %}<assistant>{% endif %}")


@pytest.fixture(scope="module")
def template_server(make_tiny_engine):
    """The tiny Llama whose tokenizer's chat template reads documents and a `shout` variable."""
    from server.app import create_app

    engine = make_tiny_engine()
    engine.tokenizer.chat_template = TEMPLATE
    with ServerThread(create_app(engine)) as server:
        server.engine = engine
        yield server


def test_chat_template_kwargs_and_documents_reach_the_template(template_server):
    messages = [{"role": "user", "content": "Hi"}]
    extra = {"documents": [{"title": "A", "text": "apples"}], "chat_template_kwargs": {"shout": True}}
    want = "[doc A: apples]LOUD <user>Hi<assistant>"
    tokens = post(template_server, "/tokenize", {"messages": messages, **extra})["tokens"]
    assert post(template_server, "/detokenize", {"tokens": tokens})["prompt"] == want
    chat = post(template_server, "/v1/chat/completions", {"messages": messages, "max_tokens": 1, "prompt_logprobs": 0,
                                                          **extra})
    first = template_server.engine.tokenizer.decode(tokens[:1])
    rendered = first + "".join(next(iter(e.values()))["decoded_token"] for e in chat["prompt_logprobs"][1:])
    assert rendered == want and chat["usage"]["prompt_tokens"] == len(tokens)
    plain = post(template_server, "/v1/chat/completions", {"messages": messages, "max_tokens": 1})
    assert plain["usage"]["prompt_tokens"] < len(tokens)
    # chat_template_kwargs override the request's own template switches, as in vLLM.
    no_gen = post(template_server, "/tokenize", {"messages": messages, "chat_template_kwargs": {
        "add_generation_prompt": False}})["tokens"]
    assert post(template_server, "/detokenize", {"tokens": no_gen})["prompt"] == "<user>Hi"


def test_continue_final_message_with_echo(real_server):
    messages = [{"role": "user", "content": "What is the capital of France?"},
                {"role": "assistant", "content": "The capital of France is"}]
    body = {"messages": messages, "add_generation_prompt": False, "continue_final_message": True}
    prompt = post(real_server, "/tokenize", body)["tokens"]
    assert post(real_server, "/detokenize", {"tokens": prompt})["prompt"].endswith("The capital of France is")
    out = post(real_server, "/v1/chat/completions", {**body, "max_tokens": 3, "temperature": 0, "echo": True})
    content = out["choices"][0]["message"]["content"]
    assert content.startswith("The capital of France is Paris"), content
    chunks = stream(real_server, "/v1/chat/completions", {**body, "max_tokens": 3, "temperature": 0, "echo": True})
    assert "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks) == content
    plain = post(real_server, "/v1/chat/completions", {**body, "max_tokens": 3, "temperature": 0})
    assert plain["choices"][0]["message"]["content"] == content[len("The capital of France is"):]


def test_bad_words_are_never_generated(real_server):
    body = {"prompt": PROMPT, "max_tokens": 6, "temperature": 0}
    free = post(real_server, "/v1/completions", body)["choices"][0]["text"]
    assert "Paris" in free
    banned = post(real_server, "/v1/completions", {**body, "bad_words": ["Paris"]})["choices"][0]["text"]
    assert "Paris" not in banned and banned != free
    chat = post(real_server, "/v1/chat/completions", {
        "messages": [{"role": "user", "content": "What is the capital of France? One word."}], "max_tokens": 8,
        "temperature": 0, "bad_words": ["Paris"]})
    assert "Paris" not in chat["choices"][0]["message"]["content"]


def test_include_stop_str_in_output(real_server):
    body = {"prompt": PROMPT, "max_tokens": 8, "temperature": 0, "stop": ["Paris"]}
    assert "Paris" not in post(real_server, "/v1/completions", body)["choices"][0]["text"]
    kept = post(real_server, "/v1/completions", {**body, "include_stop_str_in_output": True})["choices"][0]
    assert kept["text"].endswith("Paris") and kept["finish_reason"] == "stop"


def test_length_penalty_reaches_beam_search(real_server):
    from engine.llm import LLM
    from engine.sampling_params import SamplingParams

    messages = [{"role": "user", "content": "What is 2+2?"}]
    body = {"messages": messages, "max_tokens": 10, "temperature": 0, "n": 4, "best_of": 4, "use_beam_search": True}
    served = {lp: [c["message"]["content"] for c in post(real_server, "/v1/chat/completions", {
        **body, "length_penalty": lp})["choices"]] for lp in (-2.0, 2.0)}
    # Beams that finished at different lengths: a negative penalty ranks the short ones first.
    assert len(served[-2.0][0]) < len(served[2.0][0]), served
    prompt = post(real_server, "/tokenize", {"messages": messages})["tokens"]
    llm = LLM(max_model_len=512, kv_cache_space=0.1, swap_space=0.1)
    for lp, texts in served.items():
        params = SamplingParams(n=4, best_of=4, use_beam_search=True, temperature=0, max_tokens=10, length_penalty=lp)
        out = llm.generate(prompt_token_ids=[prompt], sampling_params=params, use_tqdm=False)[0]
        assert [c.text for c in out.outputs] == texts


def test_priority_overtakes_queued_requests(make_tiny_engine):
    """--scheduling-policy priority over HTTP: an urgent request sent last overtakes the queued ones and preempts
    the running one (a batch of one)."""
    from server.app import create_app

    engine = make_tiny_engine(scheduling_policy="priority", max_num_seqs=1)
    finished: list[str] = []

    def send(name: str, priority: int, max_tokens: int) -> None:
        post(server, "/v1/completions", {"prompt": name, "max_tokens": max_tokens, "ignore_eos": True,
                                         "priority": priority})
        finished.append(name)

    with ServerThread(create_app(engine)) as server:
        def wait_for(name: str, count: int) -> None:
            deadline = time.monotonic() + 30
            while metric(httpx.get(server.base_url + "/metrics").text, f"pagedserve:num_requests_{name}") < count:
                assert time.monotonic() < deadline, f"never {count} {name}"
                time.sleep(0.01)

        first = threading.Thread(target=send, args=("running", 0, 200))
        first.start()
        wait_for("running", 1)
        queued = [threading.Thread(target=send, args=(name, 0, 4)) for name in ("queued-1", "queued-2")]
        for t in queued:
            t.start()
        wait_for("waiting", 2)
        urgent = threading.Thread(target=send, args=("urgent", -1, 4))
        urgent.start()
        for t in [first, *queued, urgent]:
            t.join(timeout=60)
    assert finished.index("urgent") < finished.index("queued-1") and finished.index("urgent") < finished.index(
        "queued-2"), finished
    assert set(finished) == {"running", "queued-1", "queued-2", "urgent"}
    assert finished.index("urgent") < finished.index("running"), finished  # it preempted the running request
