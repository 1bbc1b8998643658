"""ChunkStore: tiers, write-through and promotion, verification on every read, dedup books."""

from __future__ import annotations

import logging
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from skippy_cache.chunks import Chunk, chunk_key, derive_secret, tail_key
from skippy_cache.chunks import seal as seal_with
from skippy_cache.chunkstore import ChunkStore, Tier
from skippy_cache.diskchunks import DiskChunks

SECRET = derive_secret(b"the chunk store tests' secret, 32+ bytes")


def seal(chunk: Chunk) -> bytes:
    return seal_with(chunk, SECRET)


def K(i: int) -> str:
    return chunk_key(f"page-{i}", "layout")


def make(i: int, size: int = 100, logits: bytes | None = None) -> Chunk:
    return Chunk(K(i), 1 + i % 7, bytes([i % 256]) * size, logits)


def sealed_size(i: int, size: int = 100) -> int:
    return len(seal(make(i, size)))


class Sealer:
    """A seal callback that counts its calls."""

    def __init__(self, chunk: Chunk) -> None:
        self.chunk = chunk
        self.calls = 0

    def __call__(self) -> bytes:
        self.calls += 1
        return seal(self.chunk)


def add(store: ChunkStore, i: int, size: int = 100) -> bool:
    c = make(i, size)
    return store.add(c.key, len(c.payload), Sealer(c))


@pytest.fixture
def disk(tmp_path: Path) -> Iterator[DiskChunks]:
    with DiskChunks(tmp_path, 100_000, reserve_bytes=0) as d:
        yield d


# -- where and run ---------------------------------------------------------------------------


def test_run_counts_consecutive_keys_and_reports_the_slowest_tier(disk: DiskChunks) -> None:
    one = sealed_size(0)
    store = ChunkStore(2 * one, disk, secret=SECRET)
    for i in range(4):
        add(store, i)  # RAM holds the last two: 0 and 1 are on disk only
    assert [store.where(K(i)) for i in range(5)] == [Tier.DISK, Tier.DISK, Tier.RAM, Tier.RAM, None]
    assert store.run([K(2), K(3)]) == (2, Tier.RAM)
    assert store.run([K(2), K(3), K(0), K(4), K(1)]) == (3, Tier.DISK)
    assert store.run([K(0), K(1), K(2)]) == (3, Tier.DISK)
    assert store.run([K(4), K(0)]) == (0, None)
    assert store.run([]) == (0, None)
    # pure: no recency change, no counters
    assert list(store._ram) == [K(2), K(3)]
    s = store.stats()
    assert (s.ram_hits, s.disk_hits, s.misses) == (0, 0, 0)


def test_without_disk_ram_eviction_drops(tmp_path: Path) -> None:
    one = sealed_size(0)
    store = ChunkStore(2 * one, None, secret=SECRET)
    for i in range(3):
        assert add(store, i)
    assert store.where(K(0)) is None and store.get(K(0)) is None
    assert store.get(K(2)) == make(2)
    s = store.stats()
    assert (s.ram_chunks, s.ram_hits, s.misses, s.disk) == (2, 1, 1, None)
    store.check_invariants()


def test_write_through_spills_and_promotes_back(disk: DiskChunks) -> None:
    one = sealed_size(0)
    store = ChunkStore(2 * one, disk, secret=SECRET)
    for i in range(3):
        assert add(store, i)
    assert disk.keys() == [K(0), K(1), K(2)]  # every chunk is on disk at once
    assert list(store._ram) == [K(1), K(2)]
    assert store.get(K(0)) == make(0)  # from disk, verified, promoted
    assert list(store._ram) == [K(2), K(0)]
    assert store.where(K(0)) is Tier.RAM and store.where(K(1)) is Tier.DISK
    assert store.get(K(0)) == make(0)  # now from RAM
    s = store.stats()
    assert (s.ram_hits, s.disk_hits, s.misses) == (1, 1, 0)
    store.check_invariants()


