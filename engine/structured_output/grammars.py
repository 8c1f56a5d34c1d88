"""Structured outputs: grammar-constrained decoding with xgrammar (vLLM's default backend).

A request's `GuidedSpec` (JSON schema, any JSON object, regex, a choice of strings, or an EBNF grammar) is
compiled once into an xgrammar `CompiledGrammar` (cached by spec) against the model's tokenizer. Every
sequence of the request then carries a `GrammarState`: it is advanced by each token the sequence appends,
forked with the sequence (n, best_of), and it lives on the Sequence, so preemption by recompute or by swap
keeps it (the output tokens are kept either way). The sampler masks the constrained rows of a step with one
batched bitmask; unconstrained rows are not touched.

Why xgrammar rather than llguidance: both install as wheels and run on CPU; xgrammar is vLLM's default (the
same JSON-schema coverage users get there), and a compiled grammar reports its memory size, which bounds the
cache of compiled specs in bytes.
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


class GrammarError(ValueError):
    """A schema, regex or grammar xgrammar cannot compile; the message names the problem."""


class GrammarState:
    """One sequence's position in its grammar.

    A gated state (SamplingParams.guided_after: a reasoning parser's end marker) lets the output run free until
    it ends with the gate's token ids; the grammar constrains the tokens after them (vLLM's rule: structured
    outputs apply to the content after the reasoning)."""

    __slots__ = ("matcher", "vocab_size", "gate", "tail")

    def __init__(self, matcher, vocab_size: int, gate: Optional[tuple[int, ...]] = None) -> None:
        self.matcher, self.vocab_size = matcher, vocab_size
        self.gate = gate  # None once the grammar applies
        self.tail: tuple[int, ...] = ()  # the last len(gate) output tokens while gated

    @property
    def active(self) -> bool:
        """Whether the grammar constrains the next token (the sampler masks only active rows)."""
        return self.gate is None

    def accept(self, token_id: int) -> bool:
        """Advance by a sampled token; False if the grammar refused it (it was masked out, so only a token
        forced past the mask, e.g. by a fault, can be refused) or the grammar had already ended."""
        if self.gate is not None:  # free text until the output ends with the gate
            self.tail = (self.tail + (token_id,))[-len(self.gate):]
            if self.tail == self.gate:
                self.gate = None
            return True
        if self.matcher.is_terminated():
            return False
        return self.matcher.accept_token(token_id)

    def is_terminated(self) -> bool:
        """The grammar is complete and its stop token was accepted: the output is done."""
        return self.gate is None and self.matcher.is_terminated()

    def fork(self) -> "GrammarState":
        child = GrammarState(self.matcher.fork(), self.vocab_size, self.gate)
        child.tail = self.tail
        return child

    def allows_any_token(self) -> bool:
        """Whether any token of the vocabulary (or the stop token) may come next. A grammar can reach a point where
        none may: a regex or grammar that asks for a character no token spells (SmolLM2's byte-level vocabulary has
        no token for the byte 0x04, nor for some 4-byte UTF-8 leads)."""
        return self.gate is not None or _allows_any(self.matcher, self.vocab_size)


class StructuredOutputs:
    """Compiles specs for one tokenizer (thread-safe, cached) and starts sequences' grammar states.

    The one cache is ours, keyed by spec, least recently used dropped first, holding at most `cache_bytes`
    (EngineConfig.grammar_cache_mb; a grammar counts its xgrammar memory_size_bytes plus its spec's text).
    xgrammar's compiler cache (unbounded by default) is off: every compile goes through ours first, so a second
    cache would only keep the same grammars twice."""

    def __init__(self, tokenizer, vocab_size: int, eos_token_id: Optional[int], cache_bytes: int) -> None:
        import xgrammar as xgr  # imported here: an engine that never sees a constraint never loads it

        self._xgr = xgr
        stop = [eos_token_id] if eos_token_id is not None else None
        info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size, stop_token_ids=stop)
        self.vocab_size = vocab_size
        self._compiler = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)
        self.cache_limit_bytes = cache_bytes
        self._cache: OrderedDict[GuidedSpec, tuple[object, int]] = OrderedDict()  # spec -> (grammar, its bytes)
        self.cache_bytes = 0  # the sum of the cached entries' bytes
        self._lock = threading.Lock()
        self.last_compile_ms = 0.0  # of the last spec not found in the cache (benchmarks read it)

    def cached(self, spec: GuidedSpec):
        """The compiled grammar of `spec` if the cache holds it, else None (never compiles)."""
        with self._lock:
            entry = self._cache.get(spec)
            if entry is None:
                return None
            self._cache.move_to_end(spec)
            return entry[0]

    def compile(self, spec: GuidedSpec):
        """The compiled grammar of `spec`, from the cache when it was compiled before. GrammarError if invalid.

        The lock guards the cache only: the step thread's lookups never wait behind a compile running in a
        server thread (two threads compiling one new spec at once both do the work, once)."""
        compiled = self.cached(spec)
        if compiled is not None:
            return compiled
        start = time.perf_counter()
        try:
            compiled = self._compile(spec)
        except (RuntimeError, ValueError, TypeError) as exc:  # xgrammar's errors on a bad spec
            raise GrammarError(_describe(spec, exc)) from exc
        self.last_compile_ms = (time.perf_counter() - start) * 1e3
        if not _allows_any(self._xgr.GrammarMatcher(compiled), self.vocab_size):  # nothing could ever be sampled
            raise GrammarError(_describe(spec, ValueError(_NO_FIRST_TOKEN)))
        size = compiled.memory_size_bytes + len(spec.value)
        with self._lock:
            old = self._cache.pop(spec, None)
            self.cache_bytes += size - (old[1] if old is not None else 0)
            self._cache[spec] = (compiled, size)
            while self.cache_bytes > self.cache_limit_bytes:  # a grammar over the whole limit is not kept
                _, (_, dropped) = self._cache.popitem(last=False)
                self.cache_bytes -= dropped
        return compiled

    def __len__(self) -> int:
        """Grammars in the cache."""
        return len(self._cache)

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

    def new_state(self, compiled, gate: Optional[tuple[int, ...]] = None) -> GrammarState:
        return GrammarState(self._xgr.GrammarMatcher(compiled), self.vocab_size, tuple(gate) if gate else None)


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


_NO_FIRST_TOKEN = "no token of this model's vocabulary can start it (it asks for a character no token spells)"


def _allows_any(matcher, vocab_size: int) -> bool:
    import xgrammar as xgr

    bitmask = xgr.allocate_token_bitmask(1, vocab_size)
    matcher.fill_next_token_bitmask(bitmask, 0)
    return bool(bitmask.any())


def _describe(spec: GuidedSpec, exc: Exception) -> str:
    what = {"json": "JSON schema", "json_object": "JSON object grammar", "regex": "regex",
            "choice": "choice", "grammar": "grammar"}[spec.kind]
    detail = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    detail = re.sub(r"^\[[\d:]+\] \S+:\d+: ", "", detail)  # xgrammar's "[time] file.cc:line: " prefix
    return f"invalid {what}: {detail}"[:500]
