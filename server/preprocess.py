"""Request body -> Job: prompts as token ids, one SamplingParams, every check that makes a 400."""
from __future__ import annotations

import time
import uuid
from typing import Any, Optional, Union

from engine.chat import iterates_content
from engine.sampling_params import GuidedSpec, SamplingParams, bad_words_token_ids
from server import guided, reasoning, tools
from server.context import ServerContext
from server.errors import APIError
from server.job import Job, JobKind
from server.protocol import ChatCompletionRequest, ChatMessage, ChatTemplateFields, CompletionRequest, SamplingFields

# apply_chat_template's own arguments: chat_template_kwargs may not set them (they would change what it returns).
_RESERVED_TEMPLATE_KWARGS = {"conversation", "tools", "chat_template", "tokenize", "padding", "truncation",
                             "max_length", "return_tensors", "return_dict", "return_assistant_tokens_mask",
                             "tokenizer_kwargs"}


def check_model(ctx: ServerContext, model: Optional[str]) -> None:
    if model is not None and model != ctx.model_name:
        raise APIError(f"The model `{model}` does not exist.", 404, "model")


def job_id(prefix: str, body: SamplingFields) -> str:
    return f"{prefix}-{body.request_id or uuid.uuid4().hex}"


def completion_job(ctx: ServerContext, body: CompletionRequest) -> Job:
    check_model(ctx, body.model)
    if body.suffix is not None:
        raise APIError("suffix is not supported.", 400, "suffix")
    if body.logprob_token_ids is not None and body.logprobs is None:
        raise APIError("when using `logprob_token_ids`, `logprobs` must be set.", 400, "logprob_token_ids")
    prompts, texts = _completion_prompts(ctx, body)
    logprobs = logprob_count(ctx, body.logprobs, "logprobs")
    prompt_logprobs = logprob_count(ctx, body.prompt_logprobs, "prompt_logprobs")
    echo_logprobs = logprobs if body.echo else None
    params = sampling_params(
        ctx, body, prompts, body.max_tokens,
        logprobs=logprobs, prompt_logprobs=_max_or_none(echo_logprobs, prompt_logprobs),
        guided_spec=guided.guided_spec(body),
    )
    return Job(
        JobKind.COMPLETION, job_id("cmpl", body), int(time.time()), ctx.model_name, prompts, texts, params,
        stream=body.stream, include_usage=_include_usage(body), continuous_usage=_continuous_usage(body),
        echo=body.echo, logprobs=logprobs, prompt_logprobs=prompt_logprobs, logprob_token_ids=body.logprob_token_ids,
        tokens_as_ids=body.return_tokens_as_token_ids, return_token_ids=body.return_token_ids,
        cached_tokens_details=ctx.enable_prompt_tokens_details, priority=body.priority,
        guided_param=guided.guided_param(body),
    )


def chat_job(ctx: ServerContext, body: ChatCompletionRequest) -> Job:
    check_model(ctx, body.model)
    if not body.messages:
        raise APIError("messages must contain at least one message.", 400, "messages")
    if body.top_logprobs is not None and not body.logprobs:
        raise APIError("top_logprobs requires logprobs to be true.", 400, "top_logprobs")
    if body.logprob_token_ids is not None and not body.logprobs:
        raise APIError("when using `logprob_token_ids`, `logprobs` must be set to true.", 400, "logprob_token_ids")
    tool_plan = tools.plan(body, ctx.tool_call_parser)
    spec = guided.guided_spec(body)
    guided_param = guided.guided_param(body)
    if tool_plan is not None and tool_plan.mode != "auto":
        if spec is not None:
            raise APIError(f"tool_choice {tool_plan.mode} constrains the output already; it cannot be combined "
                           f"with {guided_param}.", 400, guided_param)
        spec, guided_param = tools.guided_spec(tool_plan, body.tools), "tool_choice"
    text = render_chat(ctx, body.messages, body, tool_plan)
    ids = _truncate(ctx, body, ctx.tokenizer(text, add_special_tokens=body.add_special_tokens)["input_ids"])
    _check_prompt(ctx, ids, "messages")
    max_tokens = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
    logprobs = (logprob_count(ctx, body.top_logprobs, "top_logprobs") or 0) if body.logprobs else None
    prompt_logprobs = logprob_count(ctx, body.prompt_logprobs, "prompt_logprobs")
    reasoning_plan = reasoning.plan(ctx.reasoning_parser, text)
    # A grammar (structured output, tool_choice) constrains the content after the reasoning, not the reasoning.
    guided_after = reasoning_plan.gate(ctx.tokenizer) if reasoning_plan is not None and spec is not None else None
    params = sampling_params(ctx, body, [ids], max_tokens, logprobs=logprobs, prompt_logprobs=prompt_logprobs,
                             guided_spec=spec, guided_after=guided_after)
    last = body.messages[-1]
    echo_text = _content_text(last.content) if body.echo and last.role == "assistant" else ""
    return Job(
        JobKind.CHAT, job_id("chatcmpl", body), int(time.time()), ctx.model_name, [ids], [text], params,
        stream=body.stream, include_usage=_include_usage(body), continuous_usage=_continuous_usage(body),
        echo=body.echo, echo_text=echo_text, logprobs=logprobs, chat_logprobs=body.logprobs,
        prompt_logprobs=prompt_logprobs, logprob_token_ids=body.logprob_token_ids,
        tokens_as_ids=body.return_tokens_as_token_ids, return_token_ids=body.return_token_ids,
        cached_tokens_details=ctx.enable_prompt_tokens_details, priority=body.priority, tools=tool_plan,
        reasoning=reasoning_plan, guided_param=guided_param,
    )


