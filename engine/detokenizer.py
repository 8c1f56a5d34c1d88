"""Incremental detokenization: the tokenizer's own stream decoder (tokenizers' DecodeStream), one step per token."""
from __future__ import annotations

from tokenizers.decoders import DecodeStream

from engine.sequence import Sequence

# How many tokens before the first output token the stream is primed with, so that the tokenizer sees enough
# context for spaces and merged byte pieces (vLLM's value).
_CONTEXT_TOKENS = 5
_REPLACEMENT = "\ufffd"


def engine_reads_text(params) -> bool:
    """Whether the engine itself reads a request's text, so that an engine core which leaves detokenization to
    the API server (engine/core_proc.py) still decodes it: stop strings end a sequence on its text (and hold its
    tail back), and beam search and best_of > n choose their n choices only at the end. Every other request's text
    is decoded on the API server's side, from the token ids, by the same Detokenizer."""
    return bool(params.stop) or params.use_beam_search or params.best_of > params.n


class _Stream:
    """One sequence's decoder: the Rust stream, the last ids it has seen, and how many of those wait for the rest
    of a character (their text not emitted yet)."""

    __slots__ = ("stream", "ids", "pending", "skip", "backend")

    def __init__(self, backend, context: list[int], skip: bool) -> None:
        self.stream = DecodeStream(context, skip_special_tokens=skip)
        self.backend, self.ids, self.pending, self.skip = backend, list(context), 0, skip

    def fork(self) -> "_Stream":
        """A stream in the same state (for a forked sequence): primed with the emitted tail, then the pending ids
        replayed."""
        done = len(self.ids) - self.pending
        child = _Stream(self.backend, self.ids[max(done - _CONTEXT_TOKENS, 0):done], self.skip)
        for i in self.ids[done:]:
            child.stream.step(self.backend, i)
        child.ids, child.pending = list(self.ids), self.pending
        return child


class Detokenizer:
    """Each step decodes one token with DecodeStream (no re-decoding of earlier text: constant work a token).
    Text that ends in a partial UTF-8 character (byte-fallback pieces) is held back until the character
    completes, so no "\\ufffd" is emitted mid-character; flush() emits what an ended sequence still holds."""

    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer
        self.backend = tokenizer._tokenizer  # the fast tokenizer's tokenizers.Tokenizer
        # What skip_special_tokens drops: every added token marked special, not only all_special_ids (SmolLM2's
        # <file_sep>, <jupyter_code>, ...), as tokenizer.decode does.
        added = getattr(tokenizer, "added_tokens_decoder", {})
        self.special_ids = set(tokenizer.all_special_ids) | {i for i, t in added.items() if t.special}
        self.vocab_size = len(tokenizer)

    def _start(self, seq: Sequence, skip_special_tokens: bool) -> _Stream:
        # The prompt's last tokens give the first output token its context (e.g. SentencePiece's leading space),
        # without being emitted themselves. A prompt that ends mid-character would glue its bytes onto the first
        # output token; the output must decode on its own, so that piece is left out.
        tail = seq.prompt_token_ids[-(_CONTEXT_TOKENS + 2):]
        tail = [t for t in tail if 0 <= t < self.vocab_size]
        while tail and self.tokenizer.decode(tail, skip_special_tokens=skip_special_tokens).endswith(_REPLACEMENT):
            tail.pop()
        return _Stream(self.backend, tail[-_CONTEXT_TOKENS:], skip_special_tokens)

    def decode_next(self, seq: Sequence, skip_special_tokens: bool = True) -> str:
        """Detokenize the last output token of `seq`; append the new text to output_text and return it."""
        state = seq.detok
        if state is None:
            state = seq.detok = self._start(seq, skip_special_tokens)
        token = seq.output_token_ids[-1]
        if not 0 <= token < self.vocab_size:  # an id the tokenizer does not know (padded vocab rows): no text
            return ""
        state.ids.append(token)
        text = state.stream.step(self.backend, token)
        if text is None:
            state.pending += 1
            return ""
        state.pending = 0
        if len(state.ids) > 64:  # only the context of the next fork or flush is kept
            del state.ids[:-_CONTEXT_TOKENS]
        seq.output_text += text
        return text

    def flush(self, seq: Sequence) -> str:
        """Emit text held back for an unfinished character (the sequence has ended)."""
        state = seq.detok
        if state is None or not state.pending:
            return ""
        ids = state.ids
        done = len(ids) - state.pending
        context = ids[max(done - _CONTEXT_TOKENS, 0):done]
        skip = state.skip
        decode = self.tokenizer.decode
        text = decode(context + ids[done:], skip_special_tokens=skip)[len(decode(context, skip_special_tokens=skip)):]
        state.pending = 0
        seq.output_text += text
        return text
