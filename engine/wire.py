"""The messages between the API server and its engine core process, one msgspec Struct each, in the one module both
sides import: the core (engine/core_proc.py) decodes ToCore, its client (engine/frontend/core_client.py) FromCore.
Each travels as a msgpack array whose first item is its tag (array_like: a step's message carries no field names),
and arrives as its type, checked on the way in.

A request's outputs travel as deltas (engine/core_proc.py OutputDeltas builds them, OutputAssembler reads them): a
RequestOutput as what changed since the request's last one, the prompt once, then per choice the text, token ids and
logprobs each as (kept length, new items). A RequestOutput holds the whole text and token ids so far: sent whole, a
step at 256 streams of 128 tokens carried 256 prompts and ~16k token ids, and decoding it took the frontend's step
thread ~20 % of a core (py-spy, 2 vCPU).
"""
from __future__ import annotations

from typing import Any, Optional, Union

import msgspec

from engine.config import EngineConfig
from engine.metrics import EngineStats
from engine.sequence import RequestMetrics


class _Message(msgspec.Struct, array_like=True, tag=True):
    pass


# ---- frontend -> core ---------------------------------------------------------------------------------------------

class Add(_Message, tag="add"):
    request_id: str
    prompt: Optional[str]
    prompt_token_ids: list[int]
    params: msgspec.Raw  # SamplingParams, decoded by the core on its own: params that fail refuse this request alone
    arrival_time: float
    priority: int


class Abort(_Message, tag="abort"):
    request_ids: list[str]


class AskStats(_Message, tag="stats"):
    pass


class AskProblems(_Message, tag="problems"):
    """The block manager's broken invariants, checked after a fault."""


class Reset(_Message, tag="reset"):
    pass


class Stop(_Message, tag="stop"):
    pass


ToCore = Union[Add, Abort, AskStats, AskProblems, Reset, Stop]


# ---- core -> frontend ---------------------------------------------------------------------------------------------

class Error(msgspec.Struct, array_like=True):
    """An exception as it crosses: bad_input for a ValueError of any kind (GrammarError, msgspec's ValidationError of
    params that no longer validate), which the client gets as a 400 as in one process."""

    type_name: str
    message: str
    bad_input: bool

    @classmethod
    def of(cls, exc: BaseException) -> "Error":
        return cls(type(exc).__name__, str(exc), isinstance(exc, ValueError))


class Prompt(msgspec.Struct, array_like=True):
    text: Optional[str]
    token_ids: list[int]
    logprobs: Any  # Optional[list[Optional[Logprobs]]]: dicts keyed by token id (msgpack keeps int keys)


class ChoiceDelta(msgspec.Struct, array_like=True):
    index: int
    keep_text: int  # characters of the text sent before that still start it (fewer when a stop string cut it)
    text: str  # what follows them
    keep_ids: int
    token_ids: list[int]
    cumulative_logprob: float
    keep_logprobs: int
    logprobs: Any  # Optional[list[Logprobs]], None when the request asked for none
    finish_reason: Optional[str]
    stop_reason: Union[int, str, None]


class Delta(msgspec.Struct, array_like=True):
    request_id: str
    prompt: Optional[Prompt]  # the first time, and again when its prompt logprobs came late
    finished: bool
    error: Optional[str]
    metrics: Optional[RequestMetrics]
    choices: list[ChoiceDelta]


class Ready(_Message, tag="ready"):
    config: EngineConfig  # as the core resolved it
    vocab_size: int


class Out(_Message, tag="out"):
    """One step's outputs."""

    deltas: list[Delta]
    stats: EngineStats


class Fail(_Message, tag="fail"):
    """A step that raised StepError: `ended` its requests, `held` those the core holds after it, `adds` how many adds
    it had taken (the client tells by these a request the fault dropped without naming it)."""

    stage: str
    error: Error
    ended: list[str]
    held: list[str]
    adds: int
    deltas: list[Delta]
    stats: EngineStats


class Refused(_Message, tag="refused"):
    """An add the engine refused."""

    request_id: str
    error: Error


class Stats(_Message, tag="stats"):
    """The answer to AskStats."""

    stats: EngineStats


class Aborted(_Message, tag="aborted"):
    """An abort applied: its freed blocks show in /metrics without a step."""

    stats: EngineStats


class ResetDone(_Message, tag="reset"):
    dropped: list[str]
    stats: EngineStats


class Problems(_Message, tag="problems"):
    problems: list[str]


class Fatal(_Message, tag="fatal"):
    """Why the core stops for good."""

    reason: str


FromCore = Union[Ready, Out, Fail, Refused, Stats, Aborted, ResetDone, Problems, Fatal]
FIGURES = (Stats, Aborted)  # messages that only carry the core's figures (the client takes them in passing)


def encoder() -> msgspec.msgpack.Encoder:
    return msgspec.msgpack.Encoder()


def decoder(kind: Any) -> msgspec.msgpack.Decoder:
    """A decoder of ToCore, FromCore, or any type of this module (tests: list[Delta])."""
    return msgspec.msgpack.Decoder(kind)
