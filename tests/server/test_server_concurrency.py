"""Eight concurrent streaming clients get the text each gets alone (greedy).

Runs against a server whose engine is in deterministic mode. In the default
(fast) mode the engine batches different lanes' tokens into one
`llama_decode` and uses every core, which changes the last float bits of the
logits (EXACTNESS.md) and so may flip a greedy choice: text equality under
concurrency is the deterministic mode's promise, not the fast mode's. The
deterministic engine runs four of the eight at once: the test covers eight
interleaved SSE streams fed from one engine, lanes that share decode steps,
and cache hits recorded by the solo pass.
"""

from __future__ import annotations

import asyncio

import pytest
from live_server import LiveServer

pytestmark = [pytest.mark.model, pytest.mark.timeout(300)]

MAX_TOKENS = 10
TOPICS = ["rivers", "owls", "bread", "chess", "comets", "violins", "deserts", "bees"]


def prompt(i: int, topic: str) -> str:
    # Half of them are long enough (> 64 tokens) to be recorded by the first
    # pass and hit the cache in the concurrent one.
    body = f"Write one sentence about {topic}."
    if i % 2:
        body = f"Background on {topic}: " + " ".join(f"note {k} on {topic}." for k in range(20)) + " " + body
    return body


async def _stream_text(server: LiveServer, text: str) -> tuple[str, int]:
    client = server.async_openai()
    try:
        stream = await client.chat.completions.create(
            model=server.model_id, messages=[{"role": "user", "content": text}], max_tokens=MAX_TOKENS,
            temperature=0, stream=True, stream_options={"include_usage": True},
        )
        parts, cached = [], 0
        async for chunk in stream:
            if chunk.choices:
                parts.append(chunk.choices[0].delta.content or "")
            if chunk.usage is not None:
                cached = chunk.usage.prompt_tokens_details.cached_tokens
        return "".join(parts), cached
    finally:
        await client.close()


def test_concurrent_streams_match_solo_runs(exact_server: LiveServer) -> None:
    prompts = [prompt(i, topic) for i, topic in enumerate(TOPICS)]
    solo = [asyncio.run(_stream_text(exact_server, p))[0] for p in prompts]
    assert all(solo), "a solo run produced no text"

    async def together() -> list[tuple[str, int]]:
        return await asyncio.gather(*[_stream_text(exact_server, p) for p in prompts])

    concurrent = asyncio.run(together())
    for p, alone, (text, _cached) in zip(prompts, solo, concurrent, strict=True):
        assert text == alone, f"prompt {p[:40]!r}...: concurrent {text!r} != alone {alone!r}"
    # The long prompts were served from the cache the solo pass recorded.
    assert any(cached > 0 for _text, cached in concurrent)
    exact_server.wait_idle()
