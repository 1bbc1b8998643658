"""The engine: one thread that owns llama.cpp, the lanes and the prefix cache.

A step is schedule -> decode -> post-process:
- admit waiting requests onto free lanes (scheduler.py); a new lane starts
  from the cache's hit, decided in one place (prefixcache.py: the core plans,
  `apply` puts it on the lane, `settle` counts it); a lane whose prefix
  another lane is prefilling right now waits for those cells and shares them
  (inflight.py);
- fill one batch with every decoding lane's next token and prefill chunks
  (ending on the record grid) of the rest, ordered so that first tokens come
  out early (batching.py);
- evict (demote) LRU cache entries until the batch's cells are free, then
  `llama_decode` through the cell pool (pool.py);
- sample, stream, record finished prompts into the cache, free finished lanes,
  and demote entries that sat idle.

With a shared tier (remote.py), `submit` hands a request to a prefetch
worker first, which brings the prompt's chunks that only the shared tier holds
into RAM and then queues it: the engine thread never waits on the network.

Callers (HTTP handlers, tests, benchmarks) only `submit` and receive events,
and read `info` and `stats()`.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import threading
import time
import traceback
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import replace
from typing import TypeVar

import numpy as np

from skippy_cache.config import CacheMode, ContextConfig, PrefixCandidatePolicy, ResidentCacheConfig
from skippy_cache.family import Family, refusal, resolve_mode
from skippy_cache.identity import IdentityKey
from skippy_cache.resident import ResidentPrefixCache
from skippy_cache.runtime.batching import BatchBuilder, Planned
from skippy_cache.runtime.gguf_info import GgufInfo, ModelFileError, default_model_path, read_gguf_info
from skippy_cache.runtime.inflight import InflightJoins
from skippy_cache.runtime.info import (
    EngineConfig,
    EngineInfo,
    EngineStats,
    PoolAudit,
    PoolView,
)
from skippy_cache.runtime.lane import Lane, Phase
from skippy_cache.runtime.logprobs import token_logprobs
from skippy_cache.runtime.native import (
    Batch,
    ContextParams,
    NativeContext,
    NativeError,
    NativeModel,
    Sampler,
    grammar_error,
    runtime_abi,
)
from skippy_cache.runtime.pool import CellPool
from skippy_cache.runtime.prefixcache import Explanation, PrefixCache, TenantFigures
from skippy_cache.runtime.requests import (
    Completion,
    DoneEvent,
    EngineClosedError,
    Event,
    EventSink,
    FinishReason,
    GenerationRequest,
    RequestError,
    RequestHandle,
    RequestStats,
    TokenEvent,
    check_prompt_tokens,
    validate_request,
)
from skippy_cache.runtime.scheduler import Admission, Scheduler, Waiting
from skippy_cache.runtime.startup import StartupError
from skippy_cache.runtime.statestore import StateStore, open_store
from skippy_cache.runtime.steering import AlignedPlacement, FreePlacement, Placement
from skippy_cache.runtime.textstream import TextStream
from skippy_cache.runtime.threads import ThreadGovernor, cpu_budget, wait_policy
from skippy_cache.runtime.weightprobe import WeightLayout, layout_for
from skippy_cache.stateformat import Layout, StateFormatError, parse_sections
from skippy_cache.tiers import CacheTiers
from skippy_cache.weights import weight_layout_name

log = logging.getLogger("skippy_cache.engine")

T = TypeVar("T")

#: Requests prefetching from the shared tier at once; more wait for a worker.
_PREFETCH_WORKERS = 4

#: Generated tokens a lane's room holds past its prompt in deterministic mode (steering.py): cells
#: kept free for its first tokens, which a longer reply outgrows (its rows then go past other
#: lanes' cells, as every row did before rooms).
ROOM_TOKENS = 64


class Engine:
    def __init__(self, config: EngineConfig | None = None, *, start: bool = True) -> None:
        self.config = config = config or EngineConfig()
        gguf, weights, weight_layout, mode, mode_note = self._load_model(config)
        stage = ContextConfig(
            ctx_size=config.ctx_size,
            lane_count=config.lanes,
            layer_end=self.model.n_layer,
            cache_type_k=config.type_k,
            cache_type_v=config.type_v,
            flash_attn=config.flash_attn,
            model_id=gguf.model_id,
        )
        budgets = ResidentCacheConfig.from_context(stage, config.cache)
        policy = PrefixCandidatePolicy.from_cache(config.cache)
        cpus = cpu_budget()
        threads = config.threads or cpus.threads
        self._open_context(config, gguf, budgets, threads)
        identity_key = IdentityKey.from_context(stage, model_digest=gguf.digest, runtime_abi=runtime_abi(),
                                                weight_layout=weight_layout)
        store, store_note = self._wire_cache(config, budgets, policy, identity_key, mode)
        det = config.deterministic
        self.info = EngineInfo(
            model=gguf,
            description=self.model.description,
            family=self.family,
            weights=weights,
            weight_buffers=dict(self.model.weight_buffers),
            weight_layout=weight_layout,
            n_ctx=self.pool.n_ctx,
            lanes=config.lanes,
            threads=threads,
            threads_adapt=config.threads is None,
            cpus=cpus,
            wait_policy=wait_policy(),
            n_batch=config.n_batch,
            deterministic=det,
            mode=mode,
            configured_mode=config.cache.mode,
            mode_note=mode_note,
            budgets=budgets,
            policy=policy,
            host_cache_bytes=store.chunks.ram_max_bytes if store is not None else 0,
            cache_dir=config.cache_dir if store is not None and store.chunks.disk is not None else None,
            disk_cache_bytes=config.disk_cache_bytes,
            chunk_tokens=config.chunk_tokens,
            eviction=config.eviction,
            remote_url=store.remote.url if store is not None and store.remote is not None else None,
            store_note=store_note,
            idle_tokens=config.idle_tokens,
            max_queue=config.max_queue,
            bos_text=self.model.special_text(self.model.bos),
            eos_text=self.model.special_text(self.model.eos),
        )
        self._calls: deque[tuple[Callable[[], object], Future]] = deque()
        self._cv = threading.Condition()
        self._closing = False
        self._steps = 0
        #: Without `--threads`: the team each step runs with follows the machine's load.
        self._governor = ThreadGovernor(cpus) if config.threads is None else None
        self._decode_failures = 0
        #: Lone decode steps that fed a guessed token (drafts.py), and those whose guess was taken.
        self._guesses = 0
        self._guesses_taken = 0
        #: Grammar-forced tokens fed ahead in decode steps (jump-forward), and those sampling picked.
        self._forced_fed = 0
        self._forced_taken = 0
        self._requests_done = 0
        self._prompt_tokens = 0
        self._cached_tokens = 0
        self.invariant_failures: list[str] = []
        #: Ends of requests, sent once the step's stats are published; with a shared tier, each
        #: once its reply is on the tier too (the future the store's writer completes).
        self._outbox: list[tuple[EventSink, DoneEvent, Future[None] | None]] = []
        #: With a shared tier: workers that prefetch a request's chunks before it is queued,
        #: and the requests they hold (counted against the queue's size).
        self._prefetch = (
            ThreadPoolExecutor(_PREFETCH_WORKERS, thread_name_prefix="skippy-prefetch") if self.cache.shares else None
        )
        self._prefetching: set[RequestHandle] = set()
        self._publish()
        self._thread: threading.Thread | None = None
        if start:
            self._thread = threading.Thread(target=self._run, name="skippy-engine", daemon=True)
            self._thread.start()


    def _load_model(self, config: EngineConfig) -> tuple[GgufInfo, WeightLayout, str, CacheMode, str | None]:
        """Load the model (`self.model`, `self.family`); its file, its weights' layout and the
        name of their buffers, and the cache mode its family gets (with a note on why, if any)."""
        gguf = read_gguf_info(config.model_path or default_model_path())
        refused = refusal(gguf.architecture)
        if refused is not None:
            raise ModelFileError(f"--model {gguf.path}: {refused}")
        # Checked in a child process before this one loads anything: a layout that
        # crashes this CPU must end a probe, not the server (weightprobe.py).
        weights = layout_for(gguf, config.weight_repack, config.cache_dir)
        try:
            self.model = NativeModel(gguf.path, use_extra_bufts=weights.use_extra_bufts)
        except NativeError:
            raise ModelFileError(f"--model {gguf.path}: llama.cpp could not load it (architecture "
                                 f"{gguf.architecture!r}; the error above says why)") from None
        weight_layout = weight_layout_name(self.model.weight_buffers)
        self.family = family = Family.of(gguf.architecture, recurrent=self.model.is_recurrent,
                                         hybrid=self.model.is_hybrid, n_swa=self.model.n_swa)
        mode, mode_note = resolve_mode(config.cache.mode, config.cache.payload, family)
        if mode_note:
            log.warning("%s", mode_note)
        if 0 < self.model.n_ctx_train < config.ctx_size:
            # llama.cpp computes such positions without complaint, and a model past its trained
            # length answers with garbage: an agent's 20,000-token prompt on an 8,192 model.
            log.warning("--ctx-size %d lets one prompt run past the %d tokens %s was trained on; replies to "
                        "longer prompts are unreliable", config.ctx_size, self.model.n_ctx_train, gguf.model_id)
        return gguf, weights, weight_layout, mode, mode_note

    def _open_context(self, config: EngineConfig, gguf: GgufInfo, budgets: ResidentCacheConfig,
                      threads: int) -> None:
        """The llama.cpp context (`self.ctx`)."""
        context = ContextParams(
            n_ctx=config.ctx_size,
            n_batch=config.n_batch,
            n_seq_max=budgets.n_seq_max,
            n_threads=threads,
            type_k=config.type_k,
            type_v=config.type_v,
            flash_attn=config.flash_attn,
        )
        try:
            self.ctx = NativeContext(self.model, context)
        except NativeError:
            self.model.close()
            raise StartupError(f"--ctx-size {config.ctx_size}: llama.cpp could not create a context of "
                               f"{config.ctx_size} cells for {gguf.model_id} (out of memory?); try a smaller "
                               "--ctx-size") from None

    def _wire_cache(self, config: EngineConfig, budgets: ResidentCacheConfig, policy: PrefixCandidatePolicy,
                    identity_key: IdentityKey, mode: CacheMode) -> tuple[StateStore | None, str | None]:
        """The pool and the cache over it, and what steps are made of: the store, the tiers, the
        batch builder, placement, the prefix cache, the scheduler and in-flight joins. Returns the
        store and what opening it said."""
        family, det = self.family, config.deterministic
        self.pool = CellPool(self.ctx, whole_entries=family.whole_entries)
        # The warm-up's one-token state also names the KV layout every stored chunk is cut in.
        warm_state = self.pool.warm_up(max(self.model.bos, 0))
        store, store_note = open_store(config, warm_state, family)
        if store_note:
            log.warning("%s", store_note)
        resident = ResidentPrefixCache(budgets, max_pinned_tokens=self.ctx.n_ctx * config.pin_percent // 100,
                                       cells=self.pool.cells)
        tiers = CacheTiers(resident, store)
        self._batch = Batch(config.n_batch)
        # The seed reserves two sequence ids per lane; the ids past the lanes
        # are spare: the first holds a step's pads (a one-row step's pad row, freed
        # after its decode, and deterministic mode's placement pads, kept while
        # lanes run: steering.py).
        self._builder = BatchBuilder(self._batch, policy.grid_tokens, deterministic=det,
                                     fill_tokens=config.fill_tokens, pad_seq=config.lanes,
                                     lone_last=family.whole_entries,
                                     guess=config.lookup_decoding and family.any_prefix,
                                     jump_forward=config.jump_forward and family.any_prefix)
        # Placement pads are imported states of zeroed KV rows (steering.py), which attention and
        # sliding-window caches have; recurrent memories get grid-aligned chunks and lone prefill
        # steps, not steered cells.
        layouts = self._pad_layouts(warm_state) if det and not family.whole_entries else None
        self.placement: Placement = (AlignedPlacement(self.pool, self._builder.pad_seq, layouts)
                                     if layouts is not None else FreePlacement())
        # Both modes demote idle entries (`idle_tokens`): every resident cell
        # widens the KV view that each row of each step walks, and a stream of
        # distinct prompts otherwise keeps the view twice as wide as its lanes
        # need. A restore is recorded resident again (`PrefixCache.settle`), so
        # lanes that come back to a demoted prefix share its cells, not copies.
        self.cache = PrefixCache(
            self.pool,
            tiers,
            store,
            identity_key,
            policy,
            mode,
            bytes_per_token=self.model.kv_bytes_per_token(config.type_k, config.type_v),
            idle_tokens=config.idle_tokens,
            placement=self.placement,
            family=family,
            deterministic=det,
        )
        if config.tenant_cache_percent < 100:
            self.cache.tenant_share_tokens = self.pool.n_ctx * config.tenant_cache_percent // 100
            # One tenant's pins never release another's, nor take the whole pin budget.
            resident.max_owner_pinned_tokens = resident.max_pinned_tokens * config.tenant_cache_percent // 100
            if store is not None:
                store.owner_share_bytes = store.capacity_bytes * config.tenant_cache_percent // 100
        self.scheduler = Scheduler(config.lanes, self.pool.n_ctx, config.max_queue, config.max_queue_wait_s)
        self.joins = InflightJoins(self.pool, self.cache.counters, policy.grid_tokens, deterministic=det)
        return store, store_note

    @property
    def n_ctx(self) -> int:
        return self.info.n_ctx

    @staticmethod
    def _pad_layouts(warm_state: bytes | bytearray) -> tuple[Layout, ...] | None:
        """The KV layouts placement pads are made of, read from a one-token state; None for a state
        this build cannot read (M-RoPE cells, say): exact mode then goes without steered cells."""
        try:
            return tuple(section.layout for section in parse_sections(warm_state))
        except StateFormatError as exc:
            log.warning("exact mode without placement pads: this model's KV state cannot be read (%s)", exc)
            return None

    # -- the caller's side ---------------------------------------------------

    def tokenize(self, text: str, *, add_special: bool = True, parse_special: bool = True) -> list[int]:
        """`parse_special`: control-token text (`<|im_start|>`) becomes the control token, as a
        chat template's markup must; False spells it as text, as a user's text must."""
        return self.model.tokenize(text, add_special=add_special, parse_special=parse_special)

    @property
    def control_texts(self) -> tuple[str, ...]:
        """The texts of the model's control tokens (`<|im_start|>` and the like), longest first."""
        return self.model.control_texts

    def detokenize(self, tokens: list[int]) -> str:
        """The text of `tokens` (special tokens left out; a split character replaced).

        Raises `RequestError` for an id outside the vocabulary: llama.cpp aborts
        the process on one rather than report it.
        """
        check_prompt_tokens(tokens, self.model.n_vocab)
        return b"".join(self.model.token_bytes(t) for t in tokens).decode("utf-8", "replace")

    def validate(self, request: GenerationRequest) -> None:
        """Raise `RequestError` for a request that could never run."""
        validate_request(request, n_vocab=self.model.n_vocab, n_ctx=self.n_ctx)
        grammar = request.sampling.grammar
        if grammar is not None and (error := grammar_error(grammar)):
            raise RequestError(f"the grammar made for the request cannot be used: {error}", param="response_format")

    def submit(self, request: GenerationRequest, sink: EventSink) -> RequestHandle:
        """Queue a request; events arrive on `sink` from the engine thread."""
        self.validate(request)
        handle = RequestHandle(request)
        waiting = Waiting(handle, sink, time.perf_counter())
        with self._cv:
            if self._closing:
                raise EngineClosedError("the engine is shutting down")
            if self._prefetch is None:
                self.scheduler.enqueue(waiting, also_waiting=len(self._prefetching))
                self._cv.notify()
                return handle
            self.scheduler.check_room(len(self._prefetching), request.tenant)
            self._prefetching.add(handle)
        self._prefetch.submit(self._prefetch_then_queue, waiting)
        return handle

    def _prefetch_then_queue(self, waiting: Waiting) -> None:
        """A prefetch worker: fetch what only the shared tier holds, then queue the request (already
        counted against the queue's size at submit), whatever happened."""
        try:
            waiting.prefetched = self.cache.prefetch(waiting.handle.request)
        except Exception:  # noqa: BLE001 - the request goes on without the shared tier
            log.error("prefetch from the shared tier failed:\n%s", traceback.format_exc())
        with self._cv:
            self._prefetching.discard(waiting.handle)
            self.scheduler.add_waiting(waiting)
            self._cv.notify()

    def generate(self, request: GenerationRequest, timeout: float | None = None) -> Completion:
        """Submit and wait (tests, benchmarks, the demo)."""
        return self.generate_many([request], timeout=timeout)[0]

    def generate_many(self, requests: list[GenerationRequest], timeout: float | None = None) -> list[Completion]:
        """Submit all at once (they run concurrently on the lanes) and wait for all."""
        results: list[DoneEvent | None] = [None] * len(requests)
        remaining = threading.Semaphore(0)

        def sink_for(i: int) -> EventSink:
            def sink(event: Event) -> None:
                if isinstance(event, DoneEvent):
                    results[i] = event
                    remaining.release()

            return sink

        for i, request in enumerate(requests):
            self.submit(request, sink_for(i))
        for _ in requests:
            if not remaining.acquire(timeout=timeout):
                raise TimeoutError("generation did not finish in time")
        out = []
        for done in results:
            assert done is not None
            if done.finish_reason is FinishReason.ERROR:
                raise RuntimeError(f"generation failed: {done.error}")
            out.append(Completion(done.text, done.tokens, done.finish_reason, done.stats, done.first_logits))
        return out

    @property
    def alive(self) -> bool:
        """The engine thread is running (False once closed or if it died)."""
        return self._thread is not None and self._thread.is_alive()

    def call(self, fn: Callable[[], T], timeout: float | None = 60.0) -> T:
        """Run `fn` on the engine thread between steps (admin actions, tests) and return its result."""
        if self._thread is None or threading.current_thread() is self._thread:
            return fn()
        if not self.alive:
            raise EngineClosedError("the engine thread is not running")
        future: Future = Future()
        with self._cv:
            self._calls.append((fn, future))
            self._cv.notify()
        return future.result(timeout)

    def explain(self, request: GenerationRequest) -> Explanation:
        """What `request` would reuse right now, from where, and why not more, without running it.

        The shared tier is asked on the caller's thread; the local tiers are
        planned on the engine thread, between steps.
        """
        self.validate(request)
        remote = self.cache.prefetch(request, fetch=False)
        return self.call(lambda: self.cache.explain(request, remote))

    def pool_view(self, buckets: int = 512, *, tenant: str | None = None) -> PoolView:
        """The pool as `buckets` columns of cells, each with its owners' counts, and the top prefixes
        by tokens saved (the dashboard; with `tenant`, that tenant's only); read on the engine thread
        between steps."""
        return self.call(lambda: self._pool_view(buckets, tenant))

    def _pool_view(self, buckets: int, tenant: str | None) -> PoolView:
        kinds = self.pool.cells.owners(self.info.budgets.reserved_seq_count)
        edges = np.linspace(0, len(kinds), min(buckets, len(kinds)) + 1).astype(int)
        columns = [tuple(int(n) for n in np.bincount(kinds[a:b], minlength=4)) for a, b in itertools.pairwise(edges)]
        saved = self.cache.savings.top(None)
        if tenant is not None:
            saved = [s for s in saved if s.tenant == tenant]
        top = [(s.tokens, s.hits, s.head, s.namespace, s.tenant) for s in saved[:10]]
        return PoolView(len(kinds), columns, top)

    def pool_audit(self) -> PoolAudit:
        """Who holds the pool's cells, and whether llama.cpp agrees with the mirror; read on the
        engine thread between steps (a native call per sequence id: for checks, not for every step)."""
        return self.call(self._pool_audit)

    def _pool_audit(self) -> PoolAudit:
        cells = self.pool.cells
        lane_limit = self.info.budgets.reserved_seq_count
        entries = {entry.seq_id for entry in self.cache.tiers.resident.entries()}
        held = set(cells.sequences())
        lanes = {seq for seq in held if seq < lane_limit}
        return PoolAudit(
            used_cells=cells.used_cells,
            lane_cells=cells.cells_held(lanes),
            entry_cells=cells.cells_held(entries),
            unowned_cells=cells.cells_held(held - lanes - entries),
            native_mismatches=len(self.pool.mismatches(range(self.info.budgets.n_seq_max))),
        )

    def unpin(self, request: GenerationRequest | None) -> int:
        """Release the pin on `request`'s prompt (None: every pin); how many were released.

        RequestError for a prompt that could never run (so was never pinned), as for `submit`:
        a token id past the vocabulary would otherwise fail the identity's hash on the engine thread.
        """
        if request is not None:
            self.validate(request)
        return self.call(lambda: self.cache.unpin(request))

    def clear_cache(self) -> int:
        """Evict every resident entry and empty the state tiers; returns how many resident entries went."""
        return self.call(self.cache.evict_all)

    def clear_tenant(self, tenant: str | None) -> int:
        """Drop one tenant's resident entries and its pages in the store; how many resident entries went."""
        return self.call(lambda: self.cache.clear_tenant(tenant))

    def tenant_figures(self) -> dict[str | None, TenantFigures]:
        """What each tenant holds in the pool and the store; read on the engine thread between steps."""
        return self.call(self.cache.tenant_figures)

    def stats(self) -> EngineStats:
        """A snapshot from the end of the last step (safe from any thread).

        The store's figures are read now: its writer works while the engine
        sleeps, and an idle engine publishes no new snapshot.
        """
        snapshot = self._snapshot
        store = self.cache.store
        if store is None:
            return snapshot
        remote = store.remote.stats() if store.remote is not None else None
        return replace(snapshot, cache=replace(snapshot.cache, store=store.stats()), remote=remote)

    def _publish(self) -> None:
        """Engine thread only: the books are not safe to read while a step runs."""
        with self._cv:
            lanes = len(self.scheduler.lanes)
            queue_depth = len(self.scheduler.waiting) + len(self._prefetching)
            reserved = self.scheduler.reserved_cells
        self._snapshot = EngineStats(
            lanes_total=self.config.lanes,
            lanes_busy=lanes,
            queue_depth=queue_depth,
            n_ctx=self.n_ctx,
            used_cells=self.pool.used_cells,
            reserved_cells=reserved,
            # The store's figures are read by `stats()` when asked for, not on every step.
            cache=self.cache.stats(include_store=False),
            placement=replace(self.placement.stats),
            steps=self._steps,
            decode_failures=self._decode_failures,
            guesses=self._guesses,
            guesses_taken=self._guesses_taken,
            forced_fed=self._forced_fed,
            forced_taken=self._forced_taken,
            requests_done=self._requests_done,
            prompt_tokens=self._prompt_tokens,
            cached_tokens=self._cached_tokens,
            threads=self._governor.threads if self._governor is not None else self.info.threads,
            cpu_others=self._governor.others if self._governor is not None else 0.0,
        )

    def close(self, drain: bool = True, timeout: float | None = 60.0) -> None:
        """Stop taking requests; with `drain`, finish the queued and running ones first."""
        with self._cv:
            self._closing = True
            if not drain:
                self.scheduler.cancel_all()
                for handle in self._prefetching:
                    handle.cancel()
            self._cv.notify()
        if self._thread is not None:
            self._thread.join(timeout)
        if self._prefetch is not None:
            self._prefetch.shutdown(wait=True)
        if self._thread is None or not self._thread.is_alive():
            if self.cache.store is not None:
                self.cache.store.close()
            self.ctx.close()
            self.model.close()

    # -- the engine thread ---------------------------------------------------

    def _run(self) -> None:
        while True:
            with self._cv:
                # Closing waits for requests still prefetching: they were accepted.
                while (self.scheduler.idle and not self._calls and not self.cache.persist_left
                       and not (self._closing and not self._prefetching)):
                    self._cv.wait()
                if self._closing and self.scheduler.idle and not self._calls and not self._prefetching:
                    return
                idle = self.scheduler.idle
            self._run_calls()
            if idle:
                # No request runs: time for work that must never hold up a decode.
                self.cache.persist_one()
                self._publish()
                continue
            try:
                self.step()
            except Exception:  # noqa: BLE001 - the loop must survive a bug in one step
                log.error("engine step failed:\n%s", traceback.format_exc())
                self._fail_all("internal error in the engine step; see the server log")
            self._publish()
            outbox, self._outbox = self._outbox, []
            for sink, event, sent in outbox:
                if sent is None:
                    self._emit(sink, event)
                else:
                    # Hooked only now: a write already done would call back at once, before
                    # the publish above, and a caller reading stats() would miss its request.
                    sent.add_done_callback(lambda _sent, sink=sink, event=event: self._emit(sink, event))

    def _run_calls(self) -> None:
        while True:
            with self._cv:
                if not self._calls:
                    return
                fn, future = self._calls.popleft()
            try:
                result = fn()
                self._publish()
                future.set_result(result)
            except Exception as exc:  # noqa: BLE001 - handed to the caller
                future.set_exception(exc)

    def step(self) -> bool:
        """One schedule -> decode -> post-process round; False when there was nothing to do."""
        try:
            return self._step()
        finally:
            if self.scheduler.idle:
                self.placement.clear_pads()  # kept between steps only while lanes run

    def _step(self) -> bool:
        if self._governor is not None:
            threads = self._governor.poll()
            if threads is not None:
                self.ctx.set_threads(threads)
        self._reap_cancelled()
        self._admit()
        for lane in self.joins.poll(self.scheduler.lanes):
            if lane.n_past >= lane.prefill_end:
                self._prefill_done(lane)
        lanes = self.scheduler.lanes
        if self.config.deterministic:
            # Lowest cells first: each run needs only its own lane's cells behind it (steering.py).
            lanes = sorted(lanes, key=lambda lane: self.pool.cells.last_cell(lane.seq_id))
        planned = self._builder.fill(lanes, self.pool.cells.view)
        if not planned:
            return False
        self._steps += 1
        pad_seq = self._builder.pad_seq
        n_tokens = self._batch.n_tokens + self._builder.needs_pad
        if not self.cache.make_room(n_tokens):
            self._fail_lanes([p.lane for p in planned], "the KV pool has no free cells for this step")
            return True
        rooms = self._rooms() if self.config.deterministic else None
        self.placement.before_decode(planned, n_tokens, self.cache.evict_one, rooms, self.cache.evict_where)
        runs = [(p.lane.seq_id, p.p0, p.p1) for p in planned]
        pad_row = self.pool.cells.pos_max(pad_seq) + 1
        if self._builder.needs_pad:
            # After the placement's pads, which the pad row's sequence also holds.
            runs.append(self._builder.add_pad_row(pad_row))
        t0 = time.perf_counter()
        status = self.pool.decode(self._batch, runs)
        if status == 1 and self.cache.drop_resident():
            # No slot despite the mirror's count (fragmentation or padding):
            # drop the cache rather than a request, and try once more.
            status = self.pool.decode(self._batch, runs)
        if self._builder.needs_pad and status == 0:
            self.pool.trim(pad_seq, pad_row)
        if status != 0:
            self.placement.clear_pads()
            self._decode_failures += 1
            self._fail_lanes([p.lane for p in planned], f"llama_decode failed with status {status}")
            return True
        seconds = time.perf_counter() - t0
        prefill_tokens = sum(p.p1 - p.p0 for p in planned if p.row < 0)
        self.cache.decoded(n_tokens, prefill_tokens, seconds * 1000)
        self.scheduler.rates.step(prefill_tokens, sum(p.row >= 0 for p in planned), seconds)
        for item in planned:
            try:
                self._after_decode(item)
            except NativeError as exc:
                self._lane_fault(item.lane, exc)
        self.cache.shed_idle()
        if self.cache.shares:
            # New entries reach the shared tier while this replica still holds them.
            self.cache.persist_one()
        if self.config.check_invariants:
            self._check_invariants()
        return True

    def _rooms(self) -> dict[int, int]:
        """Each running lane's sequence -> the cells it may still grow by: the rest of its prompt and
        its first `ROOM_TOKENS` generated tokens (steering.py keeps them for it)."""
        cells = self.pool.cells
        return {
            lane.seq_id: min(lane.reserve, len(lane.prompt) + ROOM_TOKENS) - (cells.pos_max(lane.seq_id) + 1)
            for lane in self.scheduler.lanes
        }

    def _reap_cancelled(self) -> None:
        with self._cv:
            cancelled = self.scheduler.take_cancelled()
        for waiting in cancelled:
            self._emit_done_unadmitted(waiting, FinishReason.CANCELLED)
        for lane in [lane for lane in self.scheduler.lanes if lane.handle.cancelled]:
            self._finish(lane, FinishReason.CANCELLED)

    def _admit(self) -> None:
        while True:
            with self._cv:
                admission = self.scheduler.admit()
            if admission is None:
                return
            self._start_lane(admission)

    def _start_lane(self, admission: Admission) -> None:
        waiting = admission.waiting
        request = waiting.handle.request
        lane = Lane(
            seq_id=admission.seq_id,
            handle=waiting.handle,
            sink=waiting.sink,
            sampler=Sampler(request.sampling, self.model, request.tokens),
            stream=TextStream(request.stop),
            reserve=admission.reserve,
            t_submit=waiting.t_submit,
            prefetched=waiting.prefetched,
        )
        with self._cv:
            self.scheduler.start(lane)
        # Where a hit is decided: the prompt is named (hashed) once, the core
        # plans the hit, `apply` puts it on the lane (a seq_cp or a restore),
        # `settle` counts it and plans the records.
        self.cache.name(lane)
        hit = self.cache.apply(self.cache.plan(lane), lane)
        self.cache.settle(hit, lane)
        if hit.logits is not None:
            # An exact repeat: every cell is in place and the first token comes
            # from the logits the cold run's last decode produced.
            lane.t_first = time.perf_counter()
            if request.keep_first_logits:
                lane.first_logits = hit.logits.copy()
            try:
                token = lane.sampler.sample_logits(hit.logits)
            except NativeError as exc:
                self._lane_fault(lane, exc)
                return
            self._take_token(lane, token, hit.logits)
            return
        # A join shares a running lane's leading cells, which only attention keeps per position.
        if self.cache.looks_up(lane) and self.family.any_prefix and self.joins.join(lane, self.scheduler.lanes):
            return
        if lane.n_past >= lane.prefill_end:
            self._prefill_done(lane)

    def _after_decode(self, item: Planned) -> None:
        lane = item.lane
        lane.n_past = item.p1
        if item.row < 0:
            if lane.n_past in lane.checkpoints:
                self.cache.checkpoint(lane)
            if lane.n_past >= lane.prefill_end:
                self._prefill_done(lane)
            return
        logits = None
        if lane.t_first == 0.0:
            lane.t_first = time.perf_counter()
            if lane.request.keep_first_logits or lane.whole_prompt is not None:
                logits = self.ctx.logits(item.row)
                lane.first_logits = logits if lane.request.keep_first_logits else None
                self.cache.first_logits(lane, logits)
        if logits is None and lane.request.top_logprobs is not None:
            logits = self.ctx.logits(item.row)
        token = lane.sampler.sample(self.ctx, item.row)
        if not item.guesses:
            self._take_token(lane, token, logits)
            return
        # The step also fed guesses at the next positions: forced by the grammar, or a lookup's
        # (drafts.py). Row i's token is sampled as its own step would have sampled it; while it
        # is the guess fed after it, row i + 1 holds the next token's logits.
        if item.forced:
            self._forced_fed += len(item.guesses)
        else:
            self._guesses += 1
        after_sampled = item.p1 - len(item.guesses)  # the position after the sampled row's
        for i, guess in enumerate(item.guesses):
            lane.n_past = after_sampled + i
            if token != guess:
                # The cells of the guesses from here go before anything can record the lane's cells.
                self.pool.trim(lane.seq_id, lane.n_past)
                self._take_token(lane, token, logits)
                return
            if not self._take_token(lane, token, logits):
                return  # finished on a guessed token: `_finish` took the later rows' cells back
            if item.forced:
                self._forced_taken += 1
            else:
                self._guesses_taken += 1
            row = item.row + 1 + i
            logits = self.ctx.logits(row) if lane.request.top_logprobs is not None else None
            token = lane.sampler.sample(self.ctx, row)
        lane.n_past = item.p1
        self._take_token(lane, token, logits)

    def _take_token(self, lane: Lane, token: int, logits: np.ndarray | None = None) -> bool:
        """A sampled token (from `logits`, needed when the request wants logprobs): finish on EOG,
        stop string or max_tokens, else feed it back next step. False when the lane finished."""
        if self.model.is_eog(token):
            self._finish(lane, FinishReason.STOP)
            return False
        lane.take(token)
        delta = lane.stream.push(self.model.token_bytes(token))
        top_n = lane.request.top_logprobs
        logprobs = None if top_n is None or logits is None else token_logprobs(logits, token, top_n,
                                                                                self.model.token_bytes)
        self._emit(lane.sink, TokenEvent(token, delta.text, logprobs))
        if delta.stopped_on is not None:
            self._finish(lane, FinishReason.STOP)
        elif len(lane.generated) >= lane.request.max_tokens:
            self._finish(lane, FinishReason.LENGTH)
        else:
            lane.phase = Phase.DECODE
            lane.next_token = token
            return True
        return False

    @staticmethod
    def _prefill_done(lane: Lane) -> None:
        lane.phase = Phase.LAST_TOKEN
        lane.next_token = lane.prompt[-1]

    def _finish(self, lane: Lane, reason: FinishReason, error: str | None = None, *,
                request_fault: bool = False) -> None:
        completed = reason in (FinishReason.STOP, FinishReason.LENGTH)
        if completed and self.pool.cells.pos_max(lane.seq_id) >= lane.n_past:
            # Guessed rows past the last token the lane took (a lookup's or grammar-forced,
            # batching.py): the record holds exactly the state of the tokens decoded for the
            # reply, as without the guesses.
            self.pool.trim(lane.seq_id, lane.n_past)
        tail = lane.stream.finish().text if completed else ""
        if tail:
            self._emit(lane.sink, TokenEvent(-1, tail))
        sent = self.cache.finished(lane) if completed else None
        self.cache.ended(lane)
        self._release_lane(lane)
        stats = lane.stats(time.perf_counter())
        self._requests_done += 1
        self._prompt_tokens += stats.prompt_tokens
        self._cached_tokens += stats.cached_tokens
        # Sent after the step's stats are published, so a caller that reads
        # stats() on completion sees its own request counted.
        done = DoneEvent(reason, stats, lane.stream.text, tuple(lane.generated), error, lane.first_logits,
                         lane.stream.stopped_on, request_fault)
        # The client's next turn may go to another replica the moment the reply ends: with a
        # shared tier it ends once its state is there (the store's writer completes `sent`; a
        # write that hangs is given up after the tier's timeout), and a lookup there finds the
        # reply too.
        self._outbox.append((lane.sink, done, sent))

    def _release_lane(self, lane: Lane) -> None:
        """Free the lane's cells, sampler and sequence id (each even if another step fails)."""
        try:
            self.pool.free(lane.seq_id)
            lane.sampler.close()
        finally:
            with self._cv:
                self.scheduler.release(lane)

    def _lane_fault(self, lane: Lane, exc: NativeError) -> None:
        """One request's own sampler failed (a grammar that allows no token, say): that request ends
        with the reason, and the step goes on for every other lane."""
        log.warning("request on lane %d ended: %s", lane.seq_id, exc)
        if lane in self.scheduler.lanes:
            self._finish(lane, FinishReason.ERROR, f"the request's sampling failed: {exc}", request_fault=True)

    def _fail_lanes(self, lanes: list[Lane], message: str) -> None:
        for lane in lanes:
            if lane in self.scheduler.lanes:
                self._finish(lane, FinishReason.ERROR, message)

    def _fail_all(self, message: str) -> None:
        """Fail every running request; used after an unexpected error, so each lane is freed on its own."""
        for lane in list(self.scheduler.lanes):
            try:
                self._finish(lane, FinishReason.ERROR, message)
            except Exception:  # noqa: BLE001 - keep freeing the others
                log.error("could not fail lane %d cleanly:\n%s", lane.seq_id, traceback.format_exc())
                if lane in self.scheduler.lanes:
                    with contextlib.suppress(Exception):
                        self._release_lane(lane)

    def _emit_done_unadmitted(self, waiting: Waiting, reason: FinishReason) -> None:
        stats = RequestStats(len(waiting.handle.request.tokens), 0, 0, 0.0, 0.0, 0.0, 0.0)
        self._outbox.append((waiting.sink, DoneEvent(reason, stats, "", ()), None))

    @staticmethod
    def _emit(sink: EventSink, event: Event) -> None:
        # A caller's sink that raises (e.g. its event loop has closed) must not
        # take the engine step, and every other lane's request, down with it.
        try:
            sink(event)
        except Exception:  # noqa: BLE001
            log.warning("an event sink raised; dropping its event:\n%s", traceback.format_exc())

    def _check_invariants(self) -> None:
        try:
            self.cache.check_invariants()
            self.pool.cells.check_invariants()
            lanes = [lane.seq_id for lane in self.scheduler.lanes]
            for mismatch in self.pool.mismatches(lanes):
                raise AssertionError(mismatch)
        except AssertionError as exc:
            self.invariant_failures.append(str(exc))
