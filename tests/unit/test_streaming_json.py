"""The streamed chunks written without pydantic (server/streaming.ChunkJSON) are byte for byte the models' JSON, and
sse_event frames an event as sse-starlette does."""
from __future__ import annotations

import json
import random
from typing import Optional, Union

import pytest
from sse_starlette.event import ServerSentEvent

from engine.sampling_params import SamplingParams
from server.job import Job, JobKind
from server.protocol import (
    ChatCompletionStreamResponse, ChatDelta, ChatStreamChoice, CompletionStreamChoice, CompletionStreamResponse,
    UsageInfo,
)
from server.streaming import ChunkJSON, sse_event


def _job(kind: JobKind, job_id: str = "cmpl-1", model: str = "m") -> Job:
    return Job(kind=kind, id=job_id, created=1764000000, model=model, prompts=[[1]], prompt_texts=["x"],
               params=SamplingParams())


def _texts(n: int, seed: int = 0) -> list[str]:
    """Strings a detokenizer may give: ASCII with quotes, backslashes and every control character, other planes,
    U+2028 / U+0085 (the line breaks sse_json escapes), empty."""
    rng = random.Random(seed)
    pool = [lambda: chr(rng.randrange(0, 0x80)), lambda: chr(rng.randrange(0x80, 0xD800)),
            lambda: chr(rng.randrange(0xE000, 0x110000)), lambda: rng.choice('"\\\n\r\t\b\f\x00\x1f\x7f\u2028\x85')]
    return ["", "Hello, world", "\u00e9\u4e2d\U0001f600"] + [
        "".join(rng.choice(pool)() for _ in range(rng.randrange(0, 8))) for _ in range(n)]


REASONS: list[tuple[Optional[str], Union[int, str, None]]] = [
    (None, None), ("stop", None), ("stop", 2), ("stop", "</s>\n\"q\""), ("length", None)]
USAGES = [None, UsageInfo(prompt_tokens=5, completion_tokens=0, total_tokens=5),
          UsageInfo(prompt_tokens=128, completion_tokens=77, total_tokens=205)]


@pytest.mark.parametrize("job_id,model", [("cmpl-1", "m"), ('a"b\\c\u00e9', "org/Model \u4e2d")])
def test_completion_chunk_is_the_models_json(job_id: str, model: str) -> None:
    job = _job(JobKind.COMPLETION, job_id, model)
    chunks = ChunkJSON(job)
    for k, text in enumerate(_texts(400)):
        reason, stop = REASONS[k % len(REASONS)]
        usage = USAGES[k % len(USAGES)]
        want = CompletionStreamResponse(
            id=job.id, created=job.created, model=job.model, usage=usage,
            choices=[CompletionStreamChoice(index=k % 3, text=text, finish_reason=reason, stop_reason=stop)])
        assert chunks.completion(k % 3, text, reason, stop, usage) == want.model_dump_json()


@pytest.mark.parametrize("role", [None, "assistant"])
def test_chat_chunk_is_the_models_json(role: Optional[str]) -> None:
    job = _job(JobKind.CHAT, "chatcmpl-\u00e9")
    chunks = ChunkJSON(job)
    for k, text in enumerate(_texts(400, seed=1)):
        reason, stop = REASONS[k % len(REASONS)]
        usage = USAGES[k % len(USAGES)]
        choice = ChatStreamChoice(index=k % 2, delta=ChatDelta(role=role, content=text), finish_reason=reason,
                                  stop_reason=stop)
        want = ChatCompletionStreamResponse(id=job.id, created=job.created, model=job.model, choices=[choice],
                                            usage=usage)
        assert chunks.chat(k % 2, text, reason, stop, usage, role=role) == want.model_dump_json()


def test_sse_event_frames_as_sse_starlette() -> None:
    for data, event in [("[DONE]", None), ('{"a":"b"}', None), ('{"type":"x"}', "response.output_text.delta"),
                        ('{"t":"\u2028\x85"}', "error")]:
        framed = sse_event(data, event)
        escaped = data.replace("\u2028", "\\u2028").replace("\x85", "\\u0085")
        assert framed == ServerSentEvent(data=escaped, event=event, sep="\n").encode()
        # every data line is one JSON document, whatever the reader splits lines at
        for line in framed.decode().splitlines():
            if line.startswith("data: {"):
                json.loads(line[len("data: "):])
