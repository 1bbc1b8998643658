"""`skippy-cache serve`: load the model, log what was derived, run uvicorn until SIGTERM.

Shutdown on SIGTERM or Ctrl-C: uvicorn stops accepting connections and waits
for the in-flight responses (streams included) to finish; then the lifespan
closes the engine with drain, and the process exits 0.
"""

from __future__ import annotations

import ipaddress
import logging
import signal

import uvicorn

from skippy_cache.config import MIN_CTX_FOR_CELL_CAP
from skippy_cache.runtime.engine import Engine
from skippy_cache.server.app import create_app
from skippy_cache.server.settings import ServerSettings

log = logging.getLogger("skippy_cache.server")


def _host_tier_line(engine: Engine) -> str:
    if engine.pool.host is None:
        return "off (deterministic mode)" if engine.config.deterministic and engine.config.host_cache_bytes else "off"
    idle = engine.config.idle_tokens
    leaves = f"after {idle} idle tokens" if idle else "only when their cells are needed"
    return f"{engine.pool.host.max_bytes // (1 << 20)} MiB of RAM; entries leave the pool {leaves}"


def startup_report(engine: Engine, settings: ServerSettings) -> str:
    """The one block logged at start: model, pool, derived cache budgets."""
    info, budgets, policy, cfg = engine.info, engine.cache_config, engine.policy, engine.config
    token_cap = f"{budgets.max_resident_tokens} tokens" if budgets.max_resident_tokens else "none"
    if not budgets.max_resident_tokens:
        token_cap += f" (ctx {engine.n_ctx} < {MIN_CTX_FOR_CELL_CAP})"
    mode = engine.mode.value
    if cfg.cache.mode.value != mode:
        mode += f" (configured {cfg.cache.mode.value})"
    template = "GGUF tokenizer.chat_template" if info.chat_template else "none in the GGUF (ChatML fallback)"
    auth = "bearer key required on /v1/*" if settings.api_key else "open (no --api-key)"
    lines = [
        "skippy-cache server",
        f"  model     {info.path}",
        f"            {engine.model.description}, architecture {info.architecture}, id {info.model_id}",
        f"            digest {info.digest}, chat template: {template}",
        f"  pool      n_ctx {engine.n_ctx} cells, {cfg.lanes} lanes, {engine.threads} threads, "
        f"n_seq_max {budgets.n_seq_max}, n_batch {cfg.n_batch}, "
        f"deterministic {'on' if cfg.deterministic else 'off'}",
        f"  cache     mode {mode}, max entries {budgets.max_entries}, token cap {token_cap}, "
        f"byte cap {budgets.max_bytes or 'none'}",
        f"            reserved sequences 0..{budgets.reserved_seq_count - 1} (lanes), "
        f"min_tokens {policy.min_tokens}, stride {policy.stride_tokens}, "
        f"record limit {policy.record_limit or 'all'}",
        f"  host tier {_host_tier_line(engine)}",
        f"  requests  queue {cfg.max_queue}, chat max_tokens default {settings.default_max_tokens}, "
        f"model names {info.model_id!r} or {settings.model_alias!r}, {auth}",
        f"  listen    http://{settings.host}:{settings.port}",
    ]
    if engine.mode_note:
        lines.append(f"  note      {engine.mode_note}")
    return "\n".join(lines)


def serve(settings: ServerSettings) -> int:
    log.info("loading model %s", settings.model or "(default: SmolLM2-135M-Instruct Q4_1)")
    engine = Engine(settings.engine_config())
    try:
        log.info("%s", startup_report(engine, settings))
        if not _is_loopback(settings.host) and not settings.api_key:
            log.warning("listening on %s without --api-key: anyone who can reach it may use it", settings.host)
        app = create_app(engine, settings, owns_engine=True)
        config = uvicorn.Config(
            app,
            host=settings.host,
            port=settings.port,
            log_level=settings.log_level,
            # No keep-alive wait on shutdown beyond in-flight responses.
            timeout_graceful_shutdown=None,
        )
        server = uvicorn.Server(config)
        # uvicorn re-raises the signal it caught once it has shut down, to let
        # the previous handler act; a no-op handler here makes a drained
        # SIGTERM/SIGINT an exit 0 instead of death by signal.
        previous = {sig: signal.signal(sig, _ignore) for sig in (signal.SIGTERM, signal.SIGINT)}
        try:
            server.run()
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)
        if not server.started:
            log.error("the server did not start (see the error above)")
            return 1
        return 0
    finally:
        # Normally closed (drained) by the app's lifespan already; this covers a failed start.
        engine.close(drain=False, timeout=10.0)


def _is_loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return host == "localhost"


def _ignore(_sig: int, _frame: object) -> None:
    pass