def test_a_ram_tier_of_zero_bytes_serves_from_disk(disk: DiskChunks) -> None:
    store = ChunkStore(0, disk, secret=SECRET)
    assert add(store, 1)
    assert store.where(K(1)) is Tier.DISK and store.stats().ram_chunks == 0
    assert store.get(K(1)) == make(1)
    assert store.stats().disk_hits == 1


def test_a_value_that_fits_nowhere_is_not_stored(tmp_path: Path) -> None:
    with DiskChunks(tmp_path, 50, reserve_bytes=0) as d:
        store = ChunkStore(50, d, secret=SECRET)
        assert not add(store, 1)
        assert K(1) not in store
        assert store.stats().logical_bytes == 0  # not held, so stored on behalf of nobody


def test_logits_round_trip_through_both_tiers(disk: DiskChunks) -> None:
    c = Chunk(tail_key("page", "layout"), 3, b"rows" * 10, b"\x00\x00\x80\x3f" * 4)
    store = ChunkStore(10_000, disk, secret=SECRET)
    store.add(c.key, len(c.payload), lambda: seal(c))
    assert store.get(c.key) == c
    store._ram.clear()
    store._ram_bytes = 0
    assert store.get(c.key) == c


# -- verification ----------------------------------------------------------------------------


def flip_a_byte(path: Path, at: int = -1) -> None:
    data = bytearray(path.read_bytes())
    data[at] ^= 0xFF
    path.write_bytes(bytes(data))


def test_a_corrupted_file_is_quarantined(disk: DiskChunks, tmp_path: Path, caplog) -> None:
    store = ChunkStore(0, disk, secret=SECRET)
    add(store, 1)
    flip_a_byte(disk._path(K(1)))
    with caplog.at_level(logging.WARNING, logger="skippy_cache.store"):
        assert store.get(K(1)) is None
    assert K(1) not in store and store.where(K(1)) is None
    s = store.stats()
    assert (s.quarantined, s.disk.quarantined, s.misses, s.disk_hits) == (1, 1, 1, 0)
    moved = list((tmp_path / "v1" / "quarantine").iterdir())
    assert len(moved) == 1 and moved[0].name.startswith(K(1))
    assert not disk._path(K(1)).exists()
    assert [r.getMessage() for r in caplog.records] == [
        f"quarantined chunk {K(1)} from disk: chunk {K(1)}: MAC mismatch "
        "(corrupted, or not sealed with this server's secret)"
    ]
    store.check_invariants()


def test_a_chunk_planted_without_the_secret_is_quarantined_and_the_real_one_is_stored_again(
    disk: DiskChunks,
) -> None:
    # Whoever can write the tier knows every key and the format, not the secret.
    planted = derive_secret(b"the planter's own secret, 32+ bytes long")
    assert disk.put(K(1), seal_with(make(1, 300), planted))
    store = ChunkStore(0, disk, secret=SECRET)
    assert K(1) in store and store.get(K(1)) is None
    assert K(1) not in store and store.stats().quarantined == 1
    assert add(store, 1) and store.get(K(1)) == make(1)


def test_a_file_renamed_to_another_key_is_quarantined(disk: DiskChunks) -> None:
    store = ChunkStore(0, disk, secret=SECRET)
    add(store, 1)
    add(store, 2)
    shutil.copyfile(disk._path(K(1)), disk._path(K(2)))
    assert store.get(K(2)) is None
    assert store.get(K(1)) == make(1)
    assert store.stats().quarantined == 1


def test_a_corrupted_ram_value_is_dropped(caplog) -> None:
    store = ChunkStore(10_000, None, secret=SECRET)
    add(store, 1)
    bad = bytearray(store._ram[K(1)])
    bad[-1] ^= 0xFF
    store._ram[K(1)] = bytes(bad)
    with caplog.at_level(logging.WARNING, logger="skippy_cache.store"):
        assert store.get(K(1)) is None
        add(store, 2)
        store._ram[K(2)] = store._ram[K(2)][:-1] + b"\0"
        store._ram_bytes = sum(len(v) for v in store._ram.values())
        assert store.get(K(2)) is None
    assert K(1) not in store and store.stats().ram_chunks == 0
    s = store.stats()
    assert (s.quarantined, s.misses, s.ram_hits) == (2, 2, 0)
    assert len(caplog.records) == 2
    store.check_invariants()


