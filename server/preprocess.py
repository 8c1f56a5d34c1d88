"""Request body -> Job: prompts as token ids, one SamplingParams, every check that makes a 400."""
from __future__ import annotations

import enum
import time
import uuid
from dataclasses import dataclass, field
from typing import Any, Optional, Union

from engine.sampling_params import SamplingParams
from server.errors import APIError
from server.protocol import ChatCompletionRequest, ChatMessage, CompletionRequest, SamplingFields


class JobKind(enum.Enum):
    COMPLETION = "completion"
    CHAT = "chat"


@dataclass
class ServerContext:
    """What handlers share: the engine and the served model's facts (no module globals)."""

    engine: Any  # AsyncLLMEngine
    model_name: str
    max_model_len: int
    vocab_size: int
    api_key: Optional[str] = None
    shutdown_timeout_s: float = 10.0  # how long streams may outlive SIGTERM before the engine ends them
    created: int = field(default_factory=lambda: int(time.time()))

    @property
    def tokenizer(self) -> Any:
        return self.engine.tokenizer


@dataclass
class Job:
    """One API call: its prompts (each a separate engine request) sharing one SamplingParams."""

    kind: JobKind
    id: str
    created: int
    model: str
    prompts: list[list[int]]
    prompt_texts: list[str]
    params: SamplingParams
    stream: bool = False
    include_usage: bool = False
    echo: bool = False
    logprobs: Optional[int] = None  # completions: top-k per token; chat: top_logprobs
    chat_logprobs: bool = False

    def request_id(self, prompt_index: int) -> str:
        return f"{self.id}-{prompt_index}"

    def choice_index(self, prompt_index: int, choice: int) -> int:
        # vLLM's numbering: prompt i's j-th choice is i * n + j.
        return prompt_index * self.params.n + choice


def check_model(ctx: ServerContext, model: Optional[str]) -> None:
    if model is not None and model != ctx.model_name:
        raise APIError(f"The model `{model}` does not exist.", 404, "model")


def completion_job(ctx: ServerContext, body: CompletionRequest) -> Job:
    check_model(ctx, body.model)
    if body.suffix is not None:
        raise APIError("suffix is not supported.", 400, "suffix")
    prompts, texts = _completion_prompts(ctx, body.prompt)
    want_prompt_logprobs = body.echo and body.logprobs is not None
    params = _sampling_params(
        ctx, body, prompts, body.max_tokens,
        logprobs=body.logprobs, prompt_logprobs=body.logprobs if want_prompt_logprobs else None,
    )
    return Job(
        JobKind.COMPLETION, f"cmpl-{uuid.uuid4().hex}", int(time.time()), ctx.model_name, prompts, texts, params,
        stream=body.stream, include_usage=_include_usage(body), echo=body.echo, logprobs=body.logprobs,
    )


def chat_job(ctx: ServerContext, body: ChatCompletionRequest) -> Job:
    check_model(ctx, body.model)
    if not body.messages:
        raise APIError("messages must contain at least one message.", 400, "messages")
    if body.top_logprobs is not None and not body.logprobs:
        raise APIError("top_logprobs requires logprobs to be true.", 400, "top_logprobs")
    text = render_chat(ctx, body.messages, body.add_generation_prompt)
    ids = ctx.tokenizer(text, add_special_tokens=False)["input_ids"]
    _check_prompt(ctx, ids, "messages")
    max_tokens = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
    logprobs = (body.top_logprobs or 0) if body.logprobs else None
    params = _sampling_params(ctx, body, [ids], max_tokens, logprobs=logprobs)
    return Job(
        JobKind.CHAT, f"chatcmpl-{uuid.uuid4().hex}", int(time.time()), ctx.model_name, [ids], [text], params,
        stream=body.stream, include_usage=_include_usage(body), logprobs=logprobs, chat_logprobs=body.logprobs,
    )


def render_chat(ctx: ServerContext, messages: list[ChatMessage], add_generation_prompt: bool) -> str:
    """The tokenizer's chat template over messages whose content parts are joined into one string."""
    plain = [{"role": m.role, "content": _content_text(m.content)} for m in messages]
    try:
        return ctx.tokenizer.apply_chat_template(plain, tokenize=False, add_generation_prompt=add_generation_prompt)
    except Exception as exc:  # a template may reject an order of roles
        raise APIError(f"messages could not be rendered with the chat template: {exc}", 400, "messages") from exc


def _content_text(content: Union[str, list, None]) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    return "\n".join(part.text for part in content)


def _include_usage(body: SamplingFields) -> bool:
    if body.stream_options is not None and not body.stream:
        raise APIError("stream_options can only be set when stream is true.", 400, "stream_options")
    return bool(body.stream and body.stream_options and body.stream_options.include_usage)


