"""Configuration beyond the seed: defaults, environment parsing, derived budgets, policy properties."""

from __future__ import annotations

import dataclasses

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from skippy_cache.config import (
    LLAMA_MAX_SEQ,
    MAX_ENTRIES_CLAMP,
    MIN_CTX_FOR_CELL_CAP,
    CacheConfig,
    CacheMode,
    CachePayload,
    ContextConfig,
    PrefixCandidatePolicy,
    ResidentCacheConfig,
    derive_max_resident_tokens,
)

# -- constants and defaults --------------------------------------------------------------


def test_constants() -> None:
    assert LLAMA_MAX_SEQ == 256
    assert MIN_CTX_FOR_CELL_CAP == 8192
    assert MAX_ENTRIES_CLAMP == 512


def test_stage_kv_cache_config_defaults() -> None:
    cfg = CacheConfig()
    assert cfg.mode is CacheMode.AUTO
    assert cfg.payload is CachePayload.AUTO
    assert cfg.max_entries == 64
    assert cfg.max_bytes == 0
    assert cfg.min_tokens == 64
    assert cfg.shared_prefix_stride_tokens == 128
    assert cfg.shared_prefix_record_limit == 2


def test_stage_config_defaults() -> None:
    stage = ContextConfig()
    assert dataclasses.asdict(stage) == {
        "stage_id": "stage-0",
        "stage_index": 0,
        "layer_start": 0,
        "layer_end": 0,
        "ctx_size": 8192,
        "lane_count": 4,
        "cache_type_k": "f16",
        "cache_type_v": "f16",
        "flash_attn": True,
        "kv_unified": True,
        "model_id": "",
    }


@pytest.mark.parametrize("obj", [CacheConfig(), ContextConfig()], ids=["cache", "stage"])
def test_configs_are_frozen(obj: object) -> None:
    field = dataclasses.fields(obj)[0].name  # type: ignore[arg-type]
    with pytest.raises(dataclasses.FrozenInstanceError):
        setattr(obj, field, None)


def test_mode_values_are_kebab_case() -> None:
    assert {m.name: m.value for m in CacheMode} == {
        "DISABLED": "disabled",
        "AUTO": "auto",
        "RECORD": "record",
        "LOOKUP_RECORD": "lookup-record",
    }


def test_payload_values_are_kebab_case() -> None:
    assert {p.name: p.value for p in CachePayload} == {
        "AUTO": "auto",
        "RESIDENT_KV": "resident-kv",
        "KV_RECURRENT": "kv-recurrent",
        "FULL_STATE": "full-state",
    }


@pytest.mark.parametrize(
    ("mode", "records", "looks_up"),
    [
        (CacheMode.DISABLED, False, False),
        (CacheMode.AUTO, False, False),
        (CacheMode.RECORD, True, False),
        (CacheMode.LOOKUP_RECORD, True, True),
    ],
)
def test_mode_records_and_looks_up(mode: CacheMode, records: bool, looks_up: bool) -> None:
    assert mode.records is records
    assert mode.looks_up is looks_up


# -- from_env ----------------------------------------------------------------------------


def test_from_env_empty_keeps_defaults() -> None:
    assert CacheConfig.from_env({}) == CacheConfig()


def test_from_env_ignores_unrelated_variables() -> None:
    assert CacheConfig.from_env({"SKIPPY_KV": "off", "KV_CACHE": "0"}) == CacheConfig()


