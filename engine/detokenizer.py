"""Incremental detokenization: a few token strings per step, never the whole output."""
from __future__ import annotations

from engine.sequence import Sequence

# How many tokens before the read offset are decoded with the new ones, so that
# the tokenizer sees enough context for spaces and merged byte pieces (vLLM's value).
_CONTEXT_TOKENS = 5
_REPLACEMENT = "\ufffd"


class Detokenizer:
    """vLLM's prefix_offset / read_offset detokenizer over Sequence.tokens (token strings).

    Each step decodes tokens[prefix_offset:] and tokens[prefix_offset:read_offset]
    and emits the difference, so the work per token is constant. Text that ends in
    a partial UTF-8 character (byte-fallback pieces) is held back until the
    character completes, so no "\\ufffd" is emitted mid-character.
    """

    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer
        # tokenizer.decode(skip_special_tokens=True) drops every added token marked
        # special, not only all_special_ids (SmolLM2's <file_sep>, <jupyter_code>, ...).
        added = getattr(tokenizer, "added_tokens_decoder", {})
        self.special_ids = set(tokenizer.all_special_ids) | {i for i, t in added.items() if t.special}
        self.vocab_size = len(tokenizer)

    def _to_tokens(self, ids: list[int], skip_special_tokens: bool) -> list[str]:
        tokens = []
        for i in ids:
            if skip_special_tokens and i in self.special_ids:
                continue
            # An id the tokenizer does not know (padded vocab rows) decodes to nothing.
            tokens.append(self.tokenizer.convert_ids_to_tokens(i) if 0 <= i < self.vocab_size else "")
        return tokens

    def _init_from_prompt(self, seq: Sequence, skip_special_tokens: bool) -> None:
        # The prompt's last tokens give the first output token its context
        # (e.g. SentencePiece's leading space), without being emitted themselves.
        tail = seq.prompt_token_ids[-(_CONTEXT_TOKENS + 2) :]
        tokens = self._to_tokens(tail, skip_special_tokens)
        # A prompt that ends mid-character would glue its bytes onto the first
        # output token; the output must decode on its own, so drop that piece.
        while tokens and self.tokenizer.convert_tokens_to_string(tokens).endswith(_REPLACEMENT):
            tokens.pop()
        seq.tokens = tokens
        seq.read_offset = len(seq.tokens)
        seq.prefix_offset = max(seq.read_offset - _CONTEXT_TOKENS, 0)

    def decode_next(self, seq: Sequence, skip_special_tokens: bool = True) -> str:
        """Detokenize the last output token of `seq`; append the new text to output_text and return it."""
        if seq.tokens is None:
            self._init_from_prompt(seq, skip_special_tokens)
        seq.tokens.extend(self._to_tokens([seq.output_token_ids[-1]], skip_special_tokens))
        return self._emit(seq, final=False)

    def flush(self, seq: Sequence) -> str:
        """Emit text held back for an unfinished character (the sequence has ended)."""
        if seq.tokens is None:
            return ""
        return self._emit(seq, final=True)

    def _emit(self, seq: Sequence, final: bool) -> str:
        convert = self.tokenizer.convert_tokens_to_string
        prefix_text = convert(seq.tokens[seq.prefix_offset : seq.read_offset])
        new_text = convert(seq.tokens[seq.prefix_offset :])
        if len(new_text) <= len(prefix_text) or (new_text.endswith(_REPLACEMENT) and not final):
            return ""
        delta = new_text[len(prefix_text) :]
        seq.prefix_offset = seq.read_offset
        seq.read_offset = len(seq.tokens)
        seq.output_text += delta
        return delta

