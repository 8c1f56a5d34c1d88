"""All streaming in one place: merging engine streams, SSE framing, usage chunk, abort on disconnect."""
from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from dataclasses import dataclass
from typing import Any, AsyncIterator, Optional, Union

from fastapi import Request
from pydantic import BaseModel
from sse_starlette.sse import EventSourceResponse

from engine.frontend.async_engine import EngineDeadError, RequestFailedError
from engine.sequence import RequestOutput
from server import formatting, reasoning, tools
from server.errors import APIError, error_body
from server.protocol import (
    ChatCompletionStreamResponse, ChatDelta, ChatLogprobs, ChatStreamChoice, CompletionStreamChoice,
    CompletionStreamResponse, UsageInfo,
)
from server.job import Job, JobKind

logger = logging.getLogger(__name__)

DONE = "[DONE]"
PING_INTERVAL_S = 15  # SSE comments (": ping"): ignored by the openai client and `data:` parsers
DISCONNECT_POLL_S = 0.1
SHUTDOWN_GRACE_MARGIN_S = 5.0


async def run_job(engine: Any, job: Job) -> AsyncIterator[tuple[int, RequestOutput]]:
    """Yield (prompt_index, RequestOutput) from every prompt's engine request; abort them all if left early."""
    request_ids = [job.request_id(i) for i in range(len(job.prompts))]
    if len(request_ids) == 1:  # one prompt (the usual request): its stream as it is, no task and queue between
        try:
            async with contextlib.aclosing(engine.generate(request_ids[0], prompt_token_ids=job.prompts[0],
                                                           params=job.params, priority=job.priority,
                                                           grammar=job.grammar)) as stream:
                async for out in stream:
                    yield 0, out
        finally:
            engine.abort(request_ids)  # a no-op for a request that finished
        return
    unread = _Unread()

    async def pump(i: int) -> None:
        try:
            async for out in engine.generate(request_ids[i], prompt_token_ids=job.prompts[i], params=job.params,
                                             priority=job.priority, grammar=job.grammar):
                unread.put(i, out)
        except Exception as exc:  # EngineDeadError, a ValueError from add_request
            unread.put(i, exc)
        finally:
            unread.put(i, None)

    tasks = [asyncio.create_task(pump(i)) for i in range(len(job.prompts))]
    try:
        remaining = len(tasks)
        while remaining:
            i, item = await unread.get()
            if item is None:
                remaining -= 1
            elif isinstance(item, Exception):
                raise item
            else:
                yield i, item
    finally:
        for task in tasks:
            task.cancel()
        engine.abort(request_ids)  # a no-op for requests that finished


class _Unread:
    """What a job's prompts produced that its reader has not taken, merged as one prompt's stream merges it
    (engine/frontend/async_engine.py _RequestStream): a RequestOutput holds all of its prompt's output so far, so
    a newer one replaces an unread one. A slow reader of many prompts holds one output a prompt, not one a step
    (which grew with the output's length squared). Errors, ends (None) and finished outputs are never replaced."""

    def __init__(self) -> None:
        self._items: dict[int, list] = {}  # prompt index -> its unread items; prompts in the order they got them
        self._ready = asyncio.Event()

    def put(self, i: int, item: Union[RequestOutput, Exception, None]) -> None:
        items = self._items.setdefault(i, [])
        if items and isinstance(item, RequestOutput) and isinstance(items[-1], RequestOutput) \
                and not items[-1].finished:
            items[-1] = item
        else:
            items.append(item)
        self._ready.set()

    async def get(self) -> tuple[int, Union[RequestOutput, Exception, None]]:
        while not self._items:
            self._ready.clear()
            await self._ready.wait()
        i, items = next(iter(self._items.items()))
        item = items.pop(0)
        if not items:
            del self._items[i]
        return i, item


def engine_error(exc: Exception) -> APIError:
    if isinstance(exc, APIError):
        return exc
    if isinstance(exc, EngineDeadError):
        return APIError(str(exc), 503)
    if isinstance(exc, RequestFailedError):  # its message names the stage and the exception's class
        return APIError(str(exc), 500)
    if isinstance(exc, ValueError):
        return APIError.from_value_error(exc)
    return APIError(f"{type(exc).__name__}: {exc}", 500)


