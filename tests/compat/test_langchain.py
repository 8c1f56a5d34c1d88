"""LangChain's ChatOpenAI pointed at the server: invoke, stream and batch give the server's greedy answers;
with_structured_output returns valid objects."""
from __future__ import annotations

from typing import Literal

import openai
import pydantic
import pytest
from compat_helpers import MODEL

langchain_openai = pytest.importorskip("langchain_openai", reason="in the dev extra")

PROMPTS = ["Hello there", "Name a fruit.", "Count to three."]


@pytest.fixture(scope="module")
def chat(compat_server):
    return langchain_openai.ChatOpenAI(base_url=compat_server.base_url + "/v1", api_key="unused", model=MODEL,
                                       max_tokens=6, temperature=0, max_retries=0)


def direct(server, prompt: str) -> str:
    client = openai.OpenAI(base_url=server.base_url + "/v1", api_key="unused")
    out = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": prompt}], max_tokens=6,
                                         temperature=0)
    return out.choices[0].message.content


def test_invoke_stream_batch(chat, compat_server):
    want = [direct(compat_server, p) for p in PROMPTS]
    reply = chat.invoke(PROMPTS[0])
    assert reply.content == want[0] and reply.usage_metadata["output_tokens"] == 6
    assert "".join(chunk.content for chunk in chat.stream(PROMPTS[0])) == want[0]
    assert [m.content for m in chat.batch(PROMPTS)] == want


class Answer(pydantic.BaseModel):
    verdict: Literal["yes", "no"]
    confidence: int = pydantic.Field(ge=0, le=9)


@pytest.mark.parametrize("method", ["json_schema", "function_calling"])
def test_with_structured_output(compat_server, method):
    """with_structured_output: response_format json_schema, or a forced tool call; the tiny model's noise is
    turned into a valid Answer by the grammar either way."""
    chat = langchain_openai.ChatOpenAI(base_url=compat_server.base_url + "/v1", api_key="unused", model=MODEL,
                                       max_tokens=40, temperature=0, max_retries=0)
    answer = chat.with_structured_output(Answer, method=method).invoke("Is the sky blue?")
    assert isinstance(answer, Answer) and answer.verdict in ("yes", "no") and 0 <= answer.confidence <= 9
