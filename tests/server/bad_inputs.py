"""Malformed request bodies: each must get a 4xx with a parseable OpenAI error body, never a 5xx."""
from __future__ import annotations

from typing import Any

MODEL = "SmolLM2-135M-Instruct"
LONG_PROMPT = "hello " * 20000  # beyond any max_model_len (SmolLM2: 8192), well under the body limit

_C = "/v1/completions"
_CHAT = "/v1/chat/completions"
_MSG = [{"role": "user", "content": "Hi"}]


def _c(**fields: Any) -> dict[str, Any]:
    return {"model": MODEL, "prompt": "Hello", "max_tokens": 2, **fields}


def _chat(**fields: Any) -> dict[str, Any]:
    return {"model": MODEL, "messages": _MSG, "max_tokens": 2, **fields}


# (id, path, body (dict, or bytes sent raw as JSON), expected status, param the error should name or None)
BAD_INPUTS: list[tuple[str, str, Any, int, Any]] = [
    ("prompt-int", _C, _c(prompt=5), 400, "prompt"),
    ("prompt-missing", _C, {"model": MODEL}, 400, "prompt"),
    ("prompt-empty-string", _C, _c(prompt=""), 400, "prompt"),
    ("prompt-empty-list", _C, _c(prompt=[]), 400, "prompt"),
    ("prompt-empty-token-list", _C, _c(prompt=[[]]), 400, "prompt"),
    ("prompt-mixed-list", _C, _c(prompt=["a", 1]), 400, "prompt"),
    ("prompt-too-long", _C, _c(prompt=LONG_PROMPT), 400, None),
    ("token-id-outside-vocab", _C, _c(prompt=[1, 2, 10**7]), 400, "prompt"),
    ("token-id-negative", _C, _c(prompt=[1, -3]), 400, "prompt"),
    ("max-tokens-string", _C, _c(max_tokens="ten"), 400, "max_tokens"),
    ("max-tokens-zero", _C, _c(max_tokens=0), 400, "max_tokens"),
    ("max-tokens-negative", _C, _c(max_tokens=-5), 400, "max_tokens"),
    ("max-tokens-over-context", _C, _c(max_tokens=10**6), 400, "max_tokens"),
    ("temperature-too-high", _C, _c(temperature=3.5), 400, "temperature"),
    ("temperature-negative", _C, _c(temperature=-1), 400, "temperature"),
    ("temperature-string", _C, _c(temperature="hot"), 400, "temperature"),
    ("top-p-zero", _C, _c(top_p=0), 400, "top_p"),
    ("top-p-over-one", _C, _c(top_p=1.5), 400, "top_p"),
    ("top-k-zero", _C, _c(top_k=0), 400, "top_k"),
    ("presence-penalty-range", _C, _c(presence_penalty=5), 400, "presence_penalty"),
    ("frequency-penalty-range", _C, _c(frequency_penalty=-3), 400, "frequency_penalty"),
    ("repetition-penalty-zero", _C, _c(repetition_penalty=0), 400, "repetition_penalty"),
    ("n-zero", _C, _c(n=0), 400, "n"),
    ("n-huge", _C, _c(n=100000), 400, "n"),
    ("best-of-less-than-n", _C, _c(n=3, best_of=2, temperature=1.0), 400, "best_of"),
    ("logprobs-over-20", _C, _c(logprobs=21), 400, "logprobs"),
    ("logprobs-negative", _C, _c(logprobs=-1), 400, "logprobs"),
    ("unknown-model", _C, _c(model="gpt-17"), 404, "model"),
    ("stream-options-without-stream", _C, _c(stream_options={"include_usage": True}), 400, "stream_options"),
    ("suffix-unsupported", _C, _c(suffix="tail"), 400, "suffix"),
    ("stop-empty-string", _C, _c(stop=""), 400, "stop"),
    ("stop-list-with-empty", _C, _c(stop=["ok", ""]), 400, "stop"),
    ("stop-int", _C, _c(stop=7), 400, "stop"),
    ("stop-token-ids-outside-vocab", _C, _c(stop_token_ids=[10**8]), 400, "stop_token_ids"),
    ("min-tokens-over-max", _C, _c(min_tokens=5, max_tokens=2), 400, "min_tokens"),
    ("logit-bias-bad-key", _C, _c(logit_bias={"abc": 1.0}), 400, "logit_bias"),
    ("logit-bias-out-of-range", _C, _c(logit_bias={"5": 500.0}), 400, "logit_bias"),
    ("seed-string", _C, _c(seed="x"), 400, "seed"),
    ("echo-string", _C, _c(echo="yes"), 400, "echo"),
    ("stream-options-usage-string", _C,
     _c(stream=True, stream_options={"include_usage": True, "continuous_usage_stats": "y"}), 400, "stream_options"),
    ("priority-string", _C, _c(priority="high"), 400, "priority"),
    ("truncate-prompt-tokens-zero", _C, _c(truncate_prompt_tokens=0), 400, "truncate_prompt_tokens"),
    ("allowed-token-ids-outside-vocab", _C, _c(allowed_token_ids=[10**8]), 400, "allowed_token_ids"),
    ("allowed-token-ids-empty", _C, _c(allowed_token_ids=[]), 400, "allowed_token_ids"),
    ("bad-words-int", _C, _c(bad_words=[3]), 400, "bad_words"),
    ("request-id-empty", _C, _c(request_id=""), 400, "request_id"),
    ("prompt-logprobs-over-max", _C, _c(prompt_logprobs=21), 400, "prompt_logprobs"),
    ("body-array", _C, [1, 2, 3], 400, None),
    ("invalid-json", _C, b'{"prompt": "Hello", ', 400, None),
    ("empty-body", _C, b"", 400, None),
    ("chat-messages-missing", _CHAT, {"model": MODEL}, 400, "messages"),
    ("chat-messages-empty", _CHAT, _chat(messages=[]), 400, "messages"),
    ("chat-bad-role", _CHAT, _chat(messages=[{"role": "wizard", "content": "x"}]), 400, "messages"),
    ("chat-content-int", _CHAT, _chat(messages=[{"role": "user", "content": 5}]), 400, "messages"),
    ("chat-bad-part-type", _CHAT, _chat(messages=[{"role": "user", "content": [{"type": "image_url", "text": "x"}]}]),
     400, "messages"),
    ("chat-top-logprobs-over-20", _CHAT, _chat(logprobs=True, top_logprobs=21), 400, "top_logprobs"),
    ("chat-top-logprobs-without-logprobs", _CHAT, _chat(top_logprobs=2), 400, "top_logprobs"),
    ("chat-logprobs-int", _CHAT, _chat(logprobs=3), 400, "logprobs"),
    ("chat-template-kwargs-list", _CHAT, _chat(chat_template_kwargs=[1]), 400, "chat_template_kwargs"),
    ("chat-template-kwargs-reserved", _CHAT, _chat(chat_template_kwargs={"tokenize": True}), 400,
     "chat_template_kwargs"),
    ("chat-documents-not-strings", _CHAT, _chat(documents=[{"title": 5}]), 400, "documents"),
    ("chat-continue-and-generation-prompt", _CHAT,
     _chat(messages=[*_MSG, {"role": "assistant", "content": "Hel"}], continue_final_message=True), 400,
     "continue_final_message"),
    ("chat-continue-after-user", _CHAT, _chat(continue_final_message=True, add_generation_prompt=False), 400,
     "continue_final_message"),
    ("chat-unknown-model", _CHAT, _chat(model="nope"), 404, "model"),
    ("chat-max-tokens-over-context", _CHAT, _chat(max_tokens=10**6), 400, "max_tokens"),
    ("chat-stream-options-without-stream", _CHAT, _chat(stream_options={"include_usage": True}), 400,
     "stream_options"),
    ("chat-too-long", _CHAT, _chat(messages=[{"role": "user", "content": LONG_PROMPT}]), 400, None),
    ("responses-input-missing", "/v1/responses", {"model": MODEL}, 400, "input"),
    ("responses-input-empty", "/v1/responses", {"input": []}, 400, "input"),
    ("responses-bad-role", "/v1/responses", {"input": [{"role": "wizard", "content": "x"}]}, 400, "input"),
    ("responses-temperature-range", "/v1/responses", {"input": "Hi", "temperature": 3}, 400, "temperature"),
    ("responses-max-output-tokens-zero", "/v1/responses", {"input": "Hi", "max_output_tokens": 0}, 400,
     "max_output_tokens"),
    ("responses-unknown-model", "/v1/responses", {"input": "Hi", "model": "nope"}, 404, "model"),
    # structured outputs and tools (server/guided.py, server/tools.py)
    ("response-format-unknown-type", _CHAT, _chat(response_format={"type": "xml"}), 400, "response_format"),
    ("response-format-schema-missing", _CHAT, _chat(response_format={"type": "json_schema", "json_schema": {"name": "x"}}),
     400, "response_format"),
    ("response-format-schema-invalid", _CHAT, _chat(response_format={
        "type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "no-such-type"}}}), 400, "response_format"),
    ("guided-json-not-json", _C, _c(guided_json="{not json"), 400, "guided_json"),
    ("guided-json-not-a-schema", _C, _c(guided_json="[1, 2]"), 400, "guided_json"),
    ("guided-regex-invalid", _C, _c(guided_regex="[a-"), 400, "guided_regex"),
    ("guided-grammar-invalid", _C, _c(guided_grammar="root ::= undefined_rule"), 400, "guided_grammar"),
    ("guided-choice-empty", _C, _c(guided_choice=[]), 400, "guided_choice"),
    ("guided-two-constraints", _C, _c(guided_regex="a+", guided_choice=["a"]), 400, None),
    ("guided-backend-unknown", _C, _c(guided_regex="a+", guided_decoding_backend="outlines"), 400,
     "guided_decoding_backend"),
    ("guided-with-beam-search", _C, _c(guided_regex="a+", use_beam_search=True, best_of=2, temperature=0), 400,
     "use_beam_search"),
    ("structured-outputs-two", _C, _c(structured_outputs={"regex": "a+", "choice": ["a"]}), 400, "structured_outputs"),
    ("tool-choice-without-tools", _CHAT, _chat(tool_choice="required"), 400, "tool_choice"),
    ("tool-choice-unknown-function", _CHAT, _chat(
        tools=[{"type": "function", "function": {"name": "f"}}],
        tool_choice={"type": "function", "function": {"name": "g"}}), 400, "tool_choice"),
    ("tool-name-invalid", _CHAT, _chat(tools=[{"type": "function", "function": {"name": "a b"}}]), 400, "tools"),
    ("tool-type-invalid", _CHAT, _chat(tools=[{"type": "retrieval", "function": {"name": "f"}}]), 400, "tools"),
    ("tools-duplicate-names", _CHAT, _chat(tools=[{"type": "function", "function": {"name": "f"}}] * 2), 400, "tools"),
    ("tool-choice-with-guided", _CHAT, _chat(tools=[{"type": "function", "function": {"name": "f"}}],
                                              tool_choice="required", guided_regex="a+"), 400, "guided_regex"),
    ("tool-message-calls-not-list", _CHAT, _chat(messages=[*_MSG, {"role": "assistant", "tool_calls": 5}]), 400,
     "messages"),
    ("tokenize-neither", "/tokenize", {"model": MODEL}, 400, "prompt"),
    ("tokenize-continue-no-messages", "/tokenize",
     {"messages": [], "add_generation_prompt": False, "continue_final_message": True}, 400, "continue_final_message"),
    ("detokenize-outside-vocab", "/detokenize", {"tokens": [10**9]}, 400, "tokens"),
]
