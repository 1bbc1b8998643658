"""Chunks of sequence state: their names, and the sealed bytes they are stored as.

A chunk is a run of token rows as `stateformat.split` cuts them (`payload`),
plus, on the chunk that ends a whole prompt (a "tail"), the logits of its last
token. Its key names what it stands for: the stored format, the KV layout, the
kind, and the prefix identity's page id (which already covers the model, the
KV settings, the namespace and the tokens). Keys are 32 lowercase hex digits,
safe as file names and Redis keys.

A sealed value describes itself and carries its own MAC:

    8 bytes magic  b"SKPCHNK2"
    header         u16 key length, u32 tokens, u64 logits length, u64 payload length (little-endian)
    key            ASCII, exactly the key it is stored under
    mac            32-byte keyed BLAKE3 over header, key, logits and payload
    logits         float32 bytes, or nothing (length 0 stands for None)
    payload        the token rows

The MAC is keyed with a secret the operator holds (`derive_secret`), not a
plain digest: keys are computable from the model, namespace and tokens, so
anyone who can write where chunks are kept (the shared tier, a disk) could
otherwise store KV state of their choosing under another request's key, and
it would verify. Without the secret no value they make verifies.

Invariants: `unseal(key, seal(c, s), s) == c` whenever `c.key == key`;
`unseal` returns nothing it has not verified, and refuses (`ChunkError`) a
value that is truncated, extended, altered anywhere, sealed under another key
(a file renamed or copied to another key, e.g. a chunk of another model), or
sealed with another secret.
"""

from __future__ import annotations

import hmac
import re
import struct
from dataclasses import dataclass

from blake3 import blake3

from skippy_cache.stateformat import FORMAT_VERSION

MAGIC = b"SKPCHNK2"
KEY_CHARS = 32  # 128 bits of BLAKE3: a collision needs ~2**64 chunks
SECRET_BYTES = 32  # BLAKE3's key size
#: Secret material shorter than this is refused: a guessable secret lets anyone forge chunks.
MIN_SECRET_MATERIAL = 32

# v2: chunks carry a keyed MAC. New names leave v1 chunks (unkeyed digests) unnamed, so they age out
# of every tier as misses instead of failing verification one by one.
_DOMAIN = b"skippy-cache/chunk-key/v2"
_SECRET_CONTEXT = "skippy-cache chunk MAC secret v1"
_HEAD = struct.Struct("<HIQQ")  # key length, tokens, logits length, payload length
_DIGEST = 32  # the MAC's length
_KEY_RE = re.compile(f"[0-9a-f]{{{KEY_CHARS}}}")


class ChunkError(ValueError):
    """A sealed value that does not verify, or a chunk that cannot be sealed."""


@dataclass(frozen=True, slots=True)
class Chunk:
    key: str
    tokens: int
    #: Token rows, as `stateformat.split` produces them; `unseal` gives a view into the sealed value.
    payload: bytes | memoryview
    #: float32 logits of the last token; only on a whole-prompt "tail" chunk.
    logits: bytes | None = None

    @property
    def nbytes(self) -> int:
        return len(self.payload) + (len(self.logits) if self.logits is not None else 0)


def is_key(name: str) -> bool:
    """True if `name` has the shape of a key (32 lowercase hex digits)."""
    return _KEY_RE.fullmatch(name) is not None


def chunk_key(page_id: str, layout: str) -> str:
    """The key of the rows that end prefix `page_id` under `layout` (a `Layout.fingerprint()`): a full
    chunk's, or the partial chunk that ends an entry off the chunk grid (a reply's)."""
    return _key("chunk", page_id, layout)


def tail_key(page_id: str, layout: str) -> str:
    """The key of a whole-prompt chunk (rows and logits); apart from `chunk_key` of the same page."""
    return _key("tail", page_id, layout)


