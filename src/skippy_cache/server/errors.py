"""OpenAI-shaped errors: `{"error": {"message", "type", "param", "code"}}`, and the handlers that emit them.

The HTTP status mapping of the engine's exceptions lives here and nowhere
else. A client's mistake is always a 4xx naming the field (`param`); only a
bug in the server is a 500.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

from skippy_cache.runtime import EngineClosedError, QueueFullError, RequestError

log = logging.getLogger("skippy_cache.server")

#: Seconds a client should wait before retrying a 503 (full queue, shutting down).
RETRY_AFTER_SECONDS = 1


class APIError(Exception):
    def __init__(
        self,
        status: int,
        message: str,
        *,
        type: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.param = param
        self.code = code
        self.headers = headers


#: Routes whose errors take Anthropic's shape: what the `anthropic` client parses.
ANTHROPIC_PREFIX = "/v1/messages"

#: Anthropic's error type for each status (its API's list; 503 and 529 are "overloaded").
_ANTHROPIC_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
                    404: "not_found_error", 413: "request_too_large", 429: "rate_limit_error",
                    503: "overloaded_error", 529: "overloaded_error"}


def error_body(
    message: str, type: str, param: str | None = None, code: str | None = None
) -> dict:
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


def anthropic_error_body(status: int, message: str) -> dict:
    """`{"type": "error", "error": {"type", "message"}}`; the type follows the status."""
    kind = _ANTHROPIC_TYPES.get(status, "invalid_request_error" if status < 500 else "api_error")
    return {"type": "error", "error": {"type": kind, "message": message}}


def error_body_for(path: str, status: int, message: str, type: str, param: str | None = None,
                   code: str | None = None) -> dict:
    """The error body in the shape the route's clients parse: Anthropic's or OpenAI's."""
    if path.startswith(ANTHROPIC_PREFIX):
        return anthropic_error_body(status, message)
    return error_body(message, type, param, code)


def error_response(error: APIError, path: str = "") -> JSONResponse:
    body = error_body_for(path, error.status, error.message, error.type, error.param, error.code)
    return JSONResponse(body, status_code=error.status, headers=error.headers)


def from_engine_error(exc: Exception, *, prompt_param: str = "prompt") -> APIError:
    """The APIError for what `Engine.submit` raised; `prompt_param` renames the prompt field (chat)."""
    if isinstance(exc, RequestError):
        param = prompt_param if exc.param == "prompt" else exc.param
        return APIError(400, str(exc), param=param, code=exc.code)
    if isinstance(exc, QueueFullError):
        return APIError(
            503, f"{exc}; retry later", type="server_error", code="queue_full",
            headers={"Retry-After": str(exc.retry_after_s)},
        )
    if isinstance(exc, EngineClosedError):
        return APIError(
            503, str(exc), type="server_error", code="shutting_down",
            headers={"Retry-After": str(RETRY_AFTER_SECONDS)},
        )
    raise TypeError(f"not an engine error: {exc!r}")


def from_validation_errors(errors: Sequence[dict]) -> APIError:
    """The first pydantic error, with its location as an OpenAI `param` (`messages[0].content`)."""
    first = errors[0]
    loc = [part for part in first.get("loc", ()) if part != "body"]
    param = _param_path(loc)
    kind = first.get("type", "")
    if kind == "missing":
        code, message = "missing_required_parameter", f"missing required parameter: {param!r}"
    elif kind == "extra_forbidden":
        code, message = "unknown_parameter", f"unknown field {param!r}"
    elif kind == "unsupported_parameter":
        code, message = kind, f"{param!r} is not supported by this server"
    else:
        code = "invalid_type" if kind.endswith("_type") else "invalid_value"
        detail = first.get("msg", "invalid value").removeprefix("Value error, ")
        message = f"{param}: {detail}" if param else detail
    return APIError(400, message, param=param, code=code)


#: Starts the tag of a union branch that is not a field of the body (`branch_tag`): pydantic puts
#: the tag in an error's location, and `tools[0].function.type` would name a field no body has.
_BRANCH = "~"


def branch_tag(name: str) -> str:
    """A discriminated union's tag that an error's `param` leaves out."""
    return _BRANCH + name


def _param_path(loc: Sequence[str | int]) -> str | None:
    out = ""
    for part in loc:
        if isinstance(part, str) and part.startswith(_BRANCH):
            continue
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else str(part))
    return out or None


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError) -> JSONResponse:
        return error_response(exc, request.url.path)

    @app.exception_handler(RequestError)
    @app.exception_handler(QueueFullError)
    @app.exception_handler(EngineClosedError)
    async def _engine_error(request: Request, exc: Exception) -> JSONResponse:
        return error_response(from_engine_error(exc), request.url.path)

    @app.exception_handler(ValidationError)
    async def _pydantic_error(request: Request, exc: ValidationError) -> JSONResponse:
        return error_response(from_validation_errors(exc.errors()), request.url.path)

    @app.exception_handler(RequestValidationError)
    async def _fastapi_validation(request: Request, exc: RequestValidationError) -> JSONResponse:
        return error_response(from_validation_errors(list(exc.errors())), request.url.path)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        kind = "invalid_request_error" if exc.status_code < 500 else "server_error"
        code = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code)
        error = APIError(exc.status_code, str(exc.detail), type=kind, code=code, headers=exc.headers)
        return error_response(error, request.url.path)

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception) -> JSONResponse:
        log.exception("unhandled error: %s", exc)
        return error_response(APIError(500, "internal server error; see the server log", type="server_error"),
                              request.url.path)
