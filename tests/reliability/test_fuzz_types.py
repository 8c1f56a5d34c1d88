"""hypothesis over every field of the request models, through a real server on the tiny model.

Each field draws a value inside its valid shape (varied: seeds, penalties, token ids, stop lists...), an extreme
of its type (2^31, 2^63, 2^64, negatives, NaN and +-inf as raw JSON literals, lone surrogates, NUL, lists of
thousands, nesting thousands deep) or a value of another type. After every request: the status is a 2xx or a
4xx, a stream carries no 5xx error event, and /health is 200.

The default run is a few hundred requests (tens of seconds). PAGEDSERVE_FUZZ_SECONDS=300 runs batches until
that much time has passed; the figures go to the reliability report (docs/reliability.md quotes them).
"""
from __future__ import annotations

import json
import os
import time
from collections import Counter
from typing import Any

import httpx
import pytest
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

from reliability_harness import leaked_blocks, metric, record, serve, wait_engine_idle
from server.protocol import ChatCompletionRequest, CompletionRequest, DetokenizeRequest, TokenizeRequest
from server.protocol_responses import ResponsesRequest

SECONDS = float(os.environ.get("PAGEDSERVE_FUZZ_SECONDS", "0"))
EXAMPLES = {"completions": 110, "chat": 70, "responses": 40, "tokenize": 30, "detokenize": 20}  # the default run
VOCAB = 49152  # the tiny model's tokenizer (the default model's)

# -- values ---------------------------------------------------------------------------------------------------


class Raw(str):
    """A JSON literal written as is (NaN, Infinity, a nesting thousands deep)."""


EXTREME_INTS = [0, -1, 2**31 - 1, 2**31, -(2**31), -(2**31) - 1, 2**32, 2**53 + 1, 2**63 - 1, 2**63, -(2**63),
                -(2**63) - 1, 2**64 - 1, 2**64, 10**30]
odd_text = st.one_of(
    st.sampled_from(["\ud800", "a\udfffb", "\x00", "a\x00b", "\ud83d\ude00", "\ufffe", "\U0010ffff", "", " ", "tiny"]),
    st.text(st.characters(exclude_categories=()), max_size=12),  # surrogates (category Cs) included
)
extreme_int = st.one_of(st.sampled_from(EXTREME_INTS), st.integers())
extreme_float = st.one_of(st.sampled_from([Raw("NaN"), Raw("Infinity"), Raw("-Infinity"), Raw("1" * 400),
                                           Raw("1e999"), -0.0, 5e-324, 1e308, -1e308]),
                          st.floats(allow_nan=False, allow_infinity=False))
long_list = st.sampled_from([1, 2, 300, 3000, 20000]).flatmap(
    lambda k: st.sampled_from([[1] * k, ["a"] * k, [[1]] * k, [""] * k]))
deep = st.integers(2, 5000).map(lambda d: Raw("[" * d + "]" * d))
junk = st.one_of(st.none(), st.booleans(), extreme_int, extreme_float, odd_text, long_list, deep,
                 st.lists(extreme_int, max_size=3), st.dictionaries(odd_text, extreme_int, max_size=2))


class F:
    """One field: values inside its valid shape (None: drawn only as an extreme), and the extremes of its type."""

    def __init__(self, valid: st.SearchStrategy | None, extreme: st.SearchStrategy = junk) -> None:
        self.valid, self.extreme = valid, extreme


token = st.integers(0, VOCAB - 1)
prompt = F(
    st.one_of(st.text(min_size=1, max_size=30), st.lists(st.text(min_size=1, max_size=10), min_size=1, max_size=3),
              st.lists(token, min_size=1, max_size=20),
              st.lists(st.lists(token, min_size=1, max_size=8), min_size=1, max_size=3)),
    st.one_of(odd_text, st.lists(odd_text, min_size=1, max_size=3), st.lists(extreme_int, min_size=1, max_size=3),
              st.lists(st.lists(extreme_int, max_size=2), max_size=2), long_list, deep))
