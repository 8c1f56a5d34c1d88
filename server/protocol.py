"""Pydantic request/response models of the OpenAI-compatible API (mirrored by openapi.yaml)."""
from __future__ import annotations

from typing import Annotated, Any, Literal, Optional, Union

from pydantic import BaseModel, ConfigDict, Field

from server.limits import (
    MAX_CONTENT_PARTS, MAX_MESSAGES, Documents, Finite, LogitBias, LogprobTokenIds, MinTokens, NumChoices, NumLogprobs,
    NumTokens, Priority, RequestId, Seed, StopList, StopTokenIds, TemplateKwargs, Text, TextPrompts, TokenIds,
    TokenPrompts, TopK, TruncateTokens,
)

PromptType = Union[Text, TextPrompts, TokenIds, TokenPrompts]
StopType = Union[Text, StopList, None]
# A field of a streamed chunk that is left out of its JSON when None (vLLM's chunks omit what was not set), so the
# usual chunk stays byte for byte what server/streaming.ChunkJSON writes.
_OMITTED_IF_NONE = dict(default=None, exclude_if=lambda v: v is None)


class RequestModel(BaseModel):
    """A request body: values are not coerced across types ("5" is not 5) and their bounds come from the types
    of server/limits.py. Unknown fields are accepted and ignored, as vLLM does, so that clients written for newer
    servers keep working; they stay in `model_extra` for unknown_fields() to report."""

    model_config = ConfigDict(extra="allow", strict=True, use_attribute_docstrings=True)


MAX_UNKNOWN_FIELDS = 256  # names unknown_fields() reports of one body; a client chooses them, as many as fit


def unknown_fields(body: BaseModel, limit: int = MAX_UNKNOWN_FIELDS) -> list[str]:
    """The dotted names of the ignored fields of `body` and of the models nested in it (list items included),
    each once, in the order found, and at most `limit`: one pass over the models, which stops at the limit."""
    found: dict[str, None] = {}

    def walk(model: BaseModel, prefix: str) -> bool:  # True once the limit is reached
        for name in model.model_extra or {}:
            found[prefix + name] = None
            if len(found) >= limit:
                return True
        for name in type(model).model_fields:
            value = getattr(model, name)
            for item in value if isinstance(value, list) else [value]:
                if isinstance(item, BaseModel) and walk(item, f"{prefix}{name}."):
                    return True
        return False

    walk(body, "")
    return list(found)


class StreamOptions(RequestModel):
    """`stream_options`: usage in a last chunk, and (vLLM) the running usage on every chunk."""

    include_usage: bool = False
    continuous_usage_stats: bool = False
    """vLLM: with include_usage, every chunk carries `usage`: its prompt's tokens and its choice's tokens so far."""


class JsonSchemaFormat(RequestModel):
    """`response_format.json_schema`: the schema the output must validate against."""

    name: Text
    description: Optional[Text] = None
    schema_: Optional[dict[str, Any]] = Field(default=None, alias="schema")
    strict: Optional[bool] = None


class ResponseFormat(RequestModel):
    """`response_format`: free text, any JSON object, or JSON valid against a schema (grammar-constrained)."""

    type: Literal["text", "json_object", "json_schema"]
    json_schema: Optional[JsonSchemaFormat] = None


class StructuredOutputsParams(RequestModel):
    """vLLM's `structured_outputs`: one of json (a schema), regex, choice, grammar (EBNF), json_object."""

    json_: Union[dict[str, Any], Text, None] = Field(default=None, alias="json")
    regex: Optional[Text] = None
    choice: Optional[Annotated[list[Text], Field(min_length=1, max_length=1024)]] = None
    grammar: Optional[Text] = None
    json_object: Optional[bool] = None


