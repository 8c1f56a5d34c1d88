"""Pydantic request/response models of the OpenAI-compatible API (mirrored by openapi.yaml)."""
from __future__ import annotations

from typing import Annotated, Literal, Optional, Union

from pydantic import BaseModel, ConfigDict, Field

from server.limits import (
    MAX_CONTENT_PARTS, MAX_MESSAGES, Finite, LogitBias, MinTokens, NumChoices, NumLogprobs, NumTokens, Seed,
    StopList, StopTokenIds, Text, TextPrompts, TokenIds, TokenPrompts, TopK, TopLogprobs,
)

# Unknown fields are rejected, and values are not coerced across types ("5" is not 5).
# Every value's bounds come from the types of server/limits.py.
_STRICT = ConfigDict(extra="forbid", strict=True)

PromptType = Union[Text, TextPrompts, TokenIds, TokenPrompts]
StopType = Union[Text, StopList, None]


class StreamOptions(BaseModel):
    """`stream_options`: only include_usage is defined."""

    model_config = _STRICT
    include_usage: bool = False


class SamplingFields(BaseModel):
    """Parameters shared by completions and chat (OpenAI + vLLM extensions)."""

    model_config = _STRICT
    model: Optional[Text] = None
    n: NumChoices = 1
    temperature: Finite = 1.0
    top_p: Finite = 1.0
    top_k: TopK = -1
    min_p: Finite = 0.0
    presence_penalty: Finite = 0.0
    frequency_penalty: Finite = 0.0
    repetition_penalty: Finite = 1.0
    length_penalty: Finite = 1.0
    seed: Optional[Seed] = None
    stop: StopType = None
    stop_token_ids: Optional[StopTokenIds] = None
    ignore_eos: bool = False
    min_tokens: MinTokens = 0
    logit_bias: Optional[LogitBias] = None
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    use_beam_search: bool = False
    best_of: Optional[NumChoices] = None
    stream: bool = False
    stream_options: Optional[StreamOptions] = None
    user: Optional[Text] = None


class CompletionRequest(SamplingFields):
    """POST /v1/completions."""

    prompt: PromptType
    max_tokens: Optional[NumTokens] = 16
    echo: bool = False
    logprobs: Optional[NumLogprobs] = None
    suffix: Optional[Text] = None


class TextPart(BaseModel):
    """One `{"type": "text", "text": ...}` content part."""

    model_config = _STRICT
    type: Literal["text"]
    text: Text


class ChatMessage(BaseModel):
    """One message of a chat; content is a string or a list of text parts."""

    model_config = _STRICT
    role: Literal["system", "user", "assistant", "tool"]
    content: Union[Text, Annotated[list[TextPart], Field(max_length=MAX_CONTENT_PARTS)], None] = None
    name: Optional[Text] = None


ChatMessages = Annotated[list[ChatMessage], Field(max_length=MAX_MESSAGES)]


class ChatCompletionRequest(SamplingFields):
    """POST /v1/chat/completions."""

    messages: ChatMessages
    max_tokens: Optional[NumTokens] = None
    max_completion_tokens: Optional[NumTokens] = None
    logprobs: bool = False
    top_logprobs: Optional[TopLogprobs] = None
    add_generation_prompt: bool = True


class UsageInfo(BaseModel):
    """Token counts of a request, over all its choices."""

    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class CompletionLogprobs(BaseModel):
    """Completions logprobs: parallel lists, one entry per token."""

    text_offset: list[int] = Field(default_factory=list)
    token_logprobs: list[Optional[float]] = Field(default_factory=list)
    tokens: list[str] = Field(default_factory=list)
    top_logprobs: list[Optional[dict[str, float]]] = Field(default_factory=list)


class CompletionChoice(BaseModel):
    """One choice of a completion."""

    index: int
    text: str
    logprobs: Optional[CompletionLogprobs] = None
    finish_reason: Optional[str] = None
    stop_reason: Union[int, str, None] = None


class CompletionResponse(BaseModel):
    """A non-streamed completion (object "text_completion")."""

    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: UsageInfo


class CompletionStreamResponse(BaseModel):
    """One SSE chunk of a streamed completion (choices is empty in the usage chunk)."""

    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Optional[UsageInfo] = None


class TopLogprob(BaseModel):
    """One alternative token of chat logprobs."""

    token: str
    logprob: float
    bytes: Optional[list[int]] = None


class ChatTokenLogprob(TopLogprob):
    """One generated token of chat logprobs, with its alternatives."""

    top_logprobs: list[TopLogprob] = Field(default_factory=list)


class ChatLogprobs(BaseModel):
    """Chat logprobs: one entry per generated token."""

    content: Optional[list[ChatTokenLogprob]] = None


class ChatResponseMessage(BaseModel):
    """The assistant's message."""

    role: Literal["assistant"] = "assistant"
    content: Optional[str] = None


class ChatChoice(BaseModel):
    """One choice of a chat completion."""

    index: int
    message: ChatResponseMessage
    logprobs: Optional[ChatLogprobs] = None
    finish_reason: Optional[str] = None
    stop_reason: Union[int, str, None] = None


class ChatCompletionResponse(BaseModel):
    """A non-streamed chat completion (object "chat.completion")."""

    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[ChatChoice]
    usage: UsageInfo


class ChatDelta(BaseModel):
    """What a chat chunk adds to its choice."""

    role: Optional[Literal["assistant"]] = None
    content: Optional[str] = None


class ChatStreamChoice(BaseModel):
    """One choice inside a chat chunk."""

    index: int
    delta: ChatDelta
    logprobs: Optional[ChatLogprobs] = None
    finish_reason: Optional[str] = None
    stop_reason: Union[int, str, None] = None


class ChatCompletionStreamResponse(BaseModel):
    """One SSE chunk of a streamed chat completion (object "chat.completion.chunk")."""

    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatStreamChoice]
    usage: Optional[UsageInfo] = None


class ModelCard(BaseModel):
    """One served model."""

    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "pagedserve"
    max_model_len: int


class ModelList(BaseModel):
    """GET /v1/models."""

    object: Literal["list"] = "list"
    data: list[ModelCard]


class TokenizeRequest(BaseModel):
    """POST /tokenize: a prompt, or chat messages rendered with the chat template."""

    model_config = _STRICT
    model: Optional[Text] = None
    prompt: Optional[Text] = None
    messages: Optional[ChatMessages] = None
    add_special_tokens: bool = True
    add_generation_prompt: bool = True


class TokenizeResponse(BaseModel):
    """The token ids of a prompt."""

    tokens: list[int]
    count: int
    max_model_len: int


class DetokenizeRequest(BaseModel):
    """POST /detokenize."""

    model_config = _STRICT
    model: Optional[Text] = None
    tokens: TokenIds


class DetokenizeResponse(BaseModel):
    """The text of token ids."""

    prompt: str


class VersionResponse(BaseModel):
    """GET /version."""

    version: str


class ErrorInfo(BaseModel):
    """The OpenAI error object."""

    message: str
    type: str
    param: Optional[str] = None
    code: int


class ErrorResponse(BaseModel):
    """Every error body: `{"error": {...}}`."""

    error: ErrorInfo
