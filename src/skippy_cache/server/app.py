"""The FastAPI application: routes, auth, metrics middleware, error handlers, lifespan."""

from __future__ import annotations

import asyncio
import secrets
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.responses import HTMLResponse, JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST
from pydantic import BaseModel

from skippy_cache.runtime import Engine
from skippy_cache.server.anthropic import GenerateRequest, MessagesAPI, MessagesRequest
from skippy_cache.server.chat import ChatFormatter, choose_chat_template
from skippy_cache.server.dashboard import dashboard_data, page
from skippy_cache.server.errors import APIError, install_error_handlers
from skippy_cache.server.generation import Generation
from skippy_cache.server.limits import BodyLimit, RequestLimits
from skippy_cache.server.metrics import RequestCounter, ServerMetrics
from skippy_cache.server.modelnames import ModelNames
from skippy_cache.server.openai_responses import ResponsesAPI, ResponsesRequest
from skippy_cache.server.schemas import CacheQuery, ChatCompletionRequest, CompletionRequest, UnpinRequest
from skippy_cache.server.settings import ServerSettings
from skippy_cache.server.stats import cache_report

ENDPOINTS = (
    "/v1/completions",
    "/v1/chat/completions",
    "/v1/messages",
    "/v1/messages/count_tokens",
    "/v1/responses",
    "/v1/models",
    "/v1/cache",
    "/v1/cache/explain",
    "/v1/cache/unpin",
    "/v1/dashboard",
    "/dashboard",
    "/health",
    "/metrics",
)