class GuidedFields(RequestModel):
    """Structured outputs: the output is constrained by a grammar (engine/structured_output/grammars.py); at most one of these."""

    response_format: Optional[ResponseFormat] = None
    guided_json: Union[dict[str, Any], Text, None] = None
    """vLLM: the output is JSON valid against this schema (an object, or its JSON text)."""
    guided_regex: Optional[Text] = None
    """vLLM: the output matches this regular expression."""
    guided_choice: Optional[Annotated[list[Text], Field(min_length=1, max_length=1024)]] = None
    """vLLM: the output is exactly one of these strings."""
    guided_grammar: Optional[Text] = None
    """vLLM: the output is derived from this EBNF grammar (xgrammar's dialect; the start rule is `root`)."""
    guided_decoding_backend: Optional[Text] = None
    """vLLM: accepted for compatibility; "xgrammar" (or "auto") is the one backend."""
    structured_outputs: Optional[StructuredOutputsParams] = None
    """vLLM (newer): the same constraints as one object."""


class SamplingFields(GuidedFields):
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
    include_stop_str_in_output: bool = False
    use_beam_search: bool = False
    best_of: Optional[NumChoices] = None
    stream: bool = False
    stream_options: Optional[StreamOptions] = None
    user: Optional[Text] = None
    spaces_between_special_tokens: bool = True
    """vLLM: join special tokens with spaces when the tokenizer's decoding does (byte-level BPE tokenizers never
    insert them, so both values give the same text there, as in vLLM)."""
    truncate_prompt_tokens: Optional[TruncateTokens] = None
    """vLLM: keep only k prompt tokens (-1: the context length), the last ones unless truncation_side says "right"."""
    truncation_side: Optional[Literal["left", "right"]] = None
    """vLLM: with truncate_prompt_tokens, "left" (the default) cuts the start and keeps the last k tokens, "right"
    cuts the end and keeps the first k."""
    prompt_logprobs: Optional[NumLogprobs] = None
    """vLLM: return each prompt token's logprob and the top-k alternatives (-1: the whole vocabulary; not with
    stream)."""
    logprob_token_ids: Optional[LogprobTokenIds] = None
    """vLLM: the logprobs of these token ids at each generated position, beside the sampled token's, in place of
    the top-k alternatives (needs logprobs)."""
    return_token_ids: bool = False
    """vLLM: the prompt's token ids (`prompt_token_ids`) and each choice's generated ones (`token_ids`); streamed,
    the prompt's come with the first chunk and each chunk has its new ids."""
    allowed_token_ids: Optional[TokenIds] = None
    """vLLM: sample only from these token ids."""
    bad_words: Optional[StopList] = None
    """vLLM: words that must not be generated: the last token of a word is masked when the output ends with
    the word's other tokens (each word is banned at the start of the text and after a space)."""
    return_tokens_as_token_ids: bool = False
    """vLLM: logprobs name tokens as `token_id:<id>` instead of their text."""
    priority: Priority = 0
    """vLLM: with --scheduling-policy priority, lower values are scheduled first (ties: arrival order)."""
    request_id: Optional[RequestId] = None
    """vLLM: the response's id is the endpoint's prefix and this (`cmpl-<request_id>`), instead of a random one."""


class CompletionRequest(SamplingFields):
    """POST /v1/completions."""

    prompt: PromptType
    max_tokens: Optional[NumTokens] = 16
    echo: bool = False
    logprobs: Optional[NumLogprobs] = None
    """The top-k alternatives of each token (-1: the whole vocabulary, vLLM), at most --max-logprobs."""
    suffix: Optional[Text] = None
    add_special_tokens: bool = True
    """vLLM: add the tokenizer's special tokens (BOS) to text prompts."""


class TextPart(RequestModel):
    """One `{"type": "text", "text": ...}` content part."""

    type: Literal["text"]
    text: Text


class FunctionCallIn(RequestModel):
    """The function an earlier assistant message called: its name and its arguments as a JSON string."""

    name: Text
    arguments: Text


class ToolCallIn(RequestModel):
    """One tool call of an earlier assistant message (sent back in the conversation)."""

    id: Text
    type: Literal["function"] = "function"
    function: FunctionCallIn


class ChatMessage(RequestModel):
    """One message of a chat; content is a string or a list of text parts. An assistant message may carry the
    tool calls it made; a `tool` message answers one of them (tool_call_id)."""

    role: Annotated[Text, Field(min_length=1, max_length=64)]
    """system, user, assistant, tool, developer (rendered as system), or another role the chat template knows
    (vLLM passes any role through)."""
    content: Union[Text, Annotated[list[TextPart], Field(max_length=MAX_CONTENT_PARTS)], None] = None
    name: Optional[Text] = None
    tool_calls: Optional[Annotated[list[ToolCallIn], Field(max_length=MAX_MESSAGES)]] = None
    tool_call_id: Optional[Text] = None


