"""Engine outputs -> the response models of server/protocol.py: logprob shapes, choices, usage, whole responses."""
from __future__ import annotations

from typing import Any, Optional, Union

from engine.sequence import CompletionOutput, Logprobs, RequestOutput
from server import reasoning, tools
from server.errors import APIError
from server.job import Job, JobKind
from server.protocol import (
    ChatChoice, ChatCompletionResponse, ChatLogprobs, ChatResponseMessage, ChatTokenLogprob, CompletionChoice,
    CompletionLogprobs, CompletionResponse, PromptLogprob, PromptLogprobs, PromptTokensDetails, TopLogprob, UsageInfo,
)


def token_text(tokenizer: Any, job: Job, token_id: int) -> str:
    # return_tokens_as_token_ids: ids survive tokens that do not decode on their own (partial UTF-8).
    return f"token_id:{token_id}" if job.tokens_as_ids else tokenizer.decode([token_id])


def _ranked(entry: Logprobs, token_id: int, top_n: int) -> list[tuple[int, float]]:
    """The top_n alternatives of a position, most likely first, and the position's own token."""
    ranked = sorted(entry.items(), key=lambda kv: -kv[1])
    kept = ranked[:top_n]
    if token_id in entry and all(t != token_id for t, _ in kept):
        kept.append((token_id, entry[token_id]))
    return kept


def completion_logprobs(
    tokenizer: Any, job: Job, token_ids: list[int], logprobs: list[Optional[Logprobs]], text_offset: int,
    is_output: bool = True,
) -> CompletionLogprobs:
    """Parallel lists, one entry per token (generated ones, or the prompt's: is_output False); a None entry (first
    prompt token) stays null."""
    out = CompletionLogprobs()
    # logprob_token_ids (generated positions): the sampled token and the named ones, as the engine gave them
    named = job.logprob_token_ids is not None and is_output
    for token_id, entry in zip(token_ids, logprobs):
        text = token_text(tokenizer, job, token_id)
        out.tokens.append(text)
        out.text_offset.append(text_offset)
        text_offset += len(text)
        if entry is None:
            out.token_logprobs.append(None)
            out.top_logprobs.append(None)
        else:
            out.token_logprobs.append(entry.get(token_id))
            top = list(entry.items()) if named else _ranked(entry, token_id, job.logprobs or 0)
            out.top_logprobs.append({token_text(tokenizer, job, t): lp for t, lp in top})
    return out


def chat_logprobs(tokenizer: Any, job: Job, token_ids: list[int], logprobs: list[Logprobs]) -> ChatLogprobs:
    """One entry per generated token, with its top_logprobs alternatives."""
    content = []
    for token_id, entry in zip(token_ids, logprobs):
        if job.logprob_token_ids is not None:  # the sampled token and the named ones, as the engine gave them
            top = list(entry.items())
        else:
            top = sorted(entry.items(), key=lambda kv: -kv[1])[: job.logprobs or 0]
        own = _chat_token(tokenizer, job, token_id, entry.get(token_id, float("-inf")))
        content.append(ChatTokenLogprob(**own.model_dump(), top_logprobs=[
            _chat_token(tokenizer, job, t, lp) for t, lp in top]))
    return ChatLogprobs(content=content)


def _chat_token(tokenizer: Any, job: Job, token_id: int, logprob: float) -> TopLogprob:
    text = token_text(tokenizer, job, token_id)
    return TopLogprob(token=text, logprob=max(logprob, -9999.0), bytes=list(text.encode("utf-8")))


def output_logprobs(
    tokenizer: Any, job: Job, c: CompletionOutput, start: int, text_offset: int
) -> Union[CompletionLogprobs, ChatLogprobs, None]:
    """Logprobs of c's tokens [start:], in the job's shape; None when not asked for."""
    if job.logprobs is None or c.logprobs is None:
        return None
    ids, entries = c.token_ids[start:], c.logprobs[start:]
    if job.kind is JobKind.CHAT:
        return chat_logprobs(tokenizer, job, ids, entries)
    return completion_logprobs(tokenizer, job, ids, entries, text_offset)


def prompt_logprobs(tokenizer: Any, job: Job, out: RequestOutput, prompt_index: int) -> Optional[PromptLogprobs]:
    """vLLM's prompt_logprobs: per prompt token, its own logprob and the top-k, keyed by token id."""
    if job.prompt_logprobs is None or out.prompt_logprobs is None:
        return None
    computed = job.params.prompt_logprobs or 0  # the engine's k, which echo logprobs may have raised
    result: PromptLogprobs = []
    for token_id, entry in zip(job.prompts[prompt_index], out.prompt_logprobs):
        if entry is None:
            result.append(None)
            continue
        # The engine's entry is the token plus the top `computed`: when it has no more, the token is among them.
        own_rank = 1 + sum(lp > entry[token_id] for lp in entry.values()) if len(entry) == computed else None
        top = sorted(entry.items(), key=lambda kv: -kv[1])
        shown = {t: PromptLogprob(logprob=lp, rank=i + 1, decoded_token=token_text(tokenizer, job, t))
                 for i, (t, lp) in enumerate(top[: job.prompt_logprobs])}
        shown[token_id] = PromptLogprob(logprob=entry[token_id], rank=own_rank,
                                        decoded_token=token_text(tokenizer, job, token_id))
        result.append(shown)
    return result


