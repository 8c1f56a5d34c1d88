"""The OpenAI error body, and the handlers that turn every failure into it (never FastAPI's 422)."""
from __future__ import annotations

from http import HTTPStatus
from typing import Any, Optional

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from server.protocol import ErrorInfo, ErrorResponse

# status code -> the OpenAI error type name clients switch on
ERROR_TYPES = {
    400: "BadRequestError",
    401: "AuthenticationError",
    404: "NotFoundError",
    405: "MethodNotAllowedError",
    413: "RequestTooLargeError",
    500: "InternalServerError",
    503: "ServiceUnavailableError",
}


class APIError(Exception):
    """An error a handler raises on purpose; becomes `{"error": {...}}` with its status."""

    def __init__(self, message: str, status: int = 400, param: Optional[str] = None) -> None:
        super().__init__(message)
        self.message = message
        self.status = status
        self.param = param

    @classmethod
    def from_value_error(cls, exc: ValueError) -> "APIError":
        """SamplingParams' ValueErrors start with the field's name."""
        message = str(exc)
        first = message.split(" ", 1)[0]
        return cls(message, 400, first if first.isidentifier() else None)


def error_body(message: str, status: int, param: Optional[str] = None) -> dict[str, Any]:
    err_type = ERROR_TYPES.get(status) or ("BadRequestError" if status < 500 else "InternalServerError")
    info = ErrorInfo(message=_encodable(message), type=err_type, param=_encodable(param), code=status)
    return ErrorResponse(error=info).model_dump()


def _encodable(text: Optional[str]) -> Optional[str]:
    """A message may quote the client's input (a field name, a key) holding a lone surrogate: escape it, or
    encoding the body fails."""
    return None if text is None else text.encode("utf-8", "backslashreplace").decode("utf-8")


def error_response(message: str, status: int, param: Optional[str] = None) -> JSONResponse:
    return JSONResponse(error_body(message, status, param), status_code=status)


def validation_message(exc: RequestValidationError) -> tuple[str, Optional[str]]:
    """One readable sentence naming the field, from pydantic's first error."""
    errors = exc.errors()
    if not errors:
        return "Invalid request.", None
    # A union (prompt, stop, content) reports one error per member; a bound that was crossed says more than
    # "should be a valid string" from a member whose shape did not match.
    err = next((e for e in errors if not str(e.get("type", "")).endswith("_type")), errors[0])
    if err.get("type") == "json_invalid":
        return f"Invalid JSON body: {err.get('ctx', {}).get('error', err.get('msg'))}.", None
    loc = [_clip(str(p)) for p in err.get("loc", ()) if p != "body"]  # a dict key in the path is client input
    if not loc:
        if err.get("type") == "missing":
            return "The request body is required (a JSON object).", None
        return f"The request body must be a JSON object: {err.get('msg')}.", None
    # Drop pydantic's union-member tags ("str", "list[int]") so the path names only fields.
    fields = [p for i, p in enumerate(loc) if i == 0 or not _is_type_tag(p)]
    path = ".".join(fields)
    msg = err.get("msg", "invalid value")
    if err.get("type") == "extra_forbidden":
        return f"Unknown field: {path} ({msg}).", fields[0]
    value = err.get("input")
    shown = "" if err.get("type") == "missing" else f", got {_short(value)}"
    # pydantic's name for the rule (greater_than_equal, too_long, ...), as in vLLM's messages: clients match on it
    return f"{path}: {msg} [type={err.get('type')}]{shown}.", fields[0]


def _is_type_tag(part: str) -> bool:
    return any(c in part for c in "[]") or part in {"str", "int", "float", "bool", "none", "list", "dict", "function-after"}


def _short(value: Any) -> str:
    return _clip(repr(value))


def _clip(text: str, limit: int = 60) -> str:
    return text if len(text) <= limit else text[: limit - 3] + "..."


def install_error_handlers(app: FastAPI) -> None:
    """Every failure path answers in the OpenAI error shape."""

    @app.exception_handler(APIError)
    async def _api_error(_: Request, exc: APIError) -> JSONResponse:
        return error_response(exc.message, exc.status, exc.param)

    @app.exception_handler(RequestValidationError)
    async def _validation(_: Request, exc: RequestValidationError) -> JSONResponse:
        message, param = validation_message(exc)
        return error_response(message, 400, param)

    @app.exception_handler(StarletteHTTPException)
    async def _http(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        message = exc.detail if isinstance(exc.detail, str) else HTTPStatus(exc.status_code).phrase
        return error_response(message, exc.status_code)

    @app.exception_handler(Exception)
    async def _unexpected(_: Request, exc: Exception) -> JSONResponse:
        return error_response(f"Internal server error: {type(exc).__name__}: {exc}", 500)
