"""Prompt lookup: propose the tokens that followed the latest earlier occurrence of the sequence's last n tokens."""
from __future__ import annotations

import numpy as np


def ngram_propose(tokens: np.ndarray, k: int, n_max: int, n_min: int) -> list[int]:  # tokens: [len] int64
    """Up to k tokens that followed the most recent earlier match of the last n tokens (n from n_max down to
    n_min: the longest suffix that recurs wins, as vLLM's proposer). Empty when nothing matches.

    The most recent match (not the first) is the one an edit or a summary of a text is most likely continuing."""
    length = tokens.shape[0]
    for n in range(min(n_max, length - 1), n_min - 1, -1):
        # Windows over tokens[:-1]: every start i <= length - 1 - n, so a token follows each match and the
        # suffix itself is not one.
        windows = np.lib.stride_tricks.sliding_window_view(tokens[: length - 1], n)  # [length - n, n]
        hits = np.flatnonzero((windows == tokens[length - n:]).all(axis=1))
        if hits.shape[0]:
            i = int(hits[-1]) + n
            return tokens[i: i + k].tolist()
    return []


class NgramIndex:
    """A sequence's tokens as a growing NumPy array (appending is amortised O(1), not a copy a step)."""

    __slots__ = ("buf", "length")

    def __init__(self) -> None:
        self.buf = np.empty(0, dtype=np.int64)
        self.length = 0

    def view(self, all_token_ids_len: int, seq) -> np.ndarray:  # [len] int64
        """The sequence's tokens; only what was appended since the last call is copied in. A sequence whose
        length went down (never, today) is copied whole."""
        if all_token_ids_len < self.length:
            self.length = 0
        if all_token_ids_len > self.buf.shape[0]:
            grown = np.empty(max(2 * self.buf.shape[0], all_token_ids_len, 256), dtype=np.int64)
            grown[: self.length] = self.buf[: self.length]
            self.buf = grown
        if all_token_ids_len > self.length:
            prompt_len = len(seq.prompt_token_ids)
            start = self.length
            if start < prompt_len:
                self.buf[start:prompt_len] = seq.prompt_token_ids[start:]
                start = prompt_len
            self.buf[start:all_token_ids_len] = seq.output_token_ids[start - prompt_len:]
            self.length = all_token_ids_len
        return self.buf[: self.length]
