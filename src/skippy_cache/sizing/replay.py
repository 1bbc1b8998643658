"""A trace replayed through the cache's own books: what each tier would have served.

Each replica is the serving path's core with no model under it:
- `CacheTiers.plan` decides every hit, as it does for a live request;
- the resident tier is `ResidentPrefixCache` with the token radix index (`PrefixIndex`), over
  the pool's cell mirror (`CellMap`): a request's lane shares the cells of the entry it hits and
  an entry recorded from it shares the lane's, so its cap counts shared cells once, as live;
- the RAM and disk tiers are `ChunkStore` over `DiskChunks`, with their budgets and
  eviction policy; only their bytes are left out: a stored value is a `Placeholder` that
  has the chunk's size and nothing else, and the disk keeps its books and writes no file;
- chunks are named as the state store names them (`chunk_key` / `tail_key` of the
  prefix identity at the chunk's end), from synthetic tokens (trace.py), so two
  requests share a chunk exactly when the trace says they share its blocks;
- the shared tier is a model of a Redis or Valkey server (sharedtier.py), driven as
  `StateStore` drives a live one: read past the end of the local run before the plan,
  and after it every chunk of the request's entry renewed or written, with the
  expiry times `sharedorder.deadlines` gives.

A lookup finds the store's chunks by name, as a server finds them after a
restart or another replica's: hits from the store come in whole chunks, the
finest grain a trace's block ids describe. Time is the trace's: the policy's
clock reads each request's timestamp.
"""

from __future__ import annotations

import enum
import heapq
import itertools
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from skippy_cache.cells import CellMap
from skippy_cache.chunks import SECRET_BYTES, Chunk, chunk_key, tail_key
from skippy_cache.chunkstore import ChunkStore, Tier, slower
from skippy_cache.config import LLAMA_MAX_SEQ, ResidentCacheConfig
from skippy_cache.diskchunks import DiskChunks
from skippy_cache.eviction import Policy
from skippy_cache.identity import IdentityKey, PageId, PrefixHasher, PrefixIdentity
from skippy_cache.resident import ResidentEviction, ResidentPrefixCache, SeqId
from skippy_cache.sharedorder import reused_keys
from skippy_cache.sizing.sharedtier import ServerPolicy, SharedTier
from skippy_cache.sizing.trace import BLOCK_TOKENS, SyntheticTokens, TraceRequest
from skippy_cache.tiers import CacheTiers, Query, Source

#: The KV layout every replayed chunk is named under: one layout for the whole replay.
LAYOUT = "replay"
#: Seconds between two requests of a trace that share a timestamp (far below its millisecond grain).
_INSTANT = 1e-9
#: The sequence a request's lane is (the resident cache reserves two ids; entries take the others).
_LANE = 0
#: First-token logits a resident whole-prompt entry keeps (the plan asserts they exist).
_NO_LOGITS = np.zeros(1, dtype=np.float32)


class Routing(str, enum.Enum):
    #: Request i goes to replica i mod N.
    ROUND_ROBIN = "round-robin"
    #: A request that continues an earlier one (shares at least half its blocks with a prompt served
    #: before: a conversation's next turn) goes to the replica that served that prompt; any other goes
    #: round-robin. A prefix every prompt shares (a system prompt) sends nobody anywhere.
    SESSION = "session"
    #: The replica with the least work queued (misses to prefill, tokens to decode) when the request
    #: arrives, at `prefill_rate` and `decode_rate`.
    LEAST_LOADED = "least-loaded"


@dataclass(frozen=True, slots=True)
class Capacities:
    """Budgets in bytes per replica (0: no such tier), and the resident tier's in tokens."""

    ram_bytes: int = 0
    disk_bytes: int = 0
    #: One shared tier for all replicas.
    remote_bytes: int = 0
    resident_tokens: int = 0


@dataclass(frozen=True, slots=True)
class ReplayConfig:
    capacities: Capacities
    kv_bytes_per_token: int
    block_tokens: int = BLOCK_TOKENS
    policy: Policy = Policy.LRFU
    replicas: int = 1
    routing: Routing = Routing.ROUND_ROBIN
    #: Tokens per second a replica prefills and decodes (least-loaded routing's estimate of queued work).
    prefill_rate: float = 1000.0
    decode_rate: float = 50.0
    #: How the shared tier's server evicts (its `maxmemory-policy`).
    remote_policy: ServerPolicy = ServerPolicy.VOLATILE_TTL