def _completion_prompts(ctx: ServerContext, prompt: Any) -> tuple[list[list[int]], list[str]]:
    """Normalise the four prompt forms to token-id lists (and their texts, for echo)."""
    if isinstance(prompt, str):
        items: list = [prompt]
    elif prompt and all(isinstance(p, int) for p in prompt):
        items = [list(prompt)]
    else:
        items = list(prompt)
    if not items:
        raise APIError("prompt must not be empty.", 400, "prompt")
    prompts, texts = [], []
    for item in items:
        if isinstance(item, str):
            ids = ctx.tokenizer(item)["input_ids"] if item else []
            text = item
        else:
            ids = list(item)
            check_token_ids(ctx, ids, "prompt")
            text = ctx.tokenizer.decode(ids) if ids else ""
        _check_prompt(ctx, ids, "prompt")
        prompts.append(ids)
        texts.append(text)
    return prompts, texts


def check_token_ids(ctx: ServerContext, ids: list[int], param: str) -> None:
    bad = [t for t in ids if not 0 <= t < ctx.vocab_size]
    if bad:
        raise APIError(
            f"{param} contains token ids outside the vocabulary [0, {ctx.vocab_size}): {bad[:5]}.", 400, param
        )


def _check_prompt(ctx: ServerContext, ids: list[int], param: str) -> None:
    if not ids:
        raise APIError(f"{param} must not be empty.", 400, param)


def _context_error(ctx: ServerContext, prompt_len: int, max_tokens: int) -> APIError:
    return APIError(
        f"This model's maximum context length is {ctx.max_model_len} tokens. However, you requested "
        f"{prompt_len + max_tokens} tokens ({prompt_len} in the prompt, {max_tokens} in the completion). "
        "Please reduce the length of the prompt or completion.",
        400,
        "max_tokens" if prompt_len < ctx.max_model_len else "prompt",
    )


def _sampling_params(
    ctx: ServerContext,
    body: SamplingFields,
    prompts: list[list[int]],
    max_tokens: Optional[int],
    *,
    logprobs: Optional[int],
    prompt_logprobs: Optional[int] = None,
) -> SamplingParams:
    if body.stream and (body.use_beam_search or (body.best_of is not None and body.best_of != body.n)):
        raise APIError("best_of != n and use_beam_search are not supported with stream=true.", 400, "best_of")
    longest = max(len(p) for p in prompts)
    if max_tokens is None:
        # Chat's default (and completions' null): whatever fits after the longest prompt.
        max_tokens = max(1, ctx.max_model_len - longest)
    if isinstance(max_tokens, int) and max_tokens >= 1 and longest + max_tokens > ctx.max_model_len:
        raise _context_error(ctx, longest, max_tokens)
    if body.stop_token_ids:
        check_token_ids(ctx, body.stop_token_ids, "stop_token_ids")
    try:
        params = SamplingParams(
            n=body.n, best_of=body.best_of, temperature=body.temperature, top_p=body.top_p, top_k=body.top_k,
            min_p=body.min_p, presence_penalty=body.presence_penalty, frequency_penalty=body.frequency_penalty,
            repetition_penalty=body.repetition_penalty, length_penalty=body.length_penalty, seed=body.seed,
            use_beam_search=body.use_beam_search, stop=body.stop, stop_token_ids=body.stop_token_ids,
            include_stop_str_in_output=body.include_stop_str_in_output, ignore_eos=body.ignore_eos,
            max_tokens=max_tokens, min_tokens=body.min_tokens, logprobs=logprobs, prompt_logprobs=prompt_logprobs,
            skip_special_tokens=body.skip_special_tokens, logit_bias=_logit_bias(ctx, body.logit_bias),
            max_logprobs=ctx.engine.config.max_logprobs,
        )
    except ValueError as exc:
        raise APIError.from_value_error(exc) from exc
    _check_capacity(ctx, params, longest, "best_of" if body.best_of is not None else "n")
    return params


def _check_capacity(ctx: ServerContext, params: SamplingParams, prompt_len: int, param: str) -> None:
    """Refuse, before the engine sees it, a request that could never finish: it would fail half-way instead."""
    num_seqs = params.best_of
    max_num_seqs = ctx.engine.config.max_num_seqs
    if num_seqs > max_num_seqs:
        raise APIError(f"{param} asks for {num_seqs} sequences; a batch holds at most --max-num-seqs "
                       f"({max_num_seqs}).", 400, param)
    stats = ctx.engine.get_stats()
    # Upper bound: after a preemption the sequences no longer share their prompt blocks.
    needed = num_seqs * -(-(prompt_len + params.max_tokens) // stats.block_size)
    if needed > stats.num_device_blocks:
        raise APIError(
            f"{num_seqs} sequences of up to {prompt_len + params.max_tokens} tokens need {needed} KV cache blocks; "
            f"the cache has {stats.num_device_blocks}. Lower max_tokens or {param}, or give the KV cache more memory "
            "(--kv-cache-space, --gpu-memory-utilization).", 400, param)


def _logit_bias(ctx: ServerContext, bias: Optional[dict[str, float]]) -> Optional[dict[int, float]]:
    if not bias:
        return None
    out = {}
    for key, value in bias.items():
        try:
            token = int(key)
        except ValueError:
            raise APIError(f"logit_bias keys must be token ids, got {key!r}.", 400, "logit_bias") from None
        if not 0 <= token < ctx.vocab_size:
            raise APIError(f"logit_bias key {token} is outside the vocabulary [0, {ctx.vocab_size}).", 400, "logit_bias")
        out[token] = value
    return out
