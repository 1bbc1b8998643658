"""Fixtures every test directory shares: a real Redis server for the shared tier's tests, and a
umask that takes nothing away for the tests of file modes.

`make test` installs Debian's redis-server package (tests must not skip because
it is missing); run by hand without it, these tests fail with a message naming it.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest
from redisserver import RedisClusterNodes, RedisServer


@pytest.fixture
def redis_server(tmp_path: Path) -> Iterator[RedisServer]:
    server = RedisServer(tmp_path)
    yield server
    server.kill()


@pytest.fixture
def redis_with_password(tmp_path: Path) -> Iterator[RedisServer]:
    server = RedisServer(tmp_path, password="s3cret-pw")
    yield server
    server.kill()


@pytest.fixture
def redis_cluster(tmp_path: Path) -> Iterator[RedisClusterNodes]:
    cluster = RedisClusterNodes(tmp_path)
    yield cluster
    cluster.kill()


@pytest.fixture
def permissive_umask() -> Iterator[None]:
    """A umask that takes nothing away: the modes must come from the code, not from the umask."""
    old = os.umask(0o000)
    try:
        yield
    finally:
        os.umask(old)
