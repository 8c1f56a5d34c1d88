"""Structured outputs: grammar-constrained decoding with xgrammar (vLLM's default backend).

A request's `GuidedSpec` (JSON schema, any JSON object, regex, a choice of strings, or an EBNF grammar) is
compiled once into an xgrammar `CompiledGrammar` (cached by spec) against the model's tokenizer. Every
sequence of the request then carries a `GrammarState`: it is advanced by each token the sequence appends,
forked with the sequence (n, best_of), and it lives on the Sequence, so preemption by recompute or by swap
keeps it (the output tokens are kept either way). The sampler masks the constrained rows of a step with one
batched bitmask; unconstrained rows are not touched.

Why xgrammar rather than llguidance: both install as wheels and run on CPU; xgrammar is vLLM's default (the
same JSON-schema coverage users get there) and its compiled grammars and compile cache are its own.
docs/benchmarks.md has the measured compile and mask times.
"""
from __future__ import annotations

import json
import re
import threading
import time
from collections import OrderedDict
from typing import TYPE_CHECKING, Optional

from engine.sampling_params import GuidedSpec

if TYPE_CHECKING:
    import torch

_CACHE_SIZE = 256  # compiled grammars kept (xgrammar keeps its own byte-bounded cache under this)


class GrammarError(ValueError):
    """A schema, regex or grammar xgrammar cannot compile; the message names the problem."""


class GrammarState:
    """One sequence's position in its grammar."""

    __slots__ = ("matcher",)

    def __init__(self, matcher) -> None:
        self.matcher = matcher

    def accept(self, token_id: int) -> bool:
        """Advance by a sampled token; False if the grammar refused it (it was masked out, so only a token
        forced past the mask, e.g. by a fault, can be refused) or the grammar had already ended."""
        if self.matcher.is_terminated():
            return False
        return self.matcher.accept_token(token_id)

    def is_terminated(self) -> bool:
        """The grammar is complete and its stop token was accepted: the output is done."""
        return self.matcher.is_terminated()

    def fork(self) -> "GrammarState":
        return GrammarState(self.matcher.fork())


class StructuredOutputs:
    """Compiles specs for one tokenizer (thread-safe, cached) and starts sequences' grammar states."""

    def __init__(self, tokenizer, vocab_size: int, eos_token_id: Optional[int]) -> None:
        import xgrammar as xgr  # imported here: an engine that never sees a constraint never loads it

        self._xgr = xgr
        stop = [eos_token_id] if eos_token_id is not None else None
        info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size, stop_token_ids=stop)
        self.vocab_size = vocab_size
        self._compiler = xgr.GrammarCompiler(info, max_threads=1)
        self._cache: OrderedDict[GuidedSpec, object] = OrderedDict()
        self._lock = threading.Lock()
        self.last_compile_ms = 0.0  # of the last spec not found in the cache (benchmarks read it)

    def compile(self, spec: GuidedSpec):
        """The compiled grammar of `spec`, from the cache when it was compiled before. GrammarError if invalid.

        The lock guards the cache only: the step thread's lookups never wait behind a compile running in a
        server thread (two threads compiling one new spec at once both do the work, once)."""
        with self._lock:
            compiled = self._cache.get(spec)
            if compiled is not None:
                self._cache.move_to_end(spec)
                return compiled
        start = time.perf_counter()
        try:
            compiled = self._compile(spec)
        except (RuntimeError, ValueError, TypeError) as exc:  # xgrammar's errors on a bad spec
            raise GrammarError(_describe(spec, exc)) from exc
        self.last_compile_ms = (time.perf_counter() - start) * 1e3
        with self._lock:
            self._cache[spec] = compiled
            if len(self._cache) > _CACHE_SIZE:
                self._cache.popitem(last=False)
        return compiled

    def is_cached(self, spec: GuidedSpec) -> bool:
        with self._lock:
            return spec in self._cache

    def _compile(self, spec: GuidedSpec):
        compiler = self._compiler
        if spec.kind == "json":
            schema = json.loads(spec.value)
            # Compact JSON: a small model given free whitespace can spend its whole budget on it.
            return compiler.compile_json_schema(json.dumps(schema), any_whitespace=False, strict_mode=True)
        if spec.kind == "json_object":
            return compiler.compile_json_schema('{"type": "object"}', any_whitespace=False, strict_mode=False)
        if spec.kind == "regex":
            return compiler.compile_regex(spec.value)
        if spec.kind == "choice":
            alternatives = " | ".join(json.dumps(c) for c in json.loads(spec.value))
            return compiler.compile_grammar(f"root ::= {alternatives}")
        return compiler.compile_grammar(spec.value)

    def new_state(self, compiled) -> GrammarState:
        return GrammarState(self._xgr.GrammarMatcher(compiled))


def apply_grammar_masks(logits: "torch.Tensor", rows: list[tuple[int, GrammarState]]) -> None:
    """In place: in each listed row, every token the row's grammar does not allow next gets -inf (one bitmask
    for the step, applied to those rows only)."""
    import xgrammar as xgr

    vocab = logits.shape[-1]
    bitmask = xgr.allocate_token_bitmask(logits.shape[0], vocab)
    for row, state in rows:
        state.matcher.fill_next_token_bitmask(bitmask, row)
    xgr.apply_token_bitmask_inplace(logits, bitmask.to(logits.device), vocab_size=vocab,
                                    indices=[row for row, _ in rows])


def _describe(spec: GuidedSpec, exc: Exception) -> str:
    what = {"json": "JSON schema", "json_object": "JSON object grammar", "regex": "regex",
            "choice": "choice", "grammar": "grammar"}[spec.kind]
    detail = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    detail = re.sub(r"^\[[\d:]+\] \S+:\d+: ", "", detail)  # xgrammar's "[time] file.cc:line: " prefix
    return f"invalid {what}: {detail}"[:500]
