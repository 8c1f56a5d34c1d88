"""--reasoning-parser (server/reasoning.py): vLLM's deepseek_r1 / qwen3 splits of a reply, and a streamed reply split
exactly as the finished one, wherever the deltas cut the tags (inside `</think>`, a character at a time, at the
real tokenizer's token boundaries)."""
from __future__ import annotations

import pytest

from server.reasoning import PARSERS, ReasoningStream, plan, split

PROMPT = "<|im_start|>assistant\n"  # a prompt that neither opens nor closes a think block

# (reply, deepseek_r1's split, qwen3's split): vLLM's results for these replies
CASES = [
    ("<think>2 plus 2 is 4.</think>4", ("2 plus 2 is 4.", "4"), ("2 plus 2 is 4.", "4")),
    ("2 plus 2 is 4.</think>\n\nThe answer is 4.", ("2 plus 2 is 4.", "\n\nThe answer is 4."),
     (None, "2 plus 2 is 4.</think>\n\nThe answer is 4.")),  # qwen3: no <think>, no reasoning
    ("The answer is 4.", ("The answer is 4.", None), (None, "The answer is 4.")),  # r1: cut before </think>
    ("<think>still thinking", ("still thinking", None), ("still thinking", None)),
    ("<think>done</think>", ("done", None), ("done", None)),  # nothing after the reasoning: content null
    ("<think>a < b and c </ d</think>x </think> y", ("a < b and c </ d", "x </think> y"),
     ("a < b and c </ d", "x </think> y")),  # look-alike tails, and a second </think> is content
    ("", ("", None), (None, "")),
]


@pytest.mark.parametrize("reply,r1,qwen3", CASES)
def test_finished_replies_split_as_vllm(reply, r1, qwen3):
    assert split(plan("deepseek_r1", PROMPT), reply) == r1
    assert split(plan("qwen3", PROMPT), reply) == qwen3


def test_prompt_that_closed_or_opened_the_reasoning():
    """enable_thinking false: Qwen3's template closes an empty think block in the prompt: the reply is content
    (for either parser). A prompt that leaves <think> open (prefill, R1-style templates): reasoning first."""
    closed = PROMPT + "<think>\n\n</think>\n\n"
    for parser in PARSERS:
        assert split(plan(parser, closed), "x</think>y") == (None, "x</think>y")
        assert plan(parser, closed).gate(None) is None  # and a grammar applies from the first token
        assert split(plan(parser, PROMPT + "<think>\n"), "abc</think>de") == ("abc", "de")
        assert split(plan(parser, PROMPT + "<think>\n"), "<think>abc</think>de") == ("abc", "de")


def _streamed(parser: str, prompt: str, deltas: list[str]) -> tuple[str, str]:
    stream = ReasoningStream(plan(parser, prompt))
    text, reasoning, content = "", [], []
    for i, delta in enumerate(deltas):
        text += delta
        r, c = stream.feed(text, final=i == len(deltas) - 1)
        reasoning.append(r)
        content.append(c)
    return "".join(reasoning), "".join(content)


@pytest.mark.parametrize("parser", PARSERS)
@pytest.mark.parametrize("reply", [case[0] for case in CASES])
def test_every_cut_streams_the_finished_split(parser, reply):
    """Two deltas cut at every point, and one character at a time: the deltas add up to the finished split."""
    want = split(plan(parser, PROMPT), reply)
    want = (want[0] or "", want[1] or "")
    for cut in range(len(reply) + 1):
        assert _streamed(parser, PROMPT, [reply[:cut], reply[cut:]]) == want, cut
    assert _streamed(parser, PROMPT, list(reply) or [""]) == want


def test_held_back_tail_is_never_sent_early():
    """A delta ending in `</thi` sends neither it as reasoning nor anything after as reasoning once it completes."""
    stream = ReasoningStream(plan("deepseek_r1", PROMPT))
    assert stream.feed("a</thi") == ("a", "")
    assert stream.feed("a</think>b") == ("", "b")
    stream = ReasoningStream(plan("qwen3", PROMPT))
    assert stream.feed("x <thin") == ("", "x ")
    assert stream.feed("x <thinking>") == ("", "<thinking>")  # not the tag after all: content


@pytest.mark.parametrize("parser", PARSERS)
def test_token_by_token_with_the_real_tokenizer(parser, default_model_dir):
    """SmolLM2 spells `</think>` in three tokens (`</`, `think`, `>`): deltas cut at its token boundaries split as
    the finished text, and the gate is those three ids."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(default_model_dir)
    reply = "<think>I add 2 and 2: that is 4.</think>\n\nThe answer is 4. <think> is a tag."
    ids = tokenizer.encode(reply, add_special_tokens=False)
    texts = [tokenizer.decode(ids[:k]) for k in range(1, len(ids) + 1)]
    deltas = [texts[0]] + [b[len(a):] for a, b in zip(texts, texts[1:])]
    want = split(plan(parser, PROMPT), reply)
    assert _streamed(parser, PROMPT, deltas) == (want[0] or "", want[1] or "")
    assert want == ("I add 2 and 2: that is 4.", "\n\nThe answer is 4. <think> is a tag.")
    gate = plan(parser, PROMPT).gate(tokenizer)
    assert tokenizer.convert_ids_to_tokens(list(gate)) == ["</", "think", ">"]
