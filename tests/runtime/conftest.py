"""Real-model fixtures: one engine per configuration per test session."""

from __future__ import annotations

import pytest

from skippy_cache.config import CacheConfig, CacheMode
from skippy_cache.runtime import Engine, EngineConfig


def cache(**overrides: object) -> CacheConfig:
    return CacheConfig(**overrides)  # type: ignore[arg-type]


@pytest.fixture(scope="session")
def fast_engine():
    """Fast mode: all cores, lanes share decode batches, hits at any length."""
    engine = Engine(EngineConfig(ctx_size=4096, lanes=4, deterministic=False, check_invariants=True))
    yield engine
    engine.close()


@pytest.fixture(scope="session")
def exact_engine():
    """Exact mode (the default) with every grid length recorded, so most prompts get partial hits."""
    engine = Engine(
        EngineConfig(
            ctx_size=4096,
            lanes=4,
            deterministic=True,
            cache=cache(shared_prefix_record_limit=0),
            check_invariants=True,
        )
    )
    yield engine
    engine.close()


@pytest.fixture(scope="session")
def cold_engine():
    """Exact mode with the cache off: the reference for cache-on output."""
    engine = Engine(
        EngineConfig(
            ctx_size=4096,
            lanes=4,
            deterministic=True,
            cache=cache(mode=CacheMode.DISABLED),
            check_invariants=True,
        )
    )
    yield engine
    engine.close()
