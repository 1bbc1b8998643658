"""`serve --trace-log PATH`: the server's own traffic, in the format of Mooncake's public traces.

One JSON line per engine request, appended when it ends:

    {"timestamp": 1234, "input_length": 2048, "output_length": 64, "hash_ids": [917..., 40...,
     ...], "tenant": "alice"}

`timestamp` is when the request arrived, in ms since the server started;
`hash_ids` name the prompt's blocks of `BLOCK_TOKENS` tokens (the last one
may be partial), each by a keyed hash of the whole prefix up to its end, so
two prompts share their first k ids exactly when they share their first k
blocks: what a replay needs to size a cache, and nothing else. This is the
format Mooncake's FAST'25 traces, NVIDIA Dynamo's replay and aiperf read;
`tenant` is this server's own field (the tenant's name, never its key; absent
without tenants).

Privacy: the hash is BLAKE3 keyed with a per-deployment salt, kept in
`PATH.salt` (32 random bytes, mode 0600, made on first use and reused, so ids
stay stable across restarts). Without the salt an id says nothing of the
tokens: no text or token can be recovered from the log, and the same prompt
logged by a deployment with another salt gets unrelated ids. Hand out the log,
never the salt. `skippy-cache replay PATH` sizes the cache's tiers for the
traffic logged (docs/sizing.md).
"""

from __future__ import annotations

import json
import os
import threading
import time
from collections.abc import Sequence
from pathlib import Path

from blake3 import blake3

from skippy_cache.identity import token_bytes
from skippy_cache.server.settings import ServerSettings, SettingsError
from skippy_cache.sizing.trace import BLOCK_TOKENS

SALT_BYTES = 32
_PRIVATE_FILE = 0o600


def hash_ids(salt: bytes, tokens: Sequence[int], block_tokens: int = BLOCK_TOKENS) -> list[int]:
    """The ids of a prompt's blocks: each a 63-bit keyed hash of the prefix that ends with it."""
    data = token_bytes(tokens)
    state = blake3(key=salt)
    ids = []
    for start in range(0, len(tokens), block_tokens):
        state.update(data[4 * start: 4 * (start + block_tokens)])
        ids.append(int.from_bytes(state.copy().digest(length=8), "little") >> 1)
    return ids


def load_salt(path: Path) -> bytes:
    """The deployment's salt from `path`, made (random, mode 0600) if the file does not exist."""
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, _PRIVATE_FILE)
    except FileExistsError:
        salt = path.read_bytes()
        if len(salt) != SALT_BYTES:
            raise ValueError(f"{path}: a trace salt is {SALT_BYTES} bytes, this file has {len(salt)}; remove it "
                             "to make a new one (the ids then change)") from None
        return salt
    salt = os.urandom(SALT_BYTES)
    with os.fdopen(fd, "wb") as f:
        f.write(salt)
    return salt


class TraceLog:
    """Appends one line per ended request; safe from any thread."""

    def __init__(self, path: Path, *, salt: bytes | None = None, started: float | None = None) -> None:
        self.path = path
        self.salt = salt if salt is not None else load_salt(path.with_name(path.name + ".salt"))
        #: `time.monotonic()` at the server's start: timestamps count from it.
        self.started = time.monotonic() if started is None else started
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, _PRIVATE_FILE)
        self._file = os.fdopen(fd, "a", encoding="utf-8", buffering=1)
        self._lock = threading.Lock()

    @classmethod
    def for_settings(cls, settings: ServerSettings) -> TraceLog | None:
        """The log `--trace-log` names (None: none); `SettingsError` naming the file if it cannot be
        written or its salt file is malformed."""
        if settings.trace_log is None:
            return None
        try:
            return cls(settings.trace_log)
        except (OSError, ValueError) as exc:
            raise SettingsError(f"--trace-log {settings.trace_log}: {getattr(exc, 'strerror', None) or exc}") from None

    def write(self, arrived: float, tokens: Sequence[int], output_length: int, tenant: str | None) -> None:
        """One request: it arrived at `arrived` (`time.monotonic()`), with these prompt tokens."""
        line: dict[str, object] = {
            "timestamp": round((arrived - self.started) * 1000),
            "input_length": len(tokens),
            "output_length": output_length,
            "hash_ids": hash_ids(self.salt, tokens),
        }
        if tenant is not None:
            line["tenant"] = tenant
        text = json.dumps(line, separators=(",", ":")) + "\n"
        with self._lock:
            if not self._file.closed:  # a request that ends after the server stopped is not logged
                self._file.write(text)

    def close(self) -> None:
        with self._lock:
            self._file.close()
