"""The seed's tests (`skippy_cache/config.rs`), ported one to one.

Same names, same inputs, same expected values: these are the project's first
acceptance tests. Do not edit the expectations; if one fails, the port is wrong.
"""

from __future__ import annotations

from skippy_cache.config import PrefixCandidatePolicy, derive_max_resident_tokens

# -- mod resident_cache_config_tests ---------------------------------------------------


def test_cap_disabled_for_smoke_test_ctx_size() -> None:
    # Smoke-test / SmolLM2 scenario: ctx_size=768. Half=384 would be smaller
    # than a typical 533-token smoke prompt; cap stays disabled.
    assert derive_max_resident_tokens(768) == 0


def test_cap_enabled_for_production_ctx_size() -> None:
    # Production failure mode the cap is designed for.
    assert derive_max_resident_tokens(131072) == 65536
    # Exactly at the floor.
    assert derive_max_resident_tokens(8192) == 4096
    # Just above the floor.
    assert derive_max_resident_tokens(16384) == 8192


def test_cap_disabled_just_below_floor() -> None:
    # Below the hard floor.
    assert derive_max_resident_tokens(8191) == 0
    assert derive_max_resident_tokens(4096) == 0


# -- mod tests -------------------------------------------------------------------------


def test_lookup_candidates_prefer_longest_prefix_first() -> None:
    policy = PrefixCandidatePolicy(min_tokens=64, stride_tokens=32, record_limit=2, page_size_tokens=64)

    assert policy.candidate_token_counts(160) == [160, 128, 96, 64]


def test_record_candidates_are_limited_but_keep_current_and_shared_prefix() -> None:
    policy = PrefixCandidatePolicy(min_tokens=64, stride_tokens=32, record_limit=2, page_size_tokens=64)

    assert policy.record_candidate_token_counts(160) == [160, 128]


def test_candidates_below_min_only_use_exact_request() -> None:
    policy = PrefixCandidatePolicy(min_tokens=64, stride_tokens=32, record_limit=2, page_size_tokens=64)

    assert policy.candidate_token_counts(63) == [63]
    assert policy.record_candidate_token_counts(63) == [63]


def test_unlimited_record_candidates_keep_shared_prefix_grid() -> None:
    policy = PrefixCandidatePolicy(min_tokens=64, stride_tokens=32, record_limit=0, page_size_tokens=64)

    assert policy.record_candidate_token_counts(160) == [160, 128, 96, 64]


def test_same_prefix_different_tail_prompts_share_near_tail_candidate() -> None:
    policy = PrefixCandidatePolicy(min_tokens=256, stride_tokens=128, record_limit=2, page_size_tokens=256)

    recorded = policy.record_candidate_token_counts(2214)
    lookup = policy.candidate_token_counts(2231)
    shared = next((candidate for candidate in recorded if candidate in lookup), None)

    assert recorded == [2214, 2176]
    assert shared == 2176


def test_non_aligned_min_tokens_still_provides_shared_floor_candidate() -> None:
    policy = PrefixCandidatePolicy(min_tokens=300, stride_tokens=128, record_limit=2, page_size_tokens=300)

    assert policy.candidate_token_counts(350) == [350, 300]
    assert policy.record_candidate_token_counts(350) == [350, 300]
