"""The shared tier on a real Redis server, with real engines: what one engine computed, another restores.

Each engine here stands for a replica: its own pool, RAM tier and (no) disk
tier, one Redis between them.
"""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Iterator

import numpy as np
import pytest
from exactmode import assert_as_cold, assert_bit_exact
from fastmode import assert_logits_close
from prompts import make_tokens

from skippy_cache.chunks import derive_secret
from skippy_cache.config import CacheConfig, CacheMode
from skippy_cache.runtime import DoneEvent, Engine, EngineConfig, Event, GenerationRequest
from skippy_cache.runtime.remote import RemoteConfig

pytestmark = [pytest.mark.timeout(600), pytest.mark.model]

CHUNK = 256


#: The secret the replicas of one shared tier share (`--cache-secret-file`).
SECRET = derive_secret(b"the replicas' shared secret, 32 bytes or more")


def replica(url: str, *, deterministic: bool = False, secret: bytes = SECRET, **remote: object) -> Engine:
    config = RemoteConfig(url=url, retry_s=0.2, **remote)  # type: ignore[arg-type]
    return Engine(EngineConfig(ctx_size=4096, lanes=2, host_cache_bytes=1 << 30, cache_dir=None,
                               chunk_tokens=CHUNK, remote=config, deterministic=deterministic,
                               check_invariants=True, cache_secret=secret))


def cache_off(deterministic: bool) -> Engine:
    """The reference: the same engine with its cache off, every prompt computed cold."""
    return Engine(EngineConfig(ctx_size=4096, lanes=2, cache_dir=None, deterministic=deterministic,
                               cache=CacheConfig(mode=CacheMode.DISABLED)))


@pytest.fixture
def replicas(redis_server) -> Iterator[list[Engine]]:
    engines = [replica(redis_server.url), replica(redis_server.url)]
    yield engines
    for engine in engines:
        engine.close(drain=False)


def shared(engine: Engine, timeout: float = 60.0) -> None:
    """Until the engine's entries reached the server: exported, cut, written behind."""
    store = engine.cache.store
    assert store is not None and store.remote is not None
    deadline = time.monotonic() + timeout
    while engine.cache.persist_left or not store.drain(0.05) or not store.remote.flush(0.05):
        assert time.monotonic() < deadline, "the engine's entries never reached the shared tier"
        time.sleep(0.05)


def ask(engine: Engine, tokens: list[int], **kw: object):
    return engine.generate(GenerationRequest(tokens=tokens, max_tokens=2, keep_first_logits=True, **kw),
                           timeout=300)


def test_a_prompt_one_replica_computed_is_restored_by_another(replicas, redis_server):
    a, b = replicas
    prompt = make_tokens(a, 700, seed=1)
    cold = ask(a, prompt)
    assert cold.stats.cache_source == "none"
    shared(a)
    # Two chunks of 256 tokens, the prompt's tail, and the tail of prompt + reply (its chunks are the same).
    assert redis_server.client().dbsize() == 4

    # A prompt that shares 600 tokens: two chunks from the server, the rest prefilled.
    other = prompt[:600] + make_tokens(a, 100, seed=2)
    partial = ask(b, other)
    assert partial.stats.cache_source == "remote"
    assert partial.stats.cached_tokens == 2 * CHUNK
    reference = ask(a, other, lookup=False, record=False)
    assert_logits_close(partial.first_logits, reference.first_logits, "first-token logits after a remote restore")

    # The same prompt again: its chunks are here now, its tail (with the logits) comes from the server.
    repeat = ask(b, prompt)
    assert repeat.stats.cache_source == "remote"
    assert repeat.stats.cached_tokens == len(prompt)
    # An exact repeat samples from the stored first-token logits: bit for bit.
    assert np.array_equal(repeat.first_logits, cold.first_logits)
    assert repeat.stats.restore_ms > 0
    remote = b.stats().remote
    assert remote is not None and remote.hits == 3 and remote.rejected == 0
    assert b.stats().cache.counters.remote_restores == 2


def test_a_prefix_used_again_is_renewed_on_the_server_in_the_caches_order(replicas, redis_server):
    # The server evicts the nearest expiry first (volatile-ttl): a prompt's first chunk must expire
    # last, and a prefix another request reuses (held here, so never written again) is renewed.
    a, _ = replicas
    client = redis_server.client()
    prompt = make_tokens(a, 700, seed=7)
    ask(a, prompt)
    shared(a)
    store = a.cache.store
    assert store is not None and store.remote is not None
    (page,) = [p for p in store._pages.values() if p.logits is not None]
    first, second = (store.remote.name(k) for k in page.chunk_keys)
    tail = store.remote.name(page.tail_key)
    before = [client.pexpiretime(k) for k in (first, second, tail)]
    assert before == sorted(before, reverse=True) and len(set(before)) == 3, before
    time.sleep(1.1)
    longer = prompt + make_tokens(a, 300, seed=8)
    assert ask(a, longer).stats.cached_tokens >= 2 * CHUNK
    shared(a)
    after = [client.pexpiretime(k) for k in (first, second)]
    assert after[0] > after[1] > before[0] + 1000, (before, after)  # renewed by the second use


