"""`skippy-cache serve`: load the model, log what was derived, run uvicorn until SIGTERM.

Shutdown on SIGTERM or Ctrl-C: uvicorn stops accepting connections and waits
for the in-flight responses (streams included) to finish; then the lifespan
closes the engine with drain, and the process exits 0.
"""

from __future__ import annotations

import errno
import ipaddress
import logging
import signal
import socket

import uvicorn

from skippy_cache.config import MIN_CTX_FOR_CELL_CAP
from skippy_cache.runtime import Engine, EngineInfo, StartupError
from skippy_cache.server.app import create_app
from skippy_cache.server.chat import ChatFormatter
from skippy_cache.server.settings import ServerSettings
from skippy_cache.server.tenants import KeyFileError, Keys
from skippy_cache.server.tracelog import TraceLog

log = logging.getLogger("skippy_cache.server")


def _store_lines(engine: Engine) -> list[str]:
    info = engine.info
    store = engine.stats().cache.store
    if store is None:
        why = info.store_note or "no RAM or disk tier configured"
        return [f"  store     off ({why})"]
    leaves = f"after {info.idle_tokens} idle tokens" if info.idle_tokens else "only when their cells are needed"
    lines = [
        f"  store     chunks of {store.chunk_tokens} tokens, evicted {info.eviction.value}; entries leave the pool "
        f"{leaves}",
        f"            RAM {info.host_cache_bytes // (1 << 20)} MiB",
    ]
    disk = store.chunks.disk
    if disk is None:
        lines.append("            disk off (--cache-dir none)")
    else:
        lines.append(
            f"            disk {disk.root}: {disk.max_bytes // (1 << 20)} MiB, found {disk.chunks} chunks "
            f"({disk.bytes // (1 << 20)} MiB), removed {disk.removed_at_start} unfinished files"
        )
    if info.remote_url is not None:
        lines.append(f"            shared {info.remote_url}: every new entry is shared; lookups before queueing")
    elif info.store_note:
        lines.append(f"            note: {info.store_note}")
    return lines


def weights_line(info: EngineInfo) -> str:
    """`CPU_Mapped 92 MiB (AMX repack off: known to fault on this CPU; --weight-repack on to force)`."""
    weights = info.weights
    buffers = ", ".join(f"{name} {mib:.0f} MiB" for name, mib in sorted(info.weight_buffers.items()))
    reason = weights.reason
    if weights.use_extra_bufts and not set(weights.extra_bufts) & set(info.weight_buffers):
        reason += f": {', '.join(weights.extra_bufts)} has no kernels for this model's weight types"
    return f"{buffers} ({reason}; {weights.check})"


def threads_line(info: EngineInfo) -> str:
    """How many llama.cpp threads, where the count came from, and whether steps adapt it."""
    if not info.threads_adapt:
        return f"{info.threads} for llama.cpp, always (--threads; {info.cpus.describe()})"
    return (f"up to {info.threads} for llama.cpp ({info.cpus.describe()}), each step on the cores "
            "other processes leave free")