class FunctionDefinition(RequestModel):
    """A function the model may call: parameters is its arguments' JSON schema."""

    name: Annotated[str, Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_.\-]+$")]
    description: Optional[Text] = None
    parameters: Optional[dict[str, Any]] = None
    strict: Optional[bool] = None


class ChatTool(RequestModel):
    """One entry of `tools`."""

    type: Literal["function"]
    function: FunctionDefinition


class NamedFunction(RequestModel):
    name: Text


class NamedToolChoice(RequestModel):
    """`tool_choice` naming the one function the model must call."""

    type: Literal["function"]
    function: NamedFunction


ChatMessages = Annotated[list[ChatMessage], Field(max_length=MAX_MESSAGES)]


class ChatTemplateFields(RequestModel):
    """How chat messages become a prompt (vLLM's fields, shared by chat and /tokenize)."""

    add_generation_prompt: bool = True
    """End the prompt with the assistant's turn header."""
    continue_final_message: bool = False
    """vLLM: the last (assistant) message stays open and the model continues it (needs add_generation_prompt
    false)."""
    chat_template_kwargs: Optional[TemplateKwargs] = None
    """vLLM: extra variables for the chat template (they override the ones above)."""
    documents: Optional[Documents] = None
    """vLLM: passed to the chat template as `documents` (RAG templates)."""


class ChatCompletionRequest(SamplingFields, ChatTemplateFields):
    """POST /v1/chat/completions."""

    messages: ChatMessages
    tools: Optional[Annotated[list[ChatTool], Field(max_length=128)]] = None
    tool_choice: Union[Literal["none", "auto", "required"], NamedToolChoice, None] = None
    """"none": no tool call; "auto" (the default with tools): the model decides, its calls are parsed from the
    output; "required" or a named function: the output is constrained to calls (grammar)."""
    parallel_tool_calls: bool = True
    max_tokens: Optional[NumTokens] = None
    max_completion_tokens: Optional[NumTokens] = None
    logprobs: bool = False
    top_logprobs: Optional[NumLogprobs] = None
    """The alternatives of each token (needs logprobs; -1: the whole vocabulary, vLLM), at most --max-logprobs."""
    echo: bool = False
    """vLLM: the reply starts with the last message's content when that message is the assistant's."""
    add_special_tokens: bool = False
    """vLLM: add the tokenizer's special tokens (BOS) to the rendered prompt; the chat template already has them."""


class PromptTokensDetails(BaseModel):
    """What of the prompt was not computed again (with --enable-prompt-tokens-details, as vLLM)."""

    cached_tokens: int
    """Prompt tokens whose KV came from the prefix cache (0 without --enable-prefix-caching)."""


class UsageInfo(BaseModel):
    """Token counts of a request, over all its choices."""

    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: Optional[PromptTokensDetails] = Field(**_OMITTED_IF_NONE)


class CompletionLogprobs(BaseModel):
    """Completions logprobs: parallel lists, one entry per token."""

    text_offset: list[int] = Field(default_factory=list)
    token_logprobs: list[Optional[float]] = Field(default_factory=list)
    tokens: list[str] = Field(default_factory=list)
    top_logprobs: list[Optional[dict[str, float]]] = Field(default_factory=list)


class PromptLogprob(BaseModel):
    """vLLM's Logprob: one token of a prompt position (the prompt's own token or one of the top-k)."""

    logprob: float
    rank: Optional[int] = None  # 1 = most likely; null when the token is outside the top-k computed
    decoded_token: Optional[str] = None


# One entry per prompt token, keyed by token id; the first token has no context, so its entry is null.
PromptLogprobs = list[Optional[dict[int, PromptLogprob]]]


class CompletionStreamChoice(BaseModel):
    """One choice of a completion chunk."""

    index: int
    text: str
    logprobs: Optional[CompletionLogprobs] = None
    finish_reason: Optional[str] = None
    stop_reason: Union[int, str, None] = None
    prompt_token_ids: Optional[list[int]] = Field(**_OMITTED_IF_NONE)
    """return_token_ids: the prompt's token ids, in the choice's first chunk."""
    token_ids: Optional[list[int]] = Field(**_OMITTED_IF_NONE)
    """return_token_ids: the token ids this chunk adds."""


