"""--reasoning-parser through the real server, the default SmolLM2 and the openai client.

SmolLM2 has no reasoning training, but given two earlier turns that reason inside `<think>...</think>` it answers
the third the same way (greedy): "<think>2 plus 2 is 4.</think>4". The parser is switched on the shared server's
context for each test (a server flag: ServerContext.reasoning_parser), and off again after it.
"""
from __future__ import annotations

import json

import httpx
import openai
import pytest

FEW_SHOT = [{"role": "user", "content": "What is 1+1?"},
            {"role": "assistant", "content": "<think>1 plus 1 is 2.</think>2"},
            {"role": "user", "content": "What is 3+3?"},
            {"role": "assistant", "content": "<think>3 plus 3 is 6.</think>6"},
            {"role": "user", "content": "What is 2+2?"}]
REASONING, ANSWER = "2 plus 2 is 4.", "4"
# Qwen3's switch, as its template has it: enable_thinking false closes an empty think block in the prompt.
QWEN3_LIKE = ("{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
              "{% if add_generation_prompt %}<|im_start|>assistant\n"
              "{% if enable_thinking is defined and enable_thinking is false %}<think>\n\n</think>\n\n{% endif %}"
              "{% endif %}")


@pytest.fixture
def client(real_server):
    return openai.OpenAI(base_url=real_server.base_url + "/v1", api_key="unused", max_retries=0, timeout=120)


@pytest.fixture
def parser(real_server):
    """Set ctx.reasoning_parser (and ctx.chat_template) of the shared server for one test."""
    ctx = real_server.server.config.app.state.ctx
    saved = ctx.reasoning_parser, ctx.chat_template

    def use(name, chat_template=None):
        ctx.reasoning_parser, ctx.chat_template = name, chat_template

    yield use
    ctx.reasoning_parser, ctx.chat_template = saved


def _chat(client, **kwargs):
    return client.chat.completions.create(model=None, messages=FEW_SHOT, **{"max_tokens": 24, "temperature": 0, **kwargs})


@pytest.mark.parametrize("name", ["deepseek_r1", "qwen3"])
def test_reasoning_splits_out_of_the_content(client, parser, name):
    plain = _chat(client).choices[0].message
    assert plain.content == f"<think>{REASONING}</think>{ANSWER}"  # the reply itself, without a parser
    assert getattr(plain, "reasoning_content", None) is None
    parser(name)
    message = _chat(client).choices[0].message
    assert (message.reasoning_content, message.content) == (REASONING, ANSWER)


def test_streamed_reasoning_is_split_across_token_boundaries(client, parser):
    """`</think>` arrives in three tokens (`</`, `think`, `>`): no piece of it reaches either field, and the deltas
    add up to the non-streamed message."""
    parser("deepseek_r1")
    chunks = list(_chat(client, stream=True))
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    thought = "".join(getattr(d, "reasoning_content", None) or "" for d in deltas)
    content = "".join(d.content or "" for d in deltas)
    assert (thought, content) == (REASONING, ANSWER)
    assert sum(1 for d in deltas if getattr(d, "reasoning_content", None)) > 1  # streamed, not sent at the end
    assert chunks[-1].choices[0].finish_reason == "stop"


def test_structured_output_applies_after_the_reasoning(client, parser):
    """The grammar waits for `</think>`: the reasoning runs free, the content is one of the choices. (Applied from
    the first token, the choice would be the whole reply, and deepseek_r1 would call it reasoning.)"""
    parser("deepseek_r1")
    message = _chat(client, extra_body={"guided_choice": ["four", "five"]}).choices[0].message
    assert message.reasoning_content == REASONING
    assert message.content in ("four", "five")
    streamed = list(_chat(client, stream=True, extra_body={"guided_choice": ["four", "five"]}))
    assert "".join(c.choices[0].delta.content or "" for c in streamed if c.choices) == message.content


def test_tool_call_is_read_from_the_content_after_the_reasoning(client, parser):
    parser("deepseek_r1")
    tool = {"type": "function", "function": {"name": "add", "parameters": {
        "type": "object", "additionalProperties": False, "required": ["a", "b"],
        "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}}}}
    choice = _chat(client, max_tokens=40, tools=[tool],
                   tool_choice={"type": "function", "function": {"name": "add"}}).choices[0]
    assert choice.message.reasoning_content  # free text before </think>
    assert "</think>" not in choice.message.reasoning_content
    (call,) = choice.message.tool_calls
    assert call.function.name == "add" and set(json.loads(call.function.arguments)) == {"a", "b"}
    assert choice.finish_reason == "tool_calls"


@pytest.mark.parametrize("name", ["deepseek_r1", "qwen3"])
def test_enable_thinking_false_reaches_the_template(client, parser, real_server, name):
    """chat_template_kwargs reach the template; a prompt that closed the think block makes the reply content, and
    a grammar applies from its first token."""
    parser(name, QWEN3_LIKE)
    off = {"chat_template_kwargs": {"enable_thinking": False}}
    ids = httpx.post(real_server.base_url + "/tokenize", json={"messages": FEW_SHOT, **off}).json()["tokens"]
    text = httpx.post(real_server.base_url + "/detokenize", json={"tokens": ids}).json()["prompt"]
    assert text.endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    message = _chat(client, extra_body={**off, "guided_choice": ["four", "five"]}).choices[0].message
    assert message.reasoning_content is None and message.content in ("four", "five")