def test_from_env_none_reads_os_environ(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SKIPPY_KV_CACHE", "record")
    monkeypatch.setenv("SKIPPY_KV_CACHE_MIN_TOKENS", "96")
    cfg = CacheConfig.from_env()
    assert cfg.mode is CacheMode.RECORD
    assert cfg.min_tokens == 96


@pytest.mark.parametrize(
    ("word", "mode"),
    [
        ("off", CacheMode.DISABLED),
        ("0", CacheMode.DISABLED),
        ("false", CacheMode.DISABLED),
        ("disabled", CacheMode.DISABLED),
        ("on", CacheMode.LOOKUP_RECORD),
        ("1", CacheMode.LOOKUP_RECORD),
        ("true", CacheMode.LOOKUP_RECORD),
        ("lookup-record", CacheMode.LOOKUP_RECORD),
        ("record", CacheMode.RECORD),
        ("auto", CacheMode.AUTO),
        # Case and surrounding whitespace are forgiven.
        ("OFF", CacheMode.DISABLED),
        (" True ", CacheMode.LOOKUP_RECORD),
        ("Lookup-Record\n", CacheMode.LOOKUP_RECORD),
    ],
)
def test_from_env_mode_words(word: str, mode: CacheMode) -> None:
    cfg = CacheConfig.from_env({"SKIPPY_KV_CACHE": word})
    assert cfg.mode is mode
    # Only the mode moved.
    assert dataclasses.replace(cfg, mode=CacheMode.AUTO) == CacheConfig()


@pytest.mark.parametrize(
    ("word", "payload"),
    [
        ("auto", CachePayload.AUTO),
        ("resident-kv", CachePayload.RESIDENT_KV),
        ("kv-recurrent", CachePayload.KV_RECURRENT),
        ("full-state", CachePayload.FULL_STATE),
        (" Full-State ", CachePayload.FULL_STATE),
    ],
)
def test_from_env_payload(word: str, payload: CachePayload) -> None:
    cfg = CacheConfig.from_env({"SKIPPY_KV_CACHE_PAYLOAD": word})
    assert cfg.payload is payload
    assert dataclasses.replace(cfg, payload=CachePayload.AUTO) == CacheConfig()


NUMERIC_VARS = [
    ("SKIPPY_KV_CACHE_MAX_ENTRIES", "max_entries"),
    ("SKIPPY_KV_CACHE_MAX_BYTES", "max_bytes"),
    ("SKIPPY_KV_CACHE_MIN_TOKENS", "min_tokens"),
    ("SKIPPY_KV_CACHE_SHARED_STRIDE_TOKENS", "shared_prefix_stride_tokens"),
    ("SKIPPY_KV_CACHE_SHARED_RECORD_LIMIT", "shared_prefix_record_limit"),
]


@pytest.mark.parametrize(("var", "field"), NUMERIC_VARS)
@pytest.mark.parametrize(
    ("raw", "value"), [("0", 0), ("7", 7), ("300", 300), (" 4096 ", 4096), ("1_000", 1000)]
)
def test_from_env_numeric(var: str, field: str, raw: str, value: int) -> None:
    cfg = CacheConfig.from_env({var: raw})
    assert getattr(cfg, field) == value
    assert dataclasses.replace(cfg, **{field: getattr(CacheConfig(), field)}) == CacheConfig()


def test_from_env_all_at_once() -> None:
    env = {
        "SKIPPY_KV_CACHE": "lookup-record",
        "SKIPPY_KV_CACHE_PAYLOAD": "resident-kv",
        "SKIPPY_KV_CACHE_MAX_ENTRIES": "32",
        "SKIPPY_KV_CACHE_MAX_BYTES": "1073741824",
        "SKIPPY_KV_CACHE_MIN_TOKENS": "256",
        "SKIPPY_KV_CACHE_SHARED_STRIDE_TOKENS": "128",
        "SKIPPY_KV_CACHE_SHARED_RECORD_LIMIT": "0",
    }
    assert CacheConfig.from_env(env) == CacheConfig(
        mode=CacheMode.LOOKUP_RECORD,
        payload=CachePayload.RESIDENT_KV,
        max_entries=32,
        max_bytes=1 << 30,
        min_tokens=256,
        shared_prefix_stride_tokens=128,
        shared_prefix_record_limit=0,
    )


MALFORMED = [
    ("SKIPPY_KV_CACHE", "maybe"),
    ("SKIPPY_KV_CACHE", ""),
    ("SKIPPY_KV_CACHE", "lookup_record"),
    ("SKIPPY_KV_CACHE", "yes"),
    ("SKIPPY_KV_CACHE_PAYLOAD", "kv"),
    ("SKIPPY_KV_CACHE_PAYLOAD", "resident_kv"),
    ("SKIPPY_KV_CACHE_PAYLOAD", ""),
    *[(var, bad) for var, _ in NUMERIC_VARS for bad in ("-1", "1.5", "ten", "", "0x10", "+5", "1e3")],
    # `str.isdigit` accepts superscript digits, which `int` then rejects with
    # its own message: no variable name, so the deployment typo was anonymous.
    pytest.param("SKIPPY_KV_CACHE_MAX_ENTRIES", "\u00b2", id="superscript-two"),
]


@pytest.mark.parametrize(("var", "bad"), MALFORMED)
def test_from_env_malformed_names_variable_and_value(var: str, bad: str) -> None:
    with pytest.raises(ValueError) as info:
        CacheConfig.from_env({var: bad})
    message = str(info.value)
    assert var in message
    assert repr(bad) in message


# -- ResidentCacheConfig.from_context ------------------------------------------------------


@pytest.mark.parametrize(("lanes", "reserved"), [(0, 2), (1, 2), (2, 4), (4, 8), (100, 200)])
def test_reserved_seq_count_is_two_per_lane_at_least_two(lanes: int, reserved: int) -> None:
    cfg = ResidentCacheConfig.from_context(ContextConfig(lane_count=lanes), CacheConfig())
    assert cfg.reserved_seq_count == reserved


@pytest.mark.parametrize(
    ("lanes", "max_entries", "expected"),
    [
        (4, 0, 1),  # clamped up to one entry
        (4, 1, 1),
        (4, 64, 64),
        (4, 248, 248),
        (4, 249, 248),  # LLAMA_MAX_SEQ (256) minus 8 reserved lane ids
        (4, 512, 248),
        (4, 1000, 248),  # 512 clamp, then the sequence-id cap
        (0, 1000, 254),
        (1, 512, 254),
        (100, 64, 56),  # 200 reserved ids leave 56
        (127, 64, 2),
    ],
)
def test_max_entries_clamp_and_seq_id_cap(lanes: int, max_entries: int, expected: int) -> None:
    cfg = ResidentCacheConfig.from_context(
        ContextConfig(lane_count=lanes), CacheConfig(max_entries=max_entries)
    )
    assert cfg.max_entries == expected
    assert cfg.reserved_seq_count + cfg.max_entries <= LLAMA_MAX_SEQ


@pytest.mark.parametrize("ctx_size", [0, 768, 4096, 8191, 8192, 8193, 16384, 131072])
def test_from_stage_token_cap_is_derived(ctx_size: int) -> None:
    cfg = ResidentCacheConfig.from_context(ContextConfig(ctx_size=ctx_size), CacheConfig())
    assert cfg.max_resident_tokens == derive_max_resident_tokens(ctx_size)


@pytest.mark.parametrize(
    ("ctx_size", "cap"), [(768, 0), (8191, 0), (8192, 4096), (8193, 4096), (8194, 4097), (131072, 65536)]
)
def test_derive_max_resident_tokens_values(ctx_size: int, cap: int) -> None:
    assert derive_max_resident_tokens(ctx_size) == cap


def test_from_stage_copies_bytes_and_min_tokens() -> None:
    cfg = ResidentCacheConfig.from_context(
        ContextConfig(ctx_size=32768, lane_count=3),
        CacheConfig(max_entries=10, max_bytes=123456, min_tokens=77),
    )
    assert cfg == ResidentCacheConfig(
        max_entries=10, max_bytes=123456, min_tokens=77, reserved_seq_count=6, max_resident_tokens=16384
    )


@pytest.mark.parametrize(
    ("lanes", "max_entries", "n_seq_max"), [(4, 64, 72), (4, 512, 256), (0, 1, 3), (1, 0, 3), (100, 64, 256)]
)
def test_n_seq_max(lanes: int, max_entries: int, n_seq_max: int) -> None:
    cfg = ResidentCacheConfig.from_context(
        ContextConfig(lane_count=lanes), CacheConfig(max_entries=max_entries)
    )
    assert cfg.n_seq_max == n_seq_max


# -- PrefixCandidatePolicy ---------------------------------------------------------------


@pytest.mark.parametrize(("min_tokens", "page"), [(0, 1), (1, 1), (64, 64), (300, 300)])
def test_policy_from_cache(min_tokens: int, page: int) -> None:
    cache = CacheConfig(
        min_tokens=min_tokens, shared_prefix_stride_tokens=96, shared_prefix_record_limit=3
    )
    assert PrefixCandidatePolicy.from_cache(cache) == PrefixCandidatePolicy(
        min_tokens=min_tokens, stride_tokens=96, record_limit=3, page_size_tokens=page
    )


def test_default_policy_grid_is_min_tokens() -> None:
    # Defaults: stride 128 but page size 64, so shared lengths fall on multiples of 64.
    policy = PrefixCandidatePolicy.from_cache(CacheConfig())
    assert policy.grid_tokens == 64
    assert policy.candidate_token_counts(300) == [300, 256, 192, 128, 64]
    assert policy.record_candidate_token_counts(300) == [300, 256]
    assert len(policy.candidate_token_counts(8000)) == 125


def test_candidates_of_zero_are_empty() -> None:
    policy = PrefixCandidatePolicy.from_cache(CacheConfig())
    assert policy.candidate_token_counts(0) == []
    assert policy.record_candidate_token_counts(0) == []


def test_min_tokens_zero_only_exact_length() -> None:
    policy = PrefixCandidatePolicy(min_tokens=0, stride_tokens=32, record_limit=0, page_size_tokens=1)
    assert policy.candidate_token_counts(1000) == [1000]
    assert policy.record_candidate_token_counts(1000) == [1000]


def test_exactly_min_tokens_is_single_candidate() -> None:
    policy = PrefixCandidatePolicy(min_tokens=64, stride_tokens=32, record_limit=2, page_size_tokens=64)
    assert policy.candidate_token_counts(64) == [64]
    assert policy.candidate_token_counts(65) == [65, 64]
    assert policy.candidate_token_counts(128) == [128, 96, 64]


def test_record_limit_one_keeps_only_request() -> None:
    policy = PrefixCandidatePolicy(min_tokens=64, stride_tokens=32, record_limit=1, page_size_tokens=64)
    assert policy.record_candidate_token_counts(160) == [160]


def test_record_limit_three() -> None:
    policy = PrefixCandidatePolicy(min_tokens=64, stride_tokens=32, record_limit=3, page_size_tokens=64)
    assert policy.record_candidate_token_counts(170) == [170, 160, 128]


def _rust_candidates(p: PrefixCandidatePolicy, token_count: int) -> list[int]:
    """A line-by-line transliteration of the seed's `candidate_token_counts` (u64 saturating math)."""
    if token_count == 0:
        return []
    counts = [token_count]
    if p.min_tokens == 0 or token_count <= p.min_tokens:
        return counts
    stride = min(max(p.stride_tokens, 1), max(p.page_size_tokens, 1))
    candidate = max(token_count - token_count % max(stride, 1), 0)
    if candidate == token_count:
        candidate = max(candidate - stride, 0)
    candidate = max(candidate, p.min_tokens)
    while candidate >= p.min_tokens:
        counts.append(candidate)
        if candidate == p.min_tokens:
            break
        candidate = max(max(candidate - stride, 0), p.min_tokens)
    return sorted(set(counts), reverse=True)


def _rust_record(p: PrefixCandidatePolicy, token_count: int) -> list[int]:
    candidates = _rust_candidates(p, token_count)
    limit = p.record_limit
    if limit == 0 or len(candidates) <= limit:
        return candidates
    selected = [token_count]
    if limit - 1 == 0:
        return selected
    for c in candidates:
        if len(selected) >= limit:
            break
        if c != token_count:
            selected.append(c)
    if len(selected) < limit:
        for c in reversed(candidates):
            if len(selected) >= limit:
                break
            if c not in selected:
                selected.append(c)
    return sorted(set(selected), reverse=True)


policies = st.builds(
    lambda m, s, r: PrefixCandidatePolicy(
        min_tokens=m, stride_tokens=s, record_limit=r, page_size_tokens=max(m, 1)
    ),
    st.integers(0, 600),
    st.integers(1, 300),
    st.integers(0, 6),
)
token_counts = st.integers(0, 20000)


@settings(max_examples=300, deadline=None)
@given(policies, token_counts)
def test_candidates_match_seed_transliteration(policy: PrefixCandidatePolicy, n: int) -> None:
    assert policy.candidate_token_counts(n) == _rust_candidates(policy, n)
    assert policy.record_candidate_token_counts(n) == _rust_record(policy, n)


@settings(max_examples=300, deadline=None)
@given(policies, token_counts)
def test_candidates_strictly_descending_from_n(policy: PrefixCandidatePolicy, n: int) -> None:
    counts = policy.candidate_token_counts(n)
    assert all(a > b for a, b in zip(counts, counts[1:])), counts
    if n > 0:
        assert counts[0] == n
    else:
        assert counts == []


@settings(max_examples=300, deadline=None)
@given(policies, token_counts)
def test_candidates_not_below_min_tokens(policy: PrefixCandidatePolicy, n: int) -> None:
    counts = policy.candidate_token_counts(n)
    if n > policy.min_tokens > 0:
        assert min(counts) == policy.min_tokens
        assert all(c >= policy.min_tokens for c in counts)
        # Every length below n is on the grid or is the floor.
        assert all(c % policy.grid_tokens == 0 or c == policy.min_tokens for c in counts[1:])
    else:
        assert counts == ([n] if n > 0 else [])


@settings(max_examples=300, deadline=None)
@given(policies, token_counts)
def test_record_lengths_are_lookup_candidates(policy: PrefixCandidatePolicy, n: int) -> None:
    lookups = policy.candidate_token_counts(n)
    records = policy.record_candidate_token_counts(n)
    assert set(records) <= set(lookups)
    assert all(a > b for a, b in zip(records, records[1:])), records
    if policy.record_limit > 0:
        assert len(records) <= policy.record_limit
    else:
        assert records == lookups
    if n > 0:
        assert records[0] == n
        # The shared lengths kept are the longest ones below n.
        assert records == lookups[: len(records)]
    else:
        assert records == []


@settings(max_examples=200, deadline=None)
@given(policies, st.integers(1, 20000), st.integers(0, 20000))
def test_common_prefix_prompts_meet_on_a_shared_length(
    policy: PrefixCandidatePolicy, a: int, extra: int
) -> None:
    # Two prompts whose common prefix reaches one grid step past both tails' floor
    # share a recorded length when the record limit keeps at least one grid length.
    b = a + extra
    records = policy.record_candidate_token_counts(a)
    lookups = policy.candidate_token_counts(b)
    grid = policy.grid_tokens
    shares_grid_cell = a // grid == b // grid
    if policy.min_tokens > 0 and policy.record_limit != 1 and a > policy.min_tokens and shares_grid_cell:
        # Same grid cell: the longest shared grid length below a is also below b.
        assert records[1] in lookups
