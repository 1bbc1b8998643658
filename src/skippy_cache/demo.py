"""`skippy-cache demo`: the core's decisions for one context size and prompt, printed."""

from __future__ import annotations

from skippy_cache.config import CacheConfig, ContextConfig, PrefixCandidatePolicy, ResidentCacheConfig
from skippy_cache.identity import IdentityKey, prefix_identities
from skippy_cache.resident import ResidentPrefixCache


def run_demo(ctx_size: int, prompt_tokens: int, lanes: int) -> str:
    stage = ContextConfig(ctx_size=ctx_size, lane_count=lanes, model_id="demo-model", layer_end=30)
    cache_cfg = CacheConfig.from_env()
    budgets = ResidentCacheConfig.from_context(stage, cache_cfg)
    policy = PrefixCandidatePolicy.from_cache(cache_cfg)
    lookups = policy.candidate_token_counts(prompt_tokens)
    records = policy.record_candidate_token_counts(prompt_tokens)
    key = IdentityKey.from_context(stage, model_digest="0" * 16, runtime_abi="demo", weight_layout="CPU")
    tokens = list(range(prompt_tokens))
    ids = prefix_identities(key, tokens, records)

    cache = ResidentPrefixCache(budgets)
    for n in records:
        allocation = cache.allocate_for_record(ids[n].page_id, n, n * 1024, lambda _e: None)
        if allocation.should_save:
            cache.commit_record(ids[n].page_id, allocation.seq_id, n, n * 1024)
    stats = cache.stats()

    token_cap = budgets.max_resident_tokens or "none (context below 8192)"
    lines = [
        f"context {ctx_size} cells, {lanes} lanes, prompt {prompt_tokens} tokens",
        f"cache mode {cache_cfg.mode.value}, min_tokens {cache_cfg.min_tokens}, "
        f"stride {cache_cfg.shared_prefix_stride_tokens}, record limit {cache_cfg.shared_prefix_record_limit}",
        "",
        "derived budgets",
        f"  reserved sequence ids   0..{budgets.reserved_seq_count - 1} (lanes)",
        f"  max entries             {budgets.max_entries}",
        f"  max resident tokens     {token_cap}",
        f"  max bytes               {budgets.max_bytes or 'none'}",
        f"  llama.cpp n_seq_max     {budgets.n_seq_max}",
        "",
        f"lookup lengths (longest first): {_short(lookups)}",
        f"record lengths:                 {records}",
    ]
    for n in records:
        lines.append(f"  {n:>6} tokens -> {ids[n].page_id}")
    lines += [
        "",
        f"after recording: {stats.entries} entries, {stats.resident_tokens} resident tokens",
    ]
    return "\n".join(lines)


def _short(values: list[int], keep: int = 8) -> str:
    if len(values) <= keep:
        return str(values)
    return f"[{', '.join(map(str, values[:keep]))}, ... {values[-1]}] ({len(values)} lengths)"
