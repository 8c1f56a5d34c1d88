"""Background responses (POST /v1/responses with background: true): a task of the server generates the response
while the client polls GET /v1/responses/{id}; POST /v1/responses/{id}/cancel ends it, and its KV blocks."""
from __future__ import annotations

import asyncio
import logging
from typing import AsyncIterator, Optional

from server import streaming
from server.context import ServerContext, StoredResponse
from server.errors import APIError
from server.protocol_responses import ResponseObject

logger = logging.getLogger(__name__)

CANCELLABLE = ("queued", "in_progress")


def start(ctx: ServerContext, response: ResponseObject, messages: list[dict[str, str]],
          run: AsyncIterator[Optional[ResponseObject]]) -> None:
    """Keep the queued `response` and run it: `run` yields None per engine output, then the finished response.
    The task is held in ctx.background until it ends (the event loop keeps only weak references to tasks)."""
    stored = StoredResponse(response, list(messages))
    ctx.responses.put(response.id, stored)
    task = asyncio.get_running_loop().create_task(_run(stored, run), name=f"background-{response.id}")
    ctx.background[response.id] = (task, stored)
    task.add_done_callback(lambda _: ctx.background.pop(response.id, None))


async def _run(stored: StoredResponse, run: AsyncIterator[Optional[ResponseObject]]) -> None:
    """The stored response goes queued -> in_progress (its first token) -> the finished response, or failed.
    Cancelled (the cancel route set its status), the engine request is aborted as the task unwinds (run_job)."""
    response = stored.response
    try:
        async for item in run:
            if item is None:
                if response.status == "queued":
                    response.status = "in_progress"
                continue
            stored.response = item  # (in place: a response deleted or dropped from the store stays gone)
            stored.conversation.append({"role": "assistant", "content": item.output[0].content[0].text})
    except Exception as exc:  # the engine failed it, or it is shutting down: the response fails, with why
        err = streaming.engine_error(exc)
        if err.status >= 500:
            logger.warning("background response %s failed: %s", response.id, err.message)
        response.status = "failed"
        response.error = {"code": "server_error" if err.status >= 500 else "invalid_prompt", "message": err.message}


def get(ctx: ServerContext, response_id: str) -> Optional[StoredResponse]:
    """A stored response, or a background one still running that the store has dropped."""
    stored = ctx.responses.get(response_id)
    if stored is None and response_id in ctx.background:
        stored = ctx.background[response_id][1]
    return stored


async def cancel(ctx: ServerContext, response_id: str) -> ResponseObject:
    """Mark a running background response cancelled and end its task; its engine request is aborted before this
    returns (the blocks go back at the engine's next step)."""
    running = ctx.background.get(response_id)
    stored = running[1] if running is not None else ctx.responses.get(response_id)
    if stored is None:
        raise APIError(f"No stored response {response_id!r}.", 404, "response_id")
    status = stored.response.status
    if running is None or running[0].done() or status not in CANCELLABLE:
        raise APIError(f"Response {response_id!r} is {status}: only a background response that is queued or in "
                       "progress can be cancelled.", 400, "response_id")
    task = running[0]
    stored.response.status = "cancelled"
    task.cancel()
    await asyncio.wait([task])  # (not `await task`: its CancelledError is not this handler's)
    return stored.response


def discard(ctx: ServerContext, response_id: str) -> bool:
    """DELETE of a background response still running: its task ends (its engine request aborted)."""
    running = ctx.background.pop(response_id, None)
    if running is not None:
        running[0].cancel()
    return running is not None


def cancel_all(ctx: ServerContext) -> None:
    """At shutdown, after the engine stopped: end the tasks still running."""
    for task, _ in list(ctx.background.values()):
        task.cancel()