def render_chat(ctx: ServerContext, messages: list[ChatMessage], options: ChatTemplateFields,
                tool_plan: Optional[tools.ToolPlan] = None) -> str:
    """The chat template (--chat-template, else the tokenizer's) over messages whose content parts are joined
    into one string; tools, tool calls and tool results as server/tools.py renders them."""
    template = ctx.chat_template or getattr(ctx.tokenizer, "chat_template", None)
    # Templates know system, not OpenAI's newer name for it (chat_messages maps it).
    plain, tool_kwargs = tools.chat_messages(messages, tool_plan, tools.template_renders_tools(template),
                                             _content_text)
    if iterates_content(template):  # it renders content parts itself (Gemma's): give them as parts, as HF would
        shift = len(plain) - len(messages)  # (a system message chat_messages put first)
        for m, item in zip(messages, plain[shift:]):
            if isinstance(m.content, list) and item["content"] == _content_text(m.content):
                item["content"] = [{"type": "text", "text": part.text} for part in m.content]
    if options.continue_final_message and options.add_generation_prompt:
        raise APIError("continue_final_message and add_generation_prompt cannot both be true.", 400,
                       "continue_final_message")
    if options.continue_final_message and (not messages or messages[-1].role != "assistant"):
        raise APIError("continue_final_message needs the last message to be the assistant's.", 400,
                       "continue_final_message")
    kwargs: dict[str, Any] = dict(add_generation_prompt=options.add_generation_prompt,
                                  continue_final_message=options.continue_final_message)
    if options.documents is not None:
        kwargs["documents"] = options.documents
    reserved = sorted(_RESERVED_TEMPLATE_KWARGS & set(options.chat_template_kwargs or {}))
    if reserved:
        raise APIError(f"chat_template_kwargs may not set {', '.join(reserved)}.", 400, "chat_template_kwargs")
    kwargs.update(options.chat_template_kwargs or {})
    kwargs.update(tool_kwargs)
    if ctx.chat_template:
        kwargs["chat_template"] = ctx.chat_template
    try:
        return ctx.tokenizer.apply_chat_template(plain, tokenize=False, **kwargs)
    except Exception as exc:  # a template may reject an order of roles, or raise_exception(...) on its own
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


def _continuous_usage(body: SamplingFields) -> bool:
    """vLLM: continuous_usage_stats puts usage on every chunk only together with include_usage."""
    return _include_usage(body) and body.stream_options.continuous_usage_stats


def logprob_count(ctx: ServerContext, value: Optional[int], param: str) -> Optional[int]:
    """How many alternatives a logprobs field asks for: -1 is the whole vocabulary; at most --max-logprobs, whose
    -1 is no bound (vLLM's rules and words)."""
    if value is None:
        return None
    count = ctx.vocab_size if value == -1 else value
    limit = ctx.engine.config.max_logprobs
    if limit != -1 and count > limit:
        kind = "prompt logprobs" if param == "prompt_logprobs" else "sample logprobs"
        raise APIError(f"{param}: Requested {kind} of {count}, which is greater than max allowed: {limit} "
                       "(--max-logprobs; -1 allows the whole vocabulary).", 400, param)
    return count


def _max_or_none(a: Optional[int], b: Optional[int]) -> Optional[int]:
    return b if a is None else a if b is None else max(a, b)


def _completion_prompts(ctx: ServerContext, body: CompletionRequest) -> tuple[list[list[int]], list[str]]:
    """Normalise the four prompt forms to token-id lists (and their texts, for echo)."""
    prompt: Any = body.prompt
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
            ids = ctx.tokenizer(item, add_special_tokens=body.add_special_tokens)["input_ids"] if item else []
        else:
            ids = list(item)
            check_token_ids(ctx, ids, "prompt")
        truncated = _truncate(ctx, body, ids)
        if isinstance(item, str) and truncated is ids:
            text = item
        else:
            text = ctx.tokenizer.decode(truncated) if truncated else ""
        _check_prompt(ctx, truncated, "prompt")
        prompts.append(truncated)
        texts.append(text)
    return prompts, texts


def _truncate(ctx: ServerContext, body: SamplingFields, ids: list[int]) -> list[int]:
    """vLLM's truncate_prompt_tokens: keep k tokens (-1: the context length), the last ones unless truncation_side
    is "right"; ids itself when untouched."""
    k = body.truncate_prompt_tokens
    if k is None:
        return ids
    if k == 0:
        raise APIError("truncate_prompt_tokens must be -1 or at least 1, got 0.", 400, "truncate_prompt_tokens")
    if k == -1:
        k = ctx.max_model_len
    if len(ids) <= k:
        return ids
    return ids[:k] if body.truncation_side == "right" else ids[-k:]