@dataclass(slots=True)
class ReplayFigures:
    requests: int = 0
    input_tokens: int = 0
    #: Prompt tokens served from each tier (`Source` values).
    hit_tokens: dict[str, int] = field(default_factory=dict)
    #: Bytes of state restored into the pool (every hit but the resident ones).
    restored_bytes: int = 0
    #: Bytes read from and written to the shared tier.
    remote_read_bytes: int = 0
    remote_written_bytes: int = 0
    #: Requests each replica served.
    per_replica: list[int] = field(default_factory=list)
    #: Prompt tokens a cache that never evicts would have served (the infinite-cache bound's hits).
    bound_hit_tokens: int = 0

    @property
    def total_hit_tokens(self) -> int:
        return sum(self.hit_tokens.values())

    def ratio(self, source: str | None = None) -> float:
        tokens = self.total_hit_tokens if source is None else self.hit_tokens.get(source, 0)
        return tokens / self.input_tokens if self.input_tokens else 0.0

    def bound(self) -> float:
        """The infinite-cache bound's token hit ratio over the same requests (`infinite_bound`)."""
        return self.bound_hit_tokens / self.input_tokens if self.input_tokens else 0.0


class Placeholder:
    """A stored value's size without its bytes: the tiers book `len(value)`, and a replay stores nothing."""

    __slots__ = ("size",)

    def __init__(self, size: int) -> None:
        self.size = size

    def __len__(self) -> int:
        return self.size


class ReplayChunks(ChunkStore):
    """`ChunkStore` whose values are placeholders: nothing to verify, so a read never fails."""

    def __init__(self, ram_bytes: int, disk: DiskChunks | None, *, policy: Policy,
                 clock: Callable[[], float]) -> None:
        super().__init__(ram_bytes, disk, secret=bytes(SECRET_BYTES), policy=policy, clock=clock)

    def _verify(self, key: str, value: bytes, tier: Tier) -> Chunk | None:
        return Chunk(key, 0, b"")


class BooksOnlyDisk(DiskChunks):
    """`DiskChunks`' books, budget and eviction order, with no directory and no file."""

    def __init__(self, max_bytes: int, policy: Policy, clock: Callable[[], float]) -> None:
        self._init_books(max_bytes, policy, clock)
        self.root = Path("(replay)")
        self.reserve_bytes = 0

    def close(self) -> None:
        pass

    def get(self, key: str) -> bytes | None:
        if key not in self._index:
            return None
        self._index.touch(key)
        return Placeholder(self._index.size(key))  # type: ignore[return-value]

    def write_file(self, key: str, value: bytes) -> bool:
        if len(value) > self.max_bytes:
            self._skipped_full += 1
            return False
        return True

    def unwrite(self, key: str) -> None:
        pass

    def _delete(self, key: str) -> None:
        pass


@dataclass(frozen=True, slots=True)
class Prompt:
    """One request as the cache sees it: its tokens and the names of its chunks."""

    space: IdentityKey
    tokens: list[int]
    #: Identities at every multiple of the block size short of the last token, shortest first.
    chunk_ids: tuple[PrefixIdentity, ...]
    whole: PrefixIdentity
    chunk_keys: tuple[str, ...]
    tail_key: str

    @property
    def page_id(self) -> PageId:
        return self.whole.page_id


class Prompts:
    """Trace requests to prompts: synthetic tokens, identities and chunk names, as a server computes them."""

    def __init__(self, block_tokens: int) -> None:
        self.block_tokens = block_tokens
        self._tokens = SyntheticTokens(block_tokens)
        self._spaces: dict[str | None, IdentityKey] = {}

    def prompt(self, request: TraceRequest) -> Prompt:
        space = self._spaces.get(request.tenant)
        if space is None:
            space = self._spaces[request.tenant] = _identity_key(request.tenant)
        tokens = self._tokens.prompt(request)
        c = self.block_tokens
        n = len(tokens)
        hasher = PrefixHasher(space, tokens)
        # Chunks end at multiples of the block size short of the last token (a lookup covers all
        # tokens but the last; the rows past the last multiple go with the whole prompt, in its tail).
        chunk_ids = tuple(hasher.identity(end) for end in range(c, n, c))
        whole = hasher.identity(n)
        return Prompt(space, tokens, chunk_ids, whole,
                      tuple(chunk_key(i.page_id, LAYOUT) for i in chunk_ids), tail_key(whole.page_id, LAYOUT))


