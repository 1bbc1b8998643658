"""Fixtures every test directory shares: a real Redis server for the shared tier's tests, and a
umask that takes nothing away for the tests of file modes; and the rule that keeps the `model`
marker true.

`make test` installs Debian's redis-server package (tests must not skip because
it is missing); run by hand without it, these tests fail with a message naming it.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Generator, Iterator
from pathlib import Path

import pytest
from redisserver import RedisClusterNodes, RedisServer

#: llama.cpp's two ways to get a model: from a GGUF file, and built from hyperparameters (tinymodels.py).
_MODEL_LOADERS = ("llama_model_load_from_file", "llama_model_init_from_user")


@contextlib.contextmanager
def _no_model_unless_marked(item: pytest.Item) -> Iterator[None]:
    """A test not marked `model` that loads a model in this process (itself or through a fixture it
    is the first to use) fails, so `-m 'not model'` runs no model and the marker cannot drift."""
    if item.get_closest_marker("model") is not None:
        yield
        return
    import llama_cpp

    def refuse(*_: object, **__: object) -> None:
        pytest.fail(f"{item.nodeid} loads a llama.cpp model: mark its module `pytestmark = pytest.mark.model`")

    saved = {name: getattr(llama_cpp, name) for name in _MODEL_LOADERS}
    for name in _MODEL_LOADERS:
        setattr(llama_cpp, name, refuse)
    try:
        yield
    finally:
        for name, loader in saved.items():
            setattr(llama_cpp, name, loader)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_setup(item: pytest.Item) -> Generator[None, None, None]:
    with _no_model_unless_marked(item):
        yield


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_call(item: pytest.Item) -> Generator[None, None, None]:
    with _no_model_unless_marked(item):
        yield


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
def cache_secret_file(tmp_path: Path) -> Path:
    """A `--cache-secret-file` the replicas of one shared tier share."""
    path = tmp_path / "cache-secret"
    path.write_text("the replicas' shared secret: " + "0123456789abcdef" * 4 + "\n")
    path.chmod(0o600)
    return path


@pytest.fixture
def permissive_umask() -> Iterator[None]:
    """A umask that takes nothing away: the modes must come from the code, not from the umask."""
    old = os.umask(0o000)
    try:
        yield
    finally:
        os.umask(old)
