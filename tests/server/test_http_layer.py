"""HTTP layer against the real engine over a tiny random Llama: error shapes, SSE framing, auth, limits.

The tiny model's text is noise, so these tests check what the text does not decide: framing, token counts
(ignore_eos), streamed text equal to the non-streamed text; tests/server/test_serving_real.py runs the same
requests against the default SmolLM2, where the text itself is checked.
"""
from __future__ import annotations

import json

import httpx
import openai
import pytest
from bad_inputs import BAD_INPUTS, MODEL
from serving_harness import ServerThread, sse_events


def post(server, path, body, **kw):
    if isinstance(body, (bytes, str)):
        return httpx.post(server.base_url + path, content=body, headers={"content-type": "application/json"}, **kw)
    return httpx.post(server.base_url + path, json=body, **kw)


@pytest.mark.parametrize("case", BAD_INPUTS, ids=[c[0] for c in BAD_INPUTS])
def test_bad_input_is_openai_4xx(tiny_server, case):
    _, path, body, status, param = case
    r = post(tiny_server, path, body, timeout=30)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert err["code"] == status and err["message"]
    assert err["type"] == ("NotFoundError" if status == 404 else "BadRequestError")
    if param is not None:
        assert err["param"] == param, err
        assert param in err["message"] or status == 404 or "context length" in err["message"], err


def test_server_alive_after_bad_inputs(tiny_server):
    for _, path, body, _, _ in BAD_INPUTS[:10]:
        post(tiny_server, path, body, timeout=30)
    assert httpx.get(tiny_server.base_url + "/health").status_code == 200
    r = post(tiny_server, "/v1/completions", {"model": MODEL, "prompt": "Hi", "max_tokens": 3, "ignore_eos": True})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 3


def test_unknown_fields_accepted_and_warned_once(tiny_server, caplog):
    """vLLM's rule: a field the server does not know is ignored with one warning per field name, not a 400."""
    body = {"prompt": "Hi", "max_tokens": 3, "ignore_eos": True, "foo_unknown": 1,
            "stream": True, "stream_options": {"include_usage": True, "bar_unknown": True}}
    with caplog.at_level("WARNING", logger="server.context"):
        for _ in range(2):
            with httpx.stream("POST", tiny_server.base_url + "/v1/completions", json=body, timeout=30) as r:
                assert r.status_code == 200
                events = sse_events(r.read().decode().splitlines())
            assert events[-2]["usage"]["completion_tokens"] == 3
        chat = post(tiny_server, "/v1/chat/completions", {
            "messages": [{"role": "user", "content": "Hi", "audio_unknown": []}], "max_tokens": 2, "foo_unknown": 1})
        assert chat.status_code == 200 and chat.json()["usage"]["completion_tokens"] >= 1
    warned = [rec.getMessage() for rec in caplog.records if "unknown field" in rec.getMessage()]
    assert sorted(warned) == sorted([
        "/v1/completions: ignoring the unknown field 'foo_unknown' (warned once per field)",
        "/v1/completions: ignoring the unknown field 'stream_options.bar_unknown' (warned once per field)",
        "/v1/chat/completions: ignoring the unknown field 'foo_unknown' (warned once per field)",
        "/v1/chat/completions: ignoring the unknown field 'messages.audio_unknown' (warned once per field)",
    ])


def test_context_length_message_has_numbers(tiny_server):
    r = post(tiny_server, "/v1/completions", {"prompt": [5] * 200, "max_tokens": 100})
    assert r.status_code == 400
    assert r.json()["error"]["message"].startswith(
        "This model's maximum context length is 256 tokens. However, you requested 300 tokens "
        "(200 in the prompt, 100 in the completion).")


def test_streamed_completion_framing_n2_usage(tiny_server):
    body = {"prompt": ["Hello", "Bye"], "max_tokens": 4, "n": 2, "temperature": 1.0, "seed": 1, "ignore_eos": True,
            "stream": True, "stream_options": {"include_usage": True}}
    with httpx.stream("POST", tiny_server.base_url + "/v1/completions", json=body) as r:
        assert r.headers["content-type"].startswith("text/event-stream")
        raw = r.read().decode()
    assert "data: [DONE]\n\n" in raw and "\r\n" not in raw
    events = sse_events(raw.splitlines())
    assert events[-1] == "[DONE]"
    chunks = events[:-1]
    usage = chunks[-1]
    assert usage["choices"] == [] and usage["usage"]["completion_tokens"] == 16  # 2 prompts x n=2 x 4
    text: dict[int, str] = {}
    finishes: dict[int, int] = {}
    for chunk in chunks[:-1]:
        assert len(chunk["choices"]) == 1
        choice = chunk["choices"][0]
        text[choice["index"]] = text.get(choice["index"], "") + choice["text"]
        finishes[choice["index"]] = finishes.get(choice["index"], 0) + (choice["finish_reason"] is not None)
    assert sorted(text) == [0, 1, 2, 3] and finishes == {0: 1, 1: 1, 2: 1, 3: 1}
    full = post(tiny_server, "/v1/completions", {**body, "stream": False, "stream_options": None}).json()
    assert {c["index"]: c["text"] for c in full["choices"]} == text and all(text.values())  # same seed, same samples