def test_a_corrupted_ram_value_falls_back_to_the_good_disk_copy(disk: DiskChunks) -> None:
    # Both copies come from one sealed value: a flip in RAM says nothing about the file.
    store = ChunkStore(10_000, disk, secret=SECRET)
    add(store, 1)
    store._ram[K(1)] = b"\0" + store._ram[K(1)][1:]
    assert store.get(K(1)) == make(1)
    s = store.stats()
    assert (s.quarantined, s.disk.quarantined, s.ram_hits, s.disk_hits) == (1, 0, 0, 1)
    assert store.where(K(1)) is Tier.RAM  # the disk copy was promoted in place of the bad one
    assert store.get(K(1)) == make(1) and store.stats().ram_hits == 1
    store.check_invariants()


def test_a_bad_key_is_logged_once(disk: DiskChunks, caplog) -> None:
    store = ChunkStore(0, disk, secret=SECRET)
    with caplog.at_level(logging.WARNING, logger="skippy_cache.store"):
        for _ in range(3):
            add(store, 1)
            flip_a_byte(disk._path(K(1)), at=20)
            assert store.get(K(1)) is None
    assert store.stats().quarantined == 3
    assert len(caplog.records) == 1


# -- dedup books -----------------------------------------------------------------------------


def test_adding_the_same_key_twice_counts_logical_bytes_twice_and_seals_once(disk: DiskChunks) -> None:
    store = ChunkStore(10_000, disk, secret=SECRET)
    c = make(1)
    first, second = Sealer(c), Sealer(c)
    assert store.add(c.key, 100, first)
    assert not store.add(c.key, 100, second)
    assert (first.calls, second.calls) == (1, 0)
    s = store.stats()
    assert (s.logical_bytes, s.physical_bytes, s.dedup_ratio, s.duplicates) == (200, 100, 2.0, 1)
    assert s.disk.writes == 1
    store.discard(c.key)
    s = store.stats()
    assert (s.logical_bytes, s.physical_bytes, s.dedup_ratio) == (0, 0, 0.0)


def test_a_key_only_on_disk_is_a_duplicate_too(disk: DiskChunks) -> None:
    store = ChunkStore(0, disk, secret=SECRET)
    add(store, 1)
    sealer = Sealer(make(1))
    assert not store.add(K(1), 100, sealer)
    assert sealer.calls == 0 and store.stats().duplicates == 1


def test_books_drop_chunks_the_disk_evicted(tmp_path: Path) -> None:
    one = sealed_size(0)
    with DiskChunks(tmp_path, 2 * one, reserve_bytes=0) as d:
        store = ChunkStore(0, d, secret=SECRET)
        for i in range(3):
            add(store, i)
        add(store, 2)
        s = store.stats()
        assert (s.logical_bytes, s.physical_bytes) == (300, 200)  # chunk 0 left the disk


def test_discard_and_clear(disk: DiskChunks) -> None:
    store = ChunkStore(10_000, disk, secret=SECRET)
    for i in range(3):
        add(store, i)
    assert store.discard(K(0)) and not store.discard(K(0))
    assert K(0) not in disk
    store.clear()
    assert len(disk) == 0 and store.stats().ram_chunks == 0 and store.stats().physical_bytes == 0
    store.check_invariants()


def test_the_counters_live_across_a_restart(tmp_path: Path) -> None:
    with DiskChunks(tmp_path, 100_000, reserve_bytes=0) as d:
        add(ChunkStore(1000, d, secret=SECRET), 1)
    with DiskChunks(tmp_path, 100_000, reserve_bytes=0) as d:
        store = ChunkStore(1000, d, secret=SECRET)
        assert store.where(K(1)) is Tier.DISK
        assert store.get(K(1)) == make(1)
        s = store.stats()
        assert (s.disk_hits, s.logical_bytes, s.physical_bytes) == (1, 0, 0)  # not added by this process


# -- property --------------------------------------------------------------------------------


