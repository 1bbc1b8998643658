"""The prefix cache in the runtime: a lane's hit (plan, apply, settle), its records, and the tiers' upkeep.

A new lane goes through explicit steps, each called by the engine:
0. `name`: the prompt's identities are hashed, once per request;
1. `plan`: the core decides (`CacheTiers.plan`, pure) what the lane would
   reuse, from which tier, and why not more;
2. `apply`: the hit is put on the lane's sequence: a `seq_cp` from a resident
   entry, or a restore from a state tier;
3. `settle`: the hit is counted (once, in `CacheCounters`), and what the lane
   will record is planned.

Records: the whole prompt with its first-token logits right after the last
prompt token's decode (`first_logits`), and when the request ends, the lane's
whole sequence, prompt and reply (`finished`): the next turn of a chat resends
that reply inside its history, and reuses it instead of prefilling it again.
What a restore brought back is recorded at once (`settle`), so the lanes that
come back to a prefix together share one restore's cells.
Deterministic mode records the same entries, each with the kernels of the
prompt that computed it, and reuses of an entry only the rows computed by the
kernel its own cold run would use (exact.py).

Entries leave the pool when a record's budget, a decode or idleness needs their
cells; with a store their exact state is exported first (demotion) and kept as
chunks in RAM and on disk (statestore.py). An entry reused while resident is
exported too, when the engine is idle, so it outlives the process.

With a shared tier (remote.py) every new entry is exported soon after it is
recorded, one per engine step, so other replicas can restore it while this
one still holds it resident; and `prefetch` brings a prompt's chunks that only
the shared tier holds into RAM before its request is queued.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Hashable, Iterable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, replace

import numpy as np
from blake3 import blake3

from skippy_cache.config import CacheMode, PrefixCandidatePolicy
from skippy_cache.exact import Kernels, rows_key
from skippy_cache.exact import kernels as kernels_of
from skippy_cache.family import Family, Memory
from skippy_cache.identity import IdentityKey, PageId, PrefixIdentity, prefix_identities, prefix_identity
from skippy_cache.misses import MissBook, age_bucket, lengths
from skippy_cache.placement import ALIGN
from skippy_cache.resident import ResidentCacheError, ResidentEviction
from skippy_cache.runtime.costs import RestoreCosts
from skippy_cache.runtime.lane import Lane
from skippy_cache.runtime.pool import CellPool
from skippy_cache.runtime.remote import Prefetched
from skippy_cache.runtime.requests import GenerationRequest, Keep
from skippy_cache.runtime.statestore import EntryMeta, StateStore
from skippy_cache.runtime.steering import AlignedPlacement, FreePlacement, Placement
from skippy_cache.tiers import CacheCounters, CacheStats, CacheTiers, Hit, Query, Source, Why, reuse_why, told


@dataclass(slots=True)
class Saved:
    """One prefix's hits and the prompt tokens they did not prefill; `head`: its first tokens;
    `namespace`: "default", or a digest of its namespace (never a salt); `tenant`: whose it is."""

    tokens: int
    hits: int
    head: tuple[int, ...]
    namespace: str
    tenant: str | None = None


class Savings:
    """Prefixes by tokens saved, for "what is the cache doing for me" (bounded: the least saving go).

    A prefix is told apart by its namespace and first `key_tokens` tokens: the
    hits of one system prompt count together whichever entry served them.
    """

    def __init__(self, capacity: int = 256, key_tokens: int = 64, head_tokens: int = 16) -> None:
        self.capacity = capacity
        self.key_tokens = key_tokens
        self.head_tokens = head_tokens
        self._by_prefix: dict[tuple[str | None, tuple[int, ...]], Saved] = {}

    def hit(self, namespace: str | None, prompt: list[int], length: int, tenant: str | None = None) -> None:
        key = (namespace, tuple(prompt[: min(length, self.key_tokens)]))
        saved = self._by_prefix.get(key)
        if saved is None:
            if len(self._by_prefix) >= self.capacity:
                del self._by_prefix[min(self._by_prefix, key=lambda k: self._by_prefix[k].tokens)]
            label = "default" if namespace is None else f"salt {_namespace_digest(namespace)[:6]}"
            saved = self._by_prefix[key] = Saved(0, 0, tuple(prompt[: min(length, self.head_tokens)]), label,
                                                 tenant)
        saved.tokens += length
        saved.hits += 1

    def top(self, n: int | None) -> list[Saved]:
        """The `n` prefixes that saved the most (None: all of them), most first."""
        return sorted(self._by_prefix.values(), key=lambda s: s.tokens, reverse=True)[:n]


@dataclass(slots=True)
class TenantFigures:
    """What one tenant holds: resident entries and their cells, and pages in the store."""

    entries: int = 0
    #: Distinct cells the entries hold: entries sharing a prefix (one `seq_cp`) count its cells once.
    tokens: int = 0
    stored_pages: int = 0


def request_kernels(request: GenerationRequest) -> Kernels:
    """The kernels the request's rows are computed with (exact.py), as its lane would have them."""
    return kernels_of(len(request.tokens) - 1, request.replies)