def _key(kind: str, page_id: str, layout: str) -> str:
    h = blake3(_DOMAIN)
    # Each field length-prefixed, so no two field lists make the same stream.
    for value in (FORMAT_VERSION, layout, kind, page_id):
        data = value.encode("utf-8")
        h.update(struct.pack("<Q", len(data)))
        h.update(data)
    return h.hexdigest(length=KEY_CHARS // 2)


def derive_secret(material: bytes) -> bytes:
    """The MAC key made from an operator's secret material (a key file's contents, at least
    `MIN_SECRET_MATERIAL` bytes after surrounding whitespace is stripped)."""
    material = material.strip()
    if len(material) < MIN_SECRET_MATERIAL:
        raise ChunkError(f"a chunk secret needs at least {MIN_SECRET_MATERIAL} bytes, got {len(material)}")
    return blake3(material, derive_key_context=_SECRET_CONTEXT).digest()


def _mac(secret: bytes) -> blake3:
    if len(secret) != SECRET_BYTES:
        raise ChunkError(f"a MAC key is {SECRET_BYTES} bytes (derive_secret makes one), got {len(secret)}")
    return blake3(key=secret)


def seal(chunk: Chunk, secret: bytes) -> bytes:
    """The chunk as one self-describing value, MAC'd with `secret` (layout in the module docstring)."""
    if not chunk.key.isascii() or not 0 < len(chunk.key) < 2**16:
        raise ChunkError(f"cannot seal under key {chunk.key!r}: it must be 1..65535 ASCII characters")
    key = chunk.key.encode("ascii")
    if not 0 < chunk.tokens < 2**32:
        raise ChunkError(f"cannot seal a chunk of {chunk.tokens} tokens")
    if chunk.logits is not None and len(chunk.logits) == 0:
        # Length 0 spells None in the header; sealing b"" would come back as None.
        raise ChunkError("empty logits: pass None for a chunk without logits")
    logits = chunk.logits or b""
    head = _HEAD.pack(len(key), chunk.tokens, len(logits), len(chunk.payload))
    h = _mac(secret)
    h.update(head)
    h.update(key)
    h.update(logits)
    h.update(chunk.payload)
    return b"".join((MAGIC, head, key, h.digest(), logits, chunk.payload))


def unseal(key: str, value: bytes | bytearray | memoryview, secret: bytes) -> Chunk:
    """The chunk sealed in `value` under `key` with `secret`, verified; raises ChunkError if anything
    disagrees."""
    view = memoryview(value).cast("B")
    fixed = len(MAGIC) + _HEAD.size
    if len(view) < fixed:
        raise ChunkError(f"chunk {key}: truncated, {len(view)} bytes, the header alone needs {fixed}")
    if view[: len(MAGIC)] != MAGIC:
        raise ChunkError(f"chunk {key}: not a sealed chunk (magic {bytes(view[: len(MAGIC)])!r})")
    key_len, tokens, logits_len, payload_len = _HEAD.unpack_from(view, len(MAGIC))
    logits_at = fixed + key_len + _DIGEST
    total = logits_at + logits_len + payload_len
    if len(view) != total:
        what = "truncated" if len(view) < total else f"{len(view) - total} trailing bytes"
        raise ChunkError(f"chunk {key}: {what} ({len(view)} bytes, the header says {total})")
    stored_key = bytes(view[fixed : fixed + key_len])
    if stored_key != key.encode("utf-8"):
        raise ChunkError(
            f"chunk {key}: sealed under key {stored_key.decode('utf-8', 'replace')!r} "
            "(a file renamed or copied to another key)"
        )
    h = _mac(secret)
    h.update(view[len(MAGIC) : fixed + key_len])
    h.update(view[logits_at:])
    if not hmac.compare_digest(h.digest(), bytes(view[fixed + key_len : logits_at])):
        raise ChunkError(f"chunk {key}: MAC mismatch (corrupted, or not sealed with this server's secret)")
    if tokens < 1:
        raise ChunkError(f"chunk {key}: holds {tokens} tokens")
    logits = bytes(view[logits_at : logits_at + logits_len]) if logits_len else None
    payload = view[logits_at + logits_len :]
    # A view, not a copy, when nothing can change the value under it: a restore of a few thousand
    # tokens reads tens of MiB of rows, and copying each chunk first doubled its time.
    return Chunk(key, tokens, payload if isinstance(value, bytes) else bytes(payload), logits)
