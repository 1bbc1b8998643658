"""What one request may ask of the server (body size, prompt tokens, stop strings, messages), and
what one tenant may hold of it (requests in flight and queued).

Each limit is checked before the work it bounds: the body's size before it
is buffered whole or parsed (`BodyLimit`, an ASGI middleware, so chunked
bodies without a Content-Length are counted too), the stop strings and the
messages before the chat template renders them, the prompt's tokens before
the engine reserves cells for them. A request past a limit is a 4xx in
OpenAI's error shape naming the limit's option, never a 5xx.
"""

from __future__ import annotations

import json
from collections import Counter
from dataclasses import dataclass

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from skippy_cache.server.errors import APIError, error_body_for
from skippy_cache.server.settings import MIB, ServerSettings


@dataclass(frozen=True, slots=True)
class RequestLimits:
    max_body_bytes: int
    #: Resolved: the context size when the setting is 0.
    max_prompt_tokens: int
    max_stop: int
    max_stop_chars: int
    max_messages: int

    @classmethod
    def from_settings(cls, settings: ServerSettings, n_ctx: int) -> RequestLimits:
        return cls(
            max_body_bytes=settings.max_body_mib * MIB,
            max_prompt_tokens=min(settings.max_prompt_tokens or n_ctx, n_ctx),
            max_stop=settings.max_stop,
            max_stop_chars=settings.max_stop_chars,
            max_messages=settings.max_messages,
        )

    def check_stop(self, stop: list[str] | None) -> None:
        if not stop:
            return
        if len(stop) > self.max_stop:
            raise APIError(400, f"stop: at most {self.max_stop} stop sequences are allowed, got {len(stop)} "
                           "(--max-stop)", param="stop", code="invalid_value")
        for i, text in enumerate(stop):
            if len(text) > self.max_stop_chars:
                raise APIError(400, f"stop[{i}]: a stop sequence may have at most {self.max_stop_chars} "
                               f"characters, got {len(text)} (--max-stop-chars)", param="stop",
                               code="invalid_value")

    def check_messages(self, count: int) -> None:
        if count > self.max_messages:
            raise APIError(400, f"messages: at most {self.max_messages} messages are allowed, got {count} "
                           "(--max-messages)", param="messages", code="invalid_value")

    def check_prompt(self, n_tokens: int, *, param: str) -> None:
        """A prompt past the cap; one past the context alone is the engine's own 400, with the same code."""
        if n_tokens > self.max_prompt_tokens:
            raise APIError(400, f"the prompt has {n_tokens} tokens; this server accepts at most "
                           f"{self.max_prompt_tokens} (--max-prompt-tokens)", param=param,
                           code="context_length_exceeded")


class TenantRequests:
    """Requests each tenant has in flight or waiting; past `limit` a new one is a 429.

    A tenant flooding the server would otherwise fill the queue and every
    lane, and each other tenant's request would wait behind the flood (the
    scheduler also takes turns between tenants when a lane frees). Counted on
    the event loop: taken when the engine requests are submitted, given back
    as each one's DoneEvent arrives, whichever way it ended.
    """

    def __init__(self, limit: int) -> None:
        #: 0: no limit.
        self.limit = limit
        self._held: Counter[str] = Counter()

    def take(self, tenant: str | None, n: int) -> None:
        """Hold `n` requests for `tenant`, or raise the 429 (nothing held). Tenant None (a server
        without tenants) is never limited."""
        if tenant is None or not self.limit:
            return
        if self._held[tenant] + n > self.limit:
            raise APIError(429, f"tenant {tenant!r} has {self._held[tenant]} requests in flight or waiting; at "
                           f"most {self.limit} are allowed (--tenant-max-requests); retry when one is answered",
                           type="rate_limit_error", code="tenant_limit", headers={"Retry-After": "1"})
        self._held[tenant] += n

    def release(self, tenant: str | None, n: int = 1) -> None:
        if tenant is None or not self.limit:
            return
        self._held[tenant] -= n
        if self._held[tenant] <= 0:
            del self._held[tenant]

    def held(self, tenant: str) -> int:
        return self._held[tenant]


#: A refused body is read on (and dropped) up to this many times the limit before the 413 is
#: sent: a client still sending when the answer comes and the connection closes would often
#: see a reset instead of the 413. Past it the 413 goes out at once and the connection closes.
DRAIN_FACTOR = 4


class BodyLimit:
    """ASGI middleware: a request body past `max_bytes` gets a 413 before the app sees any of it.

    The body is read here, counted chunk by chunk (a chunked body has no
    length), and handed to the app in one message; a Content-Length past the
    limit is refused without buffering anything. What follows the body (the
    `http.disconnect` a streaming response watches for) passes through.
    """

    def __init__(self, app: ASGIApp, max_bytes: int) -> None:
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        length = _content_length(scope)
        if length is not None and length > self.max_bytes:
            await self._refuse(scope["path"], receive, send, drain=length <= DRAIN_FACTOR * self.max_bytes)
            return
        chunks: list[bytes] = []
        size = 0
        while True:
            message = await receive()
            if message["type"] != "http.request":
                # The client left before its body was complete: the app sees that as it would.
                await self.app(scope, _replay([message], receive), send)
                return
            chunk = message.get("body", b"")
            size += len(chunk)
            more = message.get("more_body", False)
            if size > self.max_bytes:
                await self._refuse(scope["path"], receive, send, drain=more)
                return
            chunks.append(chunk)
            if not more:
                break
        whole: Message = {"type": "http.request", "body": b"".join(chunks), "more_body": False}
        await self.app(scope, _replay([whole], receive), send)

    async def _refuse(self, path: str, receive: Receive, send: Send, *, drain: bool) -> None:
        left = drain
        dropped = 0
        while left and dropped <= DRAIN_FACTOR * self.max_bytes:
            message = await receive()
            if message["type"] != "http.request":
                return  # the client left: nobody to answer
            dropped += len(message.get("body", b""))
            left = message.get("more_body", False)
        limit = self.max_bytes // MIB if self.max_bytes % MIB == 0 else self.max_bytes
        unit = " MiB" if self.max_bytes % MIB == 0 else " bytes"
        body = json.dumps(error_body_for(
            path, 413, f"the request body is larger than {limit}{unit} (--max-body-mib)",
            "invalid_request_error", code="request_too_large",
        )).encode()
        headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
        if left:
            # Body still coming (past what is worth reading): the connection ends with the answer.
            headers.append((b"connection", b"close"))
        await send({"type": "http.response.start", "status": 413, "headers": headers})
        await send({"type": "http.response.body", "body": body, "more_body": False})


def _content_length(scope: Scope) -> int | None:
    for name, value in scope.get("headers", ()):
        if name == b"content-length":
            try:
                return int(value)
            except ValueError:
                return None  # the server's parser refuses these before the app runs
    return None


def _replay(messages: list[Message], receive: Receive) -> Receive:
    pending = list(messages)

    async def replay() -> Message:
        if pending:
            return pending.pop(0)
        return await receive()

    return replay
