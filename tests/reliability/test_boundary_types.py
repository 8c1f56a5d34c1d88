"""Values outside what the engine's types hold: a 400 naming the field, and the server keeps serving.

The two reproducers of issue #17 are here: a seed past int64 used to raise in the sampler and kill the
engine (every later request 503), a lone surrogate in a prompt used to answer 500.
"""
from __future__ import annotations

import json

import httpx
import pytest

from reliability_harness import leaked_blocks, serve, wait_engine_idle

C, CHAT, TOK, DETOK = "/v1/completions", "/v1/chat/completions", "/tokenize", "/detokenize"
BIG = [2**31, 2**63, 2**64, -(2**63) - 1]


def _c(**fields) -> dict:
    return {"model": "tiny", "prompt": "Hello", "max_tokens": 2, **fields}


def _chat(**fields) -> dict:
    return {"model": "tiny", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2, **fields}


def _raw(template: str, value: str) -> bytes:
    """A body with a literal the json module writes only on request (NaN, Infinity, a lone surrogate escape)."""
    return template.replace("@", value).encode()


# (id, path, body (dict, or raw JSON bytes), the param the 400 must name)
REFUSED = [
    *[(f"seed-{v}", C, _c(seed=v, temperature=0.8), "seed") for v in (2**63, 2**64, -(2**63) - 1)],
    *[(f"prompt-token-{v}", C, _c(prompt=[1, v]), "prompt") for v in BIG],
    *[(f"prompt-batch-token-{v}", C, _c(prompt=[[1], [2, v]]), "prompt") for v in BIG],
    *[(f"stop-token-ids-{v}", C, _c(stop_token_ids=[v]), "stop_token_ids") for v in BIG],
    *[(f"top-k-{v}", C, _c(top_k=v, temperature=0.8), "top_k") for v in (2**63, 2**64, -(2**31))],
    *[(f"logprobs-{v}", C, _c(logprobs=v), "logprobs") for v in BIG],
    *[(f"max-tokens-{v}", C, _c(max_tokens=v), "max_tokens") for v in BIG],
    *[(f"min-tokens-{v}", C, _c(min_tokens=v), "min_tokens") for v in BIG],
    *[(f"n-{v}", C, _c(n=v, temperature=0.8), "n") for v in BIG],
    *[(f"best-of-{v}", C, _c(best_of=v, temperature=0.8), "best_of") for v in BIG],
    *[(f"chat-top-logprobs-{v}", CHAT, _chat(logprobs=True, top_logprobs=v), "top_logprobs") for v in BIG],
    *[(f"chat-max-completion-tokens-{v}", CHAT, _chat(max_completion_tokens=v), "max_completion_tokens")
      for v in BIG],
    *[(f"logit-bias-key-{k[:24]}", C, _c(logit_bias={k: 1.0}), "logit_bias")
      for k in (str(2**64), "-1", "1" * 5000, "+5", "5_0", " 5", "0x10")],
    *[(f"detokenize-{v}", DETOK, {"tokens": [1, v]}, "tokens") for v in BIG],
    *[(f"{field}-{lit}", C, _raw('{"prompt": "Hi", "max_tokens": 2, "%s": @}' % field, lit), field)
      for field in ("temperature", "top_p", "min_p", "presence_penalty", "frequency_penalty",
                    "repetition_penalty", "length_penalty") for lit in ("NaN", "Infinity", "-Infinity")],
    ("logit-bias-value-nan", C, _raw('{"prompt": "Hi", "max_tokens": 2, "logit_bias": {"5": @}}', "NaN"),
     "logit_bias"),
    ("float-too-big-for-a-double", C, _raw('{"prompt": "Hi", "max_tokens": 2, "temperature": @}', "1" * 400),
     "temperature"),
    ("prompt-lone-surrogate", C, _raw('{"prompt": "@", "max_tokens": 2}', "a\\ud800b"), "prompt"),
    ("prompt-list-lone-surrogate", C, _raw('{"prompt": ["ok", "@"], "max_tokens": 2}', "\\udfff"), "prompt"),
    ("stop-lone-surrogate", C, _raw('{"prompt": "Hi", "max_tokens": 2, "stop": "@"}', "\\ud83d"), "stop"),
    ("user-lone-surrogate", C, _raw('{"prompt": "Hi", "max_tokens": 2, "user": "@"}', "\\ud83d"), "user"),
    ("model-lone-surrogate", C, _raw('{"prompt": "Hi", "max_tokens": 2, "model": "@"}', "\\ud83d"), "model"),
    ("chat-content-lone-surrogate", CHAT,
     _raw('{"messages": [{"role": "user", "content": "@"}], "max_tokens": 2}', "\\ud800"), "messages"),
    ("chat-part-lone-surrogate", CHAT,
     _raw('{"messages": [{"role": "user", "content": [{"type": "text", "text": "@"}]}], "max_tokens": 2}',
          "\\ud800"), "messages"),
    ("tokenize-lone-surrogate", TOK, _raw('{"prompt": "@"}', "\\ud800"), "prompt"),
    ("chat-image-part", CHAT, _chat(messages=[{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "http://x/y.png"}}]}]), "messages"),
    ("chat-audio-part", CHAT, _chat(messages=[{"role": "user", "content": [
        {"type": "input_audio", "input_audio": {"data": "", "format": "wav"}}]}]), "messages"),
    ("too-many-prompts", C, _c(prompt=["a"] * 10_000), "prompt"),
    ("too-many-token-prompts", C, _c(prompt=[[1]] * 10_000), "prompt"),
    ("too-many-stops", C, _c(stop=["x"] * 1000), "stop"),
    ("too-many-stop-token-ids", C, _c(stop_token_ids=[1] * 10_000), "stop_token_ids"),
    ("too-many-logit-bias", C, _c(logit_bias={str(i): 1.0 for i in range(5000)}), "logit_bias"),
    ("too-many-messages", CHAT, _chat(messages=[{"role": "user", "content": ""}] * 10_000), "messages"),
    ("too-many-parts", CHAT, _chat(messages=[{"role": "user", "content": [{"type": "text", "text": ""}] * 10_000}]),
     "messages"),
]

