"""Prefix identity: the BLAKE3 name of a KV state, over everything that shaped it.

Reuse is exact, so every input that changes the KV bytes goes into the hash:
model (id and file digest), stage and layer range, runtime ABI, the weight
layout (which buffer types hold the weights: repacked weights run other matmul
kernels, so other floats; `weights.py`), KV layout and dtype, flash attention, `kv_unified`, context size, namespace, the first
token's position, and the token ids. Each field is framed with its name, a
type tag and its length, so no two different field lists can produce the same
byte stream (e.g. stage "a1" + index 2 vs stage "a" + index 12).

Deliberately excluded: `n_batch`, thread count and lane count. They change the
float summation order of later computation, not which state a hit stands for;
EXACTNESS.md and the runtime's grid-aligned prefill deal with that.
`n_gpu_layers` is excluded too: on the CPU-only builds this project targets it
does not change the KV; a GPU build must add it (see `IdentityKey.extra`).
"""

from __future__ import annotations

import struct
import sys
from array import array
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field, replace
from typing import NewType

from blake3 import blake3

from skippy_cache.config import ContextConfig

PrefixHash = NewType("PrefixHash", str)
PageId = NewType("PageId", str)

_DOMAIN = b"skippy-cache/prefix-identity/v2"
_TOKEN_ITEMSIZE = 4


@dataclass(frozen=True, kw_only=True)
class IdentityKey:
    """Everything except the tokens that decides which KV a token run produces."""

    model_id: str
    model_digest: str
    stage_id: str
    stage_index: int
    layer_start: int
    layer_end: int
    runtime_abi: str
    #: The buffer types that hold the weights (`weights.weight_layout_name`: `CPU_Mapped`, `CPU_Mapped+CPU_REPACK`).
    weight_layout: str
    type_k: str
    type_v: str
    flash_attn: bool
    kv_unified: bool
    ctx_size: int
    #: Chat template, tenant or `cache_salt`; None is hashed apart from "".
    namespace: str | None = None
    #: Further (name, value) pairs a runtime knows change the KV bytes.
    extra: tuple[tuple[str, str], ...] = field(default=())

    @classmethod
    def from_context(
        cls,
        stage: ContextConfig,
        *,
        model_digest: str,
        runtime_abi: str,
        weight_layout: str,
        namespace: str | None = None,
    ) -> IdentityKey:
        return cls(
            model_id=stage.model_id,
            model_digest=model_digest,
            stage_id=stage.stage_id,
            stage_index=stage.stage_index,
            layer_start=stage.layer_start,
            layer_end=stage.layer_end,
            runtime_abi=runtime_abi,
            weight_layout=weight_layout,
            type_k=stage.cache_type_k,
            type_v=stage.cache_type_v,
            flash_attn=stage.flash_attn,
            kv_unified=stage.kv_unified,
            ctx_size=stage.ctx_size,
            namespace=namespace,
        )

    def with_namespace(self, namespace: str | None) -> IdentityKey:
        return replace(self, namespace=namespace)

    def header_bytes(self) -> bytes:
        out = bytearray()
        _put_str(out, b"domain", _DOMAIN.decode())
        _put_str(out, b"model_id", self.model_id)
        _put_str(out, b"model_digest", self.model_digest)
        _put_str(out, b"stage_id", self.stage_id)
        _put_int(out, b"stage_index", self.stage_index)
        _put_int(out, b"layer_start", self.layer_start)
        _put_int(out, b"layer_end", self.layer_end)
        _put_str(out, b"runtime_abi", self.runtime_abi)
        _put_str(out, b"weight_layout", self.weight_layout)
        _put_str(out, b"type_k", self.type_k)
        _put_str(out, b"type_v", self.type_v)
        _put_bool(out, b"flash_attn", self.flash_attn)
        _put_bool(out, b"kv_unified", self.kv_unified)
        _put_int(out, b"ctx_size", self.ctx_size)
        if self.namespace is None:
            _put_none(out, b"namespace")
        else:
            _put_str(out, b"namespace", self.namespace)
        _put_int(out, b"extra_count", len(self.extra))
        for name, value in self.extra:
            _put_str(out, b"extra_name", name)
            _put_str(out, b"extra_value", value)
        return bytes(out)


