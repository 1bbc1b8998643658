"""Every kind of model memory reuses exact state: cache-on output equals cache-off output.

One tiny random-weight model per architecture (tinymodels.py): attention
(llama, qwen3), sliding window (gemma3, a 16-position window), recurrent
(mamba2) and hybrid (lfm2, granitehybrid, qwen35). Random weights give
meaningless text whose greedy picks agree even on wrong state, so raw logits
are compared. A negative control shows what the rules prevent: a ranged copy of a
hybrid's entry gives the recurrent state of the entry's end.
"""

from __future__ import annotations

import random
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
from tinymodels import build

from skippy_cache.config import CacheConfig, CacheMode
from skippy_cache.family import Memory
from skippy_cache.runtime import Engine, EngineConfig
from skippy_cache.runtime.gguf_info import ModelFileError
from skippy_cache.runtime.native import Batch, SamplingParams
from skippy_cache.runtime.remote import RemoteConfig
from skippy_cache.runtime.requests import GenerationRequest

pytestmark = [pytest.mark.model, pytest.mark.timeout(300)]

MEMORY = {
    "llama": Memory.ATTENTION,
    "qwen3": Memory.ATTENTION,
    "gemma3": Memory.SLIDING_WINDOW,
    "mamba2": Memory.RECURRENT,
    "lfm2": Memory.HYBRID,
    "granitehybrid": Memory.HYBRID,
    "qwen35": Memory.HYBRID,
}


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("families")
    return {arch: build(arch, root / f"tiny-{arch}.gguf") for arch in [*MEMORY, "rwkv7"]}


def engine(path: Path, *, cache_on: bool = True, **overrides: object) -> Engine:
    mode = CacheMode.AUTO if cache_on else CacheMode.DISABLED
    settings = {"ctx_size": 2048, "lanes": 4, **overrides}
    return Engine(EngineConfig(model_path=path, host_cache_bytes=0, cache_dir=None,
                               cache=CacheConfig(mode=mode), check_invariants=True, **settings))


@pytest.fixture(scope="module", params=list(MEMORY))
def pair(request: pytest.FixtureRequest, models: dict[str, Path]) -> Iterator[tuple[str, Engine, Engine]]:
    """A cache-on and a cache-off engine of one architecture."""
    arch = request.param
    on, off = engine(models[arch]), engine(models[arch], cache_on=False)
    yield arch, on, off
    on.close()
    off.close()