stop = F(st.one_of(st.none(), st.text(min_size=1, max_size=4), st.lists(st.text(min_size=1, max_size=4), max_size=4)),
         st.one_of(odd_text, st.lists(odd_text, max_size=3), long_list))
part = st.fixed_dictionaries({"type": st.just("text"), "text": st.text(max_size=10)})
odd_part = st.fixed_dictionaries({"type": st.sampled_from(["text", "image_url", "input_audio", "refusal", ""]),
                                  "text": odd_text}, optional={"image_url": st.just({"url": "http://x/y.png"})})
message = st.fixed_dictionaries(
    {"role": st.sampled_from(["system", "user", "assistant"]),
     "content": st.one_of(st.text(max_size=30), st.lists(part, min_size=1, max_size=3))})
odd_message = st.fixed_dictionaries(
    {"role": st.one_of(st.sampled_from(["tool", "developer", "wizard"]), odd_text),
     "content": st.one_of(odd_text, st.lists(odd_part, max_size=3), junk)}, optional={"name": odd_text})
messages = F(st.lists(message, min_size=1, max_size=4).map(lambda m: m[:-1] + [{**m[-1], "role": "user"}]),
             st.one_of(long_list, deep, st.lists(odd_message, min_size=1, max_size=3),
                       st.lists(message, min_size=1000, max_size=1000)))

COMMON: dict[str, F] = {
    "model": F(st.just("tiny"), odd_text),
    "n": F(st.integers(1, 3), extreme_int),
    "best_of": F(st.none(), extreme_int),
    "temperature": F(st.floats(0.1, 2), extreme_float),
    "top_p": F(st.floats(0.01, 1), extreme_float),
    "top_k": F(st.one_of(st.just(-1), st.integers(1, 100)), extreme_int),
    "min_p": F(st.floats(0, 1), extreme_float),
    "presence_penalty": F(st.floats(-2, 2), extreme_float),
    "frequency_penalty": F(st.floats(-2, 2), extreme_float),
    "repetition_penalty": F(st.floats(0.01, 2), extreme_float),
    "length_penalty": F(st.floats(-5, 5), extreme_float),
    "seed": F(st.one_of(st.none(), st.integers(-(2**63), 2**63 - 1)), extreme_int),
    "stop": stop,
    "stop_token_ids": F(st.lists(token, max_size=4), st.lists(extreme_int, max_size=3)),
    "ignore_eos": F(st.booleans()),
    "min_tokens": F(st.integers(0, 1), extreme_int),
    "logit_bias": F(st.dictionaries(token.map(str), st.floats(-100, 100), max_size=4),
                    st.dictionaries(st.one_of(odd_text, extreme_int.map(str)), extreme_float, max_size=3)),
    "skip_special_tokens": F(st.booleans()),
    "include_stop_str_in_output": F(st.booleans()),
    "use_beam_search": F(st.just(False)),
    "stream": F(st.booleans()),
    "stream_options": F(st.none()),
    "user": F(st.text(max_size=10), odd_text),
    "max_tokens": F(st.integers(1, 6), extreme_int),
    "priority": F(st.integers(-10, 10), extreme_int),
    "spaces_between_special_tokens": F(st.booleans()),
    "truncate_prompt_tokens": F(st.one_of(st.just(-1), st.integers(1, 8)), extreme_int),
    "prompt_logprobs": F(st.none(), extreme_int),
    "allowed_token_ids": F(st.one_of(st.none(), st.lists(token, min_size=1, max_size=5)),
                           st.lists(extreme_int, max_size=3)),
    "bad_words": F(st.one_of(st.none(), st.lists(st.text(min_size=1, max_size=6), max_size=3)),
                   st.lists(odd_text, max_size=3)),
    "return_tokens_as_token_ids": F(st.booleans()),
    "request_id": F(st.none(), st.one_of(odd_text, st.text(min_size=200, max_size=400))),
    "add_special_tokens": F(st.booleans()),
}
TEMPLATE = {
    "continue_final_message": F(st.just(False)),
    "chat_template_kwargs": F(st.one_of(st.none(), st.just({})),
                              st.dictionaries(odd_text, st.one_of(odd_text, extreme_int, extreme_float, deep), max_size=3)),
    "documents": F(st.none(), st.lists(st.dictionaries(odd_text, odd_text, max_size=2), max_size=3)),
}
response_input = F(st.one_of(st.text(min_size=1, max_size=30), st.lists(st.fixed_dictionaries(
    {"role": st.sampled_from(["user", "system"]), "content": st.one_of(
        st.text(min_size=1, max_size=20),
        st.lists(st.fixed_dictionaries({"type": st.just("input_text"), "text": st.text(max_size=10)}), min_size=1,
                 max_size=2))}), min_size=1, max_size=3).map(lambda m: m[:-1] + [{**m[-1], "role": "user"}])),
    st.one_of(odd_text, long_list, deep, st.lists(odd_message, min_size=1, max_size=2)))
