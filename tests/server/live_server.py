"""A live uvicorn server on loopback, in a background thread, over a given engine."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass

import httpx
import openai
import uvicorn
from prometheus_client.parser import text_string_to_metric_families

from skippy_cache.runtime import Engine
from skippy_cache.runtime.requests import GenerationRequest
from skippy_cache.server import ServerSettings, create_app

#: The key the `key_server` fixture requires.
API_KEY = "test-key-123"


@dataclass
class LiveServer:
    url: str
    engine: Engine
    settings: ServerSettings

    @property
    def model_id(self) -> str:
        return self.engine.info.model.model_id

    def openai(self, **kwargs: object) -> openai.OpenAI:
        kwargs.setdefault("api_key", self.settings.api_key or "unused")
        kwargs.setdefault("timeout", 120.0)
        kwargs.setdefault("max_retries", 0)
        return openai.OpenAI(base_url=f"{self.url}/v1", **kwargs)  # type: ignore[arg-type]

    def async_openai(self, **kwargs: object) -> openai.AsyncOpenAI:
        kwargs.setdefault("api_key", self.settings.api_key or "unused")
        kwargs.setdefault("timeout", 120.0)
        kwargs.setdefault("max_retries", 0)
        return openai.AsyncOpenAI(base_url=f"{self.url}/v1", **kwargs)  # type: ignore[arg-type]

    def http(self, **kwargs: object) -> httpx.Client:
        kwargs.setdefault("timeout", 120.0)
        return httpx.Client(base_url=self.url, **kwargs)  # type: ignore[arg-type]

    def metrics(self) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
        """Every sample of /metrics, keyed by (name, sorted labels)."""
        text = httpx.get(f"{self.url}/metrics", timeout=30).text
        return {
            (s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text)
            for s in family.samples
        }

    def wait_idle(self, timeout: float = 60.0) -> None:
        """Until no lane is busy and nothing waits (generous: only a hang fails it)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            s = self.engine.stats()
            if s.lanes_busy == 0 and s.queue_depth == 0:
                return
            time.sleep(0.05)
        raise AssertionError(f"engine still busy after {timeout}s: {self.engine.stats()}")


def warm_up(engine: Engine) -> None:
    """One tiny generation: a fresh context's first `llama_decode` takes seconds; keep it out of tests."""
    engine.generate(GenerationRequest(tokens=engine.tokenize("Hello"), max_tokens=2), timeout=300)


def run_own_server(settings: ServerSettings) -> Iterator[LiveServer]:
    """A live server over an engine of its own, built from `settings` and closed after."""
    engine = Engine(settings.engine_config())
    warm_up(engine)
    try:
        yield from run_server(engine, settings)
    finally:
        engine.close(drain=False)


def run_server(engine: Engine, settings: ServerSettings) -> Iterator[LiveServer]:
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    app = create_app(engine, settings)
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="on"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, name=f"uvicorn-{port}",
                              daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        assert thread.is_alive() and time.monotonic() < deadline, "uvicorn did not start"
        time.sleep(0.02)
    try:
        yield LiveServer(f"http://127.0.0.1:{port}", engine, settings)
    finally:
        server.should_exit = True
        thread.join(30)
        sock.close()
