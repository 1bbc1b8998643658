"""Soak: mixed and abusive traffic from many clients against a live server, then checks that it is whole.

    .venv/bin/python benchmarks/soak.py [--minutes 10] [--clients 16] [--url URL [--pid PID]]

Without --url it starts `skippy-cache serve` on a free loopback port with the
default model (and a fresh temporary --cache-dir), and stops it at the end.

Each client loops over request classes drawn at random by weight: normal
completions and chat (streaming and not), streams dropped after a few
chunks, requests dropped before their first token, malformed JSON, wrong
types, prompts over the context, invalid UTF-8, unknown fields and bodies
over the size limit. Every 20 seconds all clients also send one fresh
identical prompt at once. At the end it waits for the server to go idle and
checks, printing a table:

- every answer had a status its class allows, and no 5xx (client side and
  the server's own `skippy_requests_total`);
- no lane busy, nothing queued;
- the pool holds no leaked cell: at rest every used cell belongs to a
  resident cache entry (`/v1/cache` `pool.audit`: used == entry cells, no
  lane or unowned cells, llama.cpp's sequences as the mirror books them);
- the server process's RSS (VmRSS from /proc) over the run, sampled each
  quarter (with --url, only if --pid is given).

Exit code 0 when every check passed, 1 otherwise.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import random
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections import Counter, defaultdict
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import urlsplit

import httpx

#: How often (per weight unit) each class is drawn by a client.
WEIGHTS = {
    "completion": 14,
    "completion_stream": 8,
    "chat": 14,
    "chat_stream": 10,
    "stream_dropped": 6,
    "dropped_before_first_token": 6,
    "malformed_json": 4,
    "wrong_types": 4,
    "prompt_over_context": 3,
    "invalid_utf8": 3,
    "unknown_field": 3,
    "body_over_limit": 1,
}
#: What each class may get back. Anything else (and any 5xx) fails the run.
ALLOWED = {
    "completion": {200},
    "completion_stream": {200},
    "chat": {200},
    "chat_stream": {200},
    "same_prompt": {200},
    "stream_dropped": {200},
    "dropped_before_first_token": set(),  # no answer is read
    "malformed_json": {400},
    "wrong_types": {400},
    "prompt_over_context": {400},
    "invalid_utf8": {400},
    "unknown_field": {400},
    "body_over_limit": {413},
}
#: Seconds between bursts of one identical prompt from every client (--burst-every).
BURST_EVERY_S = 20.0

SYSTEMS = [
    "You are a concise assistant for a hardware store. Answer in one or two sentences, name the aisle "
    "when you can, and never invent prices. " * 6,
    "You are a patient tutor of arithmetic for children. Explain each step in plain words and check "
    "the result before you answer. " * 6,
    "You summarise short texts for busy readers: one sentence, no opinions, keep the names. " * 8,
]
QUESTIONS = [
    "Where are the screws?", "What is 7 times 8?", "Summarise: the river rose and the town moved uphill.",
    "Do you sell paint?", "What is 12 plus 30?", "Summarise: the library opened late on Sunday.",
    "Where can I find rope?", "Explain 9 minus 4.", "Summarise: two friends built a boat and it floated.",
    "Is there a garden section?", "What is half of 50?", "Summarise: the train was early for once.",
]
DOCUMENT = ("The committee met on Tuesday to review the budget for the new community centre. "
            "It approved the plans for the roof and the kitchen, and asked for two more quotes "
            "for the heating. ") * 8


@dataclass
class Tally:
    sent: Counter = field(default_factory=Counter)
    statuses: defaultdict = field(default_factory=lambda: defaultdict(Counter))
    #: Answers outside the class's allowed statuses: (class, status, first bytes of the body).
    unexpected: list = field(default_factory=list)
    #: Transport failures where an answer was due: (class, error).
    errors: list = field(default_factory=list)
    #: Streams that ended without [DONE] or with an error event.
    bad_streams: list = field(default_factory=list)

    def answer(self, kind: str, status: int, body: bytes = b"") -> None:
        self.statuses[kind][status] += 1
        if status >= 500 or status not in ALLOWED[kind]:
            self.unexpected.append((kind, status, body[:300]))


@dataclass
class Target:
    url: str
    n_ctx: int
    max_body_bytes: int
    model: str

    @property
    def host_port(self) -> tuple[str, int]:
        parts = urlsplit(self.url)
        return parts.hostname or "127.0.0.1", parts.port or 80


# -- request classes -------------------------------------------------------------------------------


def chat_body(rng: random.Random, **extra: object) -> dict:
    return {"model": "gpt-4o-mini", "max_tokens": rng.randint(4, 24), "temperature": 0.7,
            "messages": [{"role": "system", "content": rng.choice(SYSTEMS)},
                         {"role": "user", "content": rng.choice(QUESTIONS)}], **extra}


def completion_body(rng: random.Random, **extra: object) -> dict:
    return {"max_tokens": rng.randint(4, 24), "temperature": 0.7,
            "prompt": f"{DOCUMENT}\nQuestion {rng.randint(1, 30)}: what was approved?\nAnswer:", **extra}


async def plain(client: httpx.AsyncClient, tally: Tally, kind: str, path: str, body: dict) -> None:
    response = await client.post(path, json=body)
    tally.answer(kind, response.status_code, response.content)


async def streamed(client: httpx.AsyncClient, tally: Tally, kind: str, path: str, body: dict,
                   drop_after: int | None = None) -> None:
    async with client.stream("POST", path, json=body) as response:
        tally.answer(kind, response.status_code)
        if response.status_code != 200:
            await response.aread()
            return
        events = 0
        done = False
        async for line in response.aiter_lines():
            if not line.startswith("data: "):
                continue
            if line == "data: [DONE]":
                done = True
                break
            if '"error"' in line and json.loads(line[6:]).get("error"):
                tally.bad_streams.append((kind, line[:300]))
            events += 1
            if drop_after is not None and events >= drop_after:
                return  # leaving the block closes the connection mid-stream
        if not done:
            tally.bad_streams.append((kind, "ended without [DONE]"))


async def raw(target: Target, tally: Tally, kind: str, path: str, body: bytes, *, read: bool = True,
              drop_after_s: float = 0.0) -> None:
    """One request over its own socket: bytes as given (no JSON encoder in the way)."""
    host, port = target.host_port
    reader, writer = await asyncio.open_connection(host, port)
    try:
        head = (f"POST {path} HTTP/1.1\r\nHost: {host}:{port}\r\nContent-Type: application/json\r\n"
                f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n").encode()
        writer.write(head + body)
        await writer.drain()
        if not read:
            await asyncio.sleep(drop_after_s)
            return
        data = await reader.read()
        status = int(data.split(b" ", 2)[1]) if data.startswith(b"HTTP/1.1 ") else -1
        tally.answer(kind, status, data.partition(b"\r\n\r\n")[2])
    finally:
        writer.close()
        with contextlib.suppress(Exception):
            await writer.wait_closed()


async def over_limit(client: httpx.AsyncClient, target: Target, tally: Tally, rng: random.Random) -> None:
    """A body past the server's limit: with a Content-Length half the time, else chunked (no length)."""
    size = target.max_body_bytes + 1024
    piece = b"x" * (256 * 1024)

    async def chunks() -> AsyncIterator[bytes]:
        yield b'{"prompt": "'
        for _ in range(size // len(piece) + 1):
            yield piece

    content = b'{"prompt": "' + b"x" * size + b'"}' if rng.random() < 0.5 else chunks()
    response = await client.post("/v1/completions", content=content, headers={"Content-Type": "application/json"})
    tally.answer("body_over_limit", response.status_code, response.content)


async def one_request(kind: str, client: httpx.AsyncClient, target: Target, tally: Tally,
                      rng: random.Random) -> None:
    tally.sent[kind] += 1
    if kind == "completion":
        await plain(client, tally, kind, "/v1/completions", completion_body(rng))
    elif kind == "completion_stream":
        await streamed(client, tally, kind, "/v1/completions", completion_body(rng, stream=True))
    elif kind == "chat":
        await plain(client, tally, kind, "/v1/chat/completions", chat_body(rng))
    elif kind == "chat_stream":
        body = chat_body(rng, stream=True, stream_options={"include_usage": True})
        await streamed(client, tally, kind, "/v1/chat/completions", body)
    elif kind == "stream_dropped":
        body = chat_body(rng, stream=True, max_tokens=64)
        await streamed(client, tally, kind, "/v1/chat/completions", body, drop_after=rng.randint(1, 4))
    elif kind == "dropped_before_first_token":
        body = json.dumps(chat_body(rng, max_tokens=64)).encode()
        await raw(target, tally, kind, "/v1/chat/completions", body, read=False,
                  drop_after_s=rng.uniform(0.0, 0.05))
    elif kind == "malformed_json":
        body = rng.choice([b'{"prompt": "x", ', b"{prompt: 'x'}", b"", b"[1, 2", b'{"messages": [}'])
        await raw(target, tally, kind, rng.choice(["/v1/completions", "/v1/chat/completions"]), body)
    elif kind == "wrong_types":
        path, body = rng.choice([
            ("/v1/completions", {"prompt": 42}),
            ("/v1/completions", {"prompt": "x", "max_tokens": "8"}),
            ("/v1/chat/completions", {"messages": "hello"}),
            ("/v1/chat/completions", {"messages": [{"role": "user", "content": 5}]}),
            ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "stream": "yes"}),
            ("/v1/completions", {"prompt": "x", "temperature": [1]}),
        ])
        await plain(client, tally, kind, path, body)
    elif kind == "prompt_over_context":
        if rng.random() < 0.5:
            await plain(client, tally, kind, "/v1/completions", {"prompt": [1] * (target.n_ctx + 16)})
        else:
            # Text: every word at least one token.
            words = " ".join(rng.choice(["river", "garden", "planet"]) for _ in range(target.n_ctx + 16))
            await plain(client, tally, kind, "/v1/chat/completions",
                        {"messages": [{"role": "user", "content": words}], "max_tokens": 4})
    elif kind == "invalid_utf8":
        body = rng.choice([b'{"prompt": "caf\xe9", "max_tokens": 2}', b'{"prompt": "\xff\xfe\xfd"}',
                           b'{"messages": [{"role": "user", "content": "\xc3\x28"}]}'])
        await raw(target, tally, kind, rng.choice(["/v1/completions", "/v1/chat/completions"]), body)
    elif kind == "unknown_field":
        await plain(client, tally, kind, "/v1/chat/completions", chat_body(rng, temprature=0.2))
    elif kind == "body_over_limit":
        await over_limit(client, target, tally, rng)
    else:
        raise AssertionError(f"unknown class {kind}")


