"""The few types between a request and a token: Sequence, SequenceGroup, RequestOutput."""
from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Optional, Union

from engine.sampling_params import SamplingParams

if TYPE_CHECKING:
    from engine.structured_output.grammars import GrammarState

# token id -> logprob, for the sampled token and its top alternatives.
Logprobs = dict[int, float]


class SequenceStatus(enum.Enum):
    WAITING = enum.auto()
    RUNNING = enum.auto()
    SWAPPED = enum.auto()
    FINISHED_STOPPED = enum.auto()        # EOS, stop string or stop token
    FINISHED_LENGTH_CAPPED = enum.auto()  # max_tokens or max_model_len
    FINISHED_ABORTED = enum.auto()        # client went away / abort()
    FINISHED_IGNORED = enum.auto()        # prompt can never fit; never queued
    FINISHED_ERROR = enum.auto()          # e.g. out of host swap space

    @property
    def finished(self) -> bool:
        return self not in UNFINISHED

    @property
    def finish_reason(self) -> Optional[str]:
        return FINISH_REASONS.get(self)


# (A tuple of members: `in` compares identities first, where Enum's `value` is a slow descriptor on every read.)
UNFINISHED = (SequenceStatus.WAITING, SequenceStatus.RUNNING, SequenceStatus.SWAPPED)

FINISH_REASONS = {
    SequenceStatus.FINISHED_STOPPED: "stop",
    SequenceStatus.FINISHED_LENGTH_CAPPED: "length",
    SequenceStatus.FINISHED_ABORTED: "abort",
    SequenceStatus.FINISHED_IGNORED: "length",
    SequenceStatus.FINISHED_ERROR: "error",
}