class CompletionChoice(BaseModel):
    """One choice of a completion."""

    index: int
    text: str
    logprobs: Optional[CompletionLogprobs] = None
    finish_reason: Optional[str] = None
    stop_reason: Union[int, str, None] = None
    prompt_logprobs: Optional[PromptLogprobs] = None
    prompt_token_ids: Optional[list[int]] = None
    """return_token_ids: the prompt's token ids."""
    token_ids: Optional[list[int]] = None
    """return_token_ids: the choice's generated token ids."""


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
    choices: list[CompletionStreamChoice]
    usage: Optional[UsageInfo] = None  # the last chunk's (include_usage), or every chunk's (continuous_usage_stats)


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


class FunctionCall(BaseModel):
    """The function a tool call names, and its arguments as a JSON string."""

    name: str
    arguments: str


class ToolCall(BaseModel):
    """One call the assistant makes."""

    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatResponseMessage(BaseModel):
    """The assistant's message: text, tool calls, or both."""

    role: Literal["assistant"] = "assistant"
    content: Optional[str] = None
    reasoning_content: Optional[str] = None
    """--reasoning-parser: the reply's reasoning (its `<think>` block), apart from content (vLLM's field)."""
    tool_calls: list[ToolCall] = Field(default_factory=list)


class DeltaFunctionCall(BaseModel):
    name: Optional[str] = None
    arguments: Optional[str] = None


class DeltaToolCall(BaseModel):
    """A streamed tool call (OpenAI's delta format): the first delta of a call has its id, type and name."""

    index: int
    id: Optional[str] = None
    type: Optional[Literal["function"]] = None
    function: DeltaFunctionCall


class ChatChoice(BaseModel):
    """One choice of a chat completion."""

    index: int
    message: ChatResponseMessage
    logprobs: Optional[ChatLogprobs] = None
    finish_reason: Optional[str] = None
    stop_reason: Union[int, str, None] = None
    token_ids: Optional[list[int]] = None
    """return_token_ids: the choice's generated token ids."""


class ChatCompletionResponse(BaseModel):
    """A non-streamed chat completion (object "chat.completion")."""

    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[ChatChoice]
    usage: UsageInfo
    prompt_logprobs: Optional[PromptLogprobs] = None
    prompt_token_ids: Optional[list[int]] = None
    """return_token_ids: the rendered prompt's token ids."""


class ChatDelta(BaseModel):
    """What a chat chunk adds to its choice."""

    role: Optional[Literal["assistant"]] = None
    content: Optional[str] = None
    reasoning_content: Optional[str] = Field(**_OMITTED_IF_NONE)
    """--reasoning-parser: the reasoning this chunk adds (absent from chunks without any)."""
    tool_calls: Optional[list[DeltaToolCall]] = None


class ChatStreamChoice(BaseModel):
    """One choice inside a chat chunk."""

    index: int
    delta: ChatDelta
    logprobs: Optional[ChatLogprobs] = None
    finish_reason: Optional[str] = None
    stop_reason: Union[int, str, None] = None
    token_ids: Optional[list[int]] = Field(**_OMITTED_IF_NONE)
    """return_token_ids: the token ids this chunk adds."""


class ChatCompletionStreamResponse(BaseModel):
    """One SSE chunk of a streamed chat completion (object "chat.completion.chunk")."""

    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatStreamChoice]
    usage: Optional[UsageInfo] = None
    prompt_token_ids: Optional[list[int]] = Field(**_OMITTED_IF_NONE)
    """return_token_ids: the rendered prompt's token ids, in the first chunk of each choice (its role)."""


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
    return_token_strs: bool = False
    """vLLM: also return each token as the tokenizer's string for it (`token_strs`)."""


class TokenizeResponse(BaseModel):
    """The token ids of a prompt."""

    tokens: list[int]
    count: int
    max_model_len: int
    token_strs: Optional[list[str]] = None
    """return_token_strs: each token's string in the tokenizer's vocabulary (byte-level BPE shows a space as Ġ)."""


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