@pytest.mark.parametrize(
    ("prompt_tokens", "max_tokens", "chunks"),
    [
        (3 * CHUNK - 1, 3, 3),  # the reply completes the third chunk: the sequence entry is sent
        (2 * CHUNK + 10, 1, 2),  # one token, nothing fed back: the whole-prompt entry is sent
    ],
)
def test_a_request_ends_once_its_state_is_on_the_shared_tier(replicas, redis_server, prompt_tokens, max_tokens,
                                                             chunks):
    # A chat client sends its next turn the moment a reply ends, and a load balancer may send
    # it to another replica: when the request's end reaches the client, the chunks of prompt
    # and reply must be on the server already, or that replica computes them again.
    a, b = replicas
    store = a.cache.store
    prompt = make_tokens(a, prompt_tokens, seed=15)
    at_the_end: dict[str, object] = {}
    ended = threading.Event()

    def sink(event: Event) -> None:
        if isinstance(event, DoneEvent):
            # The last sampled token is never fed back: the sequence is one token shorter.
            sequence = (prompt + list(event.tokens))[:-1]
            ids = store.chunk_identities(a.cache.identity_key.with_namespace(None), sequence)
            keys = [store.remote.name(key) for key in store._chunk_keys(ids)]
            at_the_end.update(sequence=sequence, chunks=len(keys), held=redis_server.client().exists(*keys))
            ended.set()

    a.submit(GenerationRequest(tokens=prompt, max_tokens=max_tokens), sink)
    assert ended.wait(300)
    assert at_the_end["chunks"] == chunks
    assert at_the_end["held"] == chunks, "the request ended before its chunks reached the shared tier"

    next_turn = ask(b, at_the_end["sequence"] + make_tokens(a, 50, seed=16))
    assert (next_turn.stats.cache_source, next_turn.stats.cached_tokens) == ("remote", chunks * CHUNK)


