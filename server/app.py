"""create_app(engine): the FastAPI app around one AsyncLLMEngine; no module globals."""
from __future__ import annotations

from contextlib import asynccontextmanager
from typing import Any, AsyncIterator, Optional

from fastapi import FastAPI
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from engine.frontend.protocol import EngineClient
from server import __version__
from server.errors import error_response, install_error_handlers
from server.limits import integer_bounds
from server.context import ServerContext
from server.responses_background import cancel_all
from server.routes import build_router, stream_chunk_schemas

MAX_BODY_BYTES = 1 << 20  # 1 MiB: far above any prompt that fits the context
# With an API key, these and every /v1/ path need it (as in vLLM): what reads the tokenizer or runs the engine.
# /health, /version and /metrics stay open for probes and scrapers.
KEYED_PATHS = ("/tokenize", "/detokenize")


class GuardMiddleware:
    """Pure ASGI (streams and disconnects pass through untouched): body size limit and the API key."""

    def __init__(self, app: ASGIApp, api_key: Optional[str], max_body_bytes: int) -> None:
        self.app = app
        self.api_key = api_key
        self.max_body_bytes = max_body_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope.get("headers", [])}
        if self.api_key and (scope["path"].startswith("/v1/") or scope["path"] in KEYED_PATHS):
            if headers.get("authorization", "") != f"Bearer {self.api_key}":
                return await error_response("Invalid or missing API key.", 401)(scope, receive, send)
        length = headers.get("content-length", "")
        if length.isdigit() and int(length) > self.max_body_bytes:
            message = f"The request body is {length} bytes; the limit is {self.max_body_bytes}."
            return await error_response(message, 413)(scope, receive, send)
        if not length.isdigit() and headers.get("transfer-encoding", "").lower() == "chunked":
            # No length announced: read the body up to the limit here, or a streamed body slips past it.
            body = await self._read_capped(receive)
            if body is None:
                message = f"The request body is over the limit of {self.max_body_bytes} bytes."
                return await error_response(message, 413)(scope, receive, send)
            receive = _replay(body, receive)
        return await self.app(scope, receive, send)

    async def _read_capped(self, receive: Receive) -> Optional[bytes]:
        """The whole body, or None once it passes max_body_bytes (or the client left)."""
        chunks, size, more = [], 0, True
        while more:
            message = await receive()
            if message["type"] != "http.request":
                return None
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > self.max_body_bytes:
                return None
            chunks.append(chunk)
            more = message.get("more_body", False)
        return b"".join(chunks)


def _replay(body: bytes, receive: Receive) -> Receive:
    """A receive that hands the app the body already read, then the client's later messages (disconnect)."""
    sent = False

    async def replay() -> Message:
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()

    return replay


def create_app(
    engine: EngineClient,
    *,
    api_key: Optional[str] = None,
    served_model_name: Optional[str] = None,
    max_body_bytes: int = MAX_BODY_BYTES,
    shutdown_timeout_s: float = 10.0,
    chat_template: Optional[str] = None,
    tool_call_parser: str = "hermes",
    reasoning_parser: Optional[str] = None,
    enable_prompt_tokens_details: bool = False,
    default_sampling: Optional[dict[str, Any]] = None,
) -> FastAPI:
    """The OpenAI-compatible app serving `engine` (an AsyncLLMEngine, or anything else that is an EngineClient)."""
    ctx = ServerContext(
        engine=engine,
        model_name=served_model_name or engine.config.model_name,
        max_model_len=engine.config.max_model_len,
        vocab_size=engine.vocab_size,
        api_key=api_key,
        shutdown_timeout_s=shutdown_timeout_s,
        chat_template=chat_template,
        tool_call_parser=tool_call_parser,
        reasoning_parser=reasoning_parser,
        enable_prompt_tokens_details=enable_prompt_tokens_details,
        default_sampling=dict(default_sampling or {}),
    )

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        engine.start()
        yield
        await engine.shutdown(shutdown_timeout_s)
        cancel_all(ctx)  # background responses the shutdown ended (or that never reached the engine)

    app = FastAPI(title="pagedserve", version=__version__, lifespan=lifespan,
                  description="OpenAI-compatible LLM server with a paged KV cache.")
    app.state.ctx = ctx
    install_error_handlers(app)
    app.include_router(build_router())
    app.add_middleware(GuardMiddleware, api_key=api_key, max_body_bytes=max_body_bytes)
    app.openapi = lambda: _openapi_without_422(app)
    return app


def _openapi_without_422(app: FastAPI) -> dict[str, Any]:
    """FastAPI's schema, less the 422 it documents on every route (this server answers validation errors with
    400), plus the stream chunk models the SSE events reference."""
    if app.openapi_schema is None:
        from fastapi.openapi.utils import get_openapi

        schema = get_openapi(title=app.title, version=app.version, description=app.description, routes=app.routes)
        for methods in schema.get("paths", {}).values():
            for op in methods.values():
                op.get("responses", {}).pop("422", None)
        components = schema.setdefault("components", {}).setdefault("schemas", {})
        for name in ("HTTPValidationError", "ValidationError"):
            components.pop(name, None)
        for name, chunk_schema in stream_chunk_schemas().items():  # what the SSE `data:` lines hold
            components.setdefault(name, chunk_schema)
        app.openapi_schema = integer_bounds(schema)
    return app.openapi_schema

