"""The state store in the runtime: exact states of entries that leave the pool, as chunks in RAM and on disk.

An entry's state (`llama_state_seq_get_data`) is cut into chunks of token rows
(stateformat.py): chunk i holds every layer's K and V rows of tokens
[i*C, (i+1)*C) and is named by the prefix identity at its end, so entries that
share a prefix share its chunks, and a chunk is found from a prompt alone,
after a restart too. The rest of an entry, at most C tokens, is its tail. A
whole-prompt entry's tail carries its first-token logits and is named by the
entry's own page id, so an exact repeat needs no decode even after a restart.
Any other entry's tail (prompt and reply, which the next chat turn resends) is
named like a chunk, by the prefix identity at its end: a prompt told where
its replies end (`GenerationRequest.replies`) finds it by name too, so
another replica's next turn reuses the history up to the reply's end.

Which chunks reach disk: those of entries that were reused (a resident hit,
or a restore from RAM), since a prompt seen once has not earned disk writes;
a reused entry's chunks are written through to disk, and an entry reused
only after it left the pool is copied there from RAM (`make_durable`). The
chunks of the others live in RAM, and leave it for good when its LRU needs
the room. Disk I/O thus follows reuse, and a restart keeps what was reused.

A model whose state is not rows per token (sliding window: the window
layers' cells before the window are not exported; recurrent and hybrid: one
state at the sequence's end, family.py) has no layout to cut by: each page is
then one piece, its tail, holding the whole exported state (a checkpoint),
restorable only at its own length. Named like any tail, it is found by name
after a restart and through the shared tier as a tail is.

Threads: the engine thread calls everything public (`put` hands over an
export; `available`, `probe` and `whole_logits` answer the plan; `fetch`
reads the chunks of a restore). The writer thread parses, cuts, seals
(BLAKE3) and stores what `put` queued, so hashing and disk writes never hold
up a decode. Until the writer is done an entry's export stays in `pending`
and a restore uses it directly. The queue is bounded in bytes: when the
writer is that far behind, `put` refuses (the entry is lost, as if the store
were full) rather than make the engine wait.

The shared tier (remote.py, optional): every chunk the writer seals is also
queued for a Redis/Valkey server, and `prefetch` brings the chunks of a
prompt that only that server holds into RAM, verified, before the request
reaches the engine; the plan then finds them like any chunk in RAM.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections import Counter, OrderedDict, deque
from collections.abc import Hashable, Iterable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass

import numpy as np

from skippy_cache.chunks import SECRET_BYTES, Chunk, ChunkError, chunk_key, tail_key
from skippy_cache.chunkstore import ChunkStore, Tier, slower
from skippy_cache.diskchunks import CacheDirUnsafe, DiskChunks
from skippy_cache.exact import Kernels, rows_key
from skippy_cache.family import Family
from skippy_cache.identity import IdentityKey, PageId, PrefixIdentity, prefix_identities
from skippy_cache.placement import ALIGN
from skippy_cache.runtime.info import EngineConfig, default_host_cache_bytes
from skippy_cache.runtime.remote import Prefetched, RemoteChunks
from skippy_cache.runtime.requests import Keep
from skippy_cache.runtime.startup import StartupError
from skippy_cache.secretfile import SecretFileError, cache_dir_secret
from skippy_cache.sharedorder import reused_keys
from skippy_cache.stateformat import Layout, StateFormatError, join, parse, split
from skippy_cache.tiers import Hit, Source, StoreStats

log = logging.getLogger("skippy_cache.store")

#: Chunks fetched from the shared tier per pipelined round trip.
_FETCH_CHUNKS = 8

_SOURCE = {Tier.RAM: Source.RAM, Tier.DISK: Source.DISK, None: Source.NONE}


@dataclass(slots=True)
class EntryMeta:
    """What the prefix cache knows of one entry it recorded, beside its cells and its index: what
    its chunks are named by when it leaves (`space`, `tokens`), and what the store is told when it
    is exported (`StateStore.put`)."""

    space: Hashable
    tokens: list[int]
    #: The recording request's tenant (`GenerationRequest.tenant`): counted, cleared and held to a
    #: share of the pool per tenant.
    owner: str | None
    #: Leading tokens the recording request reused (its hit): the shared tier keeps those chunks
    #: longer (sharedorder.py).
    hit_tokens: int
    #: Where its state may go (`GenerationRequest.keep`).
    keep: Keep = Keep.ALL
    #: Reused at least once: its chunks belong on disk when it leaves.
    reused: bool = False


@dataclass(slots=True)
class Page:
    """An entry this process put into the store: the names of its chunks and tail."""

    token_count: int
    #: Chunks of tokens [0, C), [C, 2C), ... before the tail.
    chunk_keys: tuple[str, ...]
    #: Tokens [len(chunk_keys) * C, token_count): between 1 and C of them.
    tail_key: str
    #: A whole-prompt entry's first-token logits (float32 bytes).
    logits: bytes | None
    #: Reused at least once: its chunks go to disk too.
    durable: bool = False
    #: The tenant whose request recorded it (None without tenants).
    owner: str | None = None
    #: Bytes of its exported state: what it costs its owner's share (`owner_share_bytes`).
    nbytes: int = 0
    #: Kept in this process's RAM only: never written to disk or to the shared tier.
    local: bool = False
    #: Leading tokens the request that recorded it reused rather than computed (the shared tier
    #: keeps the chunks of a prefix used again longer: sharedorder.py).
    reused: int = 0


@dataclass(frozen=True, slots=True)
class _Last:
    """What ends a run fetched from the shared tier: the whole prompt's tail, or a partial chunk."""

    key: str
    #: The position its rows end at.
    ends: int
    whole: bool


