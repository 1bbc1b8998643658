"""Fixtures every test directory shares: a real Redis server for the shared tier's tests.

`make test` installs Debian's redis-server package (tests must not skip because
it is missing); run by hand without it, these tests fail with a message naming it.
"""

from __future__ import annotations

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