def create_app(engine: Engine, settings: ServerSettings, *, owns_engine: bool = False) -> FastAPI:
    """The HTTP API over a running engine.

    With `owns_engine`, shutdown closes the engine after the server has
    stopped taking requests and finished the ones in flight (drain).
    Tests pass False to share one engine between several apps.
    """
    started = int(time.time())
    model_id = engine.info.model.model_id
    models = ModelNames(model_id, settings.model_alias, strict=settings.strict_model_names)
    limits = RequestLimits.from_settings(settings, engine.info.n_ctx)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        yield
        app.state.shutting_down = True
        if owns_engine:
            # Blocking join of the engine thread: keep it off the event loop.
            await asyncio.to_thread(engine.close, True)

    app = FastAPI(title="skippy-cache", summary="OpenAI-compatible server with exact prefix KV reuse",
                  lifespan=lifespan)
    app.state.shutting_down = False
    metrics = ServerMetrics(engine, ENDPOINTS)
    app.state.metrics = metrics
    # Added first, so it runs inside RequestCounter: a 413 is counted like any answer.
    app.add_middleware(BodyLimit, max_bytes=limits.max_body_bytes)
    app.add_middleware(RequestCounter, metrics=metrics)
    install_error_handlers(app)

    generation = Generation(
        engine=engine,
        settings=settings,
        chat=ChatFormatter(
            choose_chat_template(settings.chat_template, engine.info.model.chat_template,
                                 engine.info.model.architecture),
            bos_token=engine.info.bos_text, eos_token=engine.info.eos_text,
        ),
        metrics=metrics,
        models=models,
        limits=limits,
        system_fingerprint=f"skippy-{engine.info.model.digest[:12]}",
    )
    app.state.generation = generation

    def model_card() -> dict:
        return {
            "id": model_id,
            "object": "model",
            "created": started,
            "owned_by": "skippy-cache",
            "context_length": engine.info.n_ctx,
        }

    auth = [Depends(_bearer_auth(settings.api_key))] if settings.api_key else []
    v1 = APIRouter(prefix="/v1", dependencies=auth)
    # The handlers parse their bodies themselves (errors.py's messages, limits.py's checks);
    # the OpenAPI document still describes each body.
    v1.add_api_route("/completions", generation.completions, methods=["POST"],
                     openapi_extra=_json_body(CompletionRequest))
    v1.add_api_route("/chat/completions", generation.chat_completions, methods=["POST"],
                     openapi_extra=_json_body(ChatCompletionRequest))
    anthropic = MessagesAPI(generation)
    v1.add_api_route("/messages", anthropic.messages, methods=["POST"], openapi_extra=_json_body(GenerateRequest))
    v1.add_api_route("/messages/count_tokens", anthropic.count_tokens, methods=["POST"],
                     openapi_extra=_json_body(MessagesRequest))
    responses = ResponsesAPI(generation)
    v1.add_api_route("/responses", responses.create, methods=["POST"], openapi_extra=_json_body(ResponsesRequest))
    v1.add_api_route("/cache/explain", generation.explain, methods=["POST"], openapi_extra=_json_body(CacheQuery))
    v1.add_api_route("/cache/unpin", generation.unpin, methods=["POST"], openapi_extra=_json_body(UnpinRequest))

    @v1.get("/models")
    async def list_models() -> dict:
        return {"object": "list", "data": [model_card()]}

    @v1.get("/models/{model:path}")
    async def get_model(model: str) -> dict:
        # The card of the model that serves this name (any name, unless --strict-model-names).
        models.check(model)
        return model_card()

    @v1.get("/cache")
    async def cache() -> dict:
        # The pool's audit is read on the engine thread: keep the wait off the event loop.
        return await asyncio.to_thread(cache_report, engine)

    @v1.get("/dashboard")
    async def dashboard_json() -> dict:
        # The pool view is read on the engine thread: keep the wait off the event loop.
        return await asyncio.to_thread(dashboard_data, engine, metrics.timeline,
                                       prefix_text=settings.dashboard_prefix_text)

    app.include_router(v1)

    @app.get("/health")
    async def health() -> JSONResponse:
        s = engine.stats()
        if app.state.shutting_down:
            status = "shutting_down"
        elif not engine.alive:
            status = "engine_stopped"
        else:
            status = "ok"
        body = {
            "status": status,
            "model": model_id,
            "lanes_total": s.lanes_total,
            "lanes_busy": s.lanes_busy,
            "queue_depth": s.queue_depth,
        }
        return JSONResponse(body, status_code=200 if status == "ok" else 503)

    @app.get("/dashboard")
    async def dashboard() -> HTMLResponse:
        # The page holds no data: it fetches /v1/dashboard, which needs the API key if one is set.
        return HTMLResponse(page())

    @app.get("/metrics")
    async def prometheus() -> Response:
        return Response(metrics.render(), media_type=CONTENT_TYPE_LATEST)

    return app


def _json_body(model: type[BaseModel]) -> dict:
    """An OpenAPI `requestBody` for a pydantic model, its `$defs` inlined (none of them is recursive)."""
    schema = model.model_json_schema()
    defs = schema.pop("$defs", {})

    def inline(node: object) -> object:
        if isinstance(node, dict):
            ref = node.get("$ref")
            if isinstance(ref, str) and ref.startswith("#/$defs/"):
                rest = {k: v for k, v in node.items() if k != "$ref"}
                return inline({**defs[ref.removeprefix("#/$defs/")], **rest})
            return {k: inline(v) for k, v in node.items()}
        if isinstance(node, list):
            return [inline(v) for v in node]
        return node

    return {"requestBody": {"required": True, "content": {"application/json": {"schema": inline(schema)}}}}


def _bearer_auth(api_key: str):
    expected = api_key.encode("utf-8")

    async def check(request: Request) -> None:
        scheme, _, token = request.headers.get("authorization", "").partition(" ")
        if scheme.lower() != "bearer":
            # Anthropic's clients send the key as `x-api-key`.
            token = request.headers.get("x-api-key", "")
        if not secrets.compare_digest(token.strip().encode("utf-8"), expected):
            raise APIError(
                401,
                "missing or incorrect API key: send 'Authorization: Bearer <key>' or 'x-api-key: <key>'",
                code="invalid_api_key",
                headers={"WWW-Authenticate": "Bearer"},
            )

    return check
