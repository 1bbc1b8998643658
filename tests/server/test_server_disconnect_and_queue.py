"""A client that leaves frees its lane; a full queue answers 503 with Retry-After.

The abandoned request reserves nearly the whole context (the engine reserves
prompt + max_tokens cells at admission), so the next request can only be
admitted once the abandoned one is cancelled: that it finishes at all shows
the lane was freed, and the `cancelled` counter shows how.
"""

from __future__ import annotations

import threading
import time

import httpx
import pytest
from live_server import LiveServer

pytestmark = [pytest.mark.model, pytest.mark.timeout(180)]

#: Greedy decoding runs on for a long while (a prompt whose first token is EOS would not).
ABANDONED_PROMPT = "Once upon a time, in a land far away,"
#: Cells left free beside the abandoned request: fewer than any follow-up needs.
SLACK = 4


def hog_max_tokens(server: LiveServer) -> int:
    return server.engine.n_ctx - len(server.engine.tokenize(ABANDONED_PROMPT)) - SLACK


def cancelled_count(server: LiveServer) -> float:
    return server.metrics().get(("skippy_generations_total", (("reason", "cancelled"),)), 0.0)


def wait_for(predicate, what: str, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


class HogStream:
    """The abandoned request, streamed, read up to its first token chunk (it is then running)."""

    def __init__(self, server: LiveServer, http: httpx.Client) -> None:
        body = {"prompt": ABANDONED_PROMPT, "max_tokens": hog_max_tokens(server), "temperature": 0,
                "stream": True}
        self.response = http.send(http.build_request("POST", "/v1/completions", json=body), stream=True)
        assert self.response.status_code == 200
        # Keep the iterator referenced: dropping a half-read httpx line iterator
        # closes the connection, which the server rightly takes as a disconnect.
        self._lines = self.response.iter_lines()
        for line in self._lines:
            if line.startswith("data: {"):
                assert '"finish_reason":null' in line, f"the request finished at once: {line}"
                return
        raise AssertionError("the stream ended before its first chunk")

    def close(self) -> None:
        """The client goes away mid-stream."""
        self.response.close()


def follow_up(server: LiveServer) -> str:
    out = server.openai(timeout=120).completions.create(
        model=server.model_id, prompt="Roses are red,", max_tokens=SLACK * 4, temperature=0
    )
    assert out.choices[0].finish_reason in ("stop", "length")
    return out.choices[0].text


def test_disconnect_mid_stream_frees_the_lane(server: LiveServer) -> None:
    server.wait_idle()
    before = cancelled_count(server)
    with server.http() as http:
        hog = HogStream(server, http)
        time.sleep(0.5)
        assert server.engine.stats().lanes_busy == 1, "the request ended before it was abandoned"
        hog.close()
    follow_up(server)  # needs cells only the abandoned request held
    wait_for(lambda: cancelled_count(server) == before + 1, "the abandoned request to be cancelled")
    server.wait_idle()


def answered(server: LiveServer, status: str) -> float:
    return server.metrics().get(("skippy_requests_total", (("endpoint", "/v1/completions"), ("status", status))), 0.0)


def test_disconnect_while_waiting_non_streamed_frees_the_lane(server: LiveServer) -> None:
    server.wait_idle()
    before = cancelled_count(server)
    closed_before, unavailable_before = answered(server, "499"), answered(server, "503")
    body = {"prompt": ABANDONED_PROMPT, "max_tokens": hog_max_tokens(server), "temperature": 0}
    with server.http(timeout=httpx.Timeout(30.0, read=3.0)) as http, pytest.raises(httpx.ReadTimeout):
        http.post("/v1/completions", json=body)  # gives up after 3 s and closes the connection
    follow_up(server)
    wait_for(lambda: cancelled_count(server) == before + 1, "the abandoned request to be cancelled")
    server.wait_idle()
    # Counted as the client's doing (499, nginx's "client closed request"), not as a server error.
    assert answered(server, "499") == closed_before + 1
    assert answered(server, "503") == unavailable_before


def test_full_queue_answers_503_with_retry_after(server: LiveServer) -> None:
    server.wait_idle()
    queue_size = server.settings.queue_size
    results: list[int] = []

    def queued_request() -> None:
        with server.http() as http:
            # More cells than the hog leaves free: it waits in the queue.
            body = {"prompt": "Hello", "max_tokens": SLACK * 2, "temperature": 0}
            response = http.post("/v1/completions", json=body)
            results.append(response.status_code)

    with server.http() as http:
        hog = HogStream(server, http)
        threads = [threading.Thread(target=queued_request) for _ in range(queue_size)]
        for t in threads:
            t.start()
        wait_for(lambda: server.engine.stats().queue_depth == queue_size, "the queue to fill")

        rejected = http.post("/v1/completions", json={"prompt": "Hello", "max_tokens": 2})
        assert rejected.status_code == 503
        assert int(rejected.headers["Retry-After"]) >= 1
        error = rejected.json()["error"]
        assert error["code"] == "queue_full" and error["type"] == "server_error"

        hog.close()
    for t in threads:
        t.join(120)
    assert results == [200] * queue_size
    server.wait_idle()


def test_a_saturated_queue_answers_503_and_still_answers_what_it_took(server: LiveServer,
                                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    """Past `--max-queue-wait` new requests are refused at once, not queued behind a queue that does not drain."""
    server.wait_idle()
    monkeypatch.setattr(server.engine.scheduler, "max_wait_s", 2.0)
    results: list[int] = []

    def queued_request() -> None:
        with server.http() as http:
            results.append(http.post("/v1/completions", json={"prompt": "Hello", "max_tokens": SLACK * 2,
                                                              "temperature": 0}).status_code)

    with server.http() as http:
        hog = HogStream(server, http)
        waiting = [threading.Thread(target=queued_request) for _ in range(2)]
        for n, thread in enumerate(waiting, 1):
            thread.start()  # the second arrives while the first has waited less than the limit: queued too
            wait_for(lambda n=n: server.engine.stats().queue_depth == n, f"{n} requests to wait", timeout=1.5)
        time.sleep(2.2)
        rejected = http.post("/v1/completions", json={"prompt": "Hello", "max_tokens": 2})
        assert rejected.status_code == 503
        assert int(rejected.headers["Retry-After"]) >= 1
        error = rejected.json()["error"]
        assert error["code"] == "queue_full" and "saturated" in error["message"]
        hog.close()
    for thread in waiting:
        thread.join(120)
    assert results == [200, 200]
    server.wait_idle()