PER_ENDPOINT = {
    "completions": (CompletionRequest, "/v1/completions", {
        **COMMON, "prompt": prompt, "echo": F(st.booleans()), "logprobs": F(st.integers(0, 5), extreme_int),
        "suffix": F(st.none(), odd_text)}),
    "chat": (ChatCompletionRequest, "/v1/chat/completions", {
        **COMMON, **TEMPLATE, "messages": messages, "echo": F(st.booleans()), "max_completion_tokens": F(st.integers(1, 6), extreme_int),
        "logprobs": F(st.booleans()), "top_logprobs": F(st.none(), extreme_int),
        "add_generation_prompt": F(st.booleans())}),
    "responses": (ResponsesRequest, "/v1/responses", {
        "model": COMMON["model"], "input": response_input, "instructions": F(st.none(), odd_text),
        "max_output_tokens": F(st.integers(1, 6), extreme_int), "temperature": COMMON["temperature"],
        "top_p": COMMON["top_p"], "stream": F(st.booleans()), "store": F(st.booleans()),
        "previous_response_id": F(st.none(), odd_text), "user": COMMON["user"], "priority": COMMON["priority"],
        "metadata": F(st.none(), st.dictionaries(odd_text, odd_text, max_size=20))}),
    "tokenize": (TokenizeRequest, "/tokenize", {
        **TEMPLATE, "model": COMMON["model"], "prompt": F(st.text(max_size=30), odd_text), "messages": messages,
        "add_special_tokens": F(st.booleans()), "add_generation_prompt": F(st.booleans())}),
    "detokenize": (DetokenizeRequest, "/detokenize", {
        "model": COMMON["model"], "tokens": F(st.lists(token, max_size=20), st.lists(extreme_int, max_size=4))}),
}
REQUIRED = {"completions": ("prompt",), "chat": ("messages",), "responses": ("input",), "tokenize": ("prompt",),
            "detokenize": ("tokens",)}


@st.composite
def bodies(draw: Any, endpoint: str) -> dict[str, Any]:
    """A body valid in shape with varied values, then none to a few fields (any field of the model, one added
    since included) set to an extreme of its type or to another type, now and then a required field dropped."""
    model, _, fields = PER_ENDPOINT[endpoint]
    fields = {**{name: F(None) for name in model.model_fields}, **fields}
    optional = {name: f.valid for name, f in fields.items()
                if name not in REQUIRED[endpoint] and name in model.model_fields and f.valid is not None}
    body = draw(st.fixed_dictionaries({name: fields[name].valid for name in REQUIRED[endpoint]}, optional=optional))
    for _ in range(draw(st.sampled_from([0, 0, 0, 1, 1, 2, 4]))):
        name = draw(st.sampled_from(sorted(fields)))
        body[name] = draw(st.one_of(fields[name].extreme, fields[name].extreme, junk))
    if draw(st.integers(0, 19)) == 0:
        body.pop(REQUIRED[endpoint][0], None)
    return body


