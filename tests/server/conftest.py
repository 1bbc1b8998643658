"""Live servers on loopback over real engines: one shared engine per session.

Each server is uvicorn in a background thread on a free port, serving
`create_app(engine, settings)`; several apps may share one engine (the
engine outlives them: `owns_engine=False`).
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from live_server import API_KEY, LiveServer, run_own_server, run_server, warm_up

from skippy_cache.runtime import Engine
from skippy_cache.server import ServerSettings

CTX = 2048
LANES = 4
#: Small, so the queue-full test can fill it with a handful of requests.
QUEUE = 4


@pytest.fixture(scope="session")
def engine() -> Iterator[Engine]:
    settings = ServerSettings(ctx_size=CTX, lanes=LANES, queue_size=QUEUE, fast=True)
    engine = Engine(settings.engine_config())
    warm_up(engine)
    yield engine
    engine.close(drain=False)


@pytest.fixture(scope="session")
def server(engine: Engine) -> Iterator[LiveServer]:
    yield from run_server(engine, ServerSettings(ctx_size=CTX, lanes=LANES, queue_size=QUEUE, fast=True))


@pytest.fixture(scope="session")
def exact_server() -> Iterator[LiveServer]:
    """A server in the default (exact) mode: for tests that compare greedy text across runs.

    The session server runs in fast mode, where batching, threads and pool
    occupancy move the logits' last bits and may flip a greedy choice between
    two runs of one prompt; exact mode gives the same text every time.
    """
    yield from run_own_server(ServerSettings(ctx_size=CTX, lanes=LANES, queue_size=16))


@pytest.fixture(scope="session")
def key_server(engine: Engine) -> Iterator[LiveServer]:
    """The same engine behind a second app that requires an API key."""
    settings = ServerSettings(ctx_size=CTX, lanes=LANES, queue_size=QUEUE, api_key=API_KEY, fast=True)
    yield from run_server(engine, settings)