async def collect(request: Request, engine: Any, job: Job) -> Optional[dict[int, RequestOutput]]:
    """Run a non-streamed job to the end; None (and every request aborted) if the client disconnects first."""

    async def consume() -> dict[int, RequestOutput]:
        finals: dict[int, RequestOutput] = {}
        async for i, out in run_job(engine, job):
            if out.finished:
                finals[i] = out
        return finals

    async def client_gone() -> None:
        while not await request.is_disconnected():
            await asyncio.sleep(DISCONNECT_POLL_S)

    work, watcher = asyncio.create_task(consume()), asyncio.create_task(client_gone())
    try:
        await asyncio.wait({work, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:  # also when this handler itself is cancelled
        watcher.cancel()
        if not work.done():
            work.cancel()
    if not work.done() or work.cancelled():
        try:
            await work
        except (asyncio.CancelledError, Exception):
            pass
        logger.info("client disconnected; aborted %s", job.id)
        return None
    try:
        return work.result()
    except Exception as exc:
        raise engine_error(exc) from exc


@dataclass
class _ChoiceState:
    started: bool = False  # the first chunk (echo prefix) went out
    text_len: int = 0
    num_tokens: int = 0
    finished: bool = False
    tools: Optional[tools.ToolStream] = None  # a chat with tools: what of the text may go out
    reasoning: Optional[reasoning.ReasoningStream] = None  # --reasoning-parser: the reply's split so far


class _SSEResponse(EventSourceResponse):
    """sse-starlette's response, less its per-event cancel scope when no send timeout is set (none is here).

    EventSourceResponse wraps every send in anyio.move_on_after(send_timeout), a cancel scope entered and left
    even for a timeout of None: ~5 % of the API server's event loop at 256 streams (py-spy, docs/benchmarks.md).
    A stalled client costs nothing here either way: uvicorn's send only waits while the socket's buffer is full,
    and a client that leaves is seen by the disconnect listener, which cancels the stream."""

    async def _send_with_timeout(self, send: Any, message: dict) -> None:
        if self.send_timeout is None:
            await send(message)
        else:
            await super()._send_with_timeout(send, message)


def sse_response(engine: Any, job: Job, shutdown_timeout_s: float, events: Optional[AsyncIterator[bytes]] = None
                 ) -> EventSourceResponse:
    """The SSE response of a streamed job (its chunk events unless `events` is given): events are sse_event bytes."""
    # On SIGTERM sse-starlette cancels open streams at once (the client sees the connection drop, no [DONE])
    # unless given a grace period. The engine itself ends what is left at the shutdown deadline, and this
    # generator then sends the 503 error event and [DONE]; the grace only has to outlast that deadline.
    return _SSEResponse(events or _events(engine, job), sep="\n", ping=PING_INTERVAL_S,
                        shutdown_grace_period=shutdown_timeout_s + SHUTDOWN_GRACE_MARGIN_S)


async def _events(engine: Any, job: Job) -> AsyncIterator[bytes]:
    """`data: {json}` events: one choice per chunk, finish_reason once per choice, usage, then [DONE]."""
    tokenizer = engine.tokenizer
    chunks = ChunkJSON(job)
    states: dict[int, _ChoiceState] = {}
    finals: dict[int, RequestOutput] = {}
    try:
        if job.kind is JobKind.CHAT:
            usage = _running_usage(job, 0, 0)
            for j in range(job.params.n):
                if job.return_token_ids:  # vLLM: the prompt's ids ride on each choice's first (role) chunk
                    role = _chat_chunk(job, j, ChatDelta(role="assistant", content=""), usage=usage)
                    role.prompt_token_ids = job.prompts[0]
                    yield data(role)
                else:
                    yield sse_event(chunks.chat(j, "", None, None, usage, role="assistant"))
                if job.echo_text:
                    yield sse_event(chunks.chat(j, job.echo_text, None, None, usage))
        async for i, out in run_job(engine, job):
            formatting.raise_for_output_error(out)
            if out.finished:
                finals[i] = out
            for c in out.outputs:
                index = job.choice_index(i, c.index)
                state = states.get(index)
                if state is None:
                    state = states[index] = _ChoiceState()
                chunk = _choice_delta(tokenizer, job, chunks, i, out, c, index, state)
                if chunk is not None:
                    yield sse_event(chunk)
        if job.include_usage:
            yield data(_envelope(job, [], formatting.usage(job, finals)))
    except Exception as exc:  # after the 200 went out, errors travel as an event
        err = engine_error(exc)
        yield sse_event(json.dumps(error_body(err.message, err.status, err.param), ensure_ascii=False))
    yield sse_event(DONE)


def _choice_delta(
    tokenizer: Any, job: Job, chunks: "ChunkJSON", i: int, out: RequestOutput, c: Any, index: int, state: _ChoiceState
) -> Optional[str]:
    """The chunk's JSON for what choice c gained since the last one, or None when nothing changed."""
    if state.finished:
        return None
    text = c.text[state.text_len:]
    reason = c.finish_reason
    tool_deltas = None
    thought = None
    content = c.text  # the reply's content so far: all of it, or what follows the reasoning
    if job.reasoning is not None:  # a tail that may be a <think> tag is held back (server/reasoning.py)
        if state.reasoning is None:
            state.reasoning = reasoning.ReasoningStream(job.reasoning)
        thought, text = state.reasoning.feed(c.text, final=reason is not None)
        content = state.reasoning.content
    if job.tools is not None:  # text that may be a tool call is held back (server/tools.py)
        if state.tools is None:
            state.tools = tools.ToolStream(job.tools)
        text = state.tools.feed(content)
        if reason is not None:
            rest, deltas, reason = state.tools.finish(content, reason)
            text, tool_deltas = text + rest, deltas or None
    if job.reasoning is not None or job.tools is not None:
        state.text_len = len(c.text)  # what was held back is the parsers' to send
    prefix = job.prompt_texts[i] if job.echo and job.kind is JobKind.COMPLETION and not state.started else ""
    logprobs = None
    if job.logprobs is not None and (len(c.token_ids) > state.num_tokens or prefix):
        offset = (len(job.prompt_texts[i]) if job.echo else 0) + state.text_len
        logprobs = formatting.output_logprobs(tokenizer, job, c, state.num_tokens, offset)
        if prefix:
            logprobs = formatting.concat_logprobs(formatting.echo_logprobs(tokenizer, job, out, i), logprobs)
    # return_token_ids: the ids this chunk adds (also when the text they make is still held back, as vLLM)
    token_ids = c.token_ids[state.num_tokens:] if job.return_token_ids else None
    if not text and not thought and not prefix and reason is None and logprobs is None and not token_ids:
        return None
    first = not state.started
    state.started, state.text_len, state.num_tokens = True, len(c.text), len(c.token_ids)
    state.finished = reason is not None
    usage = _running_usage(job, i, len(c.token_ids))
    if job.kind is JobKind.CHAT:
        if logprobs is None and tool_deltas is None and token_ids is None and not thought:
            return chunks.chat(index, text, reason, c.stop_reason, usage)  # the usual chunk, its JSON written directly
        delta = ChatDelta(content=text if text or (tool_deltas is None and not thought) else None,
                          reasoning_content=thought or None, tool_calls=tool_deltas)
        chat_chunk = _chat_chunk(job, index, delta, logprobs, reason, c.stop_reason, usage)
        chat_chunk.choices[0].token_ids = token_ids
        return chat_chunk.model_dump_json()
    if logprobs is None and token_ids is None:
        return chunks.completion(index, prefix + text, reason, c.stop_reason, usage)
    choice = CompletionStreamChoice(index=index, text=prefix + text, logprobs=logprobs, finish_reason=reason,
                                    stop_reason=c.stop_reason, token_ids=token_ids,
                                    prompt_token_ids=job.prompts[i] if token_ids is not None and first else None)
    return _envelope(job, [choice], usage).model_dump_json()


def _running_usage(job: Job, prompt_index: int, num_tokens: int) -> Optional[UsageInfo]:
    """continuous_usage_stats: the chunk's prompt and the tokens of its choice so far (vLLM's per-chunk usage)."""
    if not job.continuous_usage:
        return None
    prompt = len(job.prompts[prompt_index])
    return UsageInfo(prompt_tokens=prompt, completion_tokens=num_tokens, total_tokens=prompt + num_tokens)


def _chat_chunk(job: Job, index: int, delta: ChatDelta, logprobs: Optional[ChatLogprobs] = None,
                reason: Optional[str] = None, stop_reason: Any = None,
                usage: Optional[UsageInfo] = None) -> ChatCompletionStreamResponse:
    choice = ChatStreamChoice(index=index, delta=delta, logprobs=logprobs, finish_reason=reason,
                              stop_reason=stop_reason)
    return ChatCompletionStreamResponse(id=job.id, created=job.created, model=job.model, choices=[choice],
                                        usage=usage)


def _envelope(job: Job, choices: list, usage: Optional[UsageInfo] = None
              ) -> Union[ChatCompletionStreamResponse, CompletionStreamResponse]:
    model = ChatCompletionStreamResponse if job.kind is JobKind.CHAT else CompletionStreamResponse
    return model(id=job.id, created=job.created, model=job.model, choices=choices, usage=usage)


def data(payload: BaseModel) -> bytes:
    """One SSE event of a response model (None fields kept: OpenAI's chunks carry `"logprobs": null`)."""
    return sse_event(payload.model_dump_json())


def sse_event(data: str, event: Optional[str] = None) -> bytes:
    """One SSE event's bytes: `event: <name>` when given, then `data: <data>`, then the blank line. `data` is one
    line (JSON, or [DONE]): sse_json escapes the line breaks JSON leaves raw."""
    data = sse_json(data)
    if event is None:
        return f"data: {data}\n\n".encode()
    return f"event: {event}\ndata: {data}\n\n".encode()


_json_str = json.encoder.encode_basestring  # C; the same JSON for a str as pydantic's (tests/unit/test_streaming_json.py)


def _json_scalar(value: Union[int, str, None]) -> str:
    if value is None:
        return "null"
    return _json_str(value) if isinstance(value, str) else str(int(value))


class ChunkJSON:
    """The JSON of a job's usual chunks (text, finish and stop reason, usage; no logprobs, no tool calls), written
    directly: byte for byte what model_dump_json gives for the same CompletionStreamResponse or
    ChatCompletionStreamResponse, at a tenth of the cost (building and dumping the models was ~12 us a chunk, ~10 %
    of the event loop at 256 streams)."""

    def __init__(self, job: Job) -> None:
        kind = "chat.completion.chunk" if job.kind is JobKind.CHAT else "text_completion"
        self._head = (f'{{"id":{_json_str(job.id)},"object":"{kind}","created":{int(job.created)},'
                      f'"model":{_json_str(job.model)},"choices":[{{"index":')

    def completion(self, index: int, text: str, reason: Optional[str], stop_reason: Union[int, str, None],
                   usage: Optional[UsageInfo]) -> str:
        return (f'{self._head}{index},"text":{_json_str(text)},"logprobs":null,"finish_reason":'
                f'{_json_scalar(reason)},"stop_reason":{_json_scalar(stop_reason)}}}],"usage":{_usage(usage)}}}')

    def chat(self, index: int, content: str, reason: Optional[str], stop_reason: Union[int, str, None],
             usage: Optional[UsageInfo], role: Optional[str] = None) -> str:
        return (f'{self._head}{index},"delta":{{"role":{_json_scalar(role)},"content":{_json_str(content)},'
                f'"tool_calls":null}},"logprobs":null,"finish_reason":{_json_scalar(reason)},'
                f'"stop_reason":{_json_scalar(stop_reason)}}}],"usage":{_usage(usage)}}}')


def _usage(usage: Optional[UsageInfo]) -> str:
    if usage is None:
        return "null"
    return (f'{{"prompt_tokens":{usage.prompt_tokens},"completion_tokens":{usage.completion_tokens},'
            f'"total_tokens":{usage.total_tokens}}}')


# JSON leaves U+0085, U+2028 and U+2029 raw, and str.splitlines() (httpx's aiter_lines, many SSE readers)
# breaks lines at them: escaped, every `data:` line stays one JSON document for such clients too.
_LINE_BREAKS = str.maketrans({"\x85": "\\u0085", "\u2028": "\\u2028", "\u2029": "\\u2029"})


def sse_json(text: str) -> str:
    """A JSON document safe as one SSE `data:` line for every line splitter."""
    # (str.translate walks every character through the table: ~7 % of the event loop's time at 256 streams;
    # three searches cost a fraction of that, and the characters are rare)
    if "\x85" in text or "\u2028" in text or "\u2029" in text:
        return text.translate(_LINE_BREAKS)
    return text
