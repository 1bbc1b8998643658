"""Sealed chunks in RAM and on disk, as one store.

RAM holds sealed values under `ram_bytes` (0: no RAM tier), evicted in the
order of an eviction policy (eviction.py: LRU, or LRFU over the prefix tree,
which needs each chunk's parent: the chunk before it in its prompt). The disk
is write-through: `add` writes both, so a chunk that leaves RAM's LRU is
already on disk (spilled, not lost), and a disk hit is promoted back into RAM.
Without a disk, a chunk leaving RAM is gone.

Every value is sealed and verified with the store's secret (`chunks.seal`,
`chunks.unseal`: a keyed MAC), every read verified, RAM included: a value that fails is
quarantined in the tier it failed in (dropped from RAM; moved aside on disk),
counted, and logged once per key. A RAM copy that fails does not condemn the
disk copy: both were written from the same sealed bytes, so the disk copy is
verified on its own and served if it passes.

Dedup accounting, over the chunks added by this process and still held:
`logical_bytes` counts a chunk's `nbytes` once per `add` (one per entry that
stored it), `physical_bytes` once per key. Chunks found on disk at start and
never added again count in neither (the disk's stats hold their bytes).

Invariants, checked by `check_invariants` and the property tests:
- RAM's booked bytes equal the sum of its values' sizes and never exceed `ram_max_bytes`;
- RAM's books hold exactly the keys of its values (and their own invariants hold);
- the disk's own invariants (`DiskChunks.check_invariants`).
"""

from __future__ import annotations

import enum
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from skippy_cache.chunks import Chunk, ChunkError, seal, unseal
from skippy_cache.diskchunks import DiskChunks, DiskChunkStats
from skippy_cache.eviction import Policy, make_books


class Tier(str, enum.Enum):
    RAM = "ram"
    DISK = "disk"


@dataclass(frozen=True, slots=True)
class ChunkStoreStats:
    ram_chunks: int
    ram_bytes: int
    ram_max_bytes: int
    ram_hits: int
    disk_hits: int
    misses: int
    #: Values that failed verification, in either tier (the disk's share is `disk.quarantined`).
    quarantined: int
    #: `add` calls for a key already held.
    duplicates: int
    logical_bytes: int
    physical_bytes: int
    #: logical / physical; 0 when nothing added is held.
    dedup_ratio: float
    disk: DiskChunkStats | None
    #: LRFU: the turnovers the RAM tier keeps a chunk used twice longer, as its shadow books chose
    #: lately (eviction.py); None under LRU.
    ram_eviction_bonus: float | None = None


def slower(a: Tier | None, b: Tier | None) -> Tier | None:
    """The slower of two tiers a restore reads from (None: neither)."""
    return Tier.DISK if Tier.DISK in (a, b) else (a or b)


