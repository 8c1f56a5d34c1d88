"""A family's chat template renders through the server exactly as transformers' apply_chat_template renders it:
Gemma 3's (engine/model_executor/chat_templates.py, what a Gemma 3 GGUF without a template gets), which has no
system role (it folds a system message into the first user turn) and renders content parts itself (so they reach it
as parts, not joined), set as the shared SmolLM2 server's --chat-template for each test."""
from __future__ import annotations

import httpx
import pytest

from engine.model_executor.chat_templates import GEMMA3

SYSTEM_FIRST = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "  What is 2+2?  "},
                {"role": "assistant", "content": "4"}, {"role": "user", "content": "And 3+3?"}]
PARTS = [{"role": "user", "content": [{"type": "text", "text": "Hello "}, {"type": "text", "text": " world\n"}]}]


@pytest.fixture
def gemma_template(real_server):
    ctx = real_server.server.config.app.state.ctx
    saved, ctx.chat_template = ctx.chat_template, GEMMA3
    yield real_server
    ctx.chat_template = saved


@pytest.fixture(scope="module")
def tokenizer(default_model_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(default_model_dir)


def _tokenize(server, messages, **fields) -> httpx.Response:
    return httpx.post(server.base_url + "/tokenize", json={"messages": messages, **fields})


@pytest.mark.parametrize("messages", [SYSTEM_FIRST, PARTS], ids=["system-folded", "content-parts"])
@pytest.mark.parametrize("generation_prompt", [True, False])
def test_rendered_as_transformers_renders(gemma_template, tokenizer, messages, generation_prompt):
    want = tokenizer.apply_chat_template(messages, chat_template=GEMMA3, tokenize=False,
                                         add_generation_prompt=generation_prompt)
    # add_generation_prompt set through chat_template_kwargs: they reach the template (and override the field)
    got = _tokenize(gemma_template, messages, chat_template_kwargs={"add_generation_prompt": generation_prompt})
    assert got.status_code == 200
    assert got.json()["tokens"] == tokenizer(want, add_special_tokens=False)["input_ids"]
    if messages is SYSTEM_FIRST:
        assert "<start_of_turn>user\nBe brief.\n\nWhat is 2+2?<end_of_turn>" in want  # no system turn of its own
    else:
        assert "<start_of_turn>user\nHelloworld<end_of_turn>" in want  # each part trimmed, as the template does


def test_the_templates_own_error_is_a_400(gemma_template):
    bad = [{"role": "user", "content": "a"}, {"role": "user", "content": "b"}]
    r = httpx.post(gemma_template.base_url + "/v1/chat/completions", json={"messages": bad, "max_tokens": 1})
    assert r.status_code == 400
    assert "Conversation roles must alternate" in r.json()["error"]["message"]
