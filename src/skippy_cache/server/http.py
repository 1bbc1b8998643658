"""What every endpoint does with HTTP alike: a JSON body read into its request model (a 400 in
the API's shape naming the field otherwise), and a server-sent event written."""

from __future__ import annotations

import asyncio
import json
from typing import TypeVar

from pydantic import BaseModel, ValidationError
from starlette.requests import Request

from skippy_cache.server.errors import APIError, from_validation_errors
from skippy_cache.server.schemas import Strict

T = TypeVar("T", bound=BaseModel)

#: A stream's headers: no cache, and no buffering by a proxy (nginx's) between it and the client.
SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


async def parse_body(request: Request, model: type[T]) -> T:
    """The JSON body as `model`; a 400 naming the field otherwise.

    Parsed on a worker thread: a body's JSON and its schemas' grammars (compiled as the body is
    validated) take time that grows with what a client sends, and the event loop serves everyone.
    """
    body = await asyncio.to_thread(_parse_body, await request.body(), model)
    if isinstance(body, Strict) and (ignored := body.ignored_fields()):
        request.state.ignored_fields = ignored  # the answer's header and a metric (metrics.RequestCounter)
    return body


def _parse_body(raw: bytes, model: type[T]) -> T:
    try:
        data = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise APIError(400, f"the request body is not valid JSON: {exc}", code="invalid_json") from None
    except RecursionError:
        raise APIError(400, "the request body nests arrays or objects too deeply", code="invalid_json") from None
    if not isinstance(data, dict):
        raise APIError(400, "the request body must be a JSON object", code="invalid_json")
    # JSON may escape half of a UTF-16 pair (`"\ud800"`): Python keeps it as a lone surrogate, which
    # no tokenizer or encoder takes, so it would fail far from here as a 500. Only an escape makes one.
    if b"\\u" in raw:
        try:
            json.dumps(data, ensure_ascii=False).encode("utf-8")
        except UnicodeEncodeError:
            raise APIError(400, "the request body holds a lone UTF-16 surrogate escape (\\ud800-\\udfff), "
                                "which is no Unicode character", code="invalid_json") from None
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        raise from_validation_errors(exc.errors()) from None


def sse_event(payload: dict, event: str | None = None) -> str:
    """One server-sent event: its `event:` line when the API names its events (Anthropic's,
    the Responses API's), then the compact JSON payload."""
    head = f"event: {event}\n" if event is not None else ""
    return f"{head}data: {json.dumps(payload, ensure_ascii=False, separators=(',', ':'))}\n\n"
