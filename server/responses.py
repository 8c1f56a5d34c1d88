"""POST /v1/responses on the chat path: input -> chat messages -> one engine request -> a response or its events."""
from __future__ import annotations

import itertools
import json
import time
import uuid
from typing import Any, AsyncIterator, Optional

from fastapi import Request
from fastapi.responses import Response

from engine.sequence import CompletionOutput, RequestOutput
from server import formatting, preprocess, responses_background, streaming
from server.context import ServerContext, StoredResponse
from server.errors import APIError
from server.job import Job, JobKind
from server.protocol import ChatMessage, ChatTemplateFields, ChatTokenLogprob, SamplingFields
from server.protocol_responses import (
    OUTPUT_LOGPROBS, ContentPartEvent, EventLogprob, EventTopLogprob, IncompleteDetails, InputMessage,
    LifecycleEvent, OutputItemEvent, OutputMessage, OutputText, RawMessage, ResponseObject, ResponsesRequest,
    ResponseUsage, TextDeltaEvent, TextDoneEvent,
)

# A response that is continued must have its reply (a background one may still be generating it).
FINISHED = ("completed", "incomplete")


def conversation(ctx: ServerContext, body: ResponsesRequest) -> list[dict[str, str]]:
    """The messages this response answers: a stored response's conversation, then this input (no instructions)."""
    history: list[dict[str, str]] = []
    if body.previous_response_id is not None:
        stored = ctx.responses.get(body.previous_response_id)
        if stored is None:
            raise APIError(f"No stored response {body.previous_response_id!r} (only responses created with "
                           "store: true are kept, and the oldest are dropped).", 404, "previous_response_id")
        if stored.response.status not in FINISHED:
            raise APIError(f"Response {body.previous_response_id!r} is {stored.response.status}: only a finished "
                           "response can be continued.", 400, "previous_response_id")
        history = list(stored.conversation)
    items = [InputMessage(role="user", content=body.input)] if isinstance(body.input, str) else body.input
    if not items:
        raise APIError("input must contain at least one message.", 400, "input")
    return history + [{"role": m.role, "content": _text(m)} for m in items]


def _text(message: InputMessage) -> str:
    return message.content if isinstance(message.content, str) else "\n".join(p.text for p in message.content)


def response_job(ctx: ServerContext, body: ResponsesRequest, messages: list[dict[str, str]]) -> Job:
    preprocess.check_model(ctx, body.model)
    system = [{"role": "system", "content": body.instructions}] if body.instructions is not None else []
    chat = [ChatMessage(role=m["role"], content=m["content"]) for m in system + messages]
    text = preprocess.render_chat(ctx, chat, ChatTemplateFields())
    ids = ctx.tokenizer(text, add_special_tokens=False)["input_ids"]
    logprobs = (body.top_logprobs or 0) if OUTPUT_LOGPROBS in (body.include or ()) else None
    # A background response is read as it goes (its status turns in_progress at its first token), as a stream is.
    fields = SamplingFields(temperature=1.0 if body.temperature is None else body.temperature,
                            top_p=1.0 if body.top_p is None else body.top_p, stream=body.stream or body.background)
    params = preprocess.sampling_params(ctx, fields, [ids], body.max_output_tokens, logprobs=logprobs)
    return Job(JobKind.RESPONSE, f"resp_{uuid.uuid4().hex}", int(time.time()), ctx.model_name, [ids], [text],
               params, stream=body.stream, priority=body.priority, logprobs=logprobs,
               chat_logprobs=logprobs is not None)


def _stores(body: ResponsesRequest) -> bool:
    """Whether the response is kept: store: true, or a background response (read later by its id)."""
    return body.store or body.background