def words(e: Engine, n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    tokens: list[int] = []
    while len(tokens) < n:
        tokens += e.tokenize(" ".join(rng.choice(["alpha", "beta", "gamma", "delta", "omega", "kappa", "zeta",
                                                   "iota", "sigma", "theta", "lambda", "rho"]) for _ in range(100)),
                             add_special=False)
    return tokens[:n]


def request(tokens: list[int], max_tokens: int = 6, replies: tuple[tuple[int, int], ...] = ()) -> GenerationRequest:
    return GenerationRequest(tokens=tokens, max_tokens=max_tokens, sampling=SamplingParams(temperature=0.0),
                             keep_first_logits=True, replies=replies)


#: Where cache-on equals cache-off bit for bit (the README's "Model families" says why not elsewhere):
#: - attention: always (exact mode steers every row's cells and kernel);
#: - sliding window and pure recurrent: one lane at a time. Window cells that llama.cpp hands
#:   from one sequence to another fall out of position order, and recurrent layers compute a
#:   step of several sequences otherwise than one of one;
#: - hybrid: exact repeats only. Their attention layers' cells are not steered (a placement pad
#:   would need a recurrent state), and gated delta nets compute a step by chunks that start
#:   where the step does;
#: - a restored sliding-window state: its window cells land where the window cache has room.
BIT_EXACT_ALONE = {Memory.ATTENTION, Memory.SLIDING_WINDOW, Memory.RECURRENT}
BIT_EXACT_CONCURRENT = {Memory.ATTENTION}
BIT_EXACT_RESTORED = {Memory.ATTENTION, Memory.RECURRENT}


def assert_as_cold(on, off, arch: str, what: str, *, concurrent: bool = False) -> None:
    """The reused state is the cold run's: bit for bit where promised, else within float noise."""
    diff = float(np.abs(on.first_logits - off.first_logits).max())
    label = f"{arch} {what} ({on.stats.cached_tokens} cached, {on.stats.miss_reason})"
    restored = on.stats.cache_source in ("ram", "disk", "remote")
    exact = BIT_EXACT_CONCURRENT if concurrent else BIT_EXACT_RESTORED if restored else BIT_EXACT_ALONE
    # An exact repeat samples from the logits its cold run stored: the same in every family.
    if MEMORY[arch] in exact or on.stats.cached_tokens == on.stats.prompt_tokens:
        assert diff == 0.0, f"{label}: logits differ by {diff}"
        assert on.tokens == off.tokens, f"{label}: greedy tokens differ"
    else:
        # Float noise, as large as the cache-off engine's own (a prompt alone against the same
        # prompt beside others: 2e-3 on gemma3). A wrong state (the negative control below) moves
        # them by 1e-2 or more.
        assert diff < 5e-3, f"{label}: logits differ by {diff}"


def test_every_family_starts_in_exact_mode_and_says_what_it_is(pair):
    arch, on, _ = pair
    assert on.info.family.memory is MEMORY[arch]
    assert on.info.mode is CacheMode.LOOKUP_RECORD and on.info.mode_note is None
    assert on.info.family.describe().startswith(MEMORY[arch].value)


def test_full_partial_and_diverging_hits_equal_cache_off(pair):
    arch, on, off = pair
    base = words(on, 700, seed=1)
    prompts = {
        "cold": base[:600],
        "exact repeat": base[:600],
        "extends an entry": base[:600] + words(on, 40, seed=2),
        "inside an entry": base[:450],
        "diverges mid-entry": base[:300] + words(on, 200, seed=3),
        "longer": base,
    }
    hits = {}
    for what, tokens in prompts.items():
        warm, cold = on.generate(request(tokens)), off.generate(request(tokens))
        assert_as_cold(warm, cold, arch, what)
        hits[what] = warm.stats.cached_tokens
    assert hits["cold"] == 0 and hits["exact repeat"] == 600
    assert hits["extends an entry"] >= 512, hits
    if MEMORY[arch] in (Memory.RECURRENT, Memory.HYBRID):
        # Only where an entry ends: the checkpoints the first prompt recorded on the grid.
        ends = {600, 599} | set(on.cache.policy.record_candidate_token_counts(600))
        assert all(n == 0 or n in ends or n >= 600 for n in hits.values()), hits
    assert on.invariant_failures == []


def test_a_chat_reuses_each_reply_and_equals_cache_off(pair):
    arch, on, off = pair
    on.clear_cache()
    history = words(on, 200, seed=10 + len(arch))
    replies: tuple[tuple[int, int], ...] = ()
    previous = 0
    for turn in range(4):
        # The replies are marked as a chat request marks them: exact mode computes their rows one
        # at a time, as they were generated.
        warm, cold = on.generate(request(history, 12, replies)), off.generate(request(history, 12, replies))
        assert_as_cold(warm, cold, arch, f"turn {turn + 1}")
        if turn:
            # The previous turn's prompt and reply (all but its last sampled token) are an entry.
            assert warm.stats.cached_tokens >= previous, (turn, warm.stats)
        previous = len(history) + len(warm.tokens) - 1
        replies += ((len(history), len(history) + len(warm.tokens)),)
        history = history + list(warm.tokens) + words(on, 30, seed=turn)


def test_concurrent_lanes_equal_cache_off(pair):
    arch, on, off = pair
    shared = words(on, 300, seed=20)
    on.generate(request(shared + words(on, 20, seed=21)))
    prompts = [shared + words(on, 20 + 9 * i, seed=30 + i) for i in range(4)]
    warm = on.generate_many([request(p) for p in prompts])
    cold = [off.generate(request(p)) for p in prompts]
    for i, (a, b) in enumerate(zip(warm, cold, strict=True)):
        assert_as_cold(a, b, arch, f"lane {i}", concurrent=True)
    assert on.invariant_failures == []


def test_rwkv_is_refused_at_start_with_a_reason(models):
    with pytest.raises(ModelFileError, match="rwkv7.*not supported"):
        engine(models["rwkv7"])


def test_a_ranged_copy_of_a_hybrid_entry_is_refused_and_would_be_wrong(models):
    """Negative control: llama.cpp's seq_cp copies a recurrent state whole, whatever the range, so
    the first 99 cells of a 200-token entry come with the state of its 200th token."""
    e = engine(models["lfm2"], cache_on=False)
    try:
        tokens = words(e, 200, seed=40)
        cold = e.generate(request(tokens[:100]))

        def ranged_copy() -> np.ndarray:
            ctx, batch = e.ctx, Batch(512)
            batch.add(40, tokens, 0, False)
            assert ctx.decode(batch) == 0
            ctx.seq_cp(40, 41, 0, 99)
            batch.clear()
            batch.add(41, [tokens[99]], 99, True)
            assert ctx.decode(batch) == 0
            logits = ctx.logits(0)
            ctx.seq_rm(40)
            ctx.seq_rm(41)
            return logits

        def pool_copy() -> None:
            batch = Batch(512)
            batch.add(40, tokens, 0, False)
            assert e.pool.decode(batch, [(40, 0, len(tokens))]) == 0
            try:
                e.pool.copy(40, 41, 99)
            finally:
                e.pool.free(40)

        wrong = e.call(ranged_copy)
        assert float(np.abs(wrong - cold.first_logits).max()) > 1e-2
        with pytest.raises(RuntimeError, match="recurrent state cannot be cut"):
            e.call(pool_copy)
    finally:
        e.close()



def test_a_window_prefix_is_reused_only_while_the_entry_holds_its_window(models, monkeypatch):
    """Negative control. llama.cpp hands an entry's window cells below its end to later decodes when
    the pool runs short (the seq_pos_min it then reports rises); the rule reads it and falls back to
    an entry that ends at or before the prefix. The handing out is simulated by removing the cells."""
    on = engine(models["gemma3"], deterministic=False)
    off = engine(models["gemma3"], cache_on=False, deterministic=False)
    try:
        base = words(on, 400, seed=50)
        prompt = base[:300] + words(on, 30, seed=60)
        cold = off.generate(request(prompt))

        def cut_window() -> None:
            # Every entry past 300 tokens (the checkpoint at 384, the whole prompt, its reply's): the
            # window before position 300 starts at 285.
            longer = [x for x in on.cache.tiers.resident.entries() if x.token_count > 300]
            assert len(longer) == 3
            for entry in longer:
                on.ctx.seq_rm(entry.seq_id, 0, 290)
                assert on.ctx.seq_pos_min(entry.seq_id) == 290

        on.generate(request(base))
        on.call(cut_window)
        warm = on.generate(request(prompt))
        # No entry ends at or before 300 (the prompt's checkpoint is at 384): computed cold, and why.
        assert (warm.stats.cached_tokens, warm.stats.miss_reason) == (0, "window"), warm.stats
        assert_as_cold(warm, cold, "gemma3", "window prefix", concurrent=True)

        on.clear_cache()
        on.generate(request(base))
        on.call(cut_window)
        monkeypatch.setattr(type(on.cache), "_window_held", lambda self, hit: True)
        wrong = on.generate(request(prompt))
        assert wrong.stats.cached_tokens == 300
        assert float(np.abs(wrong.first_logits - cold.first_logits).max()) > 1e-2
    finally:
        on.close()
        off.close()

# -- the store: RAM, disk (a restart), and the shared tier --------------------------------------


def stored_engine(path: Path, cache_dir: Path | None, remote_url: str | None = None) -> Engine:
    remote = RemoteConfig(url=remote_url, retry_s=0.2) if remote_url else None
    # Replicas of a shared tier share the secret; a disk tier alone keeps its own in the directory.
    secret = bytes(range(32)) if remote_url else None
    return Engine(EngineConfig(model_path=path, ctx_size=2048, lanes=2, host_cache_bytes=64 << 20,
                               cache_dir=cache_dir, remote=remote, check_invariants=True, cache_secret=secret))


def demote_all(e: Engine) -> None:
    """Every resident entry leaves the pool for the store, and the store's writer catches up."""
    e.call(e.cache.drop_resident)
    assert e.cache.store is not None and e.cache.store.drain(30)


@pytest.mark.parametrize("arch", list(MEMORY))
def test_an_entry_restored_from_ram_and_from_disk_after_a_restart_equals_cache_off(arch, models, tmp_path):
    off = engine(models[arch], cache_on=False)
    first = stored_engine(models[arch], tmp_path)
    try:
        prompt = words(first, 300, seed=70)
        longer = prompt + words(first, 40, seed=71)
        cold, cold_longer = off.generate(request(prompt)), off.generate(request(longer))
        first.generate(request(prompt))
        assert first.generate(request(prompt)).stats.cache_source == "resident"  # reused: kept on disk too
        demote_all(first)
        warm = first.generate(request(longer))
        assert warm.stats.cache_source == "ram" and warm.stats.cached_tokens >= len(prompt) - 64, warm.stats
        assert_as_cold(warm, cold_longer, arch, "restored from RAM")
    finally:
        first.close()
    second = stored_engine(models[arch], tmp_path)
    try:
        again = second.generate(request(prompt))
        assert again.stats.cache_source == "disk" and again.stats.cached_tokens == len(prompt), again.stats
        assert_as_cold(again, cold, arch, "restored from disk after a restart")
        assert second.invariant_failures == []
    finally:
        second.close()
        off.close()


@pytest.mark.parametrize("arch", ["gemma3", "mamba2", "granitehybrid"])
def test_another_replica_restores_an_entry_from_the_shared_tier(arch, models, redis_server):
    off = engine(models[arch], cache_on=False)
    a = stored_engine(models[arch], None, redis_server.url)
    b = stored_engine(models[arch], None, redis_server.url)
    try:
        prompt = words(a, 300, seed=80)
        cold = off.generate(request(prompt))
        a.generate(request(prompt))
        store = a.cache.store
        assert store is not None and store.remote is not None
        while a.cache.persist_left or not store.drain(0.05) or not store.remote.flush(0.05):
            pass
        warm = b.generate(request(prompt))
        assert warm.stats.cache_source == "remote" and warm.stats.cached_tokens == len(prompt), warm.stats
        assert_as_cold(warm, cold, arch, "restored from the shared tier")
    finally:
        for e in (a, b, off):
            e.close(drain=False)