async def guarded(kind: str, run: Callable[[], Awaitable[None]], tally: Tally) -> None:
    try:
        await run()
    except (httpx.HTTPError, OSError, asyncio.IncompleteReadError) as exc:
        tally.errors.append((kind, f"{type(exc).__name__}: {exc}"[:300]))


async def client_loop(index: int, clients: int, deadline: float, target: Target, tally: Tally,
                      seed: int) -> None:
    rng = random.Random(seed * 1000 + index)
    kinds, weights = list(WEIGHTS), list(WEIGHTS.values())
    # The clients' first requests go through every class once between them, so even a
    # short run sends each; then classes are drawn by weight.
    first = kinds[index::clients]
    async with httpx.AsyncClient(base_url=target.url, timeout=300) as client:
        while time.monotonic() < deadline:
            kind = first.pop(0) if first else rng.choices(kinds, weights)[0]
            await guarded(kind, lambda: one_request(kind, client, target, tally, rng), tally)


async def bursts(clients: int, every: float, deadline: float, target: Target, tally: Tally, seed: int) -> None:
    """Every `every` seconds, every client sends one fresh, identical prompt at the same moment."""
    rng = random.Random(seed)
    async with httpx.AsyncClient(base_url=target.url, timeout=300,
                                 limits=httpx.Limits(max_connections=clients)) as client:
        while time.monotonic() + every < deadline:
            await asyncio.sleep(every)
            prompt = f"Burst {rng.getrandbits(64):x}. {DOCUMENT}\nWhat did the committee ask for?"
            body = {"prompt": prompt, "max_tokens": 8, "temperature": 0}

            async def send(body: dict = body) -> None:
                tally.sent["same_prompt"] += 1
                await plain(client, tally, "same_prompt", "/v1/completions", body)

            await asyncio.gather(*(guarded("same_prompt", send, tally) for _ in range(clients)))


