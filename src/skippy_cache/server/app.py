"""The FastAPI application: routes, auth, metrics middleware, error handlers, lifespan."""

from __future__ import annotations

import asyncio
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
from skippy_cache.server.limits import BodyLimit, RequestLimits, TenantRequests
from skippy_cache.server.metrics import RequestCounter, ServerMetrics
from skippy_cache.server.modelnames import ModelNames
from skippy_cache.server.openai_responses import ResponsesAPI, ResponsesRequest
from skippy_cache.server.schemas import CacheQuery, ChatCompletionRequest, CompletionRequest, UnpinRequest
from skippy_cache.server.settings import ServerSettings
from skippy_cache.server.stats import cache_report, tenant_report, tenants_report
from skippy_cache.server.tenants import NAMESPACE_HEADER, OPEN, Keys, Scope, caller_of, in_tenant
from skippy_cache.server.tracelog import TraceLog

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


def create_app(engine: Engine, settings: ServerSettings, *, owns_engine: bool = False,
               keys: Keys | None = None, trace: TraceLog | None = None) -> FastAPI:
    """The HTTP API over a running engine.

    With `owns_engine`, shutdown closes the engine after the server has
    stopped taking requests and finished the ones in flight (drain).
    Tests pass False to share one engine between several apps.
    `keys`: the keys in use, which the caller may reload, and `trace`: the
    trace log, closed at shutdown (default: both as the settings name them).
    """
    if keys is None:
        keys = Keys.for_settings(settings)
    tenants = keys is not None and keys.tenants
    started = int(time.time())
    model_id = engine.info.model.model_id
    models = ModelNames(model_id, settings.model_alias, strict=settings.strict_model_names)
    limits = RequestLimits.from_settings(settings, engine.info.n_ctx)

    if trace is None:
        trace = TraceLog.for_settings(settings)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        yield
        app.state.shutting_down = True
        if owns_engine:
            # Blocking join of the engine thread: keep it off the event loop.
            await asyncio.to_thread(engine.close, True)
        if trace is not None:
            trace.close()

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
        tenant_requests=TenantRequests(settings.tenant_max_requests if tenants else 0),
        trace=trace,
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

    authenticate = _authenticate(keys)
    v1 = APIRouter(prefix="/v1", dependencies=[Depends(authenticate)])
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
    async def cache(request: Request) -> dict:
        # The pool's audit is read on the engine thread: keep the wait off the event loop.
        caller = caller_of(request)
        if not caller.admin:
            assert caller.tenant is not None  # every user key names a tenant
            return await asyncio.to_thread(tenant_report, engine, metrics, caller.tenant)
        report = await asyncio.to_thread(cache_report, engine)
        if tenants:
            report["tenants"] = await asyncio.to_thread(tenants_report, engine, metrics)
        return report

    @v1.delete("/cache")
    async def clear_cache(request: Request, tenant: str | None = None) -> dict:
        """Empty the cache: a user key its own tenant's entries; an admin key everything, or one
        tenant's (`?tenant=NAME`)."""
        caller = caller_of(request)
        if not caller.admin:
            if tenant is not None and tenant != caller.tenant:
                raise APIError(403, f"tenant: a user key may clear only its own tenant's entries ({caller.tenant!r})",
                               type="permission_error", param="tenant", code="forbidden")
            tenant = caller.tenant
        if tenant is None:
            dropped = await asyncio.to_thread(engine.clear_cache)
        else:
            dropped = await asyncio.to_thread(engine.clear_tenant, tenant)
        generation.memory.forget(lambda namespace: tenant is None or in_tenant(namespace, tenant))
        return {"object": "cache.cleared", "tenant": tenant, "resident_entries": dropped}

    @v1.get("/dashboard")
    async def dashboard_json(request: Request) -> dict:
        # The pool view is read on the engine thread: keep the wait off the event loop.
        caller = caller_of(request)
        return await asyncio.to_thread(dashboard_data, engine, metrics, prefix_text=settings.dashboard_prefix_text,
                                       tenant=None if caller.admin else caller.tenant)

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

    # With tenants, /metrics (every tenant's counters by name) is for admin keys; without, it
    # stays open, as scrapers of a single-tenant server expect.
    metrics_auth = [Depends(_admin_only(authenticate))] if tenants else []

    @app.get("/metrics", dependencies=metrics_auth)
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


def _authenticate(keys: Keys | None):
    """The dependency that names each request's caller and scope (`request.state`): 401 for a
    missing or wrong key, 403 for a shared namespace the caller may not join."""

    async def authenticate(request: Request) -> None:
        caller = OPEN
        if keys is not None:
            scheme, _, token = request.headers.get("authorization", "").partition(" ")
            if scheme.lower() != "bearer":
                # Anthropic's clients send the key as `x-api-key`.
                token = request.headers.get("x-api-key", "")
            found = keys.authenticate(token.strip())
            if found is None:
                raise APIError(
                    401,
                    "missing or incorrect API key: send 'Authorization: Bearer <key>' or 'x-api-key: <key>'",
                    code="invalid_api_key",
                    headers={"WWW-Authenticate": "Bearer"},
                )
            caller = found
        shared = request.headers.get(NAMESPACE_HEADER)
        if shared is not None:
            allowed = caller.shared | (keys.shared if keys is not None and caller.admin else frozenset())
            if not (shared in allowed or keys is None):
                raise APIError(403, f"{NAMESPACE_HEADER}: this key may not join the shared namespace {shared!r}",
                               type="permission_error", param=NAMESPACE_HEADER, code="namespace_forbidden")
        request.state.caller = caller
        request.state.scope = Scope(caller.tenant, shared, caller.keep)

    return authenticate


def _admin_only(authenticate):
    async def admin_only(request: Request) -> None:
        await authenticate(request)
        if not caller_of(request).admin:
            raise APIError(403, "this endpoint needs an admin key", type="permission_error", code="forbidden")

    return admin_only