def encode(body: dict[str, Any]) -> bytes:
    """JSON with raw literals spliced in; ensure_ascii writes a lone surrogate as its \\uXXXX escape."""
    raws: list[str] = []

    def mark(value: Any) -> Any:
        if isinstance(value, Raw):
            raws.append(str(value))
            return f"__raw_{len(raws) - 1}__"
        if isinstance(value, list):
            return [mark(v) for v in value]
        if isinstance(value, dict):
            return {k: mark(v) for k, v in value.items()}
        return value

    text = json.dumps(mark(body), ensure_ascii=True)
    for i, raw in enumerate(raws):
        text = text.replace(f'"__raw_{i}__"', raw, 1)
    return text.encode()


# -- the run --------------------------------------------------------------------------------------------------


# With the engine core in a process of its own (every value that reaches the engine crosses the process boundary as
# msgpack), half the examples.
@pytest.fixture(scope="module", params=["in-process", "core-process"])
def server(tiny_llama_dir, request):
    with serve(tiny_llama_dir, core_process=request.param == "core-process", max_model_len=128, max_num_seqs=16,
               num_gpu_blocks_override=256) as s:
        s.share = 1.0 if request.param == "in-process" else 0.5
        s.mode = request.param
        yield s


def _send(client: httpx.Client, path: str, body: dict[str, Any]) -> tuple[int, list[dict]]:
    """The status, and the error events of a stream (a 200 whose stream ends in a 5xx event is a 5xx)."""
    with client.stream("POST", path, content=encode(body), headers={"content-type": "application/json"}) as r:
        raw = r.read().decode()
    if r.status_code != 200 or not r.headers.get("content-type", "").startswith("text/event-stream"):
        return r.status_code, []
    # SSE lines end at \n (or \r\n); str.splitlines() would also cut at U+2028 or U+0085 inside generated text.
    lines = [line.rstrip("\r") for line in raw.split("\n")]
    events = [json.loads(line[5:]) for line in lines if line.startswith("data:") and "[DONE]" not in line]
    return r.status_code, [e["error"] for e in events if "error" in e]


def test_fuzz_request_fields(server):
    statuses: Counter = Counter()
    bad: list[tuple[int, bytes, str]] = []
    end = time.monotonic() + SECONDS
    with httpx.Client(base_url=server.base_url, timeout=120) as client:
        def run(endpoint: str, examples: int) -> None:
            _, path, _ = PER_ENDPOINT[endpoint]

            @settings(max_examples=examples, deadline=None, database=None, phases=[Phase.generate],
                      suppress_health_check=list(HealthCheck))
            @given(body=bodies(endpoint))
            def fuzz(body):
                status, errors = _send(client, path, body)
                if errors:
                    status = max([status] + [e.get("code", 500) for e in errors])
                statuses[(endpoint, status)] += 1
                health = client.get("/health").status_code
                if not (200 <= status < 300 or 400 <= status < 500) or health != 200:
                    bad.append((status, encode(body)[:400], f"health {health}"))
                    assert False, bad[-1]

            fuzz()

        while True:
            for endpoint, examples in EXAMPLES.items():
                run(endpoint, max(5, round(examples * server.share)))
            if time.monotonic() >= end:
                break
    wait_engine_idle(server)
    leaks = leaked_blocks(server)
    text = httpx.get(server.base_url + "/metrics").text
    resets = metric(text, "pagedserve:engine_resets_total") if "engine_resets_total" in text else 0.0
    by_class = Counter()
    for (_, status), count in statuses.items():
        by_class[f"{status // 100}xx"] += count
    record(("fuzz_types" if not SECONDS else f"fuzz_types_{int(SECONDS)}s")
           + ("_core_process" if server.mode == "core-process" else ""), {
        "requests": sum(statuses.values()), **dict(sorted(by_class.items())), "resets": resets,
        "by_endpoint_status": {f"{e} {s}": c for (e, s), c in sorted(statuses.items())},
        "blocks_leaked": sum(leaks.values()), "seconds": SECONDS or None})
    assert not bad, bad
    assert by_class["5xx"] == 0 and resets == 0
    assert by_class["2xx"] > 20 * server.share, statuses  # the valid shapes reached the engine, not only the validators
    assert leaks == {"device_blocks": 0, "cpu_blocks": 0, "block_tables": 0}