@dataclass(slots=True)
class PromptNames:
    """A prompt as the prefix cache names it (`PrefixCache.names`): its space, and the identities
    its lookup and its records use, none below `min_tokens` or where nothing is looked up or
    recorded. A lane carries the same fields."""

    request: GenerationRequest
    kernels: Kernels
    space: Hashable
    prompt_identity: PrefixIdentity | None = None
    chunk_ids: tuple[PrefixIdentity, ...] = ()
    tail_ids: tuple[PrefixIdentity, ...] = ()

    @property
    def prefill_end(self) -> int:
        return len(self.request.tokens) - 1


#: What `PrefixCache.plan` looks a prompt up by: a lane once named, or a prompt's names.
Named = Lane | PromptNames


@dataclass(frozen=True, slots=True)
class Explanation:
    """What a request would reuse now (`PrefixCache.explain`): the fields of a response's `skippy_cache`."""

    source: str
    matched_tokens: int
    prompt_tokens: int
    miss_reason: str | None
    evicted_ago: str | None


class PrefixCache:
    def __init__(
        self,
        pool: CellPool,
        tiers: CacheTiers,
        store: StateStore | None,
        identity_key: IdentityKey,
        policy: PrefixCandidatePolicy,
        mode: CacheMode,
        *,
        bytes_per_token: int,
        idle_tokens: int,
        placement: Placement | None = None,
        family: Family | None = None,
        deterministic: bool | None = None,
    ) -> None:
        self.pool = pool
        self.tiers = tiers
        #: The same object as `tiers.store`, with the runtime's side of it (export, restore).
        self.store = store
        self.identity_key = identity_key
        self.policy = policy
        self.mode = mode
        self.bytes_per_token = bytes_per_token
        #: With a store: entries unused while the pool decodes this many tokens are demoted (0: never).
        self.idle_tokens = idle_tokens
        #: Where a restore's cells land (deterministic mode: on the block grid, steering.py).
        self.placement = placement or FreePlacement()
        #: Hits reuse only rows computed by the kernel the prompt's cold run would use (exact.py).
        #: Recurrent memories are deterministic without steered cells (no placement pads).
        self.deterministic = isinstance(self.placement, AlignedPlacement) if deterministic is None else deterministic
        #: The model's kind of memory: which leading parts of an entry are exact state (family.py).
        self.family = family or Family("llama", Memory.ATTENTION)
        # Whole-prompt entries cover the last prompt token, decoded on a step
        # of its own, and carry the logits it produced: a key of their own keeps
        # them apart from any entry of the same tokens that ends a reply (which
        # has no logits to sample from).
        self._whole_prompt_key = replace(identity_key, extra=(("entry", "whole-prompt"),))
        self.counters = CacheCounters()
        self.costs = RestoreCosts()
        #: Recently evicted prefixes and recorded namespaces, to tell a miss's reason (misses.py).
        self.misses = MissBook()
        #: Prefixes by prompt tokens their hits saved (the dashboard's top list), bounded.
        self.savings = Savings()
        #: What this cache knows of each entry it recorded, beside its cells (the resident books)
        #: and its index (`tiers`): one record, made by `_record` and dropped by `_forget`.
        self._meta: dict[PageId, EntryMeta] = {}
        #: Past this many tokens in its entries, a tenant's entries leave the pool first (0: no share).
        self.tenant_share_tokens = 0
        #: Resident pages waiting to be exported, in the order they were queued: reused ones (for
        #: an idle engine), and with a shared tier every new one (one per step).
        self._to_persist: dict[PageId, None] = {}

    # -- a new lane: plan -> apply -> settle ---------------------------------------

    def name(self, lane: Lane) -> None:
        """Hash the lane's prompt once: its space, and the identities its lookup and records use."""
        names = self.names(lane.request, lane.kernels)
        lane.space, lane.prompt_identity = names.space, names.prompt_identity
        lane.chunk_ids, lane.tail_ids = names.chunk_ids, names.tail_ids

    def names(self, request: GenerationRequest, kernels: Kernels | None = None) -> PromptNames:
        """The request's prompt as this cache names it (pure hashing): what `name` puts on a lane,
        and what `plan` takes for a prompt no lane runs (an explain, a prefetch)."""
        kernels = kernels if kernels is not None else request_kernels(request)
        names = PromptNames(request, kernels, self.identity_key.with_namespace(request.namespace))
        if not ((self.mode.looks_up and request.lookup) or (self.mode.records and request.record)):
            return names  # nothing to look up or record: no hashing
        if len(request.tokens) >= max(self.tiers.min_tokens, 1):
            steer = kernels if self.deterministic else None
            names.prompt_identity = self._whole_identity(request, steer)
            if self.store is not None:
                prefix = request.tokens[: names.prefill_end]
                names.chunk_ids = self.store.chunk_identities(names.space, prefix, steer)
                names.tail_ids = self.store.identities_at(names.space, prefix, self._tail_ends(names), steer)
        return names

    def _tail_ends(self, lane: Named) -> list[int]:
        """Where an entry of another request that shares the prompt's start would end, off the chunk
        grid: at the end of one of the replies the prompt resends, or at one of its `prefix_ends`.

        The entry of a reply holds the cells its lane fed: the prompt and every
        sampled token but the last. A reply that ended on a stop token is thus
        held whole (the stop token is not in the reply's text), one cut at
        `max_tokens` without its last token: its end or one before.
        """
        ends = {n for _, end in lane.request.replies for n in (end - 1, end)}
        if self.family.checkpoints:
            # Where this prompt's own checkpoints would be: another process's entries of a prompt
            # that starts alike ended there too.
            ends.update(self.policy.candidate_token_counts(lane.prefill_end))
        return self._off_grid(lane, ends.union(lane.request.prefix_ends), lane.prefill_end)

    def _off_grid(self, lane: Named, ends: Iterable[int], limit: int) -> list[int]:
        """The `ends` up to `limit` that a lookup by name may stop at but no whole chunk ends at.

        In deterministic mode a lookup may resume only where the prompt's own
        rows are computed one at a time (exact.py): inside a reply's span, or
        in the prompt's last partial block.
        """
        assert self.store is not None
        c = self.store.chunk_tokens
        floor = max(self.tiers.min_tokens, 1)
        kept = {n for n in ends if floor <= n <= limit and n % c}
        if self.deterministic:
            # A whole state may also end on a block boundary, where a tiled chunk resumes.
            aligned = self.store.whole_states
            kept = {n for n in kept if lane.kernels.row_by_row(n) or aligned and n % ALIGN == 0}
        return sorted(kept)

    @property
    def shares(self) -> bool:
        """New entries go to the shared tier as soon as they are recorded (one export per step)."""
        return self.store is not None and self.store.remote is not None

    def prefetch(self, request: GenerationRequest, *, fetch: bool = True) -> Prefetched | None:
        """Bring the chunks of the request's prompt that only the shared tier holds into RAM (without
        `fetch`: only ask what it holds). None when the request has nothing to look up there.

        Called on a prefetch worker before the request is queued (or by an
        explain), so the engine thread never waits on the network. The names
        are the ones `name` gives the lane (pure hashing).
        """
        store = self.store
        if store is None or store.remote is None or not (self.mode.looks_up and request.lookup):
            return None
        names = self.names(request)
        if names.prompt_identity is None:
            return None  # below min_tokens: nothing is looked up
        return store.prefetch(names.chunk_ids, names.prompt_identity, names.tail_ids, fetch=fetch)

    def explain(self, request: GenerationRequest, remote: Prefetched | None = None) -> Explanation:
        """What the request would reuse right now, from where, and why not more; changes nothing.

        `remote` is what the shared tier holds for it (`prefetch(fetch=False)`,
        asked off the engine thread). Running lanes are not looked at: a
        request sent now may also share the cells another is prefilling.
        """
        lane = self.names(request)
        hit = self.plan(lane)
        if hit.source in (Source.RAM, Source.DISK) and not self.costs.restore_wins(hit.source):
            hit = Hit.miss(Why.RESTORE_SLOWER)
        if remote is not None and (remote.tokens or remote.whole):
            # The tail comes only with every chunk before it: `whole` is the whole prompt.
            length = len(request.tokens) if remote.whole else min(remote.local_tokens + remote.tokens,
                                                                  lane.prefill_end)
            if length > hit.length:
                why = Why.EXACT_REPEAT if remote.whole else reuse_why(length, lane.prefill_end)
                hit = Hit(Source.REMOTE, None, length, why)
        evicted_ago = None
        if hit.why in (Why.NEVER_SEEN, Why.DIVERGED):
            hit, evicted_ago = self._explain_miss(hit, lane)
        miss = None if hit.why in (Why.EXACT_REPEAT, Why.ALL_BUT_LAST) else hit.why.value
        return Explanation(hit.source.value, hit.length, len(request.tokens), told(miss), evicted_ago)

    def looks_up(self, lane: Lane) -> bool:
        """The lane may share cells computed for another request: a lookup the request allows."""
        return self.mode.looks_up and lane.request.lookup

    def plan(self, lane: Named) -> Hit:
        """What the lane would reuse, from where, and why not more. Changes nothing.

        A sliding-window model reuses a leading part of a resident entry only
        while the entry still holds the window before the part's end (llama.cpp
        hands older window cells to later decodes); failing that, an entry that
        ends there or earlier serves.
        """
        query = self._query(lane)
        hit = self.tiers.plan(query)
        if self.family.memory is Memory.SLIDING_WINDOW and not self._window_held(hit):
            hit = self.tiers.plan(replace(query, whole_entries=True, short_why=Why.WINDOW))
        return hit

    def _window_held(self, hit: Hit) -> bool:
        if hit.page_id is None:
            return True  # found by name: a whole state, at its own end
        if hit.source is not Source.RESIDENT:
            # A stored state holds only the window before its own end.
            return hit.length >= (self.tiers.index.token_count(hit.page_id) or 0)
        entry = self.tiers.resident.peek(hit.page_id)
        assert entry is not None, f"planned resident page {hit.page_id} is gone"
        if hit.length >= entry.token_count:
            return True  # an entry's own end: its window is never handed out
        # The next position attends to the `n_swa - 1` positions before it.
        return self.pool.ctx.seq_pos_min(entry.seq_id) <= max(hit.length - self.family.n_swa + 1, 0)

    def _query(self, lane: Named) -> Query:
        request = lane.request
        prefix = request.tokens[: lane.prefill_end]
        refused = self._refusal(request)
        whole = lane.prompt_identity if refused is None else None
        kernels = lane.kernels if self.deterministic else None
        return Query(lane.space, prefix, whole=whole, kernels=kernels, chunks=lane.chunk_ids,
                     tails=lane.tail_ids, refused=refused, whole_entries=self.family.whole_entries)

    def apply(self, hit: Hit, lane: Lane) -> Hit:
        """Put the hit on the lane's (empty) sequence; returns what is on it.

        A restore that fails (a chunk gone or quarantined, a state llama.cpp
        refuses) is dropped from the store and the lookup is planned again
        without it, so the lane gets the next best hit or a miss.
        """
        while hit.source in (Source.RAM, Source.DISK, Source.REMOTE):
            if not self.costs.restore_wins(hit.source):
                self.counters.restores_skipped += 1
                hit = Hit.miss(Why.RESTORE_SLOWER)
                break
            restored = self._restore(hit, lane)
            if restored is None:
                hit = Hit.miss(Why.NO_ROOM)
            elif restored is False:
                self.counters.restore_failures += 1
                hit = self.plan(lane)
            else:
                hit = restored
                break
        if hit.source is Source.RESIDENT:
            assert hit.page_id is not None
            entry = self.tiers.resident.touch(hit.page_id)
            assert entry is not None, f"planned resident page {hit.page_id} is gone"
            self.pool.copy(entry.seq_id, lane.seq_id, hit.length)
            self._mark_reused(hit.page_id)
            if self.store is not None and hit.page_id not in self.store:
                self._to_persist[hit.page_id] = None
        elif hit.page_id is not None and self.store is not None:
            self.store.make_durable(hit.page_id)
        prefetched = lane.prefetched
        if hit.source in (Source.RAM, Source.DISK) and prefetched is not None and prefetched.covers(hit.length):
            # The restore read RAM, but the chunks came from another replica just before.
            hit = replace(hit, source=Source.REMOTE)
            lane.restore_ms += prefetched.ms
            self.counters.remote_restores += 1
        lane.n_past = lane.cached_tokens = hit.length
        return hit

    def settle(self, hit: Hit, lane: Lane) -> None:
        """Count the lookup once, note on the lane what it reused and why not more, and plan its records."""
        if hit.why in (Why.NEVER_SEEN, Why.DIVERGED):
            hit, lane.evicted_ago = self._explain_miss(hit, lane)
        lane.cache_source = hit.source.value
        lane.miss_reason = None if hit.why in (Why.EXACT_REPEAT, Why.ALL_BUT_LAST) else hit.why.value
        c = self.counters
        if hit.why not in (Why.LOOKUP_OFF, Why.CACHE_DISABLED):
            c.lookups += 1
        if hit.source is not Source.NONE:
            c.hits += 1
            c.hit_tokens += hit.length
            self.savings.hit(lane.request.namespace, lane.prompt, hit.length, lane.request.tenant)
        if hit.source is Source.RESIDENT and hit.whole and lane.request.pin:
            assert hit.page_id is not None
            self.tiers.resident.pin(hit.page_id, lane.request.tenant)
        if hit.source in (Source.RAM, Source.DISK, Source.REMOTE):
            # What came back is resident again, sharing the lane's cells, so the
            # next request with this prefix (a repeat, or another lane admitted
            # now with the same system prompt) gets a `seq_cp` instead of a
            # restore: a restore is the lane's own copy of the cells, and copies
            # of one prefix on several lanes fill the pool.
            # Only a whole hit carries logits.
            restored = lane.prompt_identity if hit.whole else prefix_identity(lane.space, lane.prompt[: hit.length])
            self._record(lane, restored, hit.logits)
        if self.family.checkpoints and not hit.whole:
            # Cut where the checkpoints are whether or not they are recorded: a recurrent layer's
            # floats depend on where its steps start, so a cache-off run cuts there too.
            floor = max(hit.length, self.tiers.min_tokens - 1)
            lengths = {*self.policy.record_candidate_token_counts(len(lane.prompt)), *lane.request.prefix_ends}
            lane.checkpoints = tuple(sorted(n for n in lengths if floor < n < lane.prefill_end))
        if not (self.mode.records and lane.request.record) or hit.whole:
            return
        lane.whole_prompt = lane.prompt_identity

    def checkpoint(self, lane: Lane) -> None:
        """The lane's prefill reached one of its checkpoints: record its state there, where the lane
        is (a recurrent state exists only at a sequence's end; a window is whole only there)."""
        if self.mode.records and lane.request.record:
            self._record(lane, prefix_identity(lane.space, lane.prompt[: lane.n_past]))

    # -- records ---------------------------------------------------------------------

    def first_logits(self, lane: Lane, logits: np.ndarray) -> None:
        """The last prompt token was decoded: record the whole prompt with these logits, if planned,
        and with a store the prefix up to each of the request's `prefix_ends` (the resident index
        reuses any prefix of the whole prompt already; the store, which names only whole chunks and
        entries' ends, needs an entry that ends there)."""
        if lane.whole_prompt is None:
            return
        self._record(lane, lane.whole_prompt, logits)
        lane.whole_prompt = None
        if self.store is not None and not self.family.checkpoints:  # checkpoints recorded them on the way
            for end in self._off_grid(lane, lane.request.prefix_ends, len(lane.prompt) - 1):
                self._record(lane, prefix_identity(lane.space, lane.prompt[:end]))

    def ended(self, lane: Lane) -> None:
        """A request that ran ended (however): count why it reused no more, if it fell short."""
        reason = lane.miss_reason
        if reason is None:
            return
        c = self.counters
        c.misses[reason] = c.misses.get(reason, 0) + 1
        missed = max(lane.prefill_end - lane.cached_tokens, 0)
        c.missed_tokens[reason] = c.missed_tokens.get(reason, 0) + missed

    def finished(self, lane: Lane) -> Future[None] | None:
        """The request ended: record the lane's sequence, prompt and the reply tokens fed back.

        The cells hold `(prompt + generated)[:n_past]`: the last sampled token
        is fed back only if generation went on after it. Their KV is exact
        state for those tokens, so a later prompt that starts with them (the
        next chat turn) reuses the reply too. Cells are shared with the
        whole-prompt entry, so only the reply's are new.

        With a shared tier the longest entry the lane recorded is sent there
        at once, ahead of other writes: the next turn may reach another
        replica as soon as this reply ends. The future completes when it is
        there (or the tier gave up on it); the engine ends the request then.
        """
        if not (self.mode.records and lane.request.record):
            return None
        longest = lane.prompt_identity
        if lane.n_past > len(lane.prompt):
            tokens = (lane.prompt + lane.generated)[: lane.n_past]
            longest = prefix_identity(lane.space, tokens)
            self._record(lane, longest, tokens=tokens)
        if not self.shares or longest is None:
            return None
        if longest.page_id in self._to_persist:
            self._persist_waiting(longest.page_id)
        assert self.store is not None
        return self.store.when_shared(longest.page_id)

    def _record(
        self,
        lane: Lane,
        prefix: PrefixIdentity | None,
        logits: np.ndarray | None = None,
        *,
        tokens: list[int] | None = None,
    ) -> bool:
        """Record the lane's first `prefix.token_count` cells as an entry; False when nothing was saved.

        `tokens` are the entry's tokens for the index (default: the prompt's).

        Nothing is saved below `min_tokens`, when the entry exists already,
        when it alone exceeds a budget, or when pending records leave no room
        (serving goes on uncached).
        """
        if prefix is None or prefix.token_count < max(self.tiers.min_tokens, 1):
            return False
        n = prefix.token_count
        resident = self.tiers.resident
        nbytes = n * self.bytes_per_token + (logits.nbytes if logits is not None else 0)
        try:
            allocation = resident.allocate_for_record(prefix.page_id, n, nbytes, self._demote,
                                                      source=lane.seq_id)
        except ResidentCacheError:
            self.counters.record_skips += 1
            return False
        self.counters.budget_evictions += len(allocation.evictions)
        self._forget(allocation.evictions)
        entry_tokens = (tokens if tokens is not None else lane.prompt)[:n]
        if not allocation.should_save:
            if allocation.reason == "uncacheable":
                self._store_from_lane(lane, prefix, entry_tokens, logits)
            return False
        self.pool.copy(lane.seq_id, allocation.seq_id, n)
        if logits is not None:
            self.tiers.logits[prefix.page_id] = logits
        resident.commit_record(prefix.page_id, allocation.seq_id, n, nbytes)
        self.tiers.file(prefix.page_id, lane.space, entry_tokens, lane.kernels if self.deterministic else None)
        self._meta[prefix.page_id] = EntryMeta(lane.space, entry_tokens, lane.request.tenant, lane.cached_tokens,
                                               lane.request.keep)
        self._book_recorded(lane.space, lane.request, entry_tokens)
        self.counters.records += 1
        if lane.request.pin and prefix is lane.prompt_identity:
            resident.pin(prefix.page_id, lane.request.tenant)
        if self.shares:
            self._to_persist[prefix.page_id] = None
        return True

    def _store_from_lane(
        self, lane: Lane, prefix: PrefixIdentity, tokens: list[int], logits: np.ndarray | None
    ) -> None:
        """A record larger than the pool's budget never becomes an entry. The store, whose budgets
        are larger, takes it straight from the lane as it would an evicted entry: without it a
        long conversation's next turn prefilled the whole conversation again."""
        store, keep = self.store, lane.request.keep
        if (store is None or keep is Keep.NONE or prefix.page_id in store
                or self.pool.cells.seq_len(lane.seq_id) != prefix.token_count):
            return  # a prefix shorter than the lane (an off-grid end) would need a partial export
        kernels = lane.kernels if self.deterministic else None
        entry = EntryMeta(lane.space, tokens, lane.request.tenant, lane.cached_tokens, keep)
        if self._put(prefix.page_id, entry, lane.seq_id, logits, kernels):
            self.tiers.file(prefix.page_id, lane.space, tokens, kernels)
            self._book_recorded(lane.space, lane.request, tokens)
        self._forget_store_pages(store.prune())

    # -- pins -----------------------------------------------------------------------

    def unpin(self, request: GenerationRequest | None) -> int:
        """Release the pin on the request's prompt (None: every pin); how many were released."""
        resident = self.tiers.resident
        if request is None:
            return resident.unpin_all()
        kernels = request_kernels(request) if self.deterministic else None
        return int(resident.unpin(self._whole_identity(request, kernels).page_id))

    # -- the pool's cells ------------------------------------------------------------

    def make_room(self, cells: int) -> bool:
        """Evict (demote) LRU entries until `cells` are free; False if the cache alone cannot free them."""
        if self.pool.free_cells < cells:
            self.placement.clear_pads()  # placement pads are free cells to the books
        while self.pool.free_cells < cells:
            if not (self._evict_past_share() or self.evict_one()):
                return False
        return True

    def _evict_past_share(self) -> bool:
        """Evict (demote) the least recently used entry of a tenant whose entries hold more than
        `tenant_share_tokens`; False when no tenant is past its share.

        One tenant's long prompts would otherwise push every other tenant's
        entries out of the pool; past its share, its own go first.
        """
        if not self.tenant_share_tokens:
            return False
        held = self._resident_figures()
        past = {tenant for tenant, f in held.items() if tenant is not None and f.tokens > self.tenant_share_tokens}
        if not past:
            return False
        resident = self.tiers.resident
        seqs = {e.seq_id for e in resident.entries() if self._owner(e.page_id) in past}
        return self.evict_where(seqs.__contains__)

    def _resident_figures(self) -> dict[str | None, TenantFigures]:
        """Each tenant's resident entries and the distinct cells they hold (no store pages): a
        prompt's entries at several lengths share their cells, which count once."""
        seqs: dict[str | None, list[int]] = {}
        for entry in self.tiers.resident.entries():
            seqs.setdefault(self._owner(entry.page_id), []).append(entry.seq_id)
        return {tenant: TenantFigures(entries=len(held), tokens=self.pool.cells.cells_held(held))
                for tenant, held in seqs.items()}

    def tenant_figures(self) -> dict[str | None, TenantFigures]:
        """Each tenant's resident entries and their tokens, and its pages in the store."""
        figures = self._resident_figures()
        if self.store is not None:
            for owner, pages in self.store.owners().items():
                figures.setdefault(owner, TenantFigures()).stored_pages = pages
        return figures

    def clear_tenant(self, tenant: str | None) -> int:
        """Drop one tenant's resident entries (pinned ones too) and its pages in the store, chunks and
        all; how many resident entries went."""
        resident = self.tiers.resident
        pages = {page_id for page_id, meta in self._meta.items() if meta.owner == tenant}
        seqs = {e.seq_id for e in resident.entries() if e.page_id in pages}
        for page_id in pages:
            resident.unpin(page_id)
        evicted = []
        while (eviction := resident.evict_lru_where(seqs.__contains__, self._drop)) is not None:
            evicted.append(eviction)
        self._forget(evicted)
        if self.store is not None:
            self._forget_store_pages(self.store.clear_owner(tenant))
        return len(evicted)

    def evict_one(self) -> bool:
        """Evict (demote) the least recently used entry to free its cells; False when none is left.

        Pinned entries go last, when nothing else can: a pin never fails a request.
        """
        return self._evicted(self.tiers.resident.evict_one_lru_entry(self._demote, pinned_too=True))

    def evict_where(self, wanted: Callable[[int], bool]) -> bool:
        """Evict (demote) the least recently used unpinned entry whose sequence `wanted` picks; False
        when none is."""
        return self._evicted(self.tiers.resident.evict_lru_where(wanted, self._demote))

    def _evicted(self, eviction: ResidentEviction | None) -> bool:
        """Book an entry the resident cache let go to free cells; False when it let none go."""
        if eviction is None:
            return False
        self.counters.proactive_evictions += 1
        self._forget([eviction])
        return True

    def shed_idle(self) -> int:
        """Demote entries idle past `idle_tokens` decoded tokens to the store; how many left the pool.

        A pool that holds only what is in use keeps every decode's KV view narrow.
        """
        if self.store is None or self.idle_tokens <= 0:
            return 0
        evicted = self.tiers.resident.evict_idle(self.idle_tokens, self._demote)
        self.counters.idle_evictions += len(evicted)
        self._forget(evicted)
        return len(evicted)

    def drop_resident(self) -> int:
        """Free every resident entry's cells (demoting them): the last resort before failing a decode."""
        evicted = self.tiers.resident.clear(self._demote)
        self._forget(evicted)
        return len(evicted)

    def evict_all(self) -> int:
        """Drop every resident entry and empty the store (an operator's "clear"); resident entries dropped."""
        if self.store is not None:
            for page_id in self.store.clear():
                self.tiers.forget_if_gone(page_id)
        self._to_persist.clear()
        evicted = self.tiers.resident.clear(self._drop)
        self._forget(evicted)
        return len(evicted)

    def decoded(self, tokens: int, prefill_tokens: int, ms: float) -> None:
        """The pool decoded `tokens` more tokens (`prefill_tokens` of them prompt chunks) in `ms`:
        the clock idle entries are measured by, and the prefill side of the restore costs."""
        self.tiers.resident.advance_work(tokens)
        self.costs.prefilled(prefill_tokens, ms)

    def stats(self, *, include_store: bool = True) -> CacheStats:
        """The books and counters; the store's figures too unless `include_store` is False (they walk
        every chunk the store added, too much for every engine step)."""
        store = self.store if include_store else None
        return CacheStats(self.tiers.resident.stats(), store.stats() if store is not None else None,
                          self.counters.copy())

    def check_invariants(self) -> None:
        self.tiers.check_invariants()
        # One record per resident entry, none left behind by an eviction: a leftover would keep a
        # tenant's figures and the miss book's ghosts wrong for ever.
        resident = {entry.page_id for entry in self.tiers.resident.entries()}
        assert set(self._meta) == resident, (sorted(set(self._meta) ^ resident)[:4], len(resident))
        assert set(self._to_persist) <= resident, sorted(set(self._to_persist) - resident)[:4]

    # -- internals -------------------------------------------------------------------

    def _refusal(self, request: GenerationRequest) -> Why | None:
        if not self.mode.looks_up:
            return Why.CACHE_DISABLED
        if not request.lookup:
            return Why.LOOKUP_OFF
        if len(request.tokens) < max(self.tiers.min_tokens, 1):
            return Why.BELOW_MIN_TOKENS
        return None

    def _explain_miss(self, hit: Hit, lane: Named) -> tuple[Hit, str | None]:
        """What the plan could not tell: a longer prefix that was cached and left (and how long
        ago), or the same tokens recorded under another namespace."""
        tokens = lane.request.tokens
        evicted = self.misses.evicted(self._booked_ids(lane.space, tokens), hit.length)
        if evicted is not None:
            return replace(hit, why=Why.EVICTED), age_bucket(time.monotonic() - evicted.at)
        unsalted = self._booked_ids(self.identity_key.with_namespace(None), tokens)
        length, same_tenant = self.misses.other_namespace(unsalted, _scope(lane.request), hit.length)
        if length:
            return replace(hit, why=Why.NAMESPACE if same_tenant else Why.TENANT), None
        return hit, None

    def _book_recorded(self, space: Hashable, request: GenerationRequest, tokens: Sequence[int]) -> None:
        """A prefix was recorded: it is no longer a ghost, and its tokens are booked under its namespace."""
        self.misses.held(self._booked_ids(space, tokens).values())
        unsalted = self._booked_ids(self.identity_key.with_namespace(None), tokens)
        self.misses.recorded(unsalted.values(), _scope(request))

    def _booked_ids(self, space: Hashable, tokens: Sequence[int]) -> dict[int, PageId]:
        """Page ids of the prefixes of `tokens` at the lengths the miss book keeps (misses.lengths)."""
        assert isinstance(space, IdentityKey)
        at = lengths(len(tokens), self.policy.grid_tokens)
        return {n: identity.page_id for n, identity in prefix_identities(space, tokens, at).items()}

    def _whole_identity(self, request: GenerationRequest, kernels: Kernels | None) -> PrefixIdentity:
        """The identity of the request's whole prompt as an entry (with its first-token logits).

        With `kernels` (deterministic mode) it also says which kernel computed
        each row: the same tokens sent with other replies marked are another entry.
        """
        key = self._whole_prompt_key.with_namespace(request.namespace)
        if kernels is not None:
            key = rows_key(key, kernels.bounds)
        return prefix_identity(key, request.tokens)

    def _restore(self, hit: Hit, lane: Lane) -> Hit | bool | None:
        """Restore the hit from the store onto the lane's empty sequence; the hit as restored.

        Where a resident entry holds the hit's leading chunks, the lane shares
        its cells (`seq_cp`) and imports only the chunks after them.
        None when the pool has no room for it (the store keeps it); False when
        the store could not give it (a chunk gone or quarantined) or llama.cpp
        refused it (the page is dropped).
        """
        store = self.store
        assert store is not None
        t0 = time.perf_counter()
        base = self._base(hit, lane)
        fetched = store.fetch(hit, lane.chunk_ids, lane.tail_ids, base[1] // store.chunk_tokens if base else 0)
        if fetched is None or fetched.length < self.tiers.min_tokens:
            self._forget_store_pages(store.prune())
            return False
        entry = self.tiers.resident.touch(base[0]) if base is not None and fetched.start else None
        if not self.make_room(fetched.cells):
            return None
        # The imported rows go after the shared ones, in position order (deterministic mode).
        after = self.pool.cells.cell_at(entry.seq_id, fetched.start - 1) if entry is not None else -1
        if not self.placement.place_import(lane.seq_id, fetched.cells, self.evict_one, after, fetched.start):
            # Off the block grid the rows would not be what the cold run computes.
            self.placement.clear_pads()
            return None
        if entry is not None and self.tiers.resident.peek(entry.page_id) != entry:
            # Making room evicted the entry itself (the pool holds little else): import it all.
            self.placement.clear_pads()
            return self._restore(hit, lane)
        restored = self.pool.restore(lane.seq_id, fetched.payload, fetched.cells, fetched.start)
        if not restored:
            self.placement.clear_pads()
            if hit.page_id is not None:
                store.discard(hit.page_id)
                self.tiers.forget_if_gone(hit.page_id)
            return False
        if fetched.start + fetched.cells > fetched.length:
            self.pool.trim(lane.seq_id, fetched.length)
        if entry is not None:
            self.pool.copy(entry.seq_id, lane.seq_id, fetched.start)
            self._mark_reused(entry.page_id)
        ms = (time.perf_counter() - t0) * 1000
        lane.restore_ms += ms
        self.costs.restored(fetched.source, fetched.cells, ms)
        c = self.counters
        c.restores += 1
        c.restore_tokens += fetched.length
        c.restore_shared_tokens += fetched.start
        c.restore_ms += ms
        c.disk_restores += fetched.source is Source.DISK
        if fetched.length < hit.length:
            # A chunk failed its check on the way: what came before it is still exact.
            return Hit(fetched.source, hit.page_id, fetched.length, Why.DIVERGED)
        return replace(hit, logits=fetched.logits if hit.whole else None)

    def _base(self, hit: Hit, lane: Lane) -> tuple[PageId, int] | None:
        """The resident entry whose cells a restore of the hit shares, and how many of its leading
        tokens (whole chunks, short of the hit); None if none does."""
        assert self.store is not None
        base = self.tiers.resident_base(self._query(lane))
        if base is None:
            return None
        c = self.store.chunk_tokens
        shared = min(base[1], hit.length - 1) // c * c
        return (base[0], shared) if shared > 0 else None

    def _demote(self, eviction: ResidentEviction) -> None:
        """Export an evicted entry's state to the store (if there is one), then drop its cells."""
        self._persist(eviction.page_id, eviction.seq_id)
        self._drop(eviction)

    def _persist(self, page_id: PageId, seq_id: int) -> None:
        store = self.store
        meta = self._meta.get(page_id)
        if store is None or page_id in store or meta is None or meta.keep is Keep.NONE:
            return
        self._put(page_id, meta, seq_id, self.tiers.logits.get(page_id), self.tiers.kernels.get(page_id))
        self._forget_store_pages(store.prune())

    def _put(self, page_id: PageId, entry: EntryMeta, seq_id: int, logits: np.ndarray | None,
             kernels: Kernels | None) -> bool:
        """Export `seq_id`'s state to the store as `page_id`; counted as a demotion, or as a drop when the
        store's writer is too far behind to take it."""
        assert self.store is not None
        queued = self.store.put(page_id, entry, self.pool.export(seq_id),
                                logits.tobytes() if logits is not None else None, kernels=kernels)
        if queued:
            self.counters.demotions += 1
        else:
            self.counters.store_drops += 1
        return queued

    @property
    def persist_left(self) -> bool:
        return bool(self._to_persist)

    def persist_one(self) -> bool:
        """Export one resident entry waiting for it (reused, or new with a shared tier); False when none is left.

        The engine calls it when no request runs, and with a shared tier once
        per step too: an export copies the entry's whole state, so it is
        spread out rather than allowed to hold up a decode for long.
        """
        while self._to_persist:
            if self._persist_waiting(next(iter(self._to_persist))):
                return True
        return False

    def _persist_waiting(self, page_id: PageId) -> bool:
        """Take the page off the waiting list and export it if it is still resident (False: it is not)."""
        del self._to_persist[page_id]
        entry = self.tiers.resident.peek(page_id)
        if entry is None:
            return False
        self._persist(page_id, entry.seq_id)
        return True

    def _forget_store_pages(self, pages: list[PageId]) -> None:
        for page_id in pages:
            self.tiers.forget_if_gone(page_id)

    def _drop(self, eviction: ResidentEviction) -> None:
        self.pool.free(eviction.seq_id)

    def _forget(self, evictions: list[ResidentEviction] | tuple[ResidentEviction, ...]) -> None:
        """After the resident books let entries go: the index and logits follow, and the miss book
        remembers them as ghosts."""
        now = time.monotonic()
        for eviction in evictions:
            meta = self._meta.pop(eviction.page_id, None)
            if meta is not None:
                self.misses.left(self._booked_ids(meta.space, meta.tokens).values(), now)
            self._to_persist.pop(eviction.page_id, None)
            self.tiers.forget_if_gone(eviction.page_id)

    def _owner(self, page_id: PageId) -> str | None:
        meta = self._meta.get(page_id)
        return meta.owner if meta is not None else None

    def _mark_reused(self, page_id: PageId) -> None:
        meta = self._meta.get(page_id)
        if meta is not None:
            meta.reused = True


def _namespace_digest(namespace: str | None) -> str:
    """A namespace as the miss book keeps it: a digest, so the book never holds a salt."""
    return blake3(repr(namespace).encode()).hexdigest(length=8)


def _scope(request: GenerationRequest) -> tuple[str, str]:
    """The request's tenant and namespace as the miss book keeps them (digests)."""
    return _namespace_digest(request.tenant), _namespace_digest(request.namespace)
