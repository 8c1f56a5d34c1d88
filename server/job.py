"""Job: one API call, as preprocess builds it and streaming/formatting read it."""
from __future__ import annotations

import enum
import uuid
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Optional

from engine.sampling_params import SamplingParams

if TYPE_CHECKING:
    from server.reasoning import ReasoningPlan
    from server.tools import ToolPlan


class JobKind(enum.Enum):
    COMPLETION = "completion"
    CHAT = "chat"
    RESPONSE = "response"  # POST /v1/responses


@dataclass
class Job:
    """One API call: its prompts (each a separate engine request) sharing one SamplingParams."""

    kind: JobKind
    id: str  # the response's id; a client's request_id may make it repeat across calls
    created: int
    model: str
    prompts: list[list[int]]
    prompt_texts: list[str]
    params: SamplingParams
    stream: bool = False
    include_usage: bool = False
    continuous_usage: bool = False  # usage on every chunk (vLLM's continuous_usage_stats)
    echo: bool = False
    echo_text: str = ""  # chat echo: the last (assistant) message, which the reply continues
    logprobs: Optional[int] = None  # completions: top-k per token; chat: top_logprobs
    chat_logprobs: bool = False
    prompt_logprobs: Optional[int] = None  # vLLM's prompt_logprobs: top-k per prompt token, in the response
    logprob_token_ids: Optional[list[int]] = None  # vLLM: these tokens' logprobs in place of the top-k
    tokens_as_ids: bool = False  # return_tokens_as_token_ids: logprob tokens read "token_id:<id>"
    return_token_ids: bool = False  # vLLM: prompt_token_ids and token_ids in the response
    cached_tokens_details: bool = False  # --enable-prompt-tokens-details: usage.prompt_tokens_details.cached_tokens
    priority: int = 0
    tools: Optional["ToolPlan"] = None  # a chat with tools: how its calls are read back (server/tools.py)
    reasoning: Optional["ReasoningPlan"] = None  # --reasoning-parser: how a chat reply splits (server/reasoning.py)
    guided_param: str = "response_format"  # the field a structured-output compile error names
    grammar: Any = None  # params.guided compiled (routes._serve), handed to the engine with every prompt
    engine_key: str = field(default_factory=lambda: uuid.uuid4().hex)

    def request_id(self, prompt_index: int) -> str:
        # Unique per call even when the client reuses its request_id: the engine keys requests by this.
        return f"{self.id}-{self.engine_key[:8]}-{prompt_index}"

    def choice_index(self, prompt_index: int, choice: int) -> int:
        # vLLM's numbering: prompt i's j-th choice is i * n + j.
        return prompt_index * self.params.n + choice
