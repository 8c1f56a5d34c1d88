"""The baseline a user would write without pagedserve: HF transformers' `generate` behind /v1/completions.

One request at a time (an asyncio lock around `generate`), streaming token by
token through a transformers streamer, honouring max_tokens, temperature,
top_p, ignore_eos, stream and stream_options.include_usage, so that
benchmarks/serving.py can drive it exactly as it drives pagedserve.

    .venv/bin/python benchmarks/hf_server.py --port 8001            # default SmolLM2-135M-Instruct
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import threading
import time
import uuid
from pathlib import Path
from typing import Optional, Union

os.environ.setdefault("HF_HUB_OFFLINE", "1")
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # the repo root: engine.model_executor.loader's default model

import torch  # noqa: E402
from fastapi import FastAPI  # noqa: E402
from fastapi.responses import JSONResponse, StreamingResponse  # noqa: E402
from pydantic import BaseModel  # noqa: E402
from transformers.generation.streamers import BaseStreamer  # noqa: E402


class CompletionRequest(BaseModel):
    """The /v1/completions fields this baseline honours (others are accepted and ignored)."""

    model: Optional[str] = None
    prompt: Union[str, list[int]]
    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    ignore_eos: bool = False
    stream: bool = False
    stream_options: Optional[dict] = None
    seed: Optional[int] = None


class _QueueStreamer(BaseStreamer):
    """Hands each new token id from the generate thread to the event loop; None marks the end."""

    def __init__(self, loop: asyncio.AbstractEventLoop, queue: asyncio.Queue) -> None:
        self.loop, self.queue, self.prompt_seen = loop, queue, False

    def put(self, value: torch.Tensor) -> None:
        if not self.prompt_seen:  # generate() first puts the prompt itself
            self.prompt_seen = True
            return
        for token in value.reshape(-1).tolist():
            self.loop.call_soon_threadsafe(self.queue.put_nowait, token)

    def end(self) -> None:
        self.loop.call_soon_threadsafe(self.queue.put_nowait, None)


def create_app(model_dir: str, model_name: str, dtype: str = "float32") -> FastAPI:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=getattr(torch, dtype)).eval()
    lock = asyncio.Lock()  # HF generate serves one request at a time
    app = FastAPI()

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": model_name, "object": "model", "owned_by": "hf-baseline"}]}

    @app.get("/health")
    async def health():
        return {}

    @app.post("/v1/completions")
    async def completions(req: CompletionRequest):
        ids = req.prompt if isinstance(req.prompt, list) else tokenizer(req.prompt).input_ids
        input_ids = torch.tensor([ids])
        kwargs = dict(max_new_tokens=req.max_tokens, pad_token_id=tokenizer.eos_token_id)
        if req.ignore_eos:
            kwargs["min_new_tokens"] = req.max_tokens  # HF's way to keep EOS from ending generation
        if req.temperature > 0:
            kwargs.update(do_sample=True, temperature=req.temperature, top_p=req.top_p)
        else:
            kwargs.update(do_sample=False)
        cid, created = f"cmpl-{uuid.uuid4().hex}", int(time.time())
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue = asyncio.Queue()

        def run() -> None:
            try:
                if req.seed is not None:
                    torch.manual_seed(req.seed)
                with torch.inference_mode():
                    model.generate(input_ids=input_ids, attention_mask=torch.ones_like(input_ids),
                                   streamer=_QueueStreamer(loop, queue), **kwargs)
            except Exception:  # the end marker must arrive even if generate fails
                loop.call_soon_threadsafe(queue.put_nowait, None)
                raise

        async def tokens():
            """Yields (token ids so far, new text) per generated token, holding the lock throughout."""
            async with lock:
                thread = threading.Thread(target=run, daemon=True)
                thread.start()
                out: list[int] = []
                text = ""
                while (token := await queue.get()) is not None:
                    out.append(token)
                    full = tokenizer.decode(out, skip_special_tokens=True)
                    if full.endswith("\ufffd"):  # a partial UTF-8 character: wait for its other bytes
                        continue
                    delta, text = full[len(text):], full
                    yield out, delta
                await asyncio.to_thread(thread.join)

        def finish_reason(out: list[int]) -> str:
            return "length" if len(out) >= req.max_tokens else "stop"

        def usage(out: list[int]) -> dict:
            return {"prompt_tokens": len(ids), "completion_tokens": len(out), "total_tokens": len(ids) + len(out)}

        if not req.stream:
            out, text = [], ""
            async for out, delta in tokens():
                text += delta
            choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish_reason(out)}
            return JSONResponse({"id": cid, "object": "text_completion", "created": created, "model": model_name,
                                 "choices": [choice], "usage": usage(out)})

        async def events():
            out: list[int] = []
            finished = False
            async for out, delta in tokens():
                reason = finish_reason(out) if len(out) >= req.max_tokens else None
                finished = reason is not None
                choice = {"index": 0, "text": delta, "logprobs": None, "finish_reason": reason}
                yield _sse({"id": cid, "object": "text_completion", "created": created, "model": model_name,
                            "choices": [choice]})
            if not finished:  # ended on EOS, or the last token's text was held back
                choice = {"index": 0, "text": "", "logprobs": None, "finish_reason": finish_reason(out)}
                yield _sse({"id": cid, "object": "text_completion", "created": created, "model": model_name,
                            "choices": [choice]})
            if (req.stream_options or {}).get("include_usage"):
                yield _sse({"id": cid, "object": "text_completion", "created": created, "model": model_name,
                            "choices": [], "usage": usage(out)})
            yield "data: [DONE]\n\n"

        return StreamingResponse(events(), media_type="text/event-stream")

    return app


def _sse(payload: dict) -> str:
    return f"data: {json.dumps(payload)}\n\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="HF folder; default: pagedserve's converted SmolLM2-135M-Instruct")
    parser.add_argument("--served-model-name", default=None)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8001)
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    args = parser.parse_args()
    import uvicorn

    if args.model is None:
        from engine.model_executor.loader import default_model_path

        args.model = str(default_model_path())
    name = args.served_model_name or args.model.rstrip("/").split("/")[-1]
    uvicorn.run(create_app(args.model, name, args.dtype), host=args.host, port=args.port, log_level="warning")


if __name__ == "__main__":
    main()
