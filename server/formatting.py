"""Engine outputs -> OpenAI JSON: logprob shapes, choices, usage, whole non-streamed responses."""
from __future__ import annotations

from typing import Any, Optional

from engine.sequence import CompletionOutput, Logprobs, RequestOutput
from server.errors import APIError
from server.job import Job, JobKind


def token_text(tokenizer: Any, token_id: int) -> str:
    return tokenizer.decode([token_id])


def completion_logprobs(
    tokenizer: Any, token_ids: list[int], logprobs: list[Optional[Logprobs]], text_offset: int
) -> dict[str, list]:
    """`{"text_offset", "token_logprobs", "tokens", "top_logprobs"}`; a None entry (first prompt token) stays null."""
    out: dict[str, list] = {"text_offset": [], "token_logprobs": [], "tokens": [], "top_logprobs": []}
    for token_id, entry in zip(token_ids, logprobs):
        text = token_text(tokenizer, token_id)
        out["tokens"].append(text)
        out["text_offset"].append(text_offset)
        text_offset += len(text)
        if entry is None:
            out["token_logprobs"].append(None)
            out["top_logprobs"].append(None)
        else:
            out["token_logprobs"].append(entry.get(token_id))
            ranked = sorted(entry.items(), key=lambda kv: -kv[1])
            out["top_logprobs"].append({token_text(tokenizer, t): lp for t, lp in ranked})
    return out


def chat_logprobs(tokenizer: Any, token_ids: list[int], logprobs: list[Logprobs], top_n: int) -> dict[str, list]:
    """`{"content": [{"token", "logprob", "bytes", "top_logprobs": [...]}]}`."""
    content = []
    for token_id, entry in zip(token_ids, logprobs):
        ranked = sorted(entry.items(), key=lambda kv: -kv[1])[:top_n]
        content.append({**_chat_token(tokenizer, token_id, entry.get(token_id, float("-inf"))),
                        "top_logprobs": [_chat_token(tokenizer, t, lp) for t, lp in ranked]})
    return {"content": content}


def _chat_token(tokenizer: Any, token_id: int, logprob: float) -> dict[str, Any]:
    text = token_text(tokenizer, token_id)
    return {"token": text, "logprob": max(logprob, -9999.0), "bytes": list(text.encode("utf-8"))}


def output_logprobs(tokenizer: Any, job: Job, c: CompletionOutput, start: int, text_offset: int) -> Optional[dict]:
    """Logprobs of c's tokens [start:], in the job's shape; None when not asked for."""
    if job.logprobs is None or c.logprobs is None:
        return None
    ids, entries = c.token_ids[start:], c.logprobs[start:]
    if job.kind is JobKind.CHAT:
        return chat_logprobs(tokenizer, ids, entries, job.logprobs)
    return completion_logprobs(tokenizer, ids, entries, text_offset)


def usage(job: Job, finals: dict[int, RequestOutput]) -> dict[str, int]:
    """Usage over ALL prompts and choices."""
    prompt = sum(len(p) for p in job.prompts)
    completion = sum(len(c.token_ids) for out in finals.values() for c in out.outputs)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


def raise_for_output_error(out: RequestOutput) -> None:
    """An engine-side end becomes an API error: a prompt that can never fit is the client's (400); a request
    ended for lack of server capacity (out of host swap space, no room to resume) is retryable (503)."""
    if out.error is None:
        return
    reasons = {c.finish_reason for c in out.outputs}
    raise APIError(out.error, 503 if "error" in reasons else 400)


def full_response(tokenizer: Any, job: Job, finals: dict[int, RequestOutput]) -> dict[str, Any]:
    """The non-streamed body of a completion or chat job."""
    for out in finals.values():
        raise_for_output_error(out)
    choices = []
    for prompt_index in sorted(finals):
        out = finals[prompt_index]
        for c in sorted(out.outputs, key=lambda c: c.index):
            index = job.choice_index(prompt_index, c.index)
            if job.kind is JobKind.CHAT:
                choices.append(_chat_choice(tokenizer, job, c, index))
            else:
                choices.append(_completion_choice(tokenizer, job, out, c, index, prompt_index))
    return {
        "id": job.id,
        "object": "chat.completion" if job.kind is JobKind.CHAT else "text_completion",
        "created": job.created,
        "model": job.model,
        "choices": choices,
        "usage": usage(job, finals),
    }


def _chat_choice(tokenizer: Any, job: Job, c: CompletionOutput, index: int) -> dict[str, Any]:
    return {
        "index": index,
        "message": {"role": "assistant", "content": c.text},
        "logprobs": output_logprobs(tokenizer, job, c, 0, 0),
        "finish_reason": c.finish_reason,
        "stop_reason": c.stop_reason,
    }


def _completion_choice(
    tokenizer: Any, job: Job, out: RequestOutput, c: CompletionOutput, index: int, prompt_index: int
) -> dict[str, Any]:
    prefix = job.prompt_texts[prompt_index] if job.echo else ""
    logprobs = None
    if job.logprobs is not None:
        logprobs = echo_logprobs(tokenizer, job, out, prompt_index) if job.echo else None
        generated = output_logprobs(tokenizer, job, c, 0, len(prefix))
        logprobs = concat_logprobs(logprobs, generated)
    return {
        "index": index,
        "text": prefix + c.text,
        "logprobs": logprobs,
        "finish_reason": c.finish_reason,
        "stop_reason": c.stop_reason,
    }


def echo_logprobs(tokenizer: Any, job: Job, out: RequestOutput, prompt_index: int) -> Optional[dict]:
    """Completions' prompt logprobs for echo (first entry null)."""
    if job.logprobs is None:
        return None
    ids = job.prompts[prompt_index]
    entries = out.prompt_logprobs or [None] * len(ids)
    return completion_logprobs(tokenizer, ids, entries, 0)


def concat_logprobs(a: Optional[dict], b: Optional[dict]) -> Optional[dict]:
    if a is None or b is None:
        return a if b is None else b
    return {key: a[key] + b[key] for key in a}
