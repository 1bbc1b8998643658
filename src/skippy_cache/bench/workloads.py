"""The four default workloads, each a coroutine over a `Run`'s targets (and agent.py's, on request).

The tenants and chat traffic are also sent, unchanged, to groups of replicas (`tenant_rounds` and
`conversations` take a `Replicas` target and a group prefix; replicas.py drives them).

Every request streams, sets temperature 0, and is recorded by `Run.request` whether it succeeds
or not; a target that is down costs one failed request per planned request, never a crash.
Prompt text depends only on the run's seed, so every target sees the same prompts.
"""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import Awaitable, Iterable

from skippy_cache.bench.agent import agent
from skippy_cache.bench.client import Reply
from skippy_cache.bench.replay import trace
from skippy_cache.bench.run import AGENT, TRACE, Replicas, Run
from skippy_cache.bench.targets import Target
from skippy_cache.bench.text import WORDS, passage, words_for

COMPLETIONS = "/v1/completions"
CHAT = "/v1/chat/completions"
CALIBRATION_WORDS = 400


async def _bounded(limit: int, jobs: Iterable[Awaitable[object]]) -> None:
    """Run `jobs` with at most `limit` in flight (the C concurrent clients)."""
    gate = asyncio.Semaphore(limit)

    async def one(job: Awaitable[object]) -> None:
        async with gate:
            await job

    await asyncio.gather(*(one(job) for job in jobs))


async def calibrate(run: Run) -> dict[str, object]:
    """Measure prompt tokens per word on the first target whose usage says so; warm every target.

    The first `llama_decode` of a fresh context is slow (seconds), so each target answers one
    small request before anything is timed. The calibration passage has its own seed: no
    workload prompt shares its prefix.
    """
    text = passage(f"{run.seed}:calibrate", CALIBRATION_WORDS)
    measured: dict[str, object] = {"words": CALIBRATION_WORDS, "tokens": None, "target": None}
    for target in run.targets:
        if target.error is not None:
            continue
        body = {"prompt": text if measured["tokens"] is None else "Hello", "max_tokens": 1, "temperature": 0}
        if target.model_id is not None:
            body["model"] = target.model_id
        reply = await run.client.stream(target.url, COMPLETIONS, body)
        if measured["tokens"] is None and reply.ok and reply.prompt_tokens:
            measured.update(tokens=reply.prompt_tokens, target=target.label)
            run.tokens_per_word = reply.prompt_tokens / CALIBRATION_WORDS
    measured["tokens_per_word"] = run.tokens_per_word
    run.calibration = measured
    return measured


async def warm(run: Run) -> None:
    """One prompt of P tokens sent cold once, then `warm_repeats` times; max_tokens 1."""
    for size in run.sizes.warm_prompt_tokens:
        prompt = passage(f"{run.seed}:warm:{size}", words_for(size, run.tokens_per_word))
        body = {"prompt": prompt, "max_tokens": 1, "temperature": 0}
        for target in run.targets_for("warm"):
            await run.request("warm", target, f"P={size} cold", COMPLETIONS, body)
            for _ in range(run.sizes.warm_repeats):
                await run.request("warm", target, f"P={size} warm", COMPLETIONS, body)


async def tenants(run: Run) -> None:
    """K system prompts, each with a distinct short question, R rounds round-robin, C clients.

    Each round ends before the next starts, so "round 1" is every tenant's first request and
    "later rounds" are repeats of a system prompt the server has seen.
    """
    for target in run.targets_for("tenants"):
        await tenant_rounds(run, target)


async def tenant_rounds(
    run: Run, target: Target | Replicas, workload: str = "tenants", prefix: str = ""
) -> None:
    """The tenants traffic on one target, its groups named `prefix` + "round 1" / "later rounds".

    Tenant k's request of round r has index k + r: a `Replicas` target sends a tenant's
    consecutive rounds to different servers, and each round's requests to all of them.
    """
    s = run.sizes
    systems = tenant_systems(run, str(run.seed), s.tenants)
    started = time.perf_counter()
    for r in range(s.tenant_rounds):
        group = prefix + ("round 1" if r == 0 else "later rounds")
        jobs = [
            run.request(workload, target, group, CHAT, tenant_body(run, system, f"{run.seed}:question:{k}:{r}", 1),
                        index=k + r)
            for k, system in enumerate(systems)
        ]
        await _bounded(s.concurrency, jobs)
    run.span(workload, target, prefix + "all rounds", started, s.tenants * s.tenant_rounds)


def tenant_systems(run: Run, key: str, count: int) -> list[str]:
    """The system prompts of `count` tenants, their text seeded by `key`."""
    words = words_for(run.sizes.tenant_system_tokens, run.tokens_per_word)
    return [passage(f"{key}:tenant:{k}", words) for k in range(count)]