@dataclass(frozen=True)
class PrefixIdentity:
    hash: PrefixHash
    page_id: PageId
    token_start: int
    token_count: int


class PrefixHasher:
    """Identities of every prefix of one token run, hashing each token once.

    The header and the tokens stream through one BLAKE3 state; the identity of
    the first n tokens is a copy of that state with n appended as a trailer.
    Asking for lengths in ascending order costs one pass over the tokens in all,
    instead of one pass per candidate (8,000 tokens x 60 candidates would
    otherwise hash ~2 MB per request).
    """

    def __init__(self, key: IdentityKey, tokens: Sequence[int], token_start: int = 0) -> None:
        if token_start < 0:
            raise ValueError(f"token_start must be >= 0, got {token_start}")
        self._key = key
        self._tokens = tokens
        self._token_start = token_start
        self._hasher = blake3(key.header_bytes())
        start = bytearray()
        _put_int(start, b"token_start", token_start)
        start += b"tokens"
        self._hasher.update(bytes(start))
        self._fed = 0

    def identity(self, token_count: int) -> PrefixIdentity:
        """Identity of the first `token_count` tokens; counts must not decrease."""
        if not 0 <= token_count <= len(self._tokens):
            raise ValueError(f"token_count {token_count} outside 0..{len(self._tokens)}")
        if token_count < self._fed:
            raise ValueError(
                f"PrefixHasher asked for {token_count} tokens after {self._fed}: "
                "ask in ascending order (prefix_identities sorts for you)"
            )
        if token_count > self._fed:
            self._hasher.update(token_bytes(self._tokens[self._fed : token_count]))
            self._fed = token_count
        final = self._hasher.copy()
        final.update(struct.pack("<Q", token_count))
        hex_digest = final.hexdigest()
        key = self._key
        page_id = f"{key.stage_id}:{self._token_start}:{token_count}:{key.layer_start}:{hex_digest[:16]}"
        return PrefixIdentity(
            hash=PrefixHash(f"blake3:{hex_digest}"),
            page_id=PageId(page_id),
            token_start=self._token_start,
            token_count=token_count,
        )


def prefix_identity(key: IdentityKey, tokens: Sequence[int], token_start: int = 0) -> PrefixIdentity:
    """Identity of the whole token run `tokens`, whose first token sits at `token_start`."""
    return PrefixHasher(key, tokens, token_start).identity(len(tokens))


def prefix_identities(
    key: IdentityKey, tokens: Sequence[int], counts: Iterable[int], token_start: int = 0
) -> dict[int, PrefixIdentity]:
    """Identities of the prefixes of `tokens` of each length in `counts`."""
    hasher = PrefixHasher(key, tokens, token_start)
    return {n: hasher.identity(n) for n in sorted(set(counts))}


def token_bytes(tokens: Sequence[int]) -> bytes:
    """Token ids as every hash of them reads them: int32, little-endian."""
    packed = array("i", tokens)
    if packed.itemsize != _TOKEN_ITEMSIZE:  # pragma: no cover - exotic C ABI
        return struct.pack(f"<{len(tokens)}i", *tokens)
    if sys.byteorder != "little":  # pragma: no cover - big-endian hosts
        packed.byteswap()
    return packed.tobytes()


def _put(out: bytearray, name: bytes, tag: bytes, value: bytes) -> None:
    out += struct.pack("<B", len(name)) + name + tag + struct.pack("<Q", len(value)) + value


def _put_str(out: bytearray, name: bytes, value: str) -> None:
    _put(out, name, b"s", value.encode("utf-8"))


def _put_int(out: bytearray, name: bytes, value: int) -> None:
    _put(out, name, b"i", struct.pack("<q", value))


def _put_bool(out: bytearray, name: bytes, value: bool) -> None:
    _put(out, name, b"b", b"\x01" if value else b"\x00")


def _put_none(out: bytearray, name: bytes) -> None:
    _put(out, name, b"n", b"")
