"""Open-loop traffic: requests sent on the arrivals' clock, whatever the server's pace.

Each workload's traffic at each offered rate starts from prompts no server has seen (their text is
seeded by the rate), so every rate's first requests are cold and the rest reuse what those left:
- tenants: K system prompts (a tenant each), request i asks tenant i mod K a question of its own;
- chat: conversations of several turns, request i is the next turn of conversation i mod C; a
  turn is sent when it is due or when the previous turn's answer arrives, whichever is later;
- zero: distinct prompts sharing no prefix (what the cache costs when it cannot help).
Every request streams at temperature 0. The servers take each rate in turn, in alternating order
(on a shared 2-core machine, background load drifts; alternating spreads it over them alike).
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path

from skippy_cache.bench.arrivals import DEFAULT_BURST, arrival_times
from skippy_cache.bench.client import Reply
from skippy_cache.bench.curves import SLO, OpenRequest
from skippy_cache.bench.run import Run
from skippy_cache.bench.targets import Target
from skippy_cache.bench.text import passage, words_for
from skippy_cache.bench.workloads import CHAT, COMPLETIONS, Conversation, tenant_body, tenant_systems

OPEN_WORKLOADS = ("tenants", "chat", "zero")
DEFAULT_RATES = (0.25, 0.5, 1.0, 2.0, 4.0)
DEFAULT_REQUESTS = 24
#: Output tokens of a tenant's answer: enough for TPOT to mean something.
TENANT_MAX_TOKENS = 16


@dataclass(frozen=True, slots=True)
class OpenLoop:
    """An open-loop run: the arrival process, the offered rates, and requests per rate and server."""

    arrivals: str = "poisson"
    rates: tuple[float, ...] = DEFAULT_RATES
    requests: int = DEFAULT_REQUESTS
    burst: int = DEFAULT_BURST
    trace: list[float] | None = None
    slo: SLO = field(default_factory=SLO)


Send = Callable[[str, dict], Awaitable[Reply]]


class _Traffic:
    """Request i of `n` of one workload at one rate: its path, body, and group ("cold" or "hit").

    The texts are the closed loop's tenants and conversations (workloads.py), seeded by `key`.
    """

    def __init__(self, run: Run, workload: str, key: str, n: int) -> None:
        self.run, self.workload, self.key = run, workload, key
        s = run.sizes
        if workload == "tenants":
            self.systems = tenant_systems(run, key, min(s.tenants, n))
        elif workload == "chat":
            self.talks = [Conversation(run, c, key) for c in range(min(s.chat_conversations * 2, n))]
            # Turn i's answer has arrived (a turn may be due before its previous one was sent).
            self.answered = [asyncio.Event() for _ in range(n)]

    async def send(self, i: int, send: Send) -> tuple[str, Reply]:
        s = self.run.sizes
        if self.workload == "tenants":
            system = self.systems[i % len(self.systems)]
            body = tenant_body(self.run, system, f"{self.key}:question:{i}", TENANT_MAX_TOKENS)
            return ("cold" if i < len(self.systems) else "hit"), await send(CHAT, body)
        if self.workload == "chat":
            return await self._turn(i, send)
        prompt = passage(f"{self.key}:zero:{i}", words_for(s.zero_prompt_tokens, self.run.tokens_per_word),
                         first=f"Note{i}")
        body = {"prompt": prompt, "max_tokens": s.zero_max_tokens, "temperature": 0}
        return "distinct", await send(COMPLETIONS, body)

    async def _turn(self, i: int, send: Send) -> tuple[str, Reply]:
        n_talks = len(self.talks)
        talk, turn = self.talks[i % n_talks], i // n_talks
        if turn:
            await self.answered[i - n_talks].wait()
        reply = None
        try:
            reply = await send(CHAT, talk.ask(turn))
        finally:
            talk.heard(reply)
            self.answered[i].set()
        return ("cold" if turn == 0 else "hit"), reply


def _status(reply: Reply) -> str:
    if reply.ok:
        return "ok"
    error = reply.error or ""
    return error[5:8] if error.startswith("HTTP ") else "error"


async def one_rate(run: Run, target: Target, workload: str, rate: float, key: str, times: list[float],
                   on_request: Callable[[str, str, Reply], None]) -> list[OpenRequest]:
    """Send one workload's requests to one server at `times` (seconds from now); every outcome recorded."""
    traffic = _Traffic(run, workload, key, len(times))
    started = time.perf_counter()
    records: list[OpenRequest] = []

    async def fire(i: int, due: float) -> None:
        await asyncio.sleep(max(0.0, started + due - time.perf_counter()))
        sent = 0.0

        async def send(path: str, body: dict) -> Reply:
            nonlocal sent
            if target.model_id is not None:
                body = {"model": target.model_id, **body}
            sent = time.perf_counter() - started
            return await run.client.stream(target.url, path, body)

        group, reply = await traffic.send(i, send)
        records.append(OpenRequest(workload, target.label, rate, i, group, due, sent, reply.ok, _status(reply),
                                   reply.ttft_ms, reply.total_ms, reply.prompt_tokens, reply.cached_tokens,
                                   reply.completion_tokens))
        on_request(workload, target.label, reply)

    await asyncio.gather(*(fire(i, due) for i, due in enumerate(times)))
    return sorted(records, key=lambda r: r.index)


async def open_loop(run: Run, plan: OpenLoop, workloads: list[str],
                    on_request: Callable[[str, str, Reply], None], log: Path | None = None) -> list[OpenRequest]:
    """Every workload at every rate on every server; the requests, in the order they were run.

    `log`: each rate's requests are appended there as JSON lines once they are answered, so a
    long run that is stopped keeps what it measured.
    """
    records: list[OpenRequest] = []
    for workload in workloads:
        targets = run.targets_for(workload)
        for r, rate in enumerate(plan.rates):
            key = f"{run.seed}:open:{workload}:{r}"
            times = arrival_times(plan.arrivals, rate, plan.requests, key, burst=plan.burst, trace=plan.trace)
            for target in targets if r % 2 == 0 else list(reversed(targets)):
                done = await one_rate(run, target, workload, rate, key, times, on_request)
                records += done
                if log is not None:
                    with log.open("a") as f:
                        f.writelines(json.dumps(d.to_json()) + "\n" for d in done)
    return records