def tenant_body(run: Run, system: str, question_seed: str, max_tokens: int) -> dict[str, object]:
    """A tenant's request: its system prompt and a short question of its own."""
    question = passage(question_seed, run.sizes.tenant_question_words).rstrip(".") + "?"
    return {
        "messages": [{"role": "system", "content": system}, {"role": "user", "content": question}],
        "max_tokens": max_tokens,
        "temperature": 0,
    }


class Conversation:
    """Conversation c of a run: its system prompt and the history it resends on every turn, its text
    seeded by `key` (the run's seed by default)."""

    def __init__(self, run: Run, c: int, key: str | None = None) -> None:
        self.run, self.c = run, c
        self.key = str(run.seed) if key is None else key
        system = passage(f"{self.key}:chat-system:{c}", words_for(run.sizes.chat_system_tokens, run.tokens_per_word))
        self.messages: list[dict[str, str]] = [{"role": "system", "content": system}]

    def ask(self, turn: int) -> dict[str, object]:
        """Turn `turn`'s user message, added to the history; the request body that sends it."""
        s = self.run.sizes
        user = passage(f"{self.key}:chat:{self.c}:{turn}", words_for(s.chat_user_tokens, self.run.tokens_per_word))
        self.messages.append({"role": "user", "content": user + " What do you make of this?"})
        return {"messages": list(self.messages), "max_tokens": s.chat_max_tokens, "temperature": 0}

    def heard(self, reply: Reply | None) -> None:
        """The answer to the last turn (None: none came), added to the history.

        A failed turn still leaves a turn in the history, so the next turn is the same size
        class and is measured (and counted) rather than skipped.
        """
        text = reply.text if reply is not None and reply.ok and reply.text else "(no reply)"
        self.messages.append({"role": "assistant", "content": text})

    async def turn(self, target: Target | Replicas, turn: int, workload: str, prefix: str) -> None:
        """Send turn `turn` (index c + turn: a `Replicas` target alternates a conversation's servers)."""
        body = self.ask(turn)
        self.heard(await self.run.request(workload, target, f"{prefix}turn {turn + 1}", CHAT, body,
                                          index=self.c + turn))


async def chat(run: Run) -> None:
    """Conversations of several turns, each turn resending the whole history; C at once."""
    for target in run.targets_for("chat"):
        await conversations(run, target)


async def conversations(
    run: Run, target: Target | Replicas, workload: str = "chat", prefix: str = "", *, in_rounds: bool = False
) -> None:
    """The chat traffic on one target, its groups named `prefix` + "turn N".

    Each conversation sends its next turn as soon as its last one is answered; `in_rounds` makes
    every turn a round instead (turn t + 1 of any conversation waits for turn t of all), as the
    tenants' rounds do. Replicas need that: conversation c's turn t goes to server (c + t) mod N,
    and once the conversations drift a turn apart, that schedule piles them all on one server
    while the others idle, which measures the drift, not the shared tier.
    """
    s = run.sizes
    started = time.perf_counter()
    talks = [Conversation(run, c) for c in range(s.chat_conversations)]
    if in_rounds:
        for turn in range(s.chat_turns):
            await _bounded(s.concurrency, (t.turn(target, turn, workload, prefix) for t in talks))
    else:

        async def converse(talk: Conversation) -> None:
            for turn in range(s.chat_turns):
                await talk.turn(target, turn, workload, prefix)

        await _bounded(s.concurrency, (converse(t) for t in talks))
    run.span(workload, target, prefix + "all turns", started, s.chat_conversations * s.chat_turns)


async def zero(run: Run) -> None:
    """Distinct prompts with no shared prefix (each opens on its own word), C clients.

    Blocks alternate the target order (A B, then B A, ...): on a shared 2-core machine the
    background load drifts, and alternating spreads that drift over the targets alike.
    """
    s = run.sizes
    targets = run.targets_for("zero")
    first_words = list(WORDS)
    random.Random(f"skippy-bench:{run.seed}:zero-first").shuffle(first_words)
    n_words = words_for(s.zero_prompt_tokens, run.tokens_per_word)
    for block in range(s.zero_blocks):
        ids = range(block * s.zero_prompts, (block + 1) * s.zero_prompts)
        prompts = [
            passage(f"{run.seed}:zero:{i}", n_words, first=first_words[i % len(first_words)]) for i in ids
        ]
        for target in targets if block % 2 == 0 else reversed(targets):
            started = time.perf_counter()
            jobs = (
                run.request(
                    "zero",
                    target,
                    "zero",
                    COMPLETIONS,
                    {"prompt": p, "max_tokens": s.zero_max_tokens, "temperature": 0},
                )
                for p in prompts
            )
            await _bounded(s.concurrency, jobs)
            run.span("zero", target, f"block {block + 1}", started, len(prompts))


WORKLOAD_FUNCTIONS = {"warm": warm, "tenants": tenants, "chat": chat, "zero": zero, AGENT: agent, TRACE: trace}