class ChunkStore:
    """A RAM tier over a write-through disk tier; every read verified.

    `parent` and `tail`, where a method takes them, are the eviction policy's
    hints (eviction.py): the key of the chunk before this one in its prompt, and
    whether it ends a prompt off the block grid.
    """

    def __init__(
        self,
        ram_bytes: int,
        disk: DiskChunks | None,
        *,
        secret: bytes,
        policy: Policy | str = Policy.LRU,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if ram_bytes < 0:
            raise ValueError(f"ram_bytes must be >= 0, got {ram_bytes}")
        self.ram_max_bytes = ram_bytes
        self.disk = disk
        self._secret = secret
        self.policy = Policy(policy)
        self._ram: dict[str, bytes] = {}  # key -> sealed value
        self._ram_books = make_books(self.policy, clock)
        #: key -> (nbytes, adds) for keys added by this process; pruned lazily once they are held nowhere.
        self._added: dict[str, tuple[int, int]] = {}
        self._ram_hits = 0
        self._disk_hits = 0
        self._misses = 0
        self._quarantined = 0
        self._duplicates = 0
        self._logged: set[str] = set()  # keys already warned about, so a bad file warns once

    # -- lookups (no recency change) -------------------------------------------------------------

    def __contains__(self, key: object) -> bool:
        return key in self._ram or (self.disk is not None and key in self.disk)

    def where(self, key: str) -> Tier | None:
        """The fastest tier holding `key` (RAM first), or None; leaves recency alone."""
        if key in self._ram:
            return Tier.RAM
        if self.disk is not None and key in self.disk:
            return Tier.DISK
        return None

    def run(self, keys: Sequence[str]) -> tuple[int, Tier | None]:
        """How many of `keys` from the first are held consecutively, and the slowest tier among those.

        Pure: a plan for the caller, who then `get`s them (and may still miss, if a value fails to verify).
        """
        slowest: Tier | None = None
        for n, key in enumerate(keys):
            tier = self.where(key)
            if tier is None:
                return n, slowest
            slowest = slower(slowest, tier)
        return len(keys), slowest

    # -- reads -----------------------------------------------------------------------------------

    def get(self, key: str, *, parent: str | None = None, tail: bool = False) -> Chunk | None:
        """The verified chunk, now used; None on a miss or a value that fails."""
        value = self._ram.get(key)
        if value is not None:
            chunk = self._verify(key, value, Tier.RAM)
            if chunk is not None:
                self._ram_books.touch(key)
                self._ram_hits += 1
                return chunk
        if self.disk is not None and key in self.disk:
            value = self.disk.get(key)
            chunk = None if value is None else self._verify(key, value, Tier.DISK)
            if chunk is not None:
                self._disk_hits += 1
                self._ram_put(key, value, parent, tail)  # promoted: the next read of it is a RAM hit
                return chunk
        self._misses += 1
        return None

    def seal(self, chunk: Chunk) -> bytes:
        """`chunk` sealed with this store's secret."""
        return seal(chunk, self._secret)

    def unseal(self, key: str, value: bytes) -> Chunk:
        """The chunk in a value from elsewhere (the shared tier), verified; raises ChunkError."""
        return unseal(key, value, self._secret)

    def _verify(self, key: str, value: bytes, tier: Tier) -> Chunk | None:
        try:
            return unseal(key, value, self._secret)
        except ChunkError as e:
            self._quarantine(key, tier, e)
            return None

    def _quarantine(self, key: str, tier: Tier, error: ChunkError) -> None:
        if tier is Tier.RAM:
            self._ram_drop(key)
        elif self.disk is not None:
            self.disk.quarantine(key)
        self._quarantined += 1
        if key not in self._logged:
            self._logged.add(key)
            # Imported here, not at the top: logging loads threading, which the core must not
            # (tests/core/test_purity.py); by the time a value fails, the runtime has loaded it anyway.
            import logging

            logging.getLogger("skippy_cache.store").warning(
                "quarantined chunk %s from %s: %s", key, tier.value, error
            )

    # -- writes ----------------------------------------------------------------------------------

    def add(
        self, key: str, nbytes: int, seal: Callable[[], bytes], *, parent: str | None = None, tail: bool = False
    ) -> bool:
        """Store a chunk under `key` unless held; `seal()` is called only if it is stored.

        `nbytes` (the chunk's payload size) counts toward `logical_bytes` either way.
        Returns True if the value was stored in some tier now; False for a duplicate or no room.
        """
        if self.share(key, nbytes):
            return False
        value = seal()
        on_disk = self.disk is not None and self.disk.put(key, value, parent=parent, tail=tail)
        return self.add_written(key, nbytes, value, on_disk=on_disk, parent=parent, tail=tail)

    def adopt(self, key: str, value: bytes, *, parent: str | None = None, tail: bool = False) -> bool:
        """Keep a verified value another process stored (the shared tier) in RAM; False if it cannot fit.

        Not counted as added: this process did not compute it, so it counts in no dedup figure.
        """
        return self._ram_put(key, value, parent, tail)

    def ram_value(self, key: str) -> bytes | None:
        """The sealed value held in RAM (unverified; recency unchanged), for copying it to disk."""
        return self._ram.get(key)

    def book_on_disk(self, key: str, size: int, *, parent: str | None = None, tail: bool = False) -> None:
        """Count a file a writer copied from RAM to disk (`DiskChunks.write_file`) without the lock."""
        assert self.disk is not None
        self.disk.book(key, size, parent=parent, tail=tail)

    def share(self, key: str, nbytes: int) -> bool:
        """If `key` is held, count another entry's use of it (dedup: a use, for eviction) and return True."""
        if key not in self:
            return False
        self._ram_books.touch(key)
        if self.disk is not None:
            self.disk.touch(key)
        self._duplicates += 1
        size, adds = self._added.get(key, (nbytes, 0))
        self._added[key] = (size, adds + 1)
        return True

    def add_written(
        self, key: str, nbytes: int, value: bytes, *, on_disk: bool, parent: str | None = None, tail: bool = False
    ) -> bool:
        """`add` for a value already sealed, whose file a writer wrote without the store's lock
        (`DiskChunks.write_file`; `on_disk` says whether it did): books it on disk, puts it in RAM."""
        if on_disk:
            assert self.disk is not None
            self.disk.book(key, len(value), parent=parent, tail=tail)
        in_ram = self._ram_put(key, value, parent, tail)
        if on_disk or in_ram:
            self._added[key] = (nbytes, 1)
        return on_disk or in_ram

    def _ram_put(self, key: str, value: bytes, parent: str | None = None, tail: bool = False) -> bool:
        """Into RAM, evicting values in the policy's order to fit; False if it cannot fit at all."""
        size = len(value)
        if size > self.ram_max_bytes:
            return False
        self._ram_drop(key)
        books = self._ram_books
        while books.bytes + size > self.ram_max_bytes:
            victim, _ = books.evict()
            del self._ram[victim]
            if self.disk is None or victim not in self.disk:
                self._added.pop(victim, None)  # held nowhere now
        self._ram[key] = value
        books.add(key, size, parent=parent, tail=tail)
        return True

    def _ram_drop(self, key: str) -> None:
        if self._ram.pop(key, None) is not None:
            self._ram_books.remove(key)

    def discard(self, key: str) -> bool:
        """Forget a chunk in every tier; False if it was held nowhere."""
        held = key in self
        self._ram_drop(key)
        if self.disk is not None:
            self.disk.discard(key)
        self._added.pop(key, None)
        return held

    def clear(self) -> None:
        """Forget every chunk in every tier (the counters stay)."""
        for key in list(self._ram):
            self._ram_drop(key)
        if self.disk is not None:
            self.disk.clear()
        self._added.clear()

    # -- books -----------------------------------------------------------------------------------

    def stats(self) -> ChunkStoreStats:
        # The disk evicts on its own, unseen: keys it dropped (and RAM no longer holds) are pruned here.
        for key in [k for k in self._added if k not in self]:
            del self._added[key]
        logical = sum(size * adds for size, adds in self._added.values())
        physical = sum(size for size, _ in self._added.values())
        return ChunkStoreStats(
            ram_chunks=len(self._ram),
            ram_bytes=self._ram_books.bytes,
            ram_max_bytes=self.ram_max_bytes,
            ram_hits=self._ram_hits,
            disk_hits=self._disk_hits,
            misses=self._misses,
            quarantined=self._quarantined,
            duplicates=self._duplicates,
            logical_bytes=logical,
            physical_bytes=physical,
            dedup_ratio=logical / physical if physical else 0.0,
            disk=None if self.disk is None else self.disk.stats(),
            ram_eviction_bonus=self._ram_books.bonus,
        )

    def check_invariants(self) -> None:
        """Raise AssertionError if the books contradict themselves (tests and debug)."""
        books = self._ram_books
        books.check_invariants()
        assert set(books.keys()) == set(self._ram), "RAM's books and values hold different keys"
        total = sum(len(v) for v in self._ram.values())
        assert total == books.bytes, f"RAM byte books {books.bytes} != values' {total}"
        assert books.bytes <= self.ram_max_bytes, f"RAM {books.bytes} over {self.ram_max_bytes}"
        if self.disk is not None:
            self.disk.check_invariants()