def response_object(job: Job, body: ResponsesRequest, output: list[OutputMessage],
                    final: Optional[RequestOutput] = None) -> ResponseObject:
    """The response as it stands: in progress until `final` (the finished engine output) is given."""
    status, incomplete, usage = "in_progress", None, None
    if final is not None:
        choice = final.outputs[0]
        status = "incomplete" if choice.finish_reason == "length" else "completed"
        incomplete = IncompleteDetails(reason="max_output_tokens") if status == "incomplete" else None
        prompt, generated = len(job.prompts[0]), len(choice.token_ids)
        usage = ResponseUsage(input_tokens=prompt, output_tokens=generated, total_tokens=prompt + generated)
    return ResponseObject(
        id=job.id, created_at=job.created, status=status, incomplete_details=incomplete,
        instructions=body.instructions, max_output_tokens=body.max_output_tokens, model=job.model, output=output,
        previous_response_id=body.previous_response_id, store=_stores(body), temperature=body.temperature,
        top_p=body.top_p, metadata=body.metadata, user=body.user, usage=usage, background=body.background,
        top_logprobs=job.logprobs,
    )


def _finished_response(ctx: ServerContext, job: Job, body: ResponsesRequest, final: RequestOutput,
                      message_id: str) -> ResponseObject:
    """The response of a finished output: its message (with logprobs when asked for), usage, vLLM's raw messages."""
    choice = final.outputs[0]
    response = response_object(job, body, [], final)
    text = OutputText(text=choice.text, logprobs=_logprobs(ctx, job, choice))
    status = "incomplete" if response.status == "incomplete" else "completed"
    response.output = [OutputMessage(id=message_id, status=status, content=[text])]
    if body.enable_response_messages:
        response.input_messages = [RawMessage(message=job.prompt_texts[0], tokens=job.prompts[0])]
        response.output_messages = [RawMessage(message=choice.text, tokens=list(choice.token_ids))]
    return response


def _logprobs(ctx: ServerContext, job: Job, choice: CompletionOutput, start: int = 0
              ) -> Optional[list[ChatTokenLogprob]]:
    """The logprobs of choice's tokens [start:] (chat's shape, which the Responses API shares)."""
    if job.logprobs is None or choice.logprobs is None:
        return None
    ids, entries = choice.token_ids[start:], choice.logprobs[start:]
    return formatting.chat_logprobs(ctx.tokenizer, job, ids, entries).content


def _event_logprobs(ctx: ServerContext, job: Job, choice: CompletionOutput, start: int = 0) -> list[EventLogprob]:
    """A text event's logprobs: as the output text's, less the bytes."""
    return [EventLogprob(token=t.token, logprob=t.logprob,
                         top_logprobs=[EventTopLogprob(token=a.token, logprob=a.logprob) for a in t.top_logprobs])
            for t in _logprobs(ctx, job, choice, start) or ()]


# The engine ended the request without a finished output: only an abort from outside the request's own reader
# does that (the client's disconnect is its reader's), so the response failed on the server's side.
ENDED_EARLY = "The request was ended in the engine before its output was finished."


def _failed(job: Job, body: ResponsesRequest, message: OutputMessage) -> ResponseObject:
    response = response_object(job, body, [message])
    response.status, response.error = "failed", {"code": "server_error", "message": ENDED_EARLY}
    return response


def _message(message_id: str, text: str, status: str) -> OutputMessage:
    return OutputMessage(id=message_id, status=status, content=[OutputText(text=text)])


def _keep(ctx: ServerContext, body: ResponsesRequest, response: ResponseObject,
          messages: list[dict[str, str]], reply: str) -> None:
    if _stores(body):
        ctx.responses.put(response.id, StoredResponse(response, messages + [{"role": "assistant", "content": reply}]))


async def create(ctx: ServerContext, request: Request, body: ResponsesRequest) -> Response:
    if body.background and "store" in body.model_fields_set and not body.store:
        raise APIError("background can only be used when `store` is true", 400, "background")
    if body.background and body.stream:
        raise APIError("background responses are not streamed here: poll GET /v1/responses/{id}.", 400, "stream")
    messages = conversation(ctx, body)
    job = response_job(ctx, body, messages)
    if not ctx.engine.is_ready:
        raise APIError(ctx.engine.unavailable_reason, 503)
    if body.background:
        if len(ctx.background) >= ctx.max_background:
            raise APIError(f"{len(ctx.background)} background responses are in progress, the most this server runs "
                           "at once; retry when one has ended.", 503)
        response = response_object(job, body, [])
        response.status = "queued"
        responses_background.start(ctx, response, messages, _generate(ctx, job, body))
        return Response(response.model_dump_json(), media_type="application/json")
    if job.stream:
        return streaming.sse_response(ctx.engine, job, ctx.shutdown_timeout_s, _events(ctx, job, body, messages))
    finals = await streaming.collect(request, ctx.engine, job)
    if finals is None:  # the client is gone; nobody reads this
        return Response(status_code=499)
    final = finals.get(0)
    if final is None:
        raise APIError(ENDED_EARLY, 500)
    formatting.raise_for_output_error(final)
    response = _finished_response(ctx, job, body, final, f"msg_{uuid.uuid4().hex}")
    _keep(ctx, body, response, messages, final.outputs[0].text)
    return Response(response.model_dump_json(), media_type="application/json")


