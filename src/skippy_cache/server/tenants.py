"""Who is calling: API keys, the tenant and role each names, and the cache namespace of a request.

A shared prefix cache is a side channel: a request's time to first token
tells whether someone sent the same prefix before. So tenants never share
cached state unless they choose to: a request's namespace is its tenant's,
`cache_salt` narrows it inside the tenant, and a shared namespace the
operator declares is joined only by the tenants named for it, per request
(the `X-Skippy-Namespace` header).

The key file holds one key per line, then options:

    # key (or its hash)   tenant   role    options
    sha256:9f86d08...     alice    user    shared=public,docs
    sha256:1e2f3a4...     legal    user    store=none
    sha256:60303ae...     ops      admin

`shared=` names the shared namespaces the key may join; `store=` where the
tenant's entries may go when they leave the pool (`all`, the default; `ram`:
never to disk or the shared tier; `none`: nowhere). A tenant's options are
those of its keys, which must agree.

Keys are held and compared as SHA-256 digests (API keys are random, so a
fast hash is enough: no dictionary to grind through), every digest on every
request, with `hmac.compare_digest`: how long a check takes does not depend
on which key, if any, matched. A plain key in the file is hashed at load and
a warning says which line to replace (`skippy-cache hash-key`).
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import re
import secrets
from dataclasses import dataclass, field
from enum import StrEnum
from pathlib import Path

from starlette.requests import Request

from skippy_cache.runtime import Keep
from skippy_cache.server.settings import ServerSettings, SettingsError

log = logging.getLogger("skippy_cache.server")

HASH_PREFIX = "sha256:"
#: The header a request joins a shared namespace with.
NAMESPACE_HEADER = "x-skippy-namespace"
#: Tenant and shared namespace names: no separator, no control characters, nothing to escape.
NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,63}")
#: Parts of a namespace are joined with a control character, which `cache_salt` may not hold
#: (schemas.CacheSalt): a salt can never spell another tenant's namespace.
_SEP = "\x1f"
#: The tenant of the single `--api-key`, when a key file names tenants too.
ADMIN_KEY_TENANT = "admin"


class Role(StrEnum):
    #: Its own tenant's requests, entries and counters.
    USER = "user"
    #: Every tenant's entries and counters, the dashboard's prefix text, /metrics, clearing any tenant.
    ADMIN = "admin"


class KeyFileError(SettingsError):
    """A key file that cannot be used; the message names the file and the line."""


@dataclass(frozen=True, slots=True)
class Caller:
    """Whom a request's key names. `tenant` None: the server has no tenants (one shared cache)."""

    tenant: str | None
    role: Role
    #: Shared namespaces this caller may join.
    shared: frozenset[str] = field(default_factory=frozenset)
    #: Where its tenant's entries may go when they leave the pool.
    keep: Keep = Keep.ALL

    @property
    def admin(self) -> bool:
        return self.role is Role.ADMIN


#: Everyone, on a server without keys: one tenant, who sees everything.
OPEN = Caller(None, Role.ADMIN)


@dataclass(frozen=True, slots=True)
class Scope:
    """Where a request's cache entries live: its caller's tenant, or a shared namespace it joined."""

    tenant: str | None
    shared: str | None = None
    keep: Keep = Keep.ALL

    def namespace(self, cache_salt: str | None) -> str | None:
        """The engine namespace of a request with this `cache_salt`.

        Without tenants it is the salt itself, as before tenants existed, so
        entries recorded then (on disk, on the shared tier) are still found.
        """
        if self.shared is not None:
            parts = ["shared", self.shared]
        elif self.tenant is not None:
            parts = ["tenant", self.tenant]
        else:
            return cache_salt
        if cache_salt is not None:
            parts.append(cache_salt)
        return _SEP.join(parts)


def in_tenant(namespace: str | None, tenant: str) -> bool:
    """Whether a namespace is `tenant`'s own (with or without a salt); a shared one is no tenant's."""
    own = Scope(tenant).namespace(None)
    assert own is not None
    return namespace is not None and (namespace == own or namespace.startswith(own + _SEP))


@dataclass(frozen=True, slots=True)
class KeyEntry:
    """One accepted key: its SHA-256 digest and whom it names."""

    digest: bytes
    caller: Caller


def hash_key(key: str) -> str:
    """A key as the key file stores it: `sha256:` and the hex digest of its UTF-8 bytes."""
    return HASH_PREFIX + _sha256(key).hex()


def _sha256(key: str) -> bytes:
    return hashlib.sha256(key.encode("utf-8")).digest()


def new_key() -> str:
    """A fresh random key (256 bits)."""
    return "sk-skippy-" + secrets.token_urlsafe(32)


