"""Thin handlers: validate -> Job -> engine -> JSON or SSE. The work lives in preprocess/streaming/formatting."""
from __future__ import annotations

from typing import Any, Union

from fastapi import APIRouter, Request, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from pydantic import BaseModel
from pydantic.json_schema import models_json_schema

from server import __version__, formatting, preprocess, responses, responses_background, streaming
from server.context import ServerContext
from server.errors import APIError, error_response
from server.job import Job
from server.protocol import (
    ChatCompletionRequest, ChatCompletionResponse, ChatCompletionStreamResponse, CompletionRequest, CompletionResponse,
    CompletionStreamResponse, DetokenizeRequest,
    DetokenizeResponse, ErrorResponse, ModelCard, ModelList, TokenizeRequest, TokenizeResponse, VersionResponse,
)
from server.protocol_responses import (
    ContentPartEvent, LifecycleEvent, OutputItemEvent, ResponseDeleted, ResponseObject, ResponsesRequest, TextDeltaEvent,
    TextDoneEvent,
)

# Documented on every route that takes a body; the handlers in errors.py produce these shapes.
ERRORS: dict[Union[int, str], dict[str, Any]] = {
    code: {"model": ErrorResponse, "description": text}
    for code, text in [(400, "Bad request"), (401, "Missing or wrong API key"), (404, "Unknown model"),
                       (413, "Request body too large"),
                       (503, "Engine not ready, dead, shutting down, or out of capacity (retry later)")]
}
# The routes that run the engine: a step running the request, or its admission, raised (the others go on).
ENGINE_ERRORS = {**ERRORS, 500: {"model": ErrorResponse, "description": "The engine failed on this request"}}
# What each route streams when stream=true: every `data:` line is the JSON of one of its chunk models, or of an
# error body `{"error": {...}}` that ends the stream; completions and chat end with `data: [DONE]`.
STREAM_CHUNKS: dict[str, list[type[BaseModel]]] = {
    "/v1/completions": [CompletionStreamResponse],
    "/v1/chat/completions": [ChatCompletionStreamResponse],
    "/v1/responses": [LifecycleEvent, OutputItemEvent, ContentPartEvent, TextDeltaEvent, TextDoneEvent],
}


def _sse(path: str) -> dict[Union[int, str], dict[str, Any]]:
    """The 200 of a route that answers JSON, or SSE events whose `data` is one of its chunk models."""
    refs = [{"$ref": f"#/components/schemas/{m.__name__}"} for m in [*STREAM_CHUNKS[path], ErrorResponse]]
    data = {"anyOf": [{"type": "string", "contentMediaType": "application/json", "contentSchema": {"oneOf": refs}},
                      {"const": streaming.DONE}]}
    event = {"type": "object", "properties": {"data": data, "event": {"type": "string"}}, "required": ["data"]}
    return {200: {"content": {"text/event-stream": {"schema": event}}, "description": "JSON, or SSE events when stream=true"}}


def stream_chunk_schemas() -> dict[str, Any]:
    """The JSON schemas of every stream chunk model (and the models they use), for the app's components."""
    models = [m for chunks in STREAM_CHUNKS.values() for m in chunks]
    _, defs = models_json_schema([(m, "serialization") for m in models], ref_template="#/components/schemas/{model}")
    return defs.get("$defs", {})


def _ctx(request: Request) -> ServerContext:
    return request.app.state.ctx


async def create_completion(body: CompletionRequest, request: Request) -> Response:
    ctx = _ctx(request)
    ctx.warn_unknown_fields("/v1/completions", body)
    return await _serve(request, ctx, preprocess.completion_job(ctx, body))


async def create_chat_completion(body: ChatCompletionRequest, request: Request) -> Response:
    ctx = _ctx(request)
    ctx.warn_unknown_fields("/v1/chat/completions", body)
    return await _serve(request, ctx, preprocess.chat_job(ctx, body))


async def create_response(body: ResponsesRequest, request: Request) -> Response:
    ctx = _ctx(request)
    ctx.warn_unknown_fields("/v1/responses", body)
    return await responses.create(ctx, request, body)


async def get_response(response_id: str, request: Request) -> ResponseObject:
    stored = responses_background.get(_ctx(request), response_id)
    if stored is None:
        raise APIError(f"No stored response {response_id!r}.", 404, "response_id")
    return stored.response


async def cancel_response(response_id: str, request: Request) -> ResponseObject:
    return await responses_background.cancel(_ctx(request), response_id)


async def delete_response(response_id: str, request: Request) -> ResponseDeleted:
    ctx = _ctx(request)
    running = responses_background.discard(ctx, response_id)
    if not ctx.responses.delete(response_id) and not running:
        raise APIError(f"No stored response {response_id!r}.", 404, "response_id")
    return ResponseDeleted(id=response_id)


