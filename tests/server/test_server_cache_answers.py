"""Why did it miss? Each response's `skippy_cache`, /v1/cache/explain, per-request cache control and pins."""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import pytest
from live_server import LiveServer, run_own_server

from skippy_cache.server import ServerSettings

pytestmark = [pytest.mark.model, pytest.mark.timeout(600)]

WORDS = "river mountain orange seven quietly build measure exact token model layer memory".split()


def text(n_words: int, seed: int) -> str:
    return " ".join(WORDS[(i * 7 + seed * 13 + i // 5) % len(WORDS)] for i in range(n_words))


@pytest.fixture(scope="module")
def server() -> Iterator[LiveServer]:
    # No disk tier (nothing outlives the test), no idle demotions (what is resident stays put).
    yield from run_own_server(ServerSettings(ctx_size=4096, lanes=2, cache_dir=None, idle_tokens=0,
                                             fast=True))


def complete(server: LiveServer, prompt: str | list[int], **extra: object) -> dict:
    body = {"prompt": prompt, "max_tokens": 1, "temperature": 0, **extra}
    reply = httpx.post(f"{server.url}/v1/completions", json=body, timeout=300)
    assert reply.status_code == 200, reply.text
    return reply.json()


def explain(server: LiveServer, **body: object) -> dict:
    reply = httpx.post(f"{server.url}/v1/cache/explain", json=body, timeout=60)
    assert reply.status_code == 200, reply.text
    return reply.json()["skippy_cache"]


def tokens(server: LiveServer, prompt: str) -> list[int]:
    return server.engine.tokenize(prompt)


def test_four_misses_four_answers(server: LiveServer) -> None:
    prompt = tokens(server, text(700, seed=1))
    first = complete(server, prompt, cache_salt="alpha")["skippy_cache"]
    assert (first["source"], first["miss_reason"]) == ("none", "never_seen")

    # The same tokens under another cache_salt: namespaces never share, and the answer says only that.
    assert explain(server, prompt=prompt, cache_salt="beta")["miss_reason"] == "namespace"
    other = complete(server, prompt, cache_salt="beta")["skippy_cache"]
    assert (other["matched_tokens"], other["miss_reason"]) == (0, "namespace")
    assert "alpha" not in str(other)

    # Sharing the first 500 tokens with a stored prompt: diverged, reused up to there.
    shares = prompt[:500] + tokens(server, text(80, seed=2))[1:]
    said = explain(server, prompt=shares, cache_salt="alpha")
    assert (said["source"], said["matched_tokens"], said["miss_reason"]) == ("resident", 500, "diverged")
    done = complete(server, shares, cache_salt="alpha")["skippy_cache"]
    assert (done["matched_tokens"], done["miss_reason"]) == (500, "diverged")

    # Evicted: the cache was emptied (resident entries and the store); the prompt was seen before.
    server.engine.clear_cache()
    said = explain(server, prompt=prompt, cache_salt="alpha")
    assert (said["source"], said["miss_reason"], said["evicted_ago"]) == ("none", "evicted", "<1 min")
    done = complete(server, prompt, cache_salt="alpha")["skippy_cache"]
    assert (done["miss_reason"], done["evicted_ago"]) == ("evicted", "<1 min")

    # And now an exact repeat: no miss at all.
    assert "miss_reason" not in explain(server, prompt=prompt, cache_salt="alpha")
    repeat = complete(server, prompt, cache_salt="alpha")["skippy_cache"]
    assert repeat["matched_tokens"] == len(prompt) and "miss_reason" not in repeat

    counters = httpx.get(f"{server.url}/v1/cache", timeout=10).json()["counters"]
    for reason in ("never_seen", "namespace", "diverged", "evicted"):
        assert counters["misses"].get(reason, 0) >= 1, counters["misses"]
    samples = server.metrics()
    ratio = samples[("skippy_cache_recoverable_miss_ratio", ())]
    missed = counters["missed_tokens"]
    assert ratio == pytest.approx(missed["evicted"] / sum(missed.values()))


def test_explain_takes_messages_and_changes_nothing(server: LiveServer) -> None:
    before = httpx.get(f"{server.url}/v1/cache", timeout=10).json()["counters"]
    messages = [{"role": "system", "content": text(120, seed=3)}, {"role": "user", "content": "Hi"}]
    said = explain(server, messages=messages)
    assert said["source"] == "none" and said["prompt_tokens"] > 100
    after = httpx.get(f"{server.url}/v1/cache", timeout=10).json()["counters"]
    assert after == before


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"prompt": "x", "cache": {"lookup": "no"}}, "cache.lookup"),
        ({"prompt": "x", "cache": "off"}, "cache"),
        ({"prompt": "x", "pin": 1}, "pin"),
    ],
)
def test_a_wrong_cache_field_is_a_400_naming_it(server: LiveServer, body: dict, param: str) -> None:
    reply = httpx.post(f"{server.url}/v1/completions", json={**body, "max_tokens": 1}, timeout=60)
    assert reply.status_code == 400, reply.text
    assert reply.json()["error"]["param"] == param


def test_explain_needs_exactly_one_prompt(server: LiveServer) -> None:
    for body in ({}, {"prompt": "a", "messages": [{"role": "user", "content": "b"}]}):
        reply = httpx.post(f"{server.url}/v1/cache/explain", json=body, timeout=60)
        assert reply.status_code == 400 and reply.json()["error"]["message"]


def test_lookup_off_and_store_off(server: LiveServer) -> None:
    prompt = tokens(server, text(300, seed=4))
    complete(server, prompt)
    off = complete(server, prompt, cache={"lookup": False})["skippy_cache"]
    assert (off["matched_tokens"], off["miss_reason"]) == (0, "lookup_off")

    records = httpx.get(f"{server.url}/v1/cache", timeout=10).json()["counters"]["records"]
    secret = tokens(server, text(300, seed=5))
    complete(server, secret, cache={"store": False})
    assert httpx.get(f"{server.url}/v1/cache", timeout=10).json()["counters"]["records"] == records
    assert explain(server, prompt=secret)["miss_reason"] == "never_seen"


def test_a_pinned_prompt_stays_resident_until_unpinned(server: LiveServer) -> None:
    pinned = tokens(server, text(400, seed=6))
    complete(server, pinned, pin=True)
    assert httpx.get(f"{server.url}/v1/cache", timeout=10).json()["resident"]["pinned"] == 1
    # Fill the pool with other prompts until entries are evicted: the pinned one stays.
    for seed in range(7, 14):
        complete(server, tokens(server, text(450, seed=seed)))
    resident = httpx.get(f"{server.url}/v1/cache", timeout=10).json()["resident"]
    assert resident["evictions"] > 0
    said = explain(server, prompt=pinned)
    assert (said["source"], said["matched_tokens"]) == ("resident", len(pinned))

    reply = httpx.post(f"{server.url}/v1/cache/unpin", json={"prompt": pinned}, timeout=60)
    assert reply.status_code == 200 and reply.json()["released"] == 1
    reply = httpx.post(f"{server.url}/v1/cache/unpin", json={"all": True}, timeout=60)
    assert reply.json()["released"] == 0
    assert httpx.get(f"{server.url}/v1/cache", timeout=10).json()["resident"]["pinned"] == 0
