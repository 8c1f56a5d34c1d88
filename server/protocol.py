"""Pydantic request/response models of the OpenAI-compatible API (mirrored by openapi.yaml)."""
from __future__ import annotations

from typing import Annotated, Literal, Optional, Union

from pydantic import BaseModel, ConfigDict, Field

from server.limits import (
    MAX_CONTENT_PARTS, MAX_MESSAGES, Documents, Finite, LogitBias, MinTokens, NumChoices, NumLogprobs, NumTokens,
    Priority, RequestId, Seed, StopList, StopTokenIds, TemplateKwargs, Text, TextPrompts, TokenIds, TokenPrompts, TopK,
    TopLogprobs, TruncateTokens,
)

PromptType = Union[Text, TextPrompts, TokenIds, TokenPrompts]
StopType = Union[Text, StopList, None]


class RequestModel(BaseModel):
    """A request body: values are not coerced across types ("5" is not 5) and their bounds come from the types
    of server/limits.py. Unknown fields are accepted and ignored, as vLLM does, so that clients written for newer
    servers keep working; they stay in `model_extra` for unknown_fields() to report."""

    model_config = ConfigDict(extra="allow", strict=True)


def unknown_fields(body: BaseModel, prefix: str = "") -> list[str]:
    """The dotted names of every ignored field of `body` and of the models nested in it (list items included)."""
    names = [prefix + name for name in (body.model_extra or {})]
    for name in type(body).model_fields:
        value = getattr(body, name)
        items = value if isinstance(value, list) else [value]
        for item in items:
            if isinstance(item, BaseModel):
                names += [n for n in unknown_fields(item, f"{prefix}{name}.") if n not in names]
    return names


class StreamOptions(RequestModel):
    """`stream_options`: usage in a last chunk, and (vLLM) the running usage on every chunk."""

    include_usage: bool = False
    continuous_usage_stats: bool = False


class SamplingFields(RequestModel):
    """Parameters shared by completions and chat (OpenAI + vLLM extensions)."""

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
    spaces_between_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    use_beam_search: bool = False
    best_of: Optional[NumChoices] = None
    stream: bool = False
    stream_options: Optional[StreamOptions] = None
    user: Optional[Text] = None
    # vLLM's extensions
    truncate_prompt_tokens: Optional[TruncateTokens] = None  # keep the last k prompt tokens; -1: max_model_len
    prompt_logprobs: Optional[NumLogprobs] = None
    allowed_token_ids: Optional[TokenIds] = None
    bad_words: Optional[StopList] = None
    return_tokens_as_token_ids: bool = False
    priority: Priority = 0  # lower runs first under --scheduling-policy priority
    request_id: Optional[RequestId] = None  # the response's id is the endpoint's prefix + this


class CompletionRequest(SamplingFields):
    """POST /v1/completions."""

    prompt: PromptType
    max_tokens: Optional[NumTokens] = 16
    echo: bool = False
    logprobs: Optional[NumLogprobs] = None
    suffix: Optional[Text] = None
    add_special_tokens: bool = True


class TextPart(RequestModel):
    """One `{"type": "text", "text": ...}` content part."""

    type: Literal["text"]
    text: Text


class ChatMessage(RequestModel):
    """One message of a chat; content is a string or a list of text parts."""

    role: Literal["system", "user", "assistant", "tool", "developer"]
    content: Union[Text, Annotated[list[TextPart], Field(max_length=MAX_CONTENT_PARTS)], None] = None
    name: Optional[Text] = None


ChatMessages = Annotated[list[ChatMessage], Field(max_length=MAX_MESSAGES)]


class ChatTemplateFields(RequestModel):
    """How chat messages become a prompt (vLLM's fields, shared by chat and /tokenize)."""

    add_generation_prompt: bool = True
    continue_final_message: bool = False  # the last (assistant) message stays open; the model continues it
    chat_template_kwargs: Optional[TemplateKwargs] = None  # extra variables for the chat template
    documents: Optional[Documents] = None  # passed to the template as `documents` (RAG templates)


class ChatCompletionRequest(SamplingFields, ChatTemplateFields):
    """POST /v1/chat/completions."""

    messages: ChatMessages
    max_tokens: Optional[NumTokens] = None
    max_completion_tokens: Optional[NumTokens] = None
    logprobs: bool = False
    top_logprobs: Optional[TopLogprobs] = None
    echo: bool = False  # the reply starts with the last message's content when that message is the assistant's
    add_special_tokens: bool = False  # the chat template already adds them


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


class TokenizeRequest(ChatTemplateFields):
    """POST /tokenize: a prompt, or chat messages rendered with the chat template."""

    model: Optional[Text] = None
    prompt: Optional[Text] = None
    messages: Optional[ChatMessages] = None
    add_special_tokens: bool = True


class TokenizeResponse(BaseModel):
    """The token ids of a prompt."""

    tokens: list[int]
    count: int
    max_model_len: int


class DetokenizeRequest(RequestModel):
    """POST /detokenize."""

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