async def _serve(request: Request, ctx: ServerContext, job: Job) -> Response:
    if not ctx.engine.is_ready:
        raise APIError(ctx.engine.unavailable_reason, 503)
    if job.params.guided is not None:
        try:  # compiled off the event loop, before the engine sees the request (cached by spec)
            job.grammar = await ctx.engine.compile_grammar(job.params.guided)
        except ValueError as exc:  # GrammarError: the schema, regex or grammar is invalid
            raise APIError(f"{job.guided_param}: {exc}", 400, job.guided_param) from None
    if job.stream:
        return streaming.sse_response(ctx.engine, job, ctx.shutdown_timeout_s)
    finals = await streaming.collect(request, ctx.engine, job)
    if finals is None:  # the client is gone; nobody reads this
        return Response(status_code=499)
    body = formatting.full_response(ctx.tokenizer, job, finals)
    return Response(body.model_dump_json(), media_type="application/json")


async def list_models(request: Request) -> ModelList:
    ctx = _ctx(request)
    card = ModelCard(id=ctx.model_name, created=ctx.created, max_model_len=ctx.max_model_len)
    return ModelList(data=[card])


async def health(request: Request) -> Response:
    engine = _ctx(request).engine
    if engine.is_ready:
        return Response(status_code=200)
    return error_response(engine.unavailable_reason, 503)  # the body openapi.yaml documents


async def version() -> VersionResponse:
    return VersionResponse(version=__version__)


async def tokenize(body: TokenizeRequest, request: Request) -> TokenizeResponse:
    ctx = _ctx(request)
    ctx.warn_unknown_fields("/tokenize", body)
    preprocess.check_model(ctx, body.model)
    if (body.prompt is None) == (body.messages is None):
        raise APIError("Give exactly one of prompt and messages.", 400, "prompt")
    if body.messages is not None:
        text = preprocess.render_chat(ctx, body.messages, body)
        tokens = ctx.tokenizer(text, add_special_tokens=False)["input_ids"]
    else:
        tokens = ctx.tokenizer(body.prompt, add_special_tokens=body.add_special_tokens)["input_ids"]
    strs = ctx.tokenizer.convert_ids_to_tokens(tokens) if body.return_token_strs else None
    return TokenizeResponse(tokens=tokens, count=len(tokens), max_model_len=ctx.max_model_len, token_strs=strs)


async def detokenize(body: DetokenizeRequest, request: Request) -> DetokenizeResponse:
    ctx = _ctx(request)
    ctx.warn_unknown_fields("/detokenize", body)
    preprocess.check_model(ctx, body.model)
    preprocess.check_token_ids(ctx, body.tokens, "tokens")
    return DetokenizeResponse(prompt=ctx.tokenizer.decode(body.tokens))


async def metrics(request: Request) -> Response:
    registry = _ctx(request).engine.metrics.registry
    return Response(generate_latest(registry), media_type=CONTENT_TYPE_LATEST)


def build_router() -> APIRouter:
    """Every route of the API; built per app so no router lives at module level."""
    router = APIRouter()
    router.add_api_route("/v1/completions", create_completion,
                         methods=["POST"], response_model=CompletionResponse,
                         responses={**_sse("/v1/completions"), **ENGINE_ERRORS})
    router.add_api_route("/v1/chat/completions", create_chat_completion,
                         methods=["POST"], response_model=ChatCompletionResponse,
                         responses={**_sse("/v1/chat/completions"), **ENGINE_ERRORS})
    router.add_api_route("/v1/responses", create_response,
                         methods=["POST"], response_model=ResponseObject,
                         responses={**_sse("/v1/responses"), **ENGINE_ERRORS})
    router.add_api_route("/v1/responses/{response_id}", get_response,
                         methods=["GET"], response_model=ResponseObject, responses=ERRORS)
    router.add_api_route("/v1/responses/{response_id}", delete_response,
                         methods=["DELETE"], response_model=ResponseDeleted, responses=ERRORS)
    router.add_api_route("/v1/responses/{response_id}/cancel", cancel_response,
                         methods=["POST"], response_model=ResponseObject, responses=ERRORS)
    router.add_api_route("/v1/models", list_models,
                         methods=["GET"], response_model=ModelList, responses=ERRORS)
    router.add_api_route("/health", health, response_class=Response,
                         methods=["GET"], responses={200: {"description": "Engine alive (empty body)"}, 503: ERRORS[503]})
    router.add_api_route("/version", version,
                         methods=["GET"], response_model=VersionResponse)
    router.add_api_route("/tokenize", tokenize,
                         methods=["POST"], response_model=TokenizeResponse, responses=ERRORS)
    router.add_api_route("/detokenize", detokenize,
                         methods=["POST"], response_model=DetokenizeResponse, responses=ERRORS)
    router.add_api_route("/metrics", metrics,
                         methods=["GET"], response_class=Response, responses={200: {"content": {"text/plain": {}}}})
    return router