def parse_key_file(text: str, source: str) -> list[KeyEntry]:
    """The entries of a key file's text; `KeyFileError` naming `source` and the line for any fault."""
    entries: list[KeyEntry] = []
    seen: dict[bytes, str] = {}
    keeps: dict[str, tuple[Keep, int]] = {}
    for number, raw in enumerate(text.splitlines(), start=1):
        line = raw.split("#", 1)[0].strip()  # a comment; keys (hashed or made by hash-key) have no '#'
        if not line:
            continue
        where = f"{source}:{number}"
        fields = line.split()
        if len(fields) < 3:
            raise KeyFileError(f"{where}: expected 'KEY TENANT ROLE [OPTION=VALUE ...]', got {len(fields)} fields")
        key, tenant, role_name = fields[:3]
        if not NAME.fullmatch(tenant):
            raise KeyFileError(f"{where}: tenant {tenant!r} is not a name (letters, digits, '_', '.', '-'; "
                               "at most 64)")
        try:
            role = Role(role_name)
        except ValueError:
            raise KeyFileError(f"{where}: role {role_name!r} is neither 'user' nor 'admin'") from None
        shared, keep = _options(fields[3:], where)
        if keeps.setdefault(tenant, (keep, number))[0] is not keep:
            raise KeyFileError(f"{where}: store={keep.value}, but line {keeps[tenant][1]} gives tenant {tenant!r} "
                               f"store={keeps[tenant][0].value}: a tenant's keys must agree")
        digest = _digest(key, where)
        if digest in seen:
            raise KeyFileError(f"{where}: the same key as {seen[digest]}")
        seen[digest] = where
        entries.append(KeyEntry(digest, Caller(tenant, role, shared, keep)))
    if not entries:
        raise KeyFileError(f"{source}: no keys (one line per key: 'KEY TENANT ROLE [OPTION=VALUE ...]')")
    return entries


def _options(fields: list[str], where: str) -> tuple[frozenset[str], Keep]:
    shared: frozenset[str] = frozenset()
    keep = Keep.ALL
    given: set[str] = set()
    for field_ in fields:
        name, eq, value = field_.partition("=")
        if not eq or name not in ("shared", "store"):
            raise KeyFileError(f"{where}: {field_!r} is not an option (shared=NAME,... or store=all|ram|none)")
        if name in given:
            raise KeyFileError(f"{where}: {name}= given twice")
        given.add(name)
        if name == "shared":
            shared = frozenset(value.split(","))
            for namespace in sorted(shared):
                if not NAME.fullmatch(namespace):
                    raise KeyFileError(f"{where}: shared namespace {namespace!r} is not a name (letters, digits, "
                                       "'_', '.', '-'; at most 64)")
        else:
            try:
                keep = Keep(value)
            except ValueError:
                raise KeyFileError(f"{where}: store={value!r}: expected all, ram or none") from None
    return shared, keep


def read_key_file(path: Path) -> list[KeyEntry]:
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise KeyFileError(f"{path}: cannot read it ({getattr(exc, 'strerror', None) or exc})") from None
    return parse_key_file(text, str(path))


def _digest(key: str, where: str) -> bytes:
    if key.startswith(HASH_PREFIX):
        hexdigest = key.removeprefix(HASH_PREFIX)
        if not re.fullmatch(r"[0-9a-f]{64}", hexdigest):
            raise KeyFileError(f"{where}: a hashed key is 'sha256:' and 64 lowercase hex digits")
        return bytes.fromhex(hexdigest)
    log.warning("%s holds a plain key: store its hash instead (skippy-cache hash-key)", where)
    return _sha256(key)


class Keys:
    """The keys the server accepts; a reload replaces them all or, if the file is bad, none."""

    def __init__(self, path: Path | None, admin_key: str | None) -> None:
        self.path = path
        self._admin = (
            KeyEntry(_sha256(admin_key), Caller(ADMIN_KEY_TENANT if path is not None else None, Role.ADMIN))
            if admin_key else None
        )
        self._entries = self._load()

    @classmethod
    def for_settings(cls, settings: ServerSettings) -> Keys | None:
        """The keys `--api-keys` and `--api-key` name (`KeyFileError` for a bad file); None: an open server."""
        if settings.api_keys is None and not settings.api_key:
            return None
        return cls(settings.api_keys, settings.api_key)

    @property
    def tenants(self) -> bool:
        """Whether requests are told apart by tenant (a key file is in use)."""
        return self.path is not None

    @property
    def shared(self) -> frozenset[str]:
        """Every shared namespace some key may join."""
        return frozenset().union(*(entry.caller.shared for entry in self._entries))

    def _load(self) -> tuple[KeyEntry, ...]:
        entries = read_key_file(self.path) if self.path is not None else []
        return (*entries, self._admin) if self._admin is not None else tuple(entries)

    def reload(self) -> int:
        """Read the key file again (SIGHUP); how many keys are in use. On a bad file the keys in use
        stay and `KeyFileError` says why. A request already authenticated runs on."""
        entries = self._load()
        self._entries = entries
        return len(entries)

    def authenticate(self, key: str) -> Caller | None:
        digest = _sha256(key)
        found: Caller | None = None
        for entry in self._entries:  # every entry, matched or not: the time does not tell which
            if hmac.compare_digest(entry.digest, digest):
                found = entry.caller
        return found


def caller_of(request: Request) -> Caller:
    """The caller the auth dependency found for this request (app.py)."""
    return getattr(request.state, "caller", OPEN)


def scope_of(request: Request) -> Scope:
    """The scope the auth dependency gave this request: its tenant, or the shared namespace it joined."""
    caller = caller_of(request)
    return getattr(request.state, "scope", Scope(caller.tenant, keep=caller.keep))
