"""Pydantic models of OpenAI's Responses API (POST /v1/responses): the text subset this server generates."""
from __future__ import annotations

from typing import Annotated, Any, Literal, Optional, Union

from pydantic import BaseModel, Field

from server.limits import (
    MAX_CONTENT_PARTS, MAX_MESSAGES, Finite, Metadata, NumTokens, Priority, Text, TopLogprobs,
)
from server.protocol import ChatTokenLogprob, RequestModel

OUTPUT_LOGPROBS = "message.output_text.logprobs"
# OpenAI's `include` values; only OUTPUT_LOGPROBS adds anything here (the others name outputs never made).
Includable = Literal["code_interpreter_call.outputs", "computer_call_output.output.image_url",
                     "file_search_call.results", "message.input_image.image_url", "message.output_text.logprobs",
                     "reasoning.encrypted_content"]


class InputText(RequestModel):
    """One text part of an input message; `output_text` parts are earlier replies passed back."""

    type: Literal["input_text", "output_text", "text"]
    text: Text
    annotations: Optional[list[Any]] = None
    logprobs: Optional[list[Any]] = None


class InputMessage(RequestModel):
    """One message of `input` (an easy message, or an output message of an earlier response)."""

    type: Optional[Literal["message"]] = None
    role: Literal["user", "system", "developer", "assistant"]
    content: Union[Text, Annotated[list[InputText], Field(max_length=MAX_CONTENT_PARTS)]]
    id: Optional[Text] = None
    status: Optional[Text] = None


class ResponsesRequest(RequestModel):
    """POST /v1/responses."""

    model: Optional[Text] = None
    input: Union[Text, Annotated[list[InputMessage], Field(max_length=MAX_MESSAGES)]]
    """A user message, or a list of messages."""
    instructions: Optional[Text] = None
    """A system message put before the input (not carried over by previous_response_id)."""
    max_output_tokens: Optional[NumTokens] = None
    temperature: Optional[Finite] = None
    top_p: Optional[Finite] = None
    stream: bool = False
    store: bool = False
    """Keep the finished response in the server's bounded in-memory store (GET /v1/responses/{id}, and
    previous_response_id). Unlike OpenAI's, the default is false: nothing is kept unless asked."""
    previous_response_id: Optional[Text] = None
    """Continue a stored response: its input and output come before this input."""
    metadata: Optional[Metadata] = None
    user: Optional[Text] = None
    priority: Priority = 0
    """vLLM: with --scheduling-policy priority, lower values are scheduled first."""
    include: Optional[Annotated[list[Includable], Field(max_length=8)]] = None
    """"message.output_text.logprobs": each output token's logprob, with top_logprobs alternatives, in the output
    text (and in the stream's text events)."""
    top_logprobs: Optional[TopLogprobs] = None
    """Alternatives per output token, most likely first, with include ["message.output_text.logprobs"]."""
    background: bool = False
    """Answer at once with the response queued, and generate it in the server: GET /v1/responses/{id} tells its
    status (queued, in_progress, then completed, incomplete or failed), POST /v1/responses/{id}/cancel stops it.
    Kept as with store: true (an explicit store: false is refused); not with stream."""
    enable_response_messages: bool = False
    """vLLM: add input_messages and output_messages to the response: the prompt as the chat template wrote it and
    the output, each as text and token ids."""


class RawMessage(BaseModel):
    """vLLM's raw message (enable_response_messages): text and its token ids; the ids are what the model read or
    wrote."""

    type: Literal["raw_message_tokens"] = "raw_message_tokens"
    message: str
    tokens: list[int]


class OutputText(BaseModel):
    """The generated text of a message."""

    type: Literal["output_text"] = "output_text"
    text: str
    annotations: list[Any] = Field(default_factory=list)
    logprobs: Optional[list[ChatTokenLogprob]] = None
    """One entry per output token, with include ["message.output_text.logprobs"]."""