class StoreMachine(RuleBasedStateMachine):
    """Random adds, gets and discards on both tiers: budgets hold, held chunks read back, seal runs once."""

    @initialize(
        ram=st.integers(0, 1200),
        disk_budget=st.one_of(st.none(), st.integers(150, 1500)),
    )
    def setup(self, ram: int, disk_budget: int | None) -> None:
        self.dir = tempfile.mkdtemp(prefix="chunkstore-")
        self.disk = None if disk_budget is None else DiskChunks(self.dir, disk_budget, reserve_bytes=0)
        self.store = ChunkStore(ram, self.disk, secret=SECRET)

    def teardown(self) -> None:
        if getattr(self, "disk", None) is not None:
            self.disk.close()
        if hasattr(self, "dir"):
            shutil.rmtree(self.dir, ignore_errors=True)

    @rule(i=st.integers(0, 12), size=st.integers(1, 300))
    def add(self, i: int, size: int) -> None:
        c = make(i, size)
        held = c.key in self.store
        sealer = Sealer(c)
        stored = self.store.add(c.key, len(c.payload), sealer)
        assert sealer.calls == (0 if held else 1)
        assert not (held and stored)

    @rule(i=st.integers(0, 12))
    def get(self, i: int) -> None:
        tier = self.store.where(K(i))
        got = self.store.get(K(i))
        assert (got is None) == (tier is None), "a held chunk must read back: nothing here corrupts it"
        if got is not None:
            assert got.key == K(i) and set(got.payload) == {i % 256}
            fits = self.store.ram_max_bytes >= len(seal(got))
            assert self.store.where(K(i)) is (Tier.RAM if fits else Tier.DISK), "a hit is promoted if it fits"

    @rule(i=st.integers(0, 12))
    def discard(self, i: int) -> None:
        self.store.discard(K(i))
        assert self.store.where(K(i)) is None

    @precondition(lambda self: hasattr(self, "store"))
    @invariant()
    def books(self) -> None:
        self.store.check_invariants()
        s = self.store.stats()
        assert s.ram_bytes <= s.ram_max_bytes
        if s.disk is not None:
            assert s.disk.bytes <= s.disk.max_bytes
        assert s.physical_bytes <= s.logical_bytes
        assert s.quarantined == 0


TestStoreMachine = StoreMachine.TestCase
TestStoreMachine.settings = settings(max_examples=60, stateful_step_count=40, deadline=None)


# -- the eviction policy ----------------------------------------------------------------------


def test_lrfu_ram_lets_a_prompts_last_chunk_go_before_its_first() -> None:
    one = sealed_size(0)
    store = ChunkStore(3 * one, None, policy="lrfu", secret=SECRET)
    for i, parent in ((0, None), (1, K(0)), (2, K(1))):
        c = make(i)
        store.add(c.key, len(c.payload), Sealer(c), parent=parent)
    add(store, 3)  # no room for four: the chain gives up its end, so it still serves two chunks
    assert store.run([K(0), K(1), K(2)])[0] == 2
    store.check_invariants()


def test_lrfu_disk_evicts_leaves_and_books_a_restart(tmp_path: Path) -> None:
    one = sealed_size(0)
    with DiskChunks(tmp_path, 3 * one, reserve_bytes=0, policy="lrfu") as d:
        store = ChunkStore(0, d, policy="lrfu", secret=SECRET)
        for i, parent in ((0, None), (1, K(0)), (2, K(1)), (3, None)):
            c = make(i)
            store.add(c.key, len(c.payload), Sealer(c), parent=parent)
        assert set(d.keys()) == {K(0), K(1), K(3)}
        d.check_invariants()
    with DiskChunks(tmp_path, 3 * one, reserve_bytes=0, policy="lrfu") as d:
        assert set(d.keys()) == {K(0), K(1), K(3)}
        d.check_invariants()


def test_a_duplicate_add_is_a_use() -> None:
    one = sealed_size(0)
    store = ChunkStore(2 * one, None, secret=SECRET)  # LRU
    add(store, 0)
    add(store, 1)
    add(store, 0)  # another entry produced chunk 0 again: now the most recently used
    add(store, 2)
    assert K(0) in store and K(1) not in store