def check_token_ids(ctx: ServerContext, ids: list[int], param: str) -> None:
    """Every id inside the vocabulary, or a 400 in vLLM's words: a prompt's (or /detokenize's) first bad id "is
    out of vocabulary"; a parameter's ids "contain out-of-vocab token ids"."""
    bad = [t for t in ids if not 0 <= t < ctx.vocab_size]
    if not bad:
        return
    if param in ("prompt", "tokens"):
        raise APIError(f"{param}: Token id {bad[0]} is out of vocabulary (vocabulary size {ctx.vocab_size}).", 400,
                       param)
    raise APIError(f"token_id(s) {bad[:5]} in {param} contain out-of-vocab token ids. Vocabulary size: "
                   f"{ctx.vocab_size}", 400, param)


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


def sampling_params(
    ctx: ServerContext,
    body: SamplingFields,
    prompts: list[list[int]],
    max_tokens: Optional[int],
    *,
    logprobs: Optional[int],
    prompt_logprobs: Optional[int] = None,
    guided_spec: Optional[GuidedSpec] = None,
    guided_after: Optional[tuple[int, ...]] = None,
) -> SamplingParams:
    if body.stream and (body.use_beam_search or (body.best_of is not None and body.best_of != body.n)):
        raise APIError("best_of != n and use_beam_search are not supported with stream=true.", 400, "best_of")
    longest = max(len(p) for p in prompts)
    # --generation-config: the model's recommended values for the fields this request left unset (vLLM's rule)
    defaults = {} if body.use_beam_search else ctx.default_sampling
    unset = {k: v for k, v in defaults.items() if k != "max_tokens" and k not in body.model_fields_set}
    if max_tokens is None:
        # Chat's default (and completions' null): whatever fits after the longest prompt, up to max_new_tokens.
        max_tokens = min(max(1, ctx.max_model_len - longest), defaults.get("max_tokens", ctx.max_model_len))
    if isinstance(max_tokens, int) and max_tokens >= 1 and longest + max_tokens > ctx.max_model_len:
        raise _context_error(ctx, longest, max_tokens)
    if body.stream and body.prompt_logprobs is not None:
        raise APIError("prompt_logprobs is not available with stream=true.", 400, "prompt_logprobs")
    if body.stop_token_ids:
        check_token_ids(ctx, body.stop_token_ids, "stop_token_ids")
    if body.allowed_token_ids is not None:
        check_token_ids(ctx, body.allowed_token_ids, "allowed_token_ids")
    if body.logprob_token_ids is not None:
        check_token_ids(ctx, body.logprob_token_ids, "logprob_token_ids")
        if body.use_beam_search:
            raise APIError("`logprob_token_ids` is not supported with beam search.", 400, "logprob_token_ids")
        logprobs = 0  # vLLM: the named tokens take the place of the top-k alternatives
    try:
        params = SamplingParams(
            n=body.n, best_of=body.best_of, temperature=unset.get("temperature", body.temperature),
            top_p=unset.get("top_p", body.top_p), top_k=unset.get("top_k", body.top_k),
            min_p=unset.get("min_p", body.min_p), presence_penalty=body.presence_penalty,
            frequency_penalty=body.frequency_penalty,
            repetition_penalty=unset.get("repetition_penalty", body.repetition_penalty),
            length_penalty=body.length_penalty, seed=body.seed,
            use_beam_search=body.use_beam_search, stop=body.stop, stop_token_ids=body.stop_token_ids,
            include_stop_str_in_output=body.include_stop_str_in_output, ignore_eos=body.ignore_eos,
            max_tokens=max_tokens, min_tokens=body.min_tokens, logprobs=logprobs, prompt_logprobs=prompt_logprobs,
            logprob_token_ids=body.logprob_token_ids,
            skip_special_tokens=body.skip_special_tokens, logit_bias=_logit_bias(ctx, body.logit_bias),
            allowed_token_ids=body.allowed_token_ids, bad_words_token_ids=_bad_words(ctx, body.bad_words),
            max_logprobs=ctx.engine.config.max_logprobs, guided=guided_spec, guided_after=guided_after,
            final_only=not body.stream,  # (a non-streamed response reads the finished output only)
        )
    except ValueError as exc:
        raise APIError.from_value_error(exc) from exc
    _check_capacity(ctx, params, longest, "best_of" if body.best_of is not None else "n")
    return params


def _bad_words(ctx: ServerContext, words: Optional[list[str]]) -> Optional[list[list[int]]]:
    """Each word's token ids at the start of the text and, where they differ, after a space (vLLM's rule)."""
    if not words:
        return None
    try:
        return bad_words_token_ids(ctx.tokenizer, words)
    except ValueError as exc:
        raise APIError(str(exc), 400, "bad_words") from exc


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
            raise APIError(f"token_id(s) [{token}] in logit_bias contain out-of-vocab token ids. Vocabulary size: "
                           f"{ctx.vocab_size}", 400, "logit_bias")
        out[token] = value
    return out
