"""Reasoning output: `<think>...</think>` split out of a chat reply (--reasoning-parser, vLLM's names).

- `deepseek_r1`: the reply starts in its reasoning (DeepSeek-R1's template opens `<think>` in the prompt): the text
  up to the first `</think>` is reasoning (a `<think>` the model writes itself is dropped), the rest is content; a
  reply without `</think>` (cut by max_tokens) is all reasoning.
- `qwen3`: reasoning only inside a `<think>` the reply opens itself (Qwen3 writes it; with
  `chat_template_kwargs: {"enable_thinking": false}` its template closes an empty one in the prompt and the
  reply is plain content); text around the block is content.
A prompt whose text ends with `</think>` (the template closed the reasoning already) makes the reply all content;
one that leaves a `<think>` open (a template that opens it, an assistant prefill) starts the reply in its reasoning.

The split works on text, not on token ids: a tag spelled by several tokens, or arriving across two of a stream's
deltas, splits as one written in a single token, and a streamed reply splits exactly as the finished one does
(the tail that may be the start of a tag is held back until the next text says whether it is one).
Tool calls and structured outputs apply to the content: server/tools.py parses it, and the grammar is gated by
the end tag's token ids (SamplingParams.guided_after), so the reasoning runs free.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

START, END = "<think>", "</think>"
PARSERS = ("deepseek_r1", "qwen3")


@dataclass
class ReasoningPlan:
    """How one chat's reply splits: the parser, and whether the prompt closed the reasoning already."""

    parser: str
    ended_in_prompt: bool = False  # the prompt ends with </think>: the reply is content
    opened_in_prompt: bool = False  # the prompt leaves a <think> open: the reply starts in its reasoning

    def gate(self, tokenizer: Any) -> Optional[tuple[int, ...]]:
        """The token ids after which a grammar applies (None: from the first token, the prompt closed the
        reasoning). `</think>` is one special token in the reasoning models' vocabularies; where it is not, its
        plain spelling, which a model that writes it another way does not match."""
        if self.ended_in_prompt:
            return None
        token_id = tokenizer.convert_tokens_to_ids(END) if hasattr(tokenizer, "convert_tokens_to_ids") else None
        if isinstance(token_id, int) and token_id != getattr(tokenizer, "unk_token_id", None):
            return (token_id,)
        return tuple(tokenizer.encode(END, add_special_tokens=False))


def plan(parser: Optional[str], prompt_text: str) -> Optional[ReasoningPlan]:
    if parser is None:
        return None
    return ReasoningPlan(parser, ended_in_prompt=prompt_text.rstrip().endswith(END),
                         opened_in_prompt=prompt_text.rfind(START) > prompt_text.rfind(END))


class ReasoningStream:
    """One reply's split, fed the reply's whole text so far each time; returns the new (reasoning, content)."""

    def __init__(self, rplan: ReasoningPlan) -> None:
        # states: "before" (qwen3: content until a <think>), "reasoning", "after" (content for good)
        if rplan.ended_in_prompt:
            self.state = "after"
        else:
            self.state = "reasoning" if rplan.parser == "deepseek_r1" or rplan.opened_in_prompt else "before"
        # Reasoning the prompt opened drops one <think> the model writes again (vLLM's parsers strip it).
        self.start_dropped = self.state != "reasoning"
        self.seen_reasoning = self.state == "reasoning"
        self.pos = 0  # characters of the text consumed
        self.reasoning = ""
        self.content = ""

    def feed(self, text: str, final: bool = False) -> tuple[str, str]:
        """The reasoning and content that can go out now; final: the text is complete (nothing held back)."""
        reasoning, content = [], []
        while self.pos < len(text):
            rest = text[self.pos:]
            tags = self._tags()
            if not tags:
                content.append(rest)
                self.pos = len(text)
                break
            found = [(rest.find(tag), tag) for tag in tags if tag in rest]
            if found:
                at, tag = min(found)
                (reasoning if self.state == "reasoning" else content).append(rest[:at])
                self.pos += at + len(tag)
                self._on(tag)
                continue
            keep = 0 if final else max(_partial(rest, tag) for tag in tags)
            (reasoning if self.state == "reasoning" else content).append(rest[:len(rest) - keep])
            self.pos += len(rest) - keep
            break
        out = "".join(reasoning), "".join(content)
        self.reasoning += out[0]
        self.content += out[1]
        return out

    def _tags(self) -> tuple[str, ...]:
        if self.state == "before":
            return (START,)
        if self.state == "reasoning":
            return (END,) if self.start_dropped else (END, START)
        return ()

    def _on(self, tag: str) -> None:
        if tag == START:
            self.start_dropped = True
            self.state = "reasoning"
            self.seen_reasoning = True
        else:
            self.state = "after"

    def result(self) -> tuple[Optional[str], Optional[str]]:
        """(reasoning_content, content) of the finished reply, as vLLM reports them: no reasoning -> None; a
        reply with reasoning and nothing after it -> content None."""
        if not self.seen_reasoning:
            return None, self.content
        return self.reasoning, self.content or None


def split(rplan: ReasoningPlan, text: str) -> tuple[Optional[str], Optional[str]]:
    """(reasoning_content, content) of a finished reply."""
    stream = ReasoningStream(rplan)
    stream.feed(text, final=True)
    return stream.result()


def _partial(text: str, tag: str) -> int:
    """The length of the longest tail of text that is a proper prefix of tag (it may be the tag's start)."""
    for k in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:k]):
            return k
    return 0
