"""The interfaces between the engine's layers, as Protocols, and the stats snapshot that crosses them.

EngineCore is what AsyncLLMEngine drives (LLMEngine): only the async front's loop task and its step thread
call it, one call at a time. EngineClient is what the server needs of the async front (AsyncLLMEngine).
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any, AsyncIterator, Iterable, Optional, Protocol, Union, runtime_checkable

from engine.config import EngineConfig
from engine.metrics import EngineStats
from engine.sampling_params import GuidedSpec, SamplingParams
from engine.sequence import RequestOutput, SequenceGroup

if TYPE_CHECKING:
    from engine.metrics import Metrics


@runtime_checkable
class EngineCore(Protocol):
    """The synchronous engine: requests in, step() until they finish."""

    config: EngineConfig
    tokenizer: Any  # a transformers tokenizer
    hf_config: Any  # a transformers PretrainedConfig
    structured: Any  # engine/structured.StructuredOutputs: compiles structured-output specs (thread-safe)

    def add_request(self, request_id: str, prompt: Optional[str] = None,
                    prompt_token_ids: Optional[list[int]] = None, params: Optional[SamplingParams] = None,
                    arrival_time: Optional[float] = None, priority: int = 0, grammar: Any = None) -> None: ...

    def abort_request(self, request_id: Union[str, Iterable[str]]) -> list[SequenceGroup]: ...

    def has_unfinished_requests(self) -> bool: ...

    def step(self) -> Optional[list[RequestOutput]]: ...  # None: no step ended (a remote core's poll timed out)

    def get_stats(self) -> EngineStats: ...

    def request_ids(self) -> set[str]: ...

    def block_problems(self) -> list[str]: ...

    def reset(self) -> list[str]: ...


@runtime_checkable
class EngineClient(Protocol):
    """The engine as the server sees it: submit, stream, abort, health, stats, shutdown."""

    @property
    def config(self) -> EngineConfig: ...

    @property
    def tokenizer(self) -> Any: ...

    @property
    def vocab_size(self) -> int: ...

    @property
    def metrics(self) -> Metrics: ...

    @property
    def is_ready(self) -> bool: ...

    @property
    def unavailable_reason(self) -> str: ...

    def start(self) -> None: ...

    def generate(self, request_id: str, prompt: Optional[str] = None, prompt_token_ids: Optional[list[int]] = None,
                 params: Optional[SamplingParams] = None, priority: int = 0,
                 grammar: Any = None) -> AsyncIterator[RequestOutput]: ...

    def abort(self, request_id: Union[str, list[str]]) -> None: ...

    async def compile_grammar(self, spec: GuidedSpec) -> Any: ...

    def get_stats(self) -> EngineStats: ...

    def begin_shutdown(self, timeout_s: float) -> None: ...

    async def shutdown(self, timeout_s: float = 10.0) -> None: ...