# -- the server ------------------------------------------------------------------------------------


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def start_server(cache_dir: Path, log: Path, extra: list[str]) -> tuple[subprocess.Popen, str]:
    port = free_port()
    cmd = [sys.executable, "-m", "skippy_cache", "serve", "--host", "127.0.0.1", "--port", str(port),
           "--cache-dir", str(cache_dir), "--log-level", "warning", *extra]
    proc = subprocess.Popen(cmd, stdout=log.open("wb"), stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 600
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"the server exited with {proc.returncode}:\n{log.read_text()[-3000:]}")
        with contextlib.suppress(httpx.HTTPError):
            if httpx.get(f"{url}/health", timeout=5).status_code == 200:
                return proc, url
        time.sleep(0.5)
    proc.kill()
    raise SystemExit("the server did not come up in 10 minutes")


def stop_server(proc: subprocess.Popen) -> None:
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(120)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def rss_mib(pid: int | None) -> float | None:
    if pid is None:
        return None
    with contextlib.suppress(OSError):
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return None


def server_5xx(url: str) -> int:
    """5xx answers the server itself counted (`skippy_requests_total{status=5..}`)."""
    total = 0.0
    for line in httpx.get(f"{url}/metrics", timeout=30).text.splitlines():
        if line.startswith("skippy_requests_total{") and 'status="5' in line:
            total += float(line.rsplit(" ", 1)[1])
    return int(total)


