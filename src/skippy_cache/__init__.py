"""skippy-cache: exact, resident prefix KV reuse for llama.cpp serving.

The names here are the pure core: no llama.cpp, sockets or threads. The
runtime lives in `skippy_cache.runtime`, the HTTP server in `skippy_cache.server`.
"""

from skippy_cache.cells import CellMap
from skippy_cache.config import (
    LLAMA_MAX_SEQ,
    MIN_CTX_FOR_CELL_CAP,
    CacheConfig,
    CacheMode,
    CachePayload,
    ContextConfig,
    PrefixCandidatePolicy,
    ResidentCacheConfig,
    derive_max_resident_tokens,
)
from skippy_cache.identity import (
    IdentityKey,
    PageId,
    PrefixHash,
    PrefixHasher,
    PrefixIdentity,
    prefix_identities,
    prefix_identity,
)
from skippy_cache.resident import (
    NO_SEQ,
    RecordAllocation,
    ResidentCacheError,
    ResidentCacheStats,
    ResidentEviction,
    ResidentLookup,
    ResidentPrefixCache,
    SeqId,
)

__all__ = [
    "LLAMA_MAX_SEQ",
    "MIN_CTX_FOR_CELL_CAP",
    "NO_SEQ",
    "CacheConfig",
    "CacheMode",
    "CachePayload",
    "CellMap",
    "ContextConfig",
    "IdentityKey",
    "PageId",
    "PrefixCandidatePolicy",
    "PrefixHash",
    "PrefixHasher",
    "PrefixIdentity",
    "RecordAllocation",
    "ResidentCacheConfig",
    "ResidentCacheError",
    "ResidentCacheStats",
    "ResidentEviction",
    "ResidentLookup",
    "ResidentPrefixCache",
    "SeqId",
    "derive_max_resident_tokens",
    "prefix_identities",
    "prefix_identity",
]