class OutputMessage(BaseModel):
    """The assistant's message: the one output item this server generates."""

    type: Literal["message"] = "message"
    id: str
    role: Literal["assistant"] = "assistant"
    status: Literal["in_progress", "completed", "incomplete"]
    content: list[OutputText]


class InputTokensDetails(BaseModel):
    cached_tokens: int = 0


class OutputTokensDetails(BaseModel):
    reasoning_tokens: int = 0


class ResponseUsage(BaseModel):
    """Token counts of a response."""

    input_tokens: int
    input_tokens_details: InputTokensDetails = Field(default_factory=InputTokensDetails)
    output_tokens: int
    output_tokens_details: OutputTokensDetails = Field(default_factory=OutputTokensDetails)
    total_tokens: int


class IncompleteDetails(BaseModel):
    reason: Literal["max_output_tokens"]


class ResponseObject(BaseModel):
    """A response (object "response"): the body of POST and GET, and of the stream's lifecycle events."""

    id: str
    object: Literal["response"] = "response"
    created_at: int
    status: Literal["queued", "in_progress", "completed", "incomplete", "failed", "cancelled"]
    error: Optional[dict[str, Any]] = None
    incomplete_details: Optional[IncompleteDetails] = None
    instructions: Optional[str] = None
    max_output_tokens: Optional[int] = None
    model: str
    output: list[OutputMessage]
    parallel_tool_calls: bool = False
    previous_response_id: Optional[str] = None
    store: bool = False
    temperature: Optional[float] = None
    top_p: Optional[float] = None
    tool_choice: Literal["none"] = "none"
    tools: list[Any] = Field(default_factory=list)
    metadata: Optional[dict[str, str]] = None
    user: Optional[str] = None
    usage: Optional[ResponseUsage] = None
    background: bool = False
    top_logprobs: Optional[int] = None
    input_messages: Optional[list[RawMessage]] = None
    """vLLM's (enable_response_messages): the prompt as the model read it."""
    output_messages: Optional[list[RawMessage]] = None
    """vLLM's (enable_response_messages): the output as the model wrote it."""


class ResponseDeleted(BaseModel):
    """DELETE /v1/responses/{id}."""

    id: str
    object: Literal["response.deleted"] = "response.deleted"
    deleted: bool = True


class LifecycleEvent(BaseModel):
    """response.created, response.in_progress, then response.completed or response.failed."""

    type: Literal["response.created", "response.in_progress", "response.completed", "response.failed"]
    sequence_number: int
    response: ResponseObject


class OutputItemEvent(BaseModel):
    """response.output_item.added / .done."""

    type: Literal["response.output_item.added", "response.output_item.done"]
    sequence_number: int
    output_index: int
    item: OutputMessage


class ContentPartEvent(BaseModel):
    """response.content_part.added / .done."""

    type: Literal["response.content_part.added", "response.content_part.done"]
    sequence_number: int
    item_id: str
    output_index: int
    content_index: int
    part: OutputText


class EventTopLogprob(BaseModel):
    """One alternative of a streamed token."""

    token: str
    logprob: float


class EventLogprob(EventTopLogprob):
    """A streamed token's logprob, with its alternatives (include ["message.output_text.logprobs"])."""

    top_logprobs: list[EventTopLogprob] = Field(default_factory=list)


class TextDeltaEvent(BaseModel):
    """response.output_text.delta."""

    type: Literal["response.output_text.delta"] = "response.output_text.delta"
    sequence_number: int
    item_id: str
    output_index: int
    content_index: int
    delta: str
    logprobs: list[EventLogprob] = Field(default_factory=list)
    """The tokens of this delta (their text may be held back to a later delta: a stop string, partial UTF-8)."""


class TextDoneEvent(BaseModel):
    """response.output_text.done."""

    type: Literal["response.output_text.done"] = "response.output_text.done"
    sequence_number: int
    item_id: str
    output_index: int
    content_index: int
    text: str
    logprobs: list[EventLogprob] = Field(default_factory=list)