@dataclass(frozen=True, slots=True)
class Fetched:
    """What a restore imports: a payload of `cells` tokens at positions [start, start + cells), of
    which those before `length` are kept."""

    #: Valid until the next `fetch`: a view of the store's restore buffer, which that one reuses.
    payload: bytes | bytearray | memoryview
    start: int
    cells: int
    length: int
    source: Source
    logits: np.ndarray | None


#: The largest buffer kept for joining restores into (the largest restore so far, up to this).
#: A fresh buffer of tens of MiB is faulted in page by page on every restore, which cost as
#: much as the copy itself; a kept one costs its size in RSS.
RESTORE_BUFFER_MAX = 256 << 20

#: The chunk size of a store of whole states (`StateStore.whole_states`): larger than any sequence,
#: so every page is its tail alone.
WHOLE_STATE_TOKENS = 1 << 31


class StateStore:
    def __init__(
        self,
        chunks: ChunkStore,
        layout: Layout | str,
        chunk_tokens: int,
        *,
        max_pending_bytes: int,
        remote: RemoteChunks | None = None,
    ) -> None:
        """`layout`: the layout states are cut by, or for states that cannot be cut, a name of their
        format (each page is then kept whole)."""
        if chunk_tokens < 1:
            raise ValueError(f"chunk_tokens must be positive, got {chunk_tokens}")
        self.chunks = chunks
        self.layout = layout if isinstance(layout, Layout) else None
        if self.layout is None:
            chunk_tokens = WHOLE_STATE_TOKENS
        # Chunks are named by the prefix at their end, and what rows a chunk holds depends on the
        # chunk size too: a chunk ending at token 256 holds [0, 256) with C=256 but [192, 256) with
        # C=64. The size is part of every name, so a store (on disk, or a replica on the shared
        # tier) cut with another size can never hand its chunks to this one.
        fingerprint = self.layout.fingerprint() if self.layout is not None else f"whole-state/{layout}"
        self.layout_id = f"{fingerprint}/chunk-tokens={chunk_tokens}"
        self.chunk_tokens = chunk_tokens
        self.max_pending_bytes = max_pending_bytes
        #: The shared tier, if any: written behind the writer, read by `prefetch`.
        self.remote = remote
        self._pages: OrderedDict[PageId, Page] = OrderedDict()
        self._pending: dict[PageId, bytes | bytearray] = {}
        self._pending_bytes = 0
        #: Where the engine thread joins a restore's chunks (`fetch`), kept for the next one.
        self._restore_buffer: bytearray | None = None
        #: Past this many bytes of pages, a tenant's least recently used pages are dropped (chunks and
        #: all) to make room for its next one, so one tenant cannot fill the store (0: no share).
        self.owner_share_bytes = 0
        self._owner_bytes: Counter[str] = Counter()
        #: Work for the writer: (page, "store") cuts a pending export; (page, "spill") copies a
        #: stored page's chunks from RAM to disk; (page, "shared") waits until the shared tier has
        #: its chunks (`when_shared`).
        self._queue: deque[tuple[PageId, str]] = deque()
        #: Futures of `when_shared`: completed once their page's chunks are on the shared tier.
        self._sent: dict[PageId, Future[None]] = {}
        #: Pages the writer could not store (an export it could not parse): `prune` hands them back.
        self._lost: list[PageId] = []
        #: Pages deleted to keep their owner within its share, not yet told to the engine (`prune`).
        self._deleted: list[PageId] = []
        self._cv = threading.Condition()
        self._closing = False
        self._writer = threading.Thread(target=self._write_loop, name="skippy-store-writer", daemon=True)
        self._writer.start()

    # -- names -------------------------------------------------------------------------

    def chunk_identities(
        self, space: IdentityKey, tokens: Sequence[int], kernels: Kernels | None = None
    ) -> tuple[PrefixIdentity, ...]:
        """The identities that name the chunks of `tokens`: at every multiple of C up to their length.

        With `kernels` (deterministic mode) each name also says which kernel
        computed every row up to the chunk's end (exact.py), so a chunk found by
        name is exact for the prompt that asks for it.
        """
        return self.identities_at(space, tokens, range(self.chunk_tokens, len(tokens) + 1, self.chunk_tokens),
                                  kernels)

    def identities_at(
        self, space: IdentityKey, tokens: Sequence[int], ends: Iterable[int], kernels: Kernels | None = None
    ) -> tuple[PrefixIdentity, ...]:
        """The names of the rows that end at each of `ends` (ascending): a chunk's at a multiple of C,
        a partial chunk's (an entry's tail, rows from the last multiple of C before it) anywhere else."""
        lengths = list(ends)
        if not lengths:
            return ()
        if kernels is None:
            ids = prefix_identities(space, tokens, lengths)
            return tuple(ids[n] for n in lengths)
        # One hash chain per distinct set of bounds: a prompt has a few (its replies, its tiled end).
        groups: dict[tuple[int, ...], list[int]] = {}
        for n in lengths:
            groups.setdefault(kernels.before(n), []).append(n)
        named: dict[int, PrefixIdentity] = {}
        for bounds, at in groups.items():
            named.update(prefix_identities(rows_key(space, bounds), tokens[: at[-1]], at))
        return tuple(named[n] for n in lengths)

    @property
    def whole_states(self) -> bool:
        """Each page is one piece, the whole exported state, restorable only at its own length."""
        return self.layout is None

    def _chunk_keys(self, ids: Sequence[PrefixIdentity]) -> list[str]:
        return [chunk_key(i.page_id, self.layout_id) for i in ids]

    # -- the engine's side: writes -------------------------------------------------------

    def __contains__(self, page_id: object) -> bool:
        with self._cv:
            return page_id in self._pages

    def put(self, page_id: PageId, entry: EntryMeta, payload: bytes | bytearray, logits: bytes | None, *,
            kernels: Kernels | None = None) -> bool:
        """Queue an entry's exported state for the writer, as the cache's record of it says: a reused
        entry to disk too, one its request keeps in RAM (`Keep.RAM`) nowhere else; False when the
        writer is too far behind. `kernels`: those of the prompt that computed it (deterministic mode)."""
        space, tokens, owner = entry.space, entry.tokens, entry.owner
        local = entry.keep is Keep.RAM
        n = len(tokens)
        assert isinstance(space, IdentityKey) and entry.keep is not Keep.NONE
        n_chunks = (n - 1) // self.chunk_tokens
        ends = [*range(self.chunk_tokens, n_chunks * self.chunk_tokens + 1, self.chunk_tokens)]
        if logits is None:
            # No logits: the tail is named like a chunk, by the rows it ends, so a longer prompt
            # (the next turn of a chat, resending this reply) finds it by name as it finds chunks.
            ends.append(n)
        keys = self._chunk_keys(self.identities_at(space, tokens, ends, kernels))
        tail = keys.pop() if logits is None else tail_key(page_id, self.layout_id)
        page = Page(n, tuple(keys), tail, logits, entry.reused and not local, owner, len(payload), local,
                    entry.hit_tokens)
        with self._cv:
            if self._pending_bytes + len(payload) > self.max_pending_bytes:
                return False
            self._make_owner_room(owner, len(payload))
            if owner is not None:
                self._owner_bytes[owner] += page.nbytes
            self._pages[page_id] = page
            self._pages.move_to_end(page_id)
            self._pending[page_id] = payload
            self._pending_bytes += len(payload)
            self._queue.append((page_id, "store"))
            self._cv.notify()
        return True

    def when_shared(self, page_id: PageId) -> Future[None] | None:
        """A future completed once the page's chunks are on the shared tier (or the tier gave up on
        them: it is down, or a write timed out); None when there is nothing to wait for (no shared
        tier, a page this store does not know or keeps local).

        The page's writes go ahead of everything queued: a request waits on them.
        """
        if self.remote is None:
            return None
        with self._cv:
            page = self._pages.get(page_id)
            if page is None or page.local:
                return None
            sent = self._sent.get(page_id)
            if sent is not None:
                return sent
            sent = self._sent[page_id] = Future()
            store = (page_id, "store")
            if store in self._queue:
                self._queue.remove(store)
                self._queue.appendleft(store)
            else:
                # Written already, or being written: its chunks may still be queued for the server.
                self._queue.appendleft((page_id, "shared"))
            self._cv.notify()
            return sent

    def make_durable(self, page_id: PageId) -> None:
        """The page was reused: from now on its chunks belong on disk too."""
        with self._cv:
            page = self._pages.get(page_id)
            if page is None or page.durable or page.local or self.chunks.disk is None:
                return
            page.durable = True
            if page_id not in self._pending:  # else the writer sees the flag when it cuts the export
                self._queue.append((page_id, "spill"))
                self._cv.notify()

    def discard(self, page_id: PageId) -> bool:
        with self._cv:
            return self._drop_page(page_id)

    def prune(self) -> list[PageId]:
        """Forget pages none of whose tokens can be restored any more (chunks evicted or lost)."""
        with self._cv:
            gone = [p for p in self._lost if p in self._pages]
            self._lost.clear()
            for page_id, page in self._pages.items():
                if page_id not in self._pending and self.chunks.where(
                    page.chunk_keys[0] if page.chunk_keys else page.tail_key
                ) is None:
                    gone.append(page_id)
            for page_id in gone:
                self._drop_page(page_id)
            gone += self._deleted
            self._deleted.clear()
            return gone

    @property
    def capacity_bytes(self) -> int:
        """What the store can hold: its RAM tier's budget and its disk tier's."""
        disk = self.chunks.disk
        return self.chunks.ram_max_bytes + (disk.max_bytes if disk is not None else 0)

    def owners(self) -> dict[str | None, int]:
        """Pages this process put, counted by the tenant that recorded them."""
        with self._cv:
            return dict(Counter(page.owner for page in self._pages.values()))

    def clear_owner(self, owner: str | None) -> list[PageId]:
        """Forget one tenant's pages and delete their chunks from RAM and disk; the pages forgotten.

        Only pages this process put are known by tenant (a chunk's name is a
        hash): chunks from before a restart, and the shared tier's copies
        (which expire by their TTL), stay until evicted.
        """
        with self._cv:
            pages = [page_id for page_id, page in self._pages.items() if page.owner == owner]
            for page_id in pages:
                self._delete_page(page_id)
            sent = self._take_sent(pages)
        _complete(sent)
        return pages

    def _make_owner_room(self, owner: str | None, nbytes: int) -> None:
        """Delete the owner's least recently used pages until `nbytes` more fit in its share (under
        the lock). Its pages may share chunks with others of its namespace; a page left without its
        first chunk is forgotten by `prune`."""
        if owner is None or not self.owner_share_bytes:
            return
        while self._owner_bytes[owner] + nbytes > self.owner_share_bytes:
            oldest = next((p for p, page in self._pages.items() if page.owner == owner), None)
            if oldest is None:
                return
            self._delete_page(oldest)
            self._deleted.append(oldest)  # the engine's books learn it is gone at the next prune

    def _delete_page(self, page_id: PageId) -> None:
        """Forget a page and delete its chunks from RAM and disk (under the lock)."""
        page = self._pages[page_id]
        self._drop_page(page_id)
        for key in (*page.chunk_keys, page.tail_key):
            self.chunks.discard(key)

    def clear(self) -> list[PageId]:
        """Empty the store (chunks on disk too); the pages this process had put there."""
        with self._cv:
            pages = list(self._pages)
            self._pages.clear()
            self._owner_bytes.clear()
            self._pending.clear()
            self._pending_bytes = 0
            self._queue.clear()
            sent = self._take_sent(self._sent)
            self.chunks.clear()
        _complete(sent)
        return pages

    # -- the engine's side: the plan ------------------------------------------------------

    def available(self, page_id: PageId) -> tuple[int, Source]:
        with self._cv:
            page = self._pages.get(page_id)
            if page is None:
                return 0, Source.NONE
            if page_id in self._pending:
                return page.token_count, Source.RAM
            run, tier = self.chunks.run(page.chunk_keys)
            if run < len(page.chunk_keys):
                return run * self.chunk_tokens, _SOURCE[tier]
            tail = self.chunks.where(page.tail_key)
            if tail is None:
                return run * self.chunk_tokens, _SOURCE[tier]
            return page.token_count, _SOURCE[slower(tier, tail)]

    def whole_logits(self, page_id: PageId) -> np.ndarray | None:
        with self._cv:
            page = self._pages.get(page_id)
        return _logits(page.logits) if page is not None else None

    def probe(
        self, chunks: Sequence[PrefixIdentity], whole: PrefixIdentity | None, tails: Sequence[PrefixIdentity] = ()
    ) -> tuple[int, Source, bool]:
        keys = self._chunk_keys(chunks)
        with self._cv:
            run, tier = self.chunks.run(keys)
            if whole is not None and run == len(keys):
                tail = self.chunks.where(tail_key(whole.page_id, self.layout_id))
                if tail is not None:
                    return run * self.chunk_tokens, _SOURCE[slower(tier, tail)], True
            for ident in self._tails_after(run, tails):
                tail = self.chunks.where(self._chunk_keys([ident])[0])
                if tail is not None:
                    return ident.token_count, _SOURCE[slower(tier, tail)], False
        return run * self.chunk_tokens, _SOURCE[tier], False

    def _tails_after(self, run: int, tails: Sequence[PrefixIdentity]) -> list[PrefixIdentity]:
        """The partial chunks that go on from a run of `run` chunks (their rows start where it ends), longest first."""
        c = self.chunk_tokens
        return sorted((t for t in tails if t.token_count % c and t.token_count // c == run),
                      key=lambda t: -t.token_count)

    # -- the engine's side: restores ------------------------------------------------------

    def fetch(
        self, hit: Hit, chunk_ids: Sequence[PrefixIdentity], tails: Sequence[PrefixIdentity] = (), skip: int = 0
    ) -> Fetched | None:
        """The payload for the hit's tokens from the `skip`-th chunk on (those before it are resident
        already) to `hit.length`, read and verified chunk by chunk.

        A chunk that is gone or fails its check ends the run there: what comes
        before it is returned (a shorter hit), None if nothing is left past
        the skipped chunks. A page not yet cut into chunks is one payload: it
        comes whole, from position 0, whatever `skip` says.
        """
        c = self.chunk_tokens
        with self._cv:
            page = self._pages.get(hit.page_id) if hit.page_id is not None else None
            pending = self._pending.get(hit.page_id) if hit.page_id is not None else None
        if page is not None and pending is not None:
            return Fetched(pending, 0, page.token_count, hit.length, Source.RAM, _logits(page.logits))
        n = hit.length
        start = skip * c
        if not 0 <= start < n:
            raise ValueError(f"skip={skip} chunks leaves nothing of a {n}-token hit")
        if page is not None:
            keys = list(page.chunk_keys[skip : -(-n // c)])
            if n > len(page.chunk_keys) * c:
                keys.append(page.tail_key)
        else:
            keys = self._chunk_keys(chunk_ids[skip : n // c])
            if hit.whole:
                assert hit.page_id is not None
                keys.append(tail_key(hit.page_id, self.layout_id))
            elif n % c:
                keys += self._chunk_keys([t for t in tails if t.token_count == n][:1])
        pieces: list[Chunk] = []
        source = Source.RAM
        with self._cv:
            for i, key in enumerate(keys):
                where = self.chunks.where(key)
                chunk = self.chunks.get(key, parent=keys[i - 1] if i else None)
                # A full chunk holds exactly C tokens, a tail at most C: anything else ends the run.
                if chunk is None or not (chunk.tokens == c or (i == len(keys) - 1 and chunk.tokens < c)):
                    break
                pieces.append(chunk)
                if where is Tier.DISK:
                    source = Source.DISK
        if len(pieces) < len(keys):
            # Every chunk before the one that failed is a full one (only the tail is short).
            length = start + len(pieces) * c
        else:
            length = min(n, start + sum(p.tokens for p in pieces))
        if length == start:
            return None
        if self.layout is None:
            # A whole state restores at its own length or not at all.
            if len(pieces) != 1 or pieces[0].tokens != n or (hit.whole and pieces[0].logits is None):
                return None
            return Fetched(pieces[0].payload, 0, n, n, source, _logits(pieces[0].logits) if hit.whole else None)
        try:
            payload = join(self.layout, [p.payload for p in pieces], length - start, start=start,
                           into=self._restore_buffer)
        except StateFormatError:
            log.exception("store: chunks that passed their checks do not join; serving a miss")
            return None
        if isinstance(payload, bytearray) and len(payload) <= RESTORE_BUFFER_MAX:
            self._restore_buffer = payload  # a new one, larger than the last: kept for the next
        cells = length - start
        logits = None
        if hit.whole and length == n and pieces[-1].logits is not None:
            logits = _logits(pieces[-1].logits)
        elif hit.whole:
            # Without its logits a whole prompt is reused up to its last token, which is decoded.
            length = min(length, n - 1)
        return Fetched(payload, start, cells, length, source, logits)

    # -- the shared tier -----------------------------------------------------------------

    def prefetch(
        self,
        chunk_ids: Sequence[PrefixIdentity],
        whole: PrefixIdentity | None,
        tails: Sequence[PrefixIdentity] = (),
        *,
        fetch: bool = True,
    ) -> Prefetched:
        """Bring the chunks of a prompt that only the shared tier holds into RAM, verified (without
        `fetch`: only say what it would bring; `ms` is then the lookup's).

        Runs on a prefetch worker, never the engine thread: one pipelined round
        trip asks which chunks past the local run the server holds, then the
        run of them is fetched, each verified before it is kept. A missing or
        refused chunk ends the run. The whole prompt's tail is asked for too,
        and kept only when every chunk before it is held; failing that, the
        longest of `tails` (partial chunks at the ends of replies the prompt
        resends) that goes on from the run.
        """
        remote = self.remote
        assert remote is not None
        t0 = time.perf_counter()
        local, wanted, last = self._remote_run(chunk_ids, whole, tails)
        if last is not None:
            wanted.append(last.key)
        kept = 0 if fetch else len(wanted)
        for start in range(0, len(wanted) if fetch else 0, _FETCH_CHUNKS):
            batch = wanted[start : start + _FETCH_CHUNKS]
            values = remote.fetch(batch)
            if values is None:
                break
            kept += self._adopt(batch, values)
            if kept < start + len(batch):
                break
        came = last if last is not None and kept == len(wanted) else None
        c = self.chunk_tokens
        tokens = (kept - (came is not None)) * c
        if came is not None and not came.whole:
            tokens = came.ends - local * c
        return Prefetched(local * c, tokens, came is not None and came.whole, (time.perf_counter() - t0) * 1000)

    def _remote_run(
        self, chunk_ids: Sequence[PrefixIdentity], whole: PrefixIdentity | None, tails: Sequence[PrefixIdentity]
    ) -> tuple[int, list[str], _Last | None]:
        """The chunks held here from the start (how many), the keys past them that the shared tier
        holds in one run, and what ends the run: the whole prompt's tail if the server holds it and
        every chunk before it, else the longest partial chunk of `tails` that goes on from the run
        (None: neither, or held here already). One pipelined round trip."""
        remote = self.remote
        assert remote is not None
        c = self.chunk_tokens
        keys = self._chunk_keys(chunk_ids)
        whole_key = tail_key(whole.page_id, self.layout_id) if whole is not None else None
        with self._cv:
            local, _ = self.chunks.run(keys)
            if whole_key is not None and whole_key in self.chunks:
                whole_key = None
            # Only a tail whose rows start at or past the local run can take a lookup further.
            partial = [(key, t.token_count) for t in tails if t.token_count % c and t.token_count // c >= local
                       if (key := self._chunk_keys([t])[0]) not in self.chunks]
        asked = keys[local:] + ([whole_key] if whole_key is not None else []) + [key for key, _ in partial]
        if not asked:
            return local, [], None
        present = remote.present(asked)
        if present is None:
            return local, [], None
        n_chunks = len(keys) - local
        run = next((i for i, held in enumerate(present[:n_chunks]) if not held), n_chunks)
        last = None
        if whole is not None and whole_key is not None and run == n_chunks and present[n_chunks]:
            last = _Last(whole_key, whole.token_count, whole=True)
        else:
            if run < n_chunks or whole_key is not None:
                remote.missed()  # a chunk missing mid-run ends it, the whole prompt's tail included
            answers = present[n_chunks + (whole_key is not None):]
            found = [n for (_, n), held in zip(partial, answers, strict=True) if held and n // c == local + run]
            if found:
                ends = max(found)
                last = _Last(next(key for key, n in partial if n == ends), ends, whole=False)
        return local, keys[local : local + run], last

    def _adopt(self, keys: Sequence[str], values: Sequence[bytes | None]) -> int:
        """Keep the leading fetched values that verify; how many were kept. Every fetched value that
        fails is rejected (and so deleted from the server), past the first one too: a value left
        there would stand for its chunk on every replica."""
        assert self.remote is not None
        kept: int | None = None
        for n, (key, value) in enumerate(zip(keys, values, strict=True)):
            if value is None:
                kept = n if kept is None else kept
                continue
            try:
                self.chunks.unseal(key, value)
            except ChunkError as exc:
                self.remote.rejected(key, exc)
                kept = n if kept is None else kept
                continue
            if kept is not None:
                continue
            with self._cv:
                if not self.chunks.adopt(key, value, parent=keys[n - 1] if n else None):
                    kept = n
        return len(keys) if kept is None else kept

    # -- stats and upkeep ----------------------------------------------------------------

    def stats(self) -> StoreStats:
        with self._cv:
            buffer = len(self._restore_buffer) if self._restore_buffer is not None else 0
            return StoreStats(len(self._pages), len(self._pending), self.chunk_tokens, self.chunks.stats(),
                              buffer)

    def pages(self) -> list[PageId]:
        with self._cv:
            return list(self._pages)

    def check_invariants(self) -> None:
        with self._cv:
            self.chunks.check_invariants()
            assert set(self._pending) <= set(self._pages), "a pending export belongs to no page"
            booked = sum(len(p) for p in self._pending.values())
            assert booked == self._pending_bytes, f"pending bytes {self._pending_bytes}, held {booked}"

    def drain(self, timeout: float | None = None) -> bool:
        """Wait until the writer has stored everything queued (tests, shutdown); False on timeout."""
        with self._cv:
            return self._cv.wait_for(lambda: not self._pending, timeout)

    def close(self, timeout: float = 30.0) -> None:
        """Finish queued writes (up to `timeout`), stop the writer, release the disk tier."""
        self.drain(timeout)
        with self._cv:
            self._closing = True
            self._cv.notify_all()
        self._writer.join(timeout)
        with self._cv:
            sent = self._take_sent(self._sent)
        _complete(sent)  # a writer that timed out must not leave a request waiting
        if self.remote is not None:
            self.remote.close(timeout)
        if self.chunks.disk is not None:
            self.chunks.disk.close()

    # -- internals -----------------------------------------------------------------------

    def _take_sent(self, page_ids: Iterable[PageId]) -> list[Future[None]]:
        """Remove the `when_shared` futures of these pages (under the lock); `_complete` them after
        it is released, since completing one runs a caller's callback."""
        return [sent for page_id in list(page_ids) if (sent := self._sent.pop(page_id, None)) is not None]

    def _release(self, page_id: PageId) -> None:
        """The page's `when_shared` future, if any, is done (called without the lock)."""
        with self._cv:
            sent = self._take_sent([page_id])
        _complete(sent)

    def _drop_page(self, page_id: PageId) -> bool:
        page = self._pages.pop(page_id, None)
        if page is not None and page.owner is not None:
            self._owner_bytes[page.owner] -= page.nbytes
            if self._owner_bytes[page.owner] <= 0:
                del self._owner_bytes[page.owner]
        payload = self._pending.pop(page_id, None)
        if payload is not None:
            self._pending_bytes -= len(payload)
            self._cv.notify_all()
        return page is not None

    def _write_loop(self) -> None:
        while True:
            with self._cv:
                self._cv.wait_for(lambda: self._queue or self._closing)
                if not self._queue:
                    return
                page_id, job = self._queue.popleft()
                page = self._pages.get(page_id)
                payload = self._pending.get(page_id)
                urgent = page_id in self._sent
            if job == "spill":
                if page is not None:
                    self._spill(page_id, page)
                continue
            if job == "shared":
                if page is not None:
                    self._wait_shared(page)
                self._release(page_id)
                continue
            if page is None or payload is None:
                self._release(page_id)  # discarded or cleared meanwhile
                continue
            try:
                self._write(page_id, page, payload, urgent=urgent)
            except Exception:  # noqa: BLE001 - one bad export must not stop the writer
                log.exception("store: could not store an exported state; its entry is lost")
                with self._cv:
                    self._lost.append(page_id)
            with self._cv:
                if self._pending.get(page_id) is payload:
                    del self._pending[page_id]
                    self._pending_bytes -= len(payload)
                self._cv.notify_all()
            self._release(page_id)

    def _write(self, page_id: PageId, page: Page, payload: bytes | bytearray, *, urgent: bool = False) -> None:
        if self.layout is None:
            pieces = [bytes(payload)]
        else:
            state = parse(payload)
            if state.n_tokens != page.token_count:
                raise StateFormatError(f"export holds {state.n_tokens} tokens, its entry {page.token_count}")
            pieces = split(state, self.chunk_tokens)
        assert len(pieces) == len(page.chunk_keys) + 1, "the tail is the last piece"
        names = [*page.chunk_keys, page.tail_key]
        due = self._deadlines(page)
        ahead: list[tuple[str, bytes | None, float]] = []
        for i, (key, rows) in enumerate(zip(names, pieces, strict=True)):
            logits = page.logits if key == page.tail_key else None
            tokens = page.token_count - i * self.chunk_tokens if key == page.tail_key else self.chunk_tokens
            with self._cv:
                held = self.chunks.share(key, len(rows))  # held already: counted as shared, nothing to store
            if held:
                # The shared tier's copy, if any, is renewed: this use sets its place in the order.
                if page.local or self.remote is None:
                    continue
                if urgent:
                    ahead.append((key, None, due[i]))
                else:
                    self.remote.put(key, None, due[i])
                continue
            # Sealing (BLAKE3) and the disk write run without the lock: a slow disk
            # delays this thread, never a plan or a restore on the engine thread.
            value = self.chunks.seal(Chunk(key, tokens, rows, logits))
            disk = self.chunks.disk
            on_disk = page.durable and disk is not None and disk.write_file(key, value)
            with self._cv:
                if self._pages.get(page_id) is not page:
                    # Cleared or discarded while this chunk was sealed: a chunk added now would be
                    # found by its name after an operator emptied the cache.
                    if on_disk and disk is not None:
                        disk.unwrite(key)
                    return
                self.chunks.add_written(key, len(rows), value, on_disk=on_disk, parent=names[i - 1] if i else None,
                                        tail=_exact_repeat_only(key, page))
            if page.local:
                continue
            if urgent:
                ahead.append((key, value, due[i]))
            elif self.remote is not None:
                self.remote.put(key, value, due[i])
        if urgent:
            # Queued ahead of everything in chunk order, so a lookup meanwhile finds a run from the start.
            for key, value, deadline in reversed(ahead):
                self.remote.put(key, value, deadline, first=True)
            self._wait_shared(page)

    def _deadlines(self, page: Page) -> list[float]:
        """The shared tier's expiry times for the page's chunks and tail (empty: no shared tier, or local)."""
        if self.remote is None or page.local:
            return []
        n = len(page.chunk_keys)
        reused = reused_keys(page.reused, n, self.chunk_tokens, whole=page.reused >= page.token_count)
        return self.remote.deadlines(n + 1, reused=reused, tail_repeat_only=page.logits is not None)

    def _wait_shared(self, page: Page) -> None:
        """Until the shared tier has the page's chunks: those held here already may still be on their
        way from an earlier page."""
        assert self.remote is not None
        self.remote.wait_sent([*page.chunk_keys, page.tail_key], self.remote.write_timeout_s)

    def _spill(self, page_id: PageId, page: Page) -> None:
        """Copy a page's chunks that are only in RAM to disk (the file writes without the lock)."""
        disk = self.chunks.disk
        assert disk is not None
        names = [*page.chunk_keys, page.tail_key]
        for i, key in enumerate(names):
            with self._cv:
                value = None if key in disk else self.chunks.ram_value(key)
            if value is None or not disk.write_file(key, value):
                continue
            with self._cv:
                if self._pages.get(page_id) is not page:
                    disk.unwrite(key)  # cleared or discarded meanwhile, as in `_write`
                    return
                self.chunks.book_on_disk(key, len(value), parent=names[i - 1] if i else None,
                                         tail=_exact_repeat_only(key, page))


def _exact_repeat_only(key: str, page: Page) -> bool:
    """Whether `key` is a whole prompt's tail, which only an exact repeat finds (the eviction policy lets
    it go sooner). The tail of an entry without logits is named like a chunk: a longer prompt finds it."""
    return key == page.tail_key and page.logits is not None


def _complete(futures: list[Future[None]]) -> None:
    for sent in futures:
        if not sent.done():
            sent.set_result(None)


def _logits(stored: bytes | None) -> np.ndarray | None:
    """First-token logits as stored (float32 bytes), as an array the caller may keep."""
    return np.frombuffer(stored, dtype=np.float32).copy() if stored is not None else None


def open_store(
    config: EngineConfig, warm_state: bytes | bytearray, family: Family | None = None
) -> tuple[StateStore | None, str | None]:
    """The store an engine's config asks for, and why there is none (or no shared tier) when one was asked for.

    `warm_state` is any sequence's exported state: its layout is the one every
    chunk is cut in (a model whose state is not rows per token keeps whole
    states, named by its kind of memory and the state's size for one token).
    A disk tier whose directory another process holds raises `CacheDirBusy`,
    one that cannot be created or written, or that other users can write,
    `StartupError` (the server refuses to start, with that message).
    """
    ram = default_host_cache_bytes() if config.host_cache_bytes is None else config.host_cache_bytes
    if ram <= 0 and config.cache_dir is None:
        return None, _no_remote(config, "the RAM and disk tiers are off")
    if config.chunk_tokens <= 0 or config.chunk_tokens % ALIGN:
        raise ValueError(f"chunk_tokens must be a positive multiple of {ALIGN}, got {config.chunk_tokens}")
    layout: Layout | str
    if family is not None and not family.chunked:
        layout = f"{family.memory.value}/{len(warm_state)}"
    else:
        try:
            layout = parse(warm_state).layout
        except StateFormatError as exc:
            return None, f"no state store: this model's KV state cannot be cut into chunks ({exc})"
    disk = None
    if config.cache_dir is not None:
        try:
            disk = DiskChunks(config.cache_dir, config.disk_cache_bytes, reserve_bytes=config.disk_reserve_bytes,
                              policy=config.eviction)
        except OSError as exc:
            raise StartupError(
                f"--cache-dir {config.cache_dir}: cannot keep the disk tier there ({exc.strerror or exc}); "
                "pass a writable directory, or --cache-dir none for no disk tier"
            ) from None
        except CacheDirUnsafe as exc:
            raise StartupError(str(exc)) from None  # its message already names the directory and the fix
    try:
        secret = _secret(config, disk, shared=config.remote is not None and ram > 0)
    except BaseException:
        if disk is not None:
            disk.close()
        raise
    remote = None
    note = None
    if config.remote is not None and ram <= 0:
        # Chunks from the shared tier land in RAM before a restore reads them.
        note = _no_remote(config, "it needs the RAM tier (--host-cache-mib > 0)")
    elif config.remote is not None:
        remote = RemoteChunks(config.remote)
    store = StateStore(ChunkStore(ram, disk, secret=secret, policy=config.eviction), layout, config.chunk_tokens,
                       max_pending_bytes=config.max_pending_bytes, remote=remote)
    return store, note


def _secret(config: EngineConfig, disk: DiskChunks | None, *, shared: bool) -> bytes:
    """The key chunks are MAC'd with: the configured one, the cache directory's, or one of this engine's."""
    if config.cache_secret is not None:
        return config.cache_secret
    if shared:
        # A secret of each replica's own would make every chunk another replica wrote fail its MAC:
        # the shared tier would silently share nothing.
        raise StartupError(
            "--remote-cache needs --cache-secret-file: a file holding the secret every replica that "
            "shares the tier seals its chunks with (e.g. openssl rand -hex 32 > FILE; chmod 600 FILE)"
        )
    if disk is not None:
        try:
            return cache_dir_secret(disk.root)
        except (OSError, SecretFileError) as exc:
            raise StartupError(f"--cache-dir {disk.root}: {exc}") from None
    return os.urandom(SECRET_BYTES)  # nothing outlives this engine, so nothing needs to verify later


def _no_remote(config: EngineConfig, why: str) -> str | None:
    if config.remote is None:
        return None
    return f"no shared tier: {why}"