def startup_report(engine: Engine, settings: ServerSettings, chat: ChatFormatter) -> str:
    """The one block logged at start: model, the chat template the app renders with and what it
    renders, pool, derived cache budgets."""
    info = engine.info
    model, budgets, policy = info.model, info.budgets, info.policy
    token_cap = f"{budgets.max_resident_tokens} tokens" if budgets.max_resident_tokens else "none"
    if not budgets.max_resident_tokens:
        token_cap += f" (ctx {info.n_ctx} < {MIN_CTX_FOR_CELL_CAP})"
    mode = info.mode.value
    if info.configured_mode is not info.mode:
        mode += f" (configured {info.configured_mode.value})"
    if settings.api_keys is not None:
        auth = f"keys of {settings.api_keys} (a cache per tenant; SIGHUP reloads)"
    else:
        auth = "bearer key required on /v1/*" if settings.api_key else "open (no --api-key)"
    names = f"{model.model_id!r} or {settings.model_alias!r}"
    names += " only (--strict-model-names)" if settings.strict_model_names else " (any other name served too)"
    lines = [
        "skippy-cache server",
        f"  model     {model.path}",
        f"            {info.description}, architecture {model.architecture}, id {model.model_id}",
        f"            digest {model.digest}, chat template: {chat.template.origin}",
        f"            ({chat.caps.describe()})",
        f"  memory    {info.family.describe()}",
        f"  weights   {weights_line(info)}",
        f"  threads   {threads_line(info)}",
        f"            {info.wait_policy}",
        f"  pool      n_ctx {info.n_ctx} cells (KV k {settings.cache_type_k}, v {settings.cache_type_v}, on the CPU), "
        f"{info.lanes} lanes, "
        f"n_seq_max {budgets.n_seq_max}, n_batch {info.n_batch}, "
        f"{'exact' if info.deterministic else 'fast'} mode",
        f"  cache     mode {mode}, max entries {budgets.max_entries}, token cap {token_cap}, "
        f"byte cap {budgets.max_bytes or 'none'}",
        f"            reserved sequences 0..{budgets.reserved_seq_count - 1} (lanes), "
        f"min_tokens {policy.min_tokens}, stride {policy.stride_tokens}, "
        f"record limit {policy.record_limit or 'all'}",
        *_store_lines(engine),
        f"  requests  queue {info.max_queue}, chat max_tokens default {settings.default_max_tokens}, "
        f"model names {names}, {auth}",
        f"  limits    body {settings.max_body_mib} MiB, prompt {settings.max_prompt_tokens or info.n_ctx} tokens, "
        f"stop {settings.max_stop} x {settings.max_stop_chars} chars, {settings.max_messages} messages",
        f"  listen    http://{settings.host}:{settings.port}",
    ]
    if settings.trace_log is not None:
        lines.append(f"  trace     {settings.trace_log} (Mooncake format; its salt in {settings.trace_log}.salt "
                     "stays here)")
    if info.mode_note:
        lines.append(f"  note      {info.mode_note}")
    return "\n".join(lines)


def serve(settings: ServerSettings) -> int:
    """Run the server until SIGTERM; a start-up failure a user caused raises
    `SettingsError`, `StartupError` or `CacheDirBusy` (the CLI prints it in one line)."""
    check_listen(settings.host, settings.port)
    # Read before the model loads: a bad key file or trace log stops the start in one line.
    keys = Keys.for_settings(settings)
    trace = TraceLog.for_settings(settings)
    log.info("loading model %s", settings.model or "(default: SmolLM2-135M-Instruct Q4_1)")
    engine = Engine(settings.engine_config())
    try:
        app = create_app(engine, settings, owns_engine=True, keys=keys, trace=trace)
        log.info("%s", startup_report(engine, settings, app.state.generation.chat))
        if not _is_loopback(settings.host) and keys is None:
            log.warning("listening on %s without --api-key: anyone who can reach it may use it", settings.host)
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
        if keys is not None and keys.tenants:
            previous[signal.SIGHUP] = signal.signal(signal.SIGHUP, lambda _sig, _frame: reload_keys(keys))
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


def reload_keys(keys: Keys) -> None:
    """SIGHUP: read the key file again. Requests already authenticated run on; a key removed is
    refused from its next request. A bad file keeps the keys in use."""
    try:
        count = keys.reload()
    except KeyFileError as exc:
        log.error("key file not reloaded, the keys in use stay: %s", exc)
        return
    log.info("key file %s reloaded: %d keys", keys.path, count)


def check_listen(host: str, port: int) -> None:
    """Fail before the model loads, in one line, when the server could not listen on `host`:`port`.

    Binds each address the host resolves to (as uvicorn will) and lets go; uvicorn
    would otherwise find out only after the model loaded, and say it in a log
    record that names neither setting.
    """
    try:
        addresses = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as exc:
        raise StartupError(f"--host {host}: not an address of this machine ({exc.strerror}); pass one such as "
                           "127.0.0.1 (this machine only) or 0.0.0.0 (every interface)") from None
    for family, kind, proto, _, address in addresses:
        with socket.socket(family, kind, proto) as sock:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                sock.bind(address)
            except OSError as exc:
                if exc.errno == errno.EADDRINUSE:
                    raise StartupError(f"--port {port}: {host}:{port} is already in use; pass another --port, "
                                       "or stop the server that holds it") from None
                raise StartupError(f"--host {host} --port {port}: cannot listen there ({exc.strerror}); "
                                   "pass another address or port") from None


def _is_loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return host == "localhost"


def _ignore(_sig: int, _frame: object) -> None:
    pass