def test_a_tampered_value_is_refused(replicas, redis_server):
    a, b = replicas
    prompt = make_tokens(a, 700, seed=3)
    ask(a, prompt)
    shared(a)
    client = redis_server.client()
    # Flip one byte in the middle of the second chunk's value.
    remote = a.cache.store.remote
    ids = a.cache.store.chunk_identities(a.cache.identity_key.with_namespace(None), prompt[:-1])
    second = remote.name(a.cache.store._chunk_keys(ids)[1])
    value = bytearray(client.get(second))
    value[len(value) // 2] ^= 0x01
    client.set(second, bytes(value))

    got = ask(b, prompt)
    assert got.stats.cached_tokens == CHUNK  # the run ends at the chunk that failed
    stats = b.stats().remote
    assert stats is not None and stats.rejected == 1
    # B computed that chunk itself since, and holds its own value, never the refused one.
    held = b.cache.store.chunks.ram_value(a.cache.store._chunk_keys(ids)[1])
    assert held != bytes(value), "a refused value was imported"
    # The refused value was deleted, so B's own write stored the real one: a refused value left in
    # place would only have been renewed by every replica that wrote the chunk.
    shared(b)
    assert client.get(second) == held


def test_a_value_sealed_without_the_secret_is_refused_and_deleted(redis_server):
    # Whoever can write the tier knows every chunk's name and the format: a "replica" with a secret
    # of its own stands for them, and what it writes must never be restored.
    forger, b = replica(redis_server.url, secret=derive_secret(b"not the replicas' secret, 32+ bytes")), \
        replica(redis_server.url)
    try:
        prompt = make_tokens(b, 700, seed=9)
        ask(forger, prompt)
        shared(forger)
        client = redis_server.client()
        planted = {k: client.get(k) for k in client.keys("*")}
        assert len(planted) == 4
        got = ask(b, prompt)
        assert got.stats.cached_tokens == 0 and got.stats.cache_source == "none"
        stats = b.stats().remote
        # Both chunks and the prompt's tail were fetched in one run, and each one refused.
        assert stats is not None and stats.rejected == 3 and stats.hits == 0
        assert b.stats().cache.counters.remote_restores == 0
        # Each refused value was deleted, so B's write stored its own: had one stayed, B's write would
        # only have renewed it, and it would stand for the chunk on every replica.
        shared(b)
        store = b.cache.store
        keys = store._chunk_keys(store.chunk_identities(b.cache.identity_key.with_namespace(None), prompt[:-1]))
        for key in keys:
            held = client.get(store.remote.name(key))
            assert held == store.chunks.ram_value(key) and held != planted[store.remote.name(key).encode()]
    finally:
        forger.close(drain=False)
        b.close(drain=False)


def test_tenants_never_share(replicas, redis_server):
    a, b = replicas
    prompt = make_tokens(a, 700, seed=4)
    ask(a, prompt, namespace="tenant-a")
    shared(a)
    other = ask(b, prompt, namespace="tenant-b")
    assert other.stats.cached_tokens == 0 and other.stats.cache_source == "none"
    same = ask(b, prompt, namespace="tenant-a")
    assert same.stats.cache_source == "remote"


def test_a_server_killed_mid_run_leaves_every_request_answered(redis_server):
    engine = replica(redis_server.url)
    try:
        first = make_tokens(engine, 400, seed=5)
        ask(engine, first)
        shared(engine)
        redis_server.kill()
        for seed in range(6, 9):
            done = ask(engine, make_tokens(engine, 300, seed=seed))
            assert done.stats.completion_tokens == 2
        stats = engine.stats().remote
        assert stats is not None and not stats.up and stats.errors >= 1
        # What the replica holds itself still serves.
        assert ask(engine, first).stats.cached_tokens == len(first)
    finally:
        engine.close(drain=False)


def test_a_server_that_hangs_costs_a_few_timeouts_then_opens_the_breaker(redis_server):
    # Connections stay open and nothing answers: every lookup and write times out. A request's
    # end waits for its write at most that long, and a few timeouts in a row open the breaker.
    engine = replica(redis_server.url, transfer_timeout_ms=300)
    try:
        ask(engine, make_tokens(engine, 300, seed=20))
        shared(engine)
        redis_server.pause()
        for seed in range(21, 25):
            assert ask(engine, make_tokens(engine, 300, seed=seed)).stats.completion_tokens == 2
        stats = engine.stats().remote
        assert stats is not None and not stats.up and stats.errors >= 3
    finally:
        redis_server.resume()
        engine.close(drain=False)


def test_a_server_that_is_not_there_costs_no_request():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # free once closed: nothing listens there
    engine = replica(f"redis://127.0.0.1:{port}/0")
    try:
        t0 = time.perf_counter()
        for seed in range(10, 13):
            assert ask(engine, make_tokens(engine, 200, seed=seed)).stats.completion_tokens == 2
        assert time.perf_counter() - t0 < 120  # a hang would hit the timeout; this is no timing claim
        stats = engine.stats().remote
        assert stats is not None and not stats.up and stats.hits == 0
    finally:
        engine.close(drain=False)


def test_deterministic_replicas_share_a_prefix_bit_for_bit(redis_server):
    # A chunk's name says which kernel computed each of its rows (exact.py): what one
    # replica computed, another restores, and its output equals a cold run's exactly.
    a, b = (replica(redis_server.url, deterministic=True) for _ in range(2))
    cold = cache_off(deterministic=True)
    try:
        prompt = make_tokens(a, 700, seed=5)
        first = ask(a, prompt)
        shared(a)
        # Its last whole block ends at 640: the two tiled chunks of 256 serve, the rest is prefilled.
        other = prompt[:600] + make_tokens(a, 100, seed=6)
        partial, reference = ask(b, other), ask(cold, other)
        assert (partial.stats.cache_source, partial.stats.cached_tokens) == ("remote", 2 * CHUNK)
        assert_bit_exact(partial, reference, "a prompt restored from another replica")
        repeat = ask(b, prompt)
        assert (repeat.stats.cache_source, repeat.stats.cached_tokens) == ("remote", len(prompt))
        assert np.array_equal(repeat.first_logits, first.first_logits)
        assert b.stats().placement.unaligned_steps == 0
    finally:
        for engine in (a, b, cold):
            engine.close(drain=False)


def test_auth_in_the_url(redis_with_password):
    engine = replica(redis_with_password.url)
    wrong = replica(redis_with_password.url.replace("s3cret-pw", "wrong"))
    try:
        prompt = make_tokens(engine, 400, seed=14)
        ask(engine, prompt)
        shared(engine)
        assert redis_with_password.client().dbsize() > 0
        assert engine.stats().remote.up
        assert ask(wrong, prompt).stats.cache_source == "none"
        stats = wrong.stats().remote
        assert not stats.up and "s3cret" not in stats.url and "wrong" not in stats.url
    finally:
        engine.close(drain=False)
        wrong.close(drain=False)


@pytest.mark.parametrize("deterministic", [False, True])
def test_the_next_turn_on_another_replica_reuses_the_reply_to_its_end(redis_server, deterministic):
    # A chat's turn t + 1 resends turn t's reply. The replica that generated it recorded prompt +
    # reply as an entry ending off the chunk grid; its last rows are a partial chunk named by the
    # prefix at its end, so another replica's lookup goes on past the last whole chunk to there.
    a, b, c = (replica(redis_server.url, deterministic=deterministic) for _ in range(3))
    cold = cache_off(deterministic)
    try:
        prompt = make_tokens(a, 2 * CHUNK + 90, seed=21)
        turn = a.generate(GenerationRequest(tokens=prompt, max_tokens=8), timeout=300)
        reply = list(turn.tokens)
        shared(a)
        # Cut at max_tokens: every token but the last was fed back, the entry ends one before
        # the reply's end.
        held = len(prompt) + len(reply) - 1
        assert held % CHUNK
        following = prompt + reply + make_tokens(a, 60, seed=22)[1:]
        replies = ((len(prompt), len(prompt) + len(reply)),)
        # A replica not told where the reply sits stops at the last whole chunk.
        unaware = ask(c, following, record=False)
        assert (unaware.stats.cache_source, unaware.stats.cached_tokens) == ("remote", 2 * CHUNK)
        nxt = ask(b, following, replies=replies)
        assert (nxt.stats.cache_source, nxt.stats.cached_tokens) == ("remote", held)
        reference = ask(cold, following, replies=replies)
        assert_as_cold(nxt, reference, b, deterministic, "the next turn restored from another replica")
    finally:
        for engine in (a, b, c, cold):
            engine.close(drain=False)


@pytest.mark.parametrize("deterministic", [False, True])
def test_a_turn_back_on_the_first_replica_shares_its_own_cells(redis_server, deterministic):
    # Turns alternate between replicas: turn 3 returns to the replica that ran turn 1, whose entry
    # still holds the conversation's start. The restore of turn 2's history from the shared tier
    # shares that entry's cells for its whole chunks and imports only the chunks after them.
    a, b = (replica(redis_server.url, deterministic=deterministic) for _ in range(2))
    cold = cache_off(deterministic)
    try:
        prompt = make_tokens(a, 2 * CHUNK + 90, seed=31)
        first = a.generate(GenerationRequest(tokens=prompt, max_tokens=8), timeout=300)
        shared(a)
        second_prompt = prompt + list(first.tokens) + make_tokens(a, 60, seed=32)[1:]
        replies = ((len(prompt), len(prompt) + len(first.tokens)),)
        second = b.generate(GenerationRequest(tokens=second_prompt, max_tokens=8, replies=replies), timeout=300)
        shared(b)
        third_prompt = second_prompt + list(second.tokens) + make_tokens(a, 60, seed=33)[1:]
        replies += ((len(second_prompt), len(second_prompt) + len(second.tokens)),)
        before = a.stats().cache.counters
        third = ask(a, third_prompt, replies=replies)
        counters = a.stats().cache.counters
        assert (third.stats.cache_source, third.stats.cached_tokens) == ("remote", len(second_prompt) + 7)
        assert counters.restore_shared_tokens - before.restore_shared_tokens == 2 * CHUNK
        reference = ask(cold, third_prompt, replies=replies)
        assert_as_cold(third, reference, a, deterministic, "turn 3 back on the first replica")
        assert a.invariant_failures == []
    finally:
        for engine in (a, b, cold):
            engine.close(drain=False)


@pytest.mark.parametrize("deterministic", [False, True])
def test_a_system_prompt_another_replica_computed_is_restored_to_its_end(redis_server, deterministic):
    # Users of one system prompt ask their own questions. The replica that answered the first
    # recorded the system prompt as an entry of its own, whose rows past the last whole chunk are a
    # partial chunk named by the prefix at its end: another replica restores all of it.
    a, b, c = (replica(redis_server.url, deterministic=deterministic) for _ in range(3))
    cold = cache_off(deterministic)
    try:
        system = make_tokens(a, 2 * CHUNK + 40, seed=41)
        ends = (len(system),)
        ask(a, system + make_tokens(a, 20, seed=42)[1:], prefix_ends=ends)
        shared(a)
        question = system + make_tokens(a, 20, seed=43)[1:]
        # A replica not told where the system prompt ends stops at the last whole chunk.
        unaware = ask(c, question, record=False)
        assert (unaware.stats.cache_source, unaware.stats.cached_tokens) == ("remote", 2 * CHUNK)
        other = ask(b, question, prefix_ends=ends)
        assert (other.stats.cache_source, other.stats.cached_tokens) == ("remote", len(system))
        reference = ask(cold, question, prefix_ends=ends)
        assert_as_cold(other, reference, b, deterministic, "a system prompt restored from another replica")
    finally:
        for engine in (a, b, c, cold):
            engine.close(drain=False)