def wait_idle(url: str, timeout: float = 300) -> dict:
    deadline = time.monotonic() + timeout
    health: dict = {}
    while time.monotonic() < deadline:
        health = httpx.get(f"{url}/health", timeout=30).json()
        if health.get("lanes_busy") == 0 and health.get("queue_depth") == 0:
            return health
        time.sleep(0.2)
    return health


# -- the run ---------------------------------------------------------------------------------------


def describe(url: str) -> Target:
    card = httpx.get(f"{url}/v1/models", timeout=30).json()["data"][0]
    return Target(url=url, n_ctx=card["context_length"], max_body_bytes=0, model=card["id"])


async def soak(target: Target, clients: int, seconds: float, burst_every: float, seed: int, pid: int | None,
               rss: list[tuple[str, float | None]]) -> Tally:
    tally = Tally()
    deadline = time.monotonic() + seconds

    async def sample_rss() -> None:
        for quarter in (1, 2, 3):
            await asyncio.sleep(seconds / 4)
            rss.append((f"{quarter * 25}%", rss_mib(pid)))

    tasks = [client_loop(i, clients, deadline, target, tally, seed) for i in range(clients)]
    tasks.append(bursts(clients, burst_every, deadline, target, tally, seed))
    tasks.append(sample_rss())
    await asyncio.gather(*tasks)
    return tally


def report(tally: Tally, checks: list[tuple[str, bool, str]], rss: list[tuple[str, float | None]],
           store_ram: int, seconds: float, clients: int, burst_every: float) -> str:
    lines = [f"soak: {seconds / 60:.1f} min, {clients} clients (+ a burst of {clients} identical prompts "
             f"every {burst_every:g} s)", ""]
    lines.append(f"| {'class':<28} | {'sent':>6} | {'answered':>8} | statuses |")
    lines.append(f"|{'-' * 30}|{'-' * 8}|{'-' * 10}|----------|")
    for kind in [*WEIGHTS, "same_prompt"]:
        statuses = tally.statuses.get(kind, Counter())
        answered = sum(statuses.values())
        shown = ", ".join(f"{code}: {n}" for code, n in sorted(statuses.items())) or "-"
        if kind == "dropped_before_first_token":
            shown = "dropped by the client (no answer read)"
        lines.append(f"| {kind:<28} | {tally.sent[kind]:>6} | {answered:>8} | {shown} |")
    total_sent = sum(tally.sent.values())
    total_answered = sum(sum(s.values()) for s in tally.statuses.values())
    lines.append(f"| {'total':<28} | {total_sent:>6} | {total_answered:>8} | |")
    lines += ["", "| check | result | figures |", "|---|---|---|"]
    for name, ok, figures in checks:
        lines.append(f"| {name} | {'ok' if ok else 'FAILED'} | {figures} |")
    lines += ["", "server RSS (VmRSS, MiB): " + ", ".join(
        f"{label} {value:.0f}" if value is not None else f"{label} n/a" for label, value in rss)]
    lines.append("of which by design, at the end: the store's RAM tier and restore buffer "
                 f"{store_ram / 2**20:.0f} MiB (states of entries that left the pool, up to "
                 "--host-cache-mib; the largest restore, up to 256 MiB)")
    for label, items in (("unexpected answers", tally.unexpected), ("transport errors", tally.errors),
                         ("bad streams", tally.bad_streams)):
        if items:
            lines.append(f"{label} (first 5 of {len(items)}):")
            lines += [f"  {item!r}" for item in items[:5]]
    return "\n".join(lines)