def _identity_key(tenant: str | None) -> IdentityKey:
    return IdentityKey(model_id="replay", model_digest="replay", stage_id="replay", stage_index=0, layer_start=0,
                       layer_end=0, runtime_abi="replay", weight_layout="replay", type_k="f16", type_v="f16",
                       flash_attn=False, kv_unified=True, ctx_size=0, namespace=tenant)


class ReplayStore:
    """The state store as the plan sees it (`tiers.StateTier`), over a replica's `ChunkStore`.

    It files no pages: every lookup finds chunks by name, as `StateStore.probe` does.
    """

    def __init__(self, chunks: ChunkStore, block_tokens: int) -> None:
        self.chunks = chunks
        self.block_tokens = block_tokens

    def __contains__(self, page_id: object) -> bool:
        return False

    def available(self, page_id: PageId) -> tuple[int, Source]:
        return 0, Source.NONE

    def whole_logits(self, page_id: PageId) -> np.ndarray | None:
        return None

    def probe(
        self, chunks: Sequence[PrefixIdentity], whole: PrefixIdentity | None, tails: Sequence[PrefixIdentity] = ()
    ) -> tuple[int, Source, bool]:
        keys = [chunk_key(i.page_id, LAYOUT) for i in chunks]
        run, tier = self.chunks.run(keys)
        held_whole = False
        if whole is not None and run == len(keys):
            tail = self.chunks.where(tail_key(whole.page_id, LAYOUT))
            held_whole = tail is not None
            tier = slower(tier, tail) if held_whole else tier
        return run * self.block_tokens, _source(tier), held_whole

    def pages(self) -> list[PageId]:
        return []

    def discard(self, page_id: PageId) -> bool:
        return False

    def check_invariants(self) -> None:
        self.chunks.check_invariants()


def _source(tier: Tier | None) -> Source:
    return {None: Source.NONE, Tier.RAM: Source.RAM, Tier.DISK: Source.DISK}[tier]


