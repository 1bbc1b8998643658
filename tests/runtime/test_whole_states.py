"""A store of whole states (sliding-window, recurrent and hybrid models): one piece per entry, restorable
at exactly its own length, found by its page and by name. No model: the payload's bytes are opaque."""

from __future__ import annotations

import numpy as np
import pytest

from skippy_cache.chunkstore import ChunkStore
from skippy_cache.identity import IdentityKey, prefix_identity
from skippy_cache.runtime.statestore import WHOLE_STATE_TOKENS, EntryMeta, StateStore
from skippy_cache.tiers import Hit, Source, Why

KEY = IdentityKey(
    model_id="m", model_digest="d", stage_id="s", stage_index=0, layer_start=0, layer_end=4,
    runtime_abi="abi", weight_layout="CPU", type_k="f16", type_v="f16", flash_attn=True, kv_unified=True,
    ctx_size=4096,
)
TOKENS = list(range(300))


@pytest.fixture
def store():
    s = StateStore(ChunkStore(1 << 24, None, secret=bytes(32)), "recurrent/1234", 64, max_pending_bytes=1 << 24)
    yield s
    s.close()


def put(store: StateStore, n: int, payload: bytes, logits: bytes | None = None):
    ident = prefix_identity(KEY, TOKENS[:n])
    assert store.put(ident.page_id, EntryMeta(KEY, TOKENS[:n], None, 0), payload, logits)
    assert store.drain(10)
    return ident


def test_an_entry_is_one_piece_restorable_at_its_own_length_only(store):
    assert store.whole_states and store.chunk_tokens == WHOLE_STATE_TOKENS
    payload = bytes(np.random.default_rng(1).integers(0, 256, 5000, dtype=np.uint8))
    ident = put(store, 200, payload)
    assert store.available(ident.page_id) == (200, Source.RAM)
    assert store.stats().chunks.ram_chunks == 1
    fetched = store.fetch(Hit(Source.RAM, ident.page_id, 200, Why.DIVERGED), ())
    assert fetched is not None and bytes(fetched.payload) == payload
    assert (fetched.start, fetched.cells, fetched.length) == (0, 200, 200)
    # A shorter part of it is not a state anything computed: refused, never cut.
    assert store.fetch(Hit(Source.RAM, ident.page_id, 150, Why.DIVERGED), ()) is None


def test_a_whole_state_is_found_by_name_as_a_tail(store):
    ident = put(store, 256, b"state-bytes" * 100)
    # What a lookup of a longer prompt asks for: no chunks, and the ends where entries may end.
    tails = (prefix_identity(KEY, TOKENS[:128]), ident)
    assert store.probe((), None, tails) == (256, Source.RAM, False)
    fetched = store.fetch(Hit(Source.RAM, None, 256, Why.DIVERGED), (), tails)
    assert fetched is not None and bytes(fetched.payload) == b"state-bytes" * 100


def test_a_whole_prompt_keeps_its_logits(store):
    logits = np.arange(8, dtype=np.float32)
    whole = prefix_identity(KEY.with_namespace("whole"), TOKENS[:100])
    assert store.put(whole.page_id, EntryMeta(KEY, TOKENS[:100], None, 0), b"x" * 64, logits.tobytes())
    assert store.drain(10)
    assert store.probe((), whole) == (0, Source.RAM, True)
    fetched = store.fetch(Hit(Source.RAM, whole.page_id, 100, Why.EXACT_REPEAT), ())
    assert fetched is not None and np.array_equal(fetched.logits, logits)
