"""Sampling parameters of one request, validated once (OpenAI / vLLM ranges)."""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Optional, Union

_EPS = 1e-5
GUIDED_KINDS = ("json", "json_object", "regex", "choice", "grammar")


@dataclass(frozen=True)
class GuidedSpec:
    """What the output must match. `value`: the JSON schema (a JSON string), the regex, the choices (a JSON
    list of strings), or the EBNF grammar; empty for json_object."""

    kind: str
    value: str = ""

    def __post_init__(self) -> None:
        if self.kind not in GUIDED_KINDS:
            raise ValueError(f"guided decoding kind must be one of {', '.join(GUIDED_KINDS)}, got {self.kind!r}.")

    @classmethod
    def json_schema(cls, schema: dict) -> "GuidedSpec":
        return cls("json", json.dumps(schema))

    @classmethod
    def choice(cls, choices: list[str]) -> "GuidedSpec":
        return cls("choice", json.dumps(list(choices)))


@dataclass(frozen=True)
class StructuredOutputsParams:
    """vLLM's offline structured outputs (its GuidedDecodingParams before 0.10.2): exactly one of a JSON schema (a
    dict or a JSON string), a regex, a list of choices, an EBNF grammar, or json_object=True."""

    json: Union[None, str, dict] = None
    regex: Optional[str] = None
    choice: Optional[list[str]] = None
    grammar: Optional[str] = None
    json_object: Optional[bool] = None

    def spec(self) -> GuidedSpec:
        kinds = ("json", "regex", "choice", "grammar", "json_object")
        given = [k for k in kinds if getattr(self, k) not in (None, False)]
        if len(given) != 1:
            raise ValueError(f"structured_outputs must set exactly one of json, regex, choice, grammar, json_object; "
                             f"got {', '.join(given) or 'none'}.")
        kind = given[0]
        if kind == "json":
            return GuidedSpec("json", self.json if isinstance(self.json, str) else json.dumps(self.json))
        if kind == "choice":
            return GuidedSpec.choice(self.choice)
        return GuidedSpec(kind, "" if kind == "json_object" else getattr(self, kind))


GuidedDecodingParams = StructuredOutputsParams  # vLLM's name before 0.10.2


def bad_words_token_ids(tokenizer, words: list[str]) -> list[list[int]]:
    """Each word's token ids at the start of the text and, where they differ, after a space (vLLM's rule);
    ValueError for a word without tokens."""
    out: list[list[int]] = []
    for word in words:
        bare = tokenizer.encode(word.lstrip(), add_special_tokens=False)
        if not bare:
            raise ValueError(f"bad_words: {word!r} has no tokens.")
        out.append(bare)
        spaced = tokenizer.encode(" " + word.lstrip(), add_special_tokens=False)
        if spaced and spaced[0] != bare[0] and len(spaced) == len(bare):
            out.append(spaced)
    return out