def test_chat_stream_role_first_with_openai_client(tiny_server):
    client = openai.OpenAI(base_url=tiny_server.base_url + "/v1", api_key="x")
    stream = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=3,
                                            n=2, stream=True, temperature=0.7)
    chunks = list(stream)
    firsts = {}
    for ch in chunks:
        for c in ch.choices:
            firsts.setdefault(c.index, c.delta)
    assert set(firsts) == {0, 1} and all(d.role == "assistant" and d.content == "" for d in firsts.values())
    assert sum(c.finish_reason is not None for ch in chunks for c in ch.choices) == 2


def test_completion_logprobs_echo_shape(tiny_server):
    r = post(tiny_server, "/v1/completions", {"prompt": "Hello world", "max_tokens": 2, "logprobs": 2, "echo": True,
                                              "ignore_eos": True})
    choice = r.json()["choices"][0]
    lp = choice["logprobs"]
    assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
    assert len(lp["tokens"]) == len(lp["text_offset"]) == 2 + 2  # "Hello", " world" + 2 generated
    assert "".join(lp["tokens"]) == choice["text"] and choice["text"].startswith("Hello world")
    assert lp["text_offset"] == [0, 5, 11, 11 + len(lp["tokens"][2])]


def test_chat_logprobs_shape(tiny_server):
    r = post(tiny_server, "/v1/chat/completions", {"messages": [{"role": "user", "content": [
        {"type": "text", "text": "Hi"}]}], "max_tokens": 2, "logprobs": True, "top_logprobs": 2, "ignore_eos": True})
    content = r.json()["choices"][0]["logprobs"]["content"]
    assert len(content) == 2
    assert set(content[0]) == {"token", "logprob", "bytes", "top_logprobs"} and len(content[0]["top_logprobs"]) == 2


def test_api_key_guards_v1(make_tiny_engine):
    from server.app import create_app

    with ServerThread(create_app(make_tiny_engine(), api_key="sekret")) as s:
        r = httpx.get(s.base_url + "/v1/models")
        assert r.status_code == 401 and r.json()["error"]["type"] == "AuthenticationError"
        assert httpx.get(s.base_url + "/v1/models", headers={"Authorization": "Bearer wrong"}).status_code == 401
        ok = httpx.get(s.base_url + "/v1/models", headers={"Authorization": "Bearer sekret"})
        assert ok.status_code == 200 and ok.json()["data"][0]["id"] == MODEL
        assert httpx.get(s.base_url + "/health").status_code == 200  # only /v1 is guarded


def test_body_limit_413(tiny_server):
    r = post(tiny_server, "/v1/completions", json.dumps({"prompt": "x" * (2 << 20)}).encode())
    assert r.status_code == 413 and r.json()["error"]["code"] == 413


def test_fault_in_step_is_a_500_for_its_request_only(make_tiny_engine):
    from server.app import create_app

    engine = make_tiny_engine()
    with ServerThread(create_app(engine)) as s:
        assert httpx.get(s.base_url + "/health").status_code == 200

        def boom(stage, request_ids):
            if stage == "sampler":
                raise RuntimeError("injected fault")

        engine.engine.fault_injector = boom
        r = httpx.post(s.base_url + "/v1/completions", json={"prompt": "Hi", "max_tokens": 3}, timeout=10)
        assert r.status_code == 500 and "(sampler): RuntimeError: injected fault" in r.json()["error"]["message"]
        assert r.json()["error"]["type"] == "InternalServerError"
        assert httpx.get(s.base_url + "/health").status_code == 200
        engine.engine.fault_injector = None
        r = httpx.post(s.base_url + "/v1/completions", json={"prompt": "Hi", "max_tokens": 3, "stream": True},
                       timeout=10)
        assert r.status_code == 200 and '"error"' not in r.text