class Sequence:
    """One stream of tokens: a prompt plus what has been generated after it."""

    def __init__(self, seq_id: int, prompt_token_ids: list[int]) -> None:
        self.seq_id = seq_id
        self.prompt_token_ids = prompt_token_ids
        self.output_token_ids: list[int] = []
        self.status = SequenceStatus.WAITING
        self.cumulative_logprob = 0.0
        # One per output token when the request asks for logprobs (the one-pass step keeps none otherwise).
        self.output_logprobs: list[Logprobs] = []
        self.output_text = ""
        # Tokens whose K/V are in the cache. The next forward computes
        # tokens [num_computed_tokens, get_len()); prefix-cache hits start it > 0.
        self.num_computed_tokens = 0
        self.stop_reason: Union[int, str, None] = None
        # Where the output is in the request's grammar (structured outputs); None when unconstrained.
        self.grammar: Optional[GrammarState] = None
        # A sampled token the grammar refused (the mask allows none: a bug or a fault got one past it); the
        # output processor ends the sequence with an error, as vLLM does, instead of going on unconstrained.
        self.refused_token: Optional[int] = None
        # Incremental detokenizer state (engine/detokenizer.py owns it).
        self.detok = None

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    def get_len(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    def get_output_len(self) -> int:
        return len(self.output_token_ids)

    def get_last_token_id(self) -> int:
        return self.output_token_ids[-1] if self.output_token_ids else self.prompt_token_ids[-1]

    def num_uncomputed_tokens(self) -> int:
        return self.get_len() - self.num_computed_tokens

    def append_token(self, token_id: int, logprobs: Logprobs) -> None:
        self.output_token_ids.append(token_id)
        self.output_logprobs.append(logprobs)
        self.cumulative_logprob += logprobs[token_id]
        if self.grammar is not None and not self.grammar.accept(token_id):
            self.refused_token = token_id

    def reset_for_recompute(self) -> None:
        """After preemption by recompute: all K/V are gone, recompute everything."""
        self.num_computed_tokens = 0
        self.status = SequenceStatus.WAITING

    def is_finished(self) -> bool:
        return self.status not in UNFINISHED

    def fork(self, new_seq_id: int) -> "Sequence":
        child = Sequence.__new__(Sequence)
        child.__dict__.update(self.__dict__)
        child.seq_id = new_seq_id
        child.output_token_ids = list(self.output_token_ids)
        child.output_logprobs = list(self.output_logprobs)
        child.detok = self.detok.fork() if self.detok is not None else None
        child.grammar = self.grammar.fork() if self.grammar is not None else None
        return child

    def __repr__(self) -> str:
        return f"Sequence(id={self.seq_id}, status={self.status.name}, len={self.get_len()})"


@dataclass
class RequestMetrics:
    arrival_time: float
    first_scheduled_time: Optional[float] = None
    first_token_time: Optional[float] = None
    finished_time: Optional[float] = None
    # Prompt tokens the prefix cache served at the request's first admission (vLLM's num_cached_tokens); None
    # before it. A request recomputed after a preemption keeps its first count.
    num_cached_tokens: Optional[int] = None


class SequenceGroup:
    """One request: its sequences (n / best_of / beams) sharing one prompt."""

    def __init__(
        self,
        request_id: str,
        seqs: list[Sequence],
        sampling_params: SamplingParams,
        arrival_time: Optional[float] = None,
        priority: int = 0,
        prompt: Optional[str] = None,
    ) -> None:
        self.request_id = request_id
        self.seqs = seqs
        self.sampling_params = sampling_params
        self.metrics = RequestMetrics(arrival_time if arrival_time is not None else time.monotonic())
        self.priority = priority
        self.prompt = prompt
        self.prompt_logprobs: Optional[list[Optional[Logprobs]]] = None
        # Why the group ended early (FINISHED_IGNORED / FINISHED_ERROR), for the client.
        self.error: Optional[str] = None
        # The sampler's seeded torch.Generator when sampling_params.seed is set.
        self.generator: object = None
        # Steps that gave this request tokens since its last output (LLMEngine's stream_interval); -1: no output
        # yet (its first token is reported at once).
        self.steps_unreported = -1
        self.final_only = sampling_params.final_only  # reported only when finished (SamplingParams.final_only)
        # When the engine's last step gave it tokens (inter-token latency); kept off `metrics`, which crosses the
        # process boundary only when it changes, a few times a request.
        self.last_token_time: Optional[float] = None

    @property
    def arrival_time(self) -> float:
        return self.metrics.arrival_time

    @property
    def prompt_token_ids(self) -> list[int]:
        return self.seqs[0].prompt_token_ids

    def get_seqs(self, status: Optional[SequenceStatus] = None) -> list[Sequence]:
        if status is None:
            return list(self.seqs)
        return [s for s in self.seqs if s.status is status]

    def num_seqs(self, status: Optional[SequenceStatus] = None) -> int:
        if status is None:
            return len(self.seqs)
        return sum(1 for s in self.seqs if s.status is status)

    def unfinished_seqs(self) -> list[Sequence]:
        return [s for s in self.seqs if not s.status.finished]

    def add(self, seq: Sequence) -> None:
        self.seqs.append(seq)

    def remove(self, seq_id: int) -> None:
        self.seqs = [s for s in self.seqs if s.seq_id != seq_id]

    def before_first_token(self) -> bool:
        """No token sampled yet: one sequence, whose next sampling draws best_of tokens (or beams) from one row."""
        return len(self.seqs) == 1 and not self.seqs[0].output_token_ids

    def get_max_num_running_seqs(self) -> int:
        """Most sequences this group may run at once over its remaining life."""
        params = self.sampling_params
        if params.use_beam_search or self.before_first_token():  # the one sequence forks to best_of
            return params.best_of
        return len(self.unfinished_seqs())

    @property
    def wants_prompt_logprobs(self) -> bool:
        """Whether the request asked for prompt logprobs (then every prompt position's logits are needed)."""
        return self.sampling_params.prompt_logprobs is not None

    def is_finished(self) -> bool:
        for s in self.seqs:
            if s.status in UNFINISHED:
                return False
        return True

    def __repr__(self) -> str:
        return f"SequenceGroup(request_id={self.request_id!r}, seqs={self.seqs})"


@dataclass(slots=True)
class CompletionOutput:
    """One choice of a request, as far as it has been generated."""

    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float
    logprobs: Optional[list[Logprobs]]
    finish_reason: Optional[str] = None
    stop_reason: Union[int, str, None] = None


@dataclass(slots=True)
class RequestOutput:
    """What one step produced for one request; `finished` marks the last one."""

    request_id: str
    prompt: Optional[str]
    prompt_token_ids: list[int]
    prompt_logprobs: Optional[list[Optional[Logprobs]]]
    outputs: list[CompletionOutput]
    finished: bool
    error: Optional[str] = None
    metrics: Optional[RequestMetrics] = field(default=None, repr=False)