@dataclass
class SamplingParams:
    """How to pick the tokens of one request. Raises ValueError naming the field."""

    n: int = 1
    best_of: Optional[int] = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    seed: Optional[int] = None
    use_beam_search: bool = False
    length_penalty: float = 1.0
    early_stopping: Union[bool, str] = False
    stop: Union[None, str, list[str]] = None
    stop_token_ids: Optional[list[int]] = None
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False
    max_tokens: Optional[int] = 16
    min_tokens: int = 0
    logprobs: Optional[int] = None
    prompt_logprobs: Optional[int] = None
    # vLLM: the logprobs of these token ids at every sampled position, beside the sampled token's (logprobs then
    # defaults to 0: the per-token logprobs are kept, without top-k alternatives unless logprobs asks for them).
    logprob_token_ids: Optional[list[int]] = None
    skip_special_tokens: bool = True
    logit_bias: Optional[dict[int, float]] = None
    allowed_token_ids: Optional[list[int]] = None  # only these may be sampled
    # Token ids of each banned word: its last token is masked whenever the output ends with the others.
    bad_words_token_ids: Optional[list[list[int]]] = None
    bad_words: Optional[list[str]] = None  # vLLM's: words, made bad_words_token_ids by the engine's tokenizer
    # The output must match this (JSON schema, JSON object, regex, choice, grammar): engine/structured_output/grammars.py.
    guided: Optional[GuidedSpec] = None
    structured_outputs: Optional[StructuredOutputsParams] = None  # vLLM's name for it (guided_decoding before 0.10.2)
    guided_decoding: Optional[StructuredOutputsParams] = None
    # The grammar applies after the output's first run of these token ids (a reasoning parser's end marker,
    # `</think>`): the reasoning before it is free. None: from the first token.
    guided_after: Optional[tuple[int, ...]] = None
    max_logprobs: int = field(default=20, repr=False)  # -1: no bound
    # Report the request only when it has finished (vLLM's RequestOutputKind.FINAL_ONLY): no output is built and
    # delivered each step for a reader that takes the last one only (LLM.generate, a non-streamed HTTP request).
    final_only: bool = field(default=False, repr=False)

    def __post_init__(self) -> None:
        if self.best_of is None:
            self.best_of = self.n
        if self.stop is None:
            self.stop = []
        elif isinstance(self.stop, str):
            self.stop = [self.stop]
        else:
            self.stop = list(self.stop)
        self.stop_token_ids = list(self.stop_token_ids or [])
        if self.logprob_token_ids is not None:
            self.logprob_token_ids = list(self.logprob_token_ids)
            if self.logprobs is None:
                self.logprobs = 0
        if self.logit_bias:
            self.logit_bias = {int(k): float(v) for k, v in self.logit_bias.items()}
        if isinstance(self.bad_words, str):
            self.bad_words = [self.bad_words]
        for name in ("structured_outputs", "guided_decoding"):
            value = getattr(self, name)
            if value is None:
                continue
            if not isinstance(value, StructuredOutputsParams):
                raise ValueError(f"{name} must be a StructuredOutputsParams, got {type(value).__name__}.")
            spec = value.spec()
            if self.guided is not None and self.guided != spec:
                raise ValueError(f"{name}: the output is constrained already (guided, structured_outputs or "
                                 "guided_decoding): give one.")
            self.guided = spec
        self._verify()
        if self.temperature < _EPS and not self.use_beam_search:
            # Greedy: sampling knobs are meaningless, normalise them.
            self.top_p, self.top_k, self.min_p = 1.0, -1, 0.0

    @property
    def greedy(self) -> bool:
        return self.temperature < _EPS and not self.use_beam_search

    def _verify(self) -> None:
        def fail(name: str, msg: str) -> None:
            raise ValueError(f"{name} {msg}")

        if not isinstance(self.n, int) or self.n < 1:
            fail("n", f"must be at least 1, got {self.n}.")
        if not isinstance(self.best_of, int) or self.best_of < self.n:
            fail("best_of", f"must be greater than or equal to n, got n={self.n} and best_of={self.best_of}.")
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not -2.0 <= value <= 2.0:
                fail(name, f"must be in [-2, 2], got {value}.")
        if not 0.0 < self.repetition_penalty <= 2.0:
            fail("repetition_penalty", f"must be in (0, 2], got {self.repetition_penalty}.")
        if not 0.0 <= self.temperature <= 2.0:
            fail("temperature", f"must be in [0, 2], got {self.temperature}.")
        if not 0.0 < self.top_p <= 1.0:
            fail("top_p", f"must be in (0, 1], got {self.top_p}.")
        if not isinstance(self.top_k, int) or self.top_k < -1 or self.top_k == 0:
            fail("top_k", f"must be -1 (disable), or at least 1, got {self.top_k}.")
        if not 0.0 <= self.min_p <= 1.0:
            fail("min_p", f"must be in [0, 1], got {self.min_p}.")
        if self.seed is not None and not isinstance(self.seed, int):
            fail("seed", f"must be an integer, got {self.seed!r}.")
        if self.max_tokens is not None and self.max_tokens < 1:
            fail("max_tokens", f"must be at least 1, got {self.max_tokens}.")
        if self.min_tokens < 0:
            fail("min_tokens", f"must be greater than or equal to 0, got {self.min_tokens}.")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            fail("min_tokens", f"must be less than or equal to max_tokens={self.max_tokens}, got {self.min_tokens}.")
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None and (value < 0 or 0 <= self.max_logprobs < value):
                fail(name, f"must be in [0, {self.max_logprobs}], got {value}." if self.max_logprobs >= 0
                     else f"must be at least 0, got {value}.")
        if self.logprob_token_ids is not None and (
            not self.logprob_token_ids or any(not isinstance(t, int) or t < 0 for t in self.logprob_token_ids)
        ):
            fail("logprob_token_ids", "must be a non-empty list of non-negative integers.")
        if any(not isinstance(s, str) or s == "" for s in self.stop):
            fail("stop", "cannot contain an empty string.")
        if any(not isinstance(t, int) or t < 0 for t in self.stop_token_ids):
            fail("stop_token_ids", "must be non-negative integers.")
        if self.allowed_token_ids is not None and (
            not self.allowed_token_ids or any(not isinstance(t, int) or t < 0 for t in self.allowed_token_ids)
        ):
            fail("allowed_token_ids", "must be a non-empty list of non-negative integers.")
        if self.bad_words_token_ids and any(not word for word in self.bad_words_token_ids):
            fail("bad_words", "cannot contain a word without tokens.")
        if self.bad_words is not None and any(not isinstance(w, str) or not w.strip() for w in self.bad_words):
            fail("bad_words", "must be non-empty strings.")
        if self.logit_bias and any(not -100.0 <= v <= 100.0 for v in self.logit_bias.values()):
            fail("logit_bias", "values must be in [-100, 100].")
        if self.guided is not None and not isinstance(self.guided, GuidedSpec):
            fail("guided", f"must be a GuidedSpec, got {type(self.guided).__name__}.")
        if self.guided_after is not None and (not self.guided_after
                                              or any(not isinstance(t, int) or t < 0 for t in self.guided_after)):
            fail("guided_after", "must be a non-empty sequence of token ids.")
        if self.use_beam_search:
            if self.guided is not None:
                fail("use_beam_search", "cannot be combined with structured outputs (a JSON schema, regex, choice, "
                     "grammar or tool choice).")
            if self.logprob_token_ids is not None:
                fail("logprob_token_ids", "is not supported with beam search.")
            if self.best_of == 1:
                fail("best_of", "must be greater than 1 when using beam search.")
            if self.temperature > _EPS:
                fail("temperature", "must be 0 when using beam search.")
            if self.top_p < 1.0 - _EPS or self.top_k != -1 or self.min_p > _EPS:
                fail("top_p", "top_p, top_k and min_p must be disabled when using beam search.")
            if self.early_stopping not in (True, False, "never"):
                fail("early_stopping", f"must be True, False or 'never', got {self.early_stopping!r}.")
        elif self.greedy and self.best_of > 1:
            fail("best_of", f"must be 1 when using greedy sampling (temperature 0), got {self.best_of}.")