# Valid edges: the largest and smallest values each type holds are served.
SERVED = [
    ("seed-int64-max", C, _c(seed=2**63 - 1, temperature=0.8)),
    ("seed-int64-min", C, _c(seed=-(2**63), temperature=0.8)),
    ("top-k-int32-max", C, _c(top_k=2**31 - 1, temperature=0.8)),
    ("prompt-with-nul", C, _c(prompt="a\u0000b")),
    ("stop-with-nul", C, _c(stop="\u0000")),
    ("chat-with-nul", CHAT, _chat(messages=[{"role": "user", "content": "\u0000"}])),
    ("surrogate-pair-is-text", C, _raw('{"prompt": "@", "max_tokens": 2}', "\\ud83d\\ude00")),
]


@pytest.fixture(scope="module")
def server(tiny_llama_dir):
    with serve(tiny_llama_dir, max_model_len=64, max_num_seqs=8, num_gpu_blocks_override=64) as s:
        yield s


def _post(server, path: str, body) -> httpx.Response:
    if isinstance(body, bytes):
        return httpx.post(server.base_url + path, content=body, headers={"content-type": "application/json"},
                          timeout=60)
    return httpx.post(server.base_url + path, json=body, timeout=60)


@pytest.mark.parametrize("name,path,body,param", REFUSED, ids=[r[0] for r in REFUSED])
def test_out_of_type_value_is_a_400_naming_the_field(server, name, path, body, param):
    r = _post(server, path, body)
    assert r.status_code == 400, (name, r.status_code, r.text[:500])
    err = r.json()["error"]
    assert err["code"] == 400 and err["type"] == "BadRequestError" and err["param"] == param, err
    assert len(err["message"]) < 400, err["message"]  # the offending value is shown cut short
    assert httpx.get(server.base_url + "/health", timeout=5).status_code == 200


@pytest.mark.parametrize("name,path,body", SERVED, ids=[r[0] for r in SERVED])
def test_edge_value_inside_the_type_is_served(server, name, path, body):
    r = _post(server, path, body)
    assert r.status_code == 200, (name, r.text[:500])
    assert r.json()["usage"]["completion_tokens"] == 2


def test_deeply_nested_and_huge_literals_are_400(server):
    deep = b'{"prompt": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"
    huge_int = b'{"prompt": "Hi", "seed": ' + b"9" * 20_000 + b"}"
    for body in (deep, huge_int):
        r = _post(server, C, body)
        assert r.status_code == 400 and r.json()["error"]["code"] == 400, r.text[:300]


def test_seed_overflow_does_not_take_the_engine_down(server):
    """Issue #17's first reproducer, then ordinary traffic on the same server."""
    r = _post(server, C, _c(seed=2**64 - 1, temperature=0.8))
    assert r.status_code == 400 and r.json()["error"]["param"] == "seed", r.text
    assert httpx.get(server.base_url + "/health", timeout=5).status_code == 200
    ok = _post(server, C, _c(seed=7, temperature=0.8, max_tokens=4, ignore_eos=True))
    assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] == 4
    wait_engine_idle(server)
    assert leaked_blocks(server) == {"device_blocks": 0, "cpu_blocks": 0, "block_tables": 0}


def test_lone_surrogate_in_a_streamed_prompt_is_a_400_before_the_stream(server):
    body = '{"prompt": "\\ud800", "max_tokens": 2, "stream": true}'.encode()
    r = _post(server, C, body)
    assert r.status_code == 400 and r.json()["error"]["param"] == "prompt", r.text
    assert json.loads(r.text)["error"]["type"] == "BadRequestError"


def test_stream_lines_survive_unicode_line_separators(server):
    """U+2028, U+2029 and U+0085 in streamed text (here echoed from the prompt) stay inside their `data:` line for
    readers that split with str.splitlines() (httpx's aiter_lines among them)."""
    prompt = "a\u2028b\u2029c\x85d"
    body = _c(prompt=prompt, echo=True, stream=True)
    with httpx.stream("POST", server.base_url + C, json=body, timeout=60) as r:
        assert r.status_code == 200
        lines = [line for line in r.iter_lines() if line.startswith("data:")]
    assert lines[-1] == "data: [DONE]"
    chunks = [json.loads(line[5:]) for line in lines[:-1]]  # each line one whole JSON document
    assert "".join(c["choices"][0]["text"] for c in chunks if c["choices"]).startswith(prompt)