def usage(job: Job, finals: dict[int, RequestOutput]) -> UsageInfo:
    """Usage over ALL prompts and choices; with --enable-prompt-tokens-details, the prompt tokens the prefix cache
    served (summed over the prompts)."""
    prompt = sum(len(p) for p in job.prompts)
    completion = sum(len(c.token_ids) for out in finals.values() for c in out.outputs)
    details = None
    if job.cached_tokens_details:
        cached = sum(out.metrics.num_cached_tokens or 0 for out in finals.values() if out.metrics is not None)
        details = PromptTokensDetails(cached_tokens=cached)
    return UsageInfo(prompt_tokens=prompt, completion_tokens=completion, total_tokens=prompt + completion,
                     prompt_tokens_details=details)


def raise_for_output_error(out: RequestOutput) -> None:
    """An engine-side end becomes an API error: a prompt that can never fit is the client's (400); a request
    ended for lack of server capacity (out of host swap space, no room to resume) is retryable (503)."""
    if out.error is None:
        return
    reasons = {c.finish_reason for c in out.outputs}
    raise APIError(out.error, 503 if "error" in reasons else 400)


def full_response(
    tokenizer: Any, job: Job, finals: dict[int, RequestOutput]
) -> Union[CompletionResponse, ChatCompletionResponse]:
    """The non-streamed body of a completion or chat job."""
    for out in finals.values():
        raise_for_output_error(out)
    if job.kind is JobKind.CHAT:
        out = finals[0]
        choices = [_chat_choice(tokenizer, job, c, job.choice_index(0, c.index))
                   for c in sorted(out.outputs, key=lambda c: c.index)]
        return ChatCompletionResponse(id=job.id, created=job.created, model=job.model, choices=choices,
                                      usage=usage(job, finals), prompt_logprobs=prompt_logprobs(tokenizer, job, out, 0),
                                      prompt_token_ids=job.prompts[0] if job.return_token_ids else None)
    completion_choices = [
        _completion_choice(tokenizer, job, finals[i], c, job.choice_index(i, c.index), i)
        for i in sorted(finals) for c in sorted(finals[i].outputs, key=lambda c: c.index)
    ]
    return CompletionResponse(id=job.id, created=job.created, model=job.model, choices=completion_choices,
                              usage=usage(job, finals))


def _chat_choice(tokenizer: Any, job: Job, c: CompletionOutput, index: int) -> ChatChoice:
    text, thought = c.text, None
    if job.reasoning is not None:  # tool calls and the echo go with the content after the reasoning
        thought, text = reasoning.split(job.reasoning, c.text)
    content: Optional[str] = job.echo_text + text if text is not None or job.echo_text else None
    calls: list = []
    if job.tools is not None and c.finish_reason == "stop" and text is not None:
        content, calls = tools.parse(job.tools, text)
    return ChatChoice(
        index=index,
        message=ChatResponseMessage(content=content, reasoning_content=thought, tool_calls=calls),
        logprobs=output_logprobs(tokenizer, job, c, 0, 0),
        finish_reason=tools.finish_reason(c.finish_reason, calls),
        stop_reason=c.stop_reason,
        token_ids=c.token_ids if job.return_token_ids else None,
    )


def _completion_choice(
    tokenizer: Any, job: Job, out: RequestOutput, c: CompletionOutput, index: int, prompt_index: int
) -> CompletionChoice:
    prefix = job.prompt_texts[prompt_index] if job.echo else ""
    logprobs = None
    if job.logprobs is not None:
        logprobs = echo_logprobs(tokenizer, job, out, prompt_index) if job.echo else None
        logprobs = concat_logprobs(logprobs, output_logprobs(tokenizer, job, c, 0, len(prefix)))
    return CompletionChoice(
        index=index, text=prefix + c.text, logprobs=logprobs, finish_reason=c.finish_reason,
        stop_reason=c.stop_reason, prompt_logprobs=prompt_logprobs(tokenizer, job, out, prompt_index),
        prompt_token_ids=job.prompts[prompt_index] if job.return_token_ids else None,
        token_ids=c.token_ids if job.return_token_ids else None,
    )


def echo_logprobs(tokenizer: Any, job: Job, out: RequestOutput, prompt_index: int) -> Optional[CompletionLogprobs]:
    """Completions' prompt logprobs for echo (first entry null)."""
    if job.logprobs is None:
        return None
    ids = job.prompts[prompt_index]
    entries = out.prompt_logprobs or [None] * len(ids)
    return completion_logprobs(tokenizer, job, ids, entries, 0, is_output=False)


def concat_logprobs(a: Any, b: Any) -> Any:
    """Completions logprobs of a then b (either may be None)."""
    if a is None or b is None:
        return a if b is None else b
    return CompletionLogprobs(**{key: getattr(a, key) + getattr(b, key) for key in CompletionLogprobs.model_fields})