async def _generate(ctx: ServerContext, job: Job, body: ResponsesRequest) -> AsyncIterator[Optional[ResponseObject]]:
    """A background response's run: None as each output comes (its first turns it in_progress), then the finished
    response (server/responses_background.py keeps it). An error raises: the response fails."""
    final = None
    async for _, out in streaming.run_job(ctx.engine, job):
        formatting.raise_for_output_error(out)
        if out.finished:
            final = out
        yield None
    if final is None:
        raise APIError(ENDED_EARLY, 500)
    yield _finished_response(ctx, job, body, final, f"msg_{uuid.uuid4().hex}")


async def _events(ctx: ServerContext, job: Job, body: ResponsesRequest,
                  messages: list[dict[str, str]]) -> AsyncIterator[bytes]:
    """The Responses stream: lifecycle, the message item and its one text part, text deltas, then completion."""
    seq = itertools.count()
    item_id = f"msg_{uuid.uuid4().hex}"
    where = dict(item_id=item_id, output_index=0, content_index=0)
    yield _event(LifecycleEvent(type="response.created", sequence_number=next(seq),
                                response=response_object(job, body, [])))
    yield _event(LifecycleEvent(type="response.in_progress", sequence_number=next(seq),
                                response=response_object(job, body, [])))
    yield _event(OutputItemEvent(type="response.output_item.added", sequence_number=next(seq), output_index=0,
                                 item=OutputMessage(id=item_id, status="in_progress", content=[])))
    yield _event(ContentPartEvent(type="response.content_part.added", sequence_number=next(seq),
                                  part=OutputText(text=""), **where))
    text, num_tokens, final = "", 0, None
    try:
        async for _, out in streaming.run_job(ctx.engine, job):
            formatting.raise_for_output_error(out)
            choice = out.outputs[0]
            delta = choice.text[len(text):]
            logprobs = _event_logprobs(ctx, job, choice, num_tokens)
            if delta or logprobs:
                text, num_tokens = text + delta, len(choice.token_ids)
                yield _event(TextDeltaEvent(sequence_number=next(seq), delta=delta, logprobs=logprobs, **where))
            if out.finished:
                final = out
    except Exception as exc:  # after the 200 went out, errors travel as an event
        err = streaming.engine_error(exc)
        payload = {"type": "error", "sequence_number": next(seq), "code": str(err.status), "message": err.message,
                   "param": err.param}
        yield streaming.sse_event(json.dumps(payload, ensure_ascii=False), "error")
        return
    if final is None:  # OpenAI's end of a response that failed: response.failed, its error and partial output
        failed = _failed(job, body, _message(item_id, text, "incomplete"))
        yield _event(LifecycleEvent(type="response.failed", sequence_number=next(seq), response=failed))
        return
    response = _finished_response(ctx, job, body, final, item_id)
    message = response.output[0]
    yield _event(TextDoneEvent(sequence_number=next(seq), text=text,
                               logprobs=_event_logprobs(ctx, job, final.outputs[0]), **where))
    yield _event(ContentPartEvent(type="response.content_part.done", sequence_number=next(seq),
                                  part=message.content[0], **where))
    yield _event(OutputItemEvent(type="response.output_item.done", sequence_number=next(seq), output_index=0,
                                 item=message))
    # Also when max_output_tokens ended it (status "incomplete"): the openai client's stream helper finishes
    # on response.completed only (vLLM sends the same).
    yield _event(LifecycleEvent(type="response.completed", sequence_number=next(seq), response=response))
    _keep(ctx, body, response, messages, text)


def _event(event: Any) -> bytes:
    return streaming.sse_event(event.model_dump_json(), event.type)