def run_checks(target: Target, tally: Tally) -> tuple[list[tuple[str, bool, str]], int]:
    """The checks, and the store's RAM tier bytes."""
    health = wait_idle(target.url)
    cache = httpx.get(f"{target.url}/v1/cache", timeout=60).json()
    store = cache.get("store")
    store_ram = store["chunks"]["ram_bytes"] + store["restore_buffer_bytes"] if store else 0
    pool, audit = cache["pool"], cache["pool"]["audit"]
    five = sum(n for s in tally.statuses.values() for code, n in s.items() if code >= 500)
    server_five = server_5xx(target.url)
    answered = sum(sum(s.values()) for s in tally.statuses.values())
    return [
        ("no 5xx (client / server count)", five == 0 and server_five == 0, f"{five} / {server_five}"),
        ("every answer as its class expects", not tally.unexpected, f"{len(tally.unexpected)} unexpected"),
        ("every request answered", not tally.errors, f"{answered} answers, {len(tally.errors)} transport errors"),
        ("every stream ends with [DONE]", not tally.bad_streams, f"{len(tally.bad_streams)} bad"),
        ("lanes busy back to 0", health.get("lanes_busy") == 0, f"{health.get('lanes_busy')}"),
        ("queue depth 0", health.get("queue_depth") == 0, f"{health.get('queue_depth')}"),
        ("used cells == cells of resident entries", audit["used_cells"] == audit["entry_cells"],
         f"{audit['used_cells']} used, {audit['entry_cells']} in {cache['resident']['entries']} entries "
         f"of {pool['n_ctx']}"),
        ("no cells held by lanes or no one", audit["lane_cells"] == 0 and audit["unowned_cells"] == 0,
         f"lanes {audit['lane_cells']}, unowned {audit['unowned_cells']}"),
        ("llama.cpp agrees with the books", audit["native_mismatches"] == 0,
         f"{audit['native_mismatches']} sequences differ"),
    ], store_ram


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--minutes", type=float, default=10.0, help="how long to send traffic (default 10)")
    parser.add_argument("--clients", type=int, default=16, help="concurrent clients (default 16)")
    parser.add_argument("--url", help="a running server (default: start `skippy-cache serve` on a free port)")
    parser.add_argument("--pid", type=int, help="with --url: the server's process id, for its RSS")
    parser.add_argument("--serve-arg", action="append", default=[], metavar="ARG",
                        help="without --url: an option for `skippy-cache serve`, e.g. --serve-arg=--host-cache-mib=0 "
                        "(repeat for more)")
    parser.add_argument("--max-body-mib", type=float, default=8,
                        help="the server's --max-body-mib, to size bodies over it (default 8)")
    parser.add_argument("--burst-every", type=float, default=BURST_EVERY_S,
                        help=f"seconds between bursts of one identical prompt from every client (default {BURST_EVERY_S:g})")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, help="also write the table to this file")
    args = parser.parse_args(argv)

    seconds = args.minutes * 60
    with tempfile.TemporaryDirectory(prefix="skippy-soak-") as tmp:
        proc = None
        pid = args.pid
        if args.url is None:
            log = Path(tmp) / "server.log"
            proc, url = start_server(Path(tmp) / "cache", log, args.serve_arg)
            pid = proc.pid
            print(f"started skippy-cache serve at {url} (pid {pid}, log {log})", flush=True)
        else:
            url = args.url.rstrip("/")
        try:
            target = describe(url)
            target.max_body_bytes = int(args.max_body_mib * 1024 * 1024)
            rss: list[tuple[str, float | None]] = [("start", rss_mib(pid))]
            print(f"soaking {url} ({target.model}, context {target.n_ctx}) for {args.minutes} min with "
                  f"{args.clients} clients", flush=True)
            t0 = time.monotonic()
            tally = asyncio.run(soak(target, args.clients, seconds, args.burst_every, args.seed, pid, rss))
            elapsed = time.monotonic() - t0
            checks, store_ram = run_checks(target, tally)
            rss.append(("end", rss_mib(pid)))
            start, end = rss[0][1], rss[-1][1]
            if start is not None and end is not None:
                rss.append(("growth", end - start))
            text = report(tally, checks, rss, store_ram, elapsed, args.clients, args.burst_every)
        finally:
            if proc is not None:
                stop_server(proc)
    print(text)
    if args.out is not None:
        args.out.write_text(text + "\n")
    return 0 if all(ok for _, ok, _ in checks) else 1


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    sys.exit(main())