class Replica:
    """One server's tiers, driven request by request."""

    def __init__(self, config: ReplayConfig, clock: Callable[[], float], shared: SharedTier | None) -> None:
        self.config = config
        caps = config.capacities
        c = config.block_tokens
        disk = BooksOnlyDisk(caps.disk_bytes, config.policy, clock) if caps.disk_bytes > 0 else None
        self.chunks = ReplayChunks(caps.ram_bytes, disk, policy=config.policy, clock=clock)
        self.shared = shared
        #: The pool's cells, mirrored as the server mirrors llama.cpp's: an entry recorded from a lane
        #: that reused another shares that one's cells, so the resident cap counts them once. Twice the
        #: resident budget, as a server's cap is half its pool; the rest is the lane's.
        self.cells = CellMap(2 * caps.resident_tokens) if caps.resident_tokens > 0 else None
        resident = ResidentPrefixCache(ResidentCacheConfig(
            max_entries=LLAMA_MAX_SEQ - 2, max_bytes=0, min_tokens=min(64, c), reserved_seq_count=2,
            max_resident_tokens=max(caps.resident_tokens, 1)), cells=self.cells)
        self.tiers = CacheTiers(resident, ReplayStore(self.chunks, c))
        #: Resident pages' prompts, to write their chunks when they leave the pool.
        self._resident_prompts: dict[PageId, Prompt] = {}
        self._left: list[PageId] = []
        #: When this replica's queued work is done (least-loaded routing), in trace seconds.
        self.busy_until = 0.0

    def serve(self, prompt: Prompt, figures: ReplayFigures) -> int:
        """Look up, reuse and record one request; adds what it reused to `figures`. Returns the hit's tokens."""
        remote_keys = self._fetch_shared(prompt, figures)
        query = Query(prompt.space, prompt.tokens[:-1], whole=prompt.whole, chunks=prompt.chunk_ids)
        hit = self.tiers.plan(query)
        entry = None
        if hit.source is Source.RESIDENT:
            assert hit.page_id is not None
            entry = self.tiers.resident.touch(hit.page_id)
            _count(figures, Source.RESIDENT, hit.length)
        elif hit.length:
            self._read(prompt, hit.length, hit.whole, remote_keys, figures)
        in_pool = self._fill_lane(len(prompt.tokens), entry.seq_id if entry is not None else None, hit.length)
        if self._record(prompt, in_pool) and self.shared is not None:
            self._share(prompt, hit.length, hit.whole, figures)
        if self.cells is not None:
            self.cells.seq_rm(_LANE)
        return hit.length

    def _fill_lane(self, n: int, entry: int | None, hit: int) -> bool:
        """The lane's cells for an `n`-token prompt, as the pool gives them: the resident entry's first
        `hit` shared (`seq_cp`), the rest new, evicting entries while no slot is free (as a server makes
        room before a step). False when the prompt does not fit the pool (or there is no pool)."""
        cells = self.cells
        if cells is None or n > cells.n_cells:
            return False
        if entry is not None:
            cells.seq_cp(entry, _LANE, 0, hit)
        else:
            hit = 0
        while cells.find_slot(n - hit) is None:
            if self.tiers.resident.evict_one_lru_entry(self._demote, pinned_too=True) is None:
                return False
            self._forget_left()
        cells.decode([(_LANE, hit, n)])
        return True

    def _read(self, prompt: Prompt, length: int, whole: bool, remote: set[str], figures: ReplayFigures) -> None:
        """Read the hit's chunks (as a restore does: each one a use), counting each one's tokens by its tier."""
        c = self.config.block_tokens
        keys = list(prompt.chunk_keys[: length // c])
        if whole:
            keys.append(prompt.tail_key)
        parent = None
        for i, key in enumerate(keys):
            tokens = min(c, length - i * c)
            source = Source.REMOTE if key in remote else _source(self.chunks.where(key))
            self.chunks.get(key, parent=parent, tail=key == prompt.tail_key)
            _count(figures, source, tokens)
            figures.restored_bytes += tokens * self.config.kv_bytes_per_token
            parent = key

    def _fetch_shared(self, prompt: Prompt, figures: ReplayFigures) -> set[str]:
        """The shared tier's chunks past the local run, into RAM (`StateStore.prefetch`); their keys."""
        if self.shared is None:
            return set()
        local, _ = self.chunks.run(prompt.chunk_keys)
        fetched: set[str] = set()
        parent = prompt.chunk_keys[local - 1] if local else None
        for key in [*prompt.chunk_keys[local:], prompt.tail_key]:
            if key == prompt.tail_key and key in self.chunks:
                break  # held here already
            if not self.shared.fetch(key):
                break  # a missing chunk ends the run; the tail serves only after every chunk before it
            value: bytes = Placeholder(self.shared.size(key))  # type: ignore[assignment]
            if not self.chunks.adopt(key, value, parent=parent, tail=key == prompt.tail_key):
                break
            figures.remote_read_bytes += len(value)
            fetched.add(key)
            parent = key
        return fetched

    def _record(self, prompt: Prompt, in_pool: bool) -> bool:
        """Keep the request's state: in the pool when there is a resident tier (its chunks go to the store
        when it leaves), else straight into the store. False when it is kept nowhere. `in_pool`: the lane
        holds the prompt's cells."""
        if self.config.capacities.resident_tokens > 0:
            return self._record_resident(prompt, in_pool)
        self._write(prompt)
        return True

    def _share(self, prompt: Prompt, hit: int, whole: bool, figures: ReplayFigures) -> None:
        """The entry's chunks to the shared tier at once, as a server sends a new entry's: the ones it
        holds renewed, the others written."""
        assert self.shared is not None
        c = self.config.block_tokens
        per_token = self.config.kv_bytes_per_token
        reused = reused_keys(hit, len(prompt.chunk_keys), c, whole=whole)
        figures.remote_written_bytes += self.shared.use(
            [*prompt.chunk_keys, prompt.tail_key], [n * per_token for n in prompt_sizes(prompt, c)],
            reused=reused, tail_repeat_only=True)

    def _record_resident(self, prompt: Prompt, in_pool: bool) -> bool:
        """Record the prompt in the pool, or in the store when it is longer than the pool's budget (as a
        server stores it from its lane); False when it is kept nowhere (shorter than `min_tokens`)."""
        resident = self.tiers.resident
        n = len(prompt.tokens)
        nbytes = n * self.config.kv_bytes_per_token
        if n < resident.config.min_tokens:
            return False
        if not in_pool:
            self._write(prompt)
            return True
        allocation = resident.allocate_for_record(prompt.page_id, n, nbytes, self._demote, source=SeqId(_LANE))
        self._forget_left()
        if not allocation.should_save:
            if allocation.reason == "uncacheable":
                self._write(prompt)
                return True
            return allocation.reason == "exists"
        assert self.cells is not None
        self.cells.seq_cp(_LANE, allocation.seq_id, 0, n)
        resident.commit_record(prompt.page_id, allocation.seq_id, n, nbytes)
        self.tiers.file(prompt.page_id, prompt.space, prompt.tokens)
        self.tiers.logits[prompt.page_id] = _NO_LOGITS
        self._resident_prompts[prompt.page_id] = prompt
        return True

    def _demote(self, eviction: ResidentEviction) -> None:
        prompt = self._resident_prompts.pop(eviction.page_id)
        self._write(prompt)
        assert self.cells is not None
        self.cells.seq_rm(eviction.seq_id)
        self._left.append(eviction.page_id)

    def _forget_left(self) -> None:
        """Take the entries that left the pool out of the plan's index (a store may still hold them)."""
        for page in self._left:
            self.tiers.forget_if_gone(page)
        self._left.clear()

    def _write(self, prompt: Prompt) -> None:
        """Add the prompt's chunks to this replica's store, first to last."""
        per_token = self.config.kv_bytes_per_token
        parent = None
        keys = [*prompt.chunk_keys, prompt.tail_key]
        for key, tokens in zip(keys, prompt_sizes(prompt, self.config.block_tokens), strict=True):
            size = tokens * per_token
            self.chunks.add(key, size, lambda size=size: Placeholder(size), parent=parent,  # type: ignore[misc]
                            tail=key == prompt.tail_key)
            parent = key


def _count(figures: ReplayFigures, source: Source, tokens: int) -> None:
    figures.hit_tokens[source.value] = figures.hit_tokens.get(source.value, 0) + tokens


class Router:
    """Which replica serves each request."""

    def __init__(self, routing: Routing, replicas: Sequence[Replica]) -> None:
        self.routing = routing
        self.replicas = replicas
        self._turn = itertools.count()
        #: Session routing: block chain (a prompt's chunk keys) -> the replica that last served it.
        self._served_by: dict[str, int] = {}

    def pick(self, prompt: Prompt, request: TraceRequest) -> int:
        n = len(self.replicas)
        if n == 1:
            return 0
        if self.routing is Routing.SESSION:
            where, depth = None, 0
            for depth, key in enumerate(prompt.chunk_keys, 1):
                found = self._served_by.get(key)
                if found is None:
                    depth -= 1
                    break
                where = found
            if where is not None and 2 * depth >= len(prompt.chunk_keys):
                return where
            return next(self._turn) % n
        if self.routing is Routing.LEAST_LOADED:
            now = request.seconds
            return min(range(n), key=lambda i: (max(self.replicas[i].busy_until - now, 0.0), i))
        return next(self._turn) % n

    def served(self, index: int, prompt: Prompt, request: TraceRequest, hit: int, config: ReplayConfig) -> None:
        if self.routing is Routing.SESSION:
            for key in prompt.chunk_keys:
                self._served_by[key] = index
        elif self.routing is Routing.LEAST_LOADED:
            replica = self.replicas[index]
            work = (request.input_length - hit) / config.prefill_rate + request.output_length / config.decode_rate
            replica.busy_until = max(replica.busy_until, request.seconds) + work


def replay(requests: Sequence[TraceRequest], config: ReplayConfig, *, count_from_ms: float = 0.0) -> ReplayFigures:
    """Every request through the replicas' tiers, in trace order; deterministic. Requests before
    `count_from_ms` warm the tiers and count in no figure."""
    now = [0.0]

    def clock() -> float:
        return now[0]

    caps = config.capacities
    shared = SharedTier(caps.remote_bytes, config.remote_policy, clock) if caps.remote_bytes > 0 else None
    replicas = [Replica(config, clock, shared) for _ in range(config.replicas)]
    router = Router(config.routing, replicas)
    prompts = Prompts(config.block_tokens)
    figures = ReplayFigures(per_replica=[0] * config.replicas)
    # Every key named so far: the infinite-cache bound, counted in the same pass (naming a prompt's
    # chunks hashes all its tokens, the replay's main cost).
    seen: set[str] = set()
    for i, request in enumerate(requests):
        # Each request its own instant (a trace's millisecond timestamps repeat), so that the books'
        # "uses at one instant count once" joins a request's own uses and no two requests'.
        now[0] = request.seconds + i * _INSTANT
        prompt = prompts.prompt(request)
        index = router.pick(prompt, request)
        counted = request.timestamp >= count_from_ms
        hit = replicas[index].serve(prompt, figures if counted else ReplayFigures())
        router.served(index, prompt, request, hit, config)
        if counted:
            figures.requests += 1
            figures.input_tokens += request.input_length
            figures.per_replica[index] += 1
            figures.bound_hit_tokens += _hit(prompt.chunk_keys, prompt.tail_key,
                                             prompt_sizes(prompt, config.block_tokens), seen.__contains__)
        seen.update(prompt.chunk_keys)
        seen.add(prompt.tail_key)
    return figures


# -- references: the infinite cache and the offline optimum -------------------------------------


def block_keys(requests: Sequence[TraceRequest], block_tokens: int) -> list[tuple[list[str], str, list[int]]]:
    """Each request's chunk keys, tail key and the tokens each key covers, named as `replay` names them."""
    prompts = Prompts(block_tokens)
    out = []
    for request in requests:
        p = prompts.prompt(request)
        out.append((list(p.chunk_keys), p.tail_key, prompt_sizes(p, block_tokens)))
    return out


def prompt_sizes(prompt: Prompt, block_tokens: int) -> list[int]:
    """The tokens each of a prompt's keys covers: its chunks, then its tail."""
    n = len(prompt.tokens)
    return [block_tokens] * len(prompt.chunk_keys) + [n - len(prompt.chunk_keys) * block_tokens]


def _hit(keys: Sequence[str], tail: str, sizes: list[int], held: Callable[[str], bool]) -> int:
    """Tokens a lookup reuses when `held` says which keys are held: the run of chunks, the tail after all."""
    run = 0
    for key in keys:
        if not held(key):
            break
        run += 1
    tokens = sum(sizes[:run])
    if run == len(keys) and held(tail):
        tokens += sizes[-1]
    return tokens


def infinite_bound(requests: Sequence[TraceRequest], block_tokens: int, *, count_from_ms: float = 0.0) -> float:
    """The token hit ratio of a cache that never evicts."""
    seen: set[str] = set()
    hit = total = 0
    for (keys, tail, sizes), request in zip(block_keys(requests, block_tokens), requests, strict=True):
        if request.timestamp >= count_from_ms:
            hit += _hit(keys, tail, sizes, seen.__contains__)
            total += request.input_length
        seen.update(keys)
        seen.add(tail)
    return hit / total if total else 0.0


def belady(requests: Sequence[TraceRequest], block_tokens: int, capacity_tokens: int, *,
           count_from_ms: float = 0.0) -> float:
    """The token hit ratio of the offline optimum's rule (evict what is next used farthest ahead)
    at `capacity_tokens`: a reference for a policy, not a policy."""
    named = block_keys(requests, block_tokens)
    uses: dict[str, list[int]] = {}
    for t, (keys, tail, _) in enumerate(named):
        for key in (*keys, tail):
            uses.setdefault(key, []).append(t)
    for times in uses.values():
        times.reverse()  # pop() gives the next use
    held: dict[str, int] = {}
    heap: list[tuple[float, str]] = []  # (-next use, key); stale entries skipped
    next_use: dict[str, float] = {}
    used = hit = total = 0
    for t, ((keys, tail, sizes), request) in enumerate(zip(named, requests, strict=True)):
        if request.timestamp >= count_from_ms:
            hit += _hit(keys, tail, sizes, held.__contains__)
            total += request.input_length
        for key, size in zip((*keys, tail), sizes, strict=True):
            times = uses[key]
            while times and times[-1] <= t:
                times.pop()
            nxt = times[-1] if times else math.inf
            if key not in held:
                if nxt == math.inf or size > capacity_tokens:
                    continue  # never used again: the optimum does not keep it
                held[key] = size
                used += size
            next_use[key] = nxt
            heapq.heappush(heap, (-nxt, key))
        while used > capacity_tokens:
            neg, key = heapq.heappop(heap)
            if key in held and next_use[key] == -neg:
                used -= held.pop(key)
                del next_use[key]
    return hit / total if total else 0.0
