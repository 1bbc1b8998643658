"""Tenants through the live server with the official client: a prompt one tenant cached is a hit for
it and a miss for every other; what each role may see and clear; a tenant's flood leaves the others
answered."""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections.abc import Iterator
from pathlib import Path

import anthropic
import httpx
import openai
import pytest
from live_server import LiveServer, run_server

from skippy_cache.runtime import Engine
from skippy_cache.server import ServerSettings
from skippy_cache.server.tenants import NAMESPACE_HEADER, hash_key

pytestmark = [pytest.mark.model, pytest.mark.timeout(300)]

ALICE, BOB, CAROL, ROOT = "sk-alice-1", "sk-bob-2", "sk-carol-3", "sk-root-4"
#: Requests one tenant may have in flight and waiting here.
TENANT_LIMIT = 3


def key_lines() -> str:
    return (f"{hash_key(ALICE)} alice user shared=public\n"
            f"{hash_key(BOB)} bob user\n"
            f"{hash_key(CAROL)} carol user shared=public\n"
            f"{hash_key(ROOT)} ops admin\n")


@pytest.fixture(scope="module")
def tenant_server(engine: Engine, tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveServer]:
    path = tmp_path_factory.mktemp("tenants") / "keys.txt"
    path.write_text(key_lines())
    settings = ServerSettings(ctx_size=2048, lanes=4, queue_size=4, fast=True, api_keys=path,
                              tenant_max_requests=TENANT_LIMIT)
    yield from run_server(engine, settings)


def prompt(topic: str) -> str:
    """A prompt long enough to be recorded (past min_tokens), about `topic`, no other test's."""
    return (f"Notes on {topic} at {time.monotonic_ns()}: " + "the quick brown fox jumps over the lazy dog. " * 12
            + "Summarise them.")


def complete(server: LiveServer, key: str, text: str, **extra: object) -> openai.types.Completion:
    client = server.openai(api_key=key)
    return client.completions.create(model="skippy-cache", prompt=text, max_tokens=2, temperature=0, **extra)


def cached(out: openai.types.Completion) -> int:
    return out.usage.prompt_tokens_details.cached_tokens


def reason(out: openai.types.Completion) -> str | None:
    return out.model_extra["skippy_cache"].get("miss_reason")


def tenant_misses(server: LiveServer) -> int:
    with server.http(headers={"Authorization": f"Bearer {ROOT}"}) as http:
        return http.get("/v1/cache").json()["counters"]["misses"].get("tenant", 0)


def test_a_prompt_is_a_hit_for_its_tenant_and_a_cold_miss_for_another(tenant_server: LiveServer) -> None:
    text = prompt("isolation")
    first = complete(tenant_server, ALICE, text)
    assert cached(first) == 0
    again = complete(tenant_server, ALICE, text)
    assert cached(again) > 0
    before = tenant_misses(tenant_server)
    other = complete(tenant_server, BOB, text)
    assert cached(other) == 0
    # Bob is told what he would be told had nobody sent it; the operator sees why it missed.
    assert reason(other) == "never_seen"
    assert tenant_misses(tenant_server) == before + 1
    assert cached(complete(tenant_server, BOB, text)) > 0, "bob's own entry now serves bob"


def test_a_salt_narrows_a_tenant_and_never_reaches_another(tenant_server: LiveServer) -> None:
    text = prompt("salts")
    complete(tenant_server, ALICE, text, extra_body={"cache_salt": "team-a"})
    # Alice's own other namespace: she may be told why.
    other_salt = complete(tenant_server, ALICE, text, extra_body={"cache_salt": "team-b"})
    assert cached(other_salt) == 0 and reason(other_salt) == "namespace"
    same_salt = complete(tenant_server, BOB, text, extra_body={"cache_salt": "team-a"})
    assert cached(same_salt) == 0 and reason(same_salt) == "never_seen"
    assert cached(complete(tenant_server, ALICE, text, extra_body={"cache_salt": "team-a"})) > 0


def test_a_salt_with_a_control_character_is_a_400(tenant_server: LiveServer) -> None:
    with pytest.raises(openai.BadRequestError) as caught:
        complete(tenant_server, ALICE, "hello", extra_body={"cache_salt": "a\x1fb"})
    assert caught.value.body["param"] == "cache_salt"


def test_a_shared_namespace_is_shared_by_its_members_only(tenant_server: LiveServer) -> None:
    text = prompt("a public system prompt")
    shared = {NAMESPACE_HEADER: "public"}
    complete(tenant_server, ALICE, text, extra_headers=shared)
    assert cached(complete(tenant_server, CAROL, text, extra_headers=shared)) > 0
    assert cached(complete(tenant_server, CAROL, text)) == 0, "outside the shared namespace: carol's own"
    with pytest.raises(openai.PermissionDeniedError) as caught:
        complete(tenant_server, BOB, text, extra_headers=shared)
    assert caught.value.body["code"] == "namespace_forbidden"
    with pytest.raises(openai.PermissionDeniedError):
        complete(tenant_server, ALICE, text, extra_headers={NAMESPACE_HEADER: "undeclared"})
    assert cached(complete(tenant_server, ROOT, text, extra_headers=shared)) > 0, "an admin may join it"


def test_explain_answers_within_the_callers_tenant(tenant_server: LiveServer) -> None:
    text = prompt("explain")
    complete(tenant_server, ALICE, text)
    body = {"prompt": text}
    for key, matched in ((ALICE, True), (BOB, False)):
        with tenant_server.http(headers={"Authorization": f"Bearer {key}"}) as http:
            said = http.post("/v1/cache/explain", json=body).json()["skippy_cache"]
        assert (said["matched_tokens"] > 0) is matched
        if not matched:
            assert said["miss_reason"] == "never_seen"


def test_a_user_sees_its_own_tenant_and_an_admin_sees_all(tenant_server: LiveServer) -> None:
    complete(tenant_server, ALICE, prompt("visibility"))
    complete(tenant_server, BOB, prompt("visibility"))
    with tenant_server.http(headers={"Authorization": f"Bearer {ALICE}"}) as http:
        mine = http.get("/v1/cache").json()
        board = http.get("/v1/dashboard").json()
        assert http.get("/metrics").status_code == 403
    assert mine["tenant"] == "alice" and mine["resident_entries"] >= 1
    assert "budgets" not in mine and "tenants" not in mine and "counters" not in mine
    assert mine["requests"]["done"] >= 1
    assert board["tenant"] == "alice"
    assert all(p["first_words"] is None and p["namespace"] == "alice" for p in board["top_prefixes"])
    with tenant_server.http(headers={"Authorization": f"Bearer {ROOT}"}) as http:
        everything = http.get("/v1/cache").json()
        admin_board = http.get("/v1/dashboard").json()
        metrics = http.get("/metrics")
    assert {"alice", "bob"} <= set(everything["tenants"])
    assert everything["tenants"]["bob"]["resident_entries"] >= 1
    assert "tenant" not in admin_board
    assert metrics.status_code == 200
    assert 'skippy_tenant_requests_total{tenant="alice"}' in metrics.text
    for key in (ALICE, BOB, CAROL, ROOT):
        assert key not in metrics.text and hash_key(key) not in metrics.text
    with tenant_server.http() as http:
        assert http.get("/metrics").status_code == 401


def test_a_user_clears_only_its_own_entries_and_an_admin_any(tenant_server: LiveServer) -> None:
    mine, theirs = prompt("alice's"), prompt("bob's")
    complete(tenant_server, ALICE, mine)
    complete(tenant_server, BOB, theirs)
    with tenant_server.http(headers={"Authorization": f"Bearer {ALICE}"}) as http:
        refused = http.delete("/v1/cache", params={"tenant": "bob"})
        assert refused.status_code == 403
        assert refused.json()["error"]["type"] == "permission_error"
        assert http.post("/v1/cache/unpin", json={"all": True}).status_code == 403
        cleared = http.delete("/v1/cache").json()
    assert cleared["tenant"] == "alice" and cleared["resident_entries"] >= 1
    assert cached(complete(tenant_server, ALICE, mine)) == 0
    assert cached(complete(tenant_server, BOB, theirs)) > 0, "alice's clear left bob's entries"
    with tenant_server.http(headers={"Authorization": f"Bearer {ROOT}"}) as http:
        assert http.delete("/v1/cache", params={"tenant": "bob"}).json()["tenant"] == "bob"
    assert cached(complete(tenant_server, BOB, theirs)) == 0


def test_one_tenants_flood_gets_429s_while_another_tenant_is_answered(tenant_server: LiveServer) -> None:
    async def flood() -> tuple[list[object], object]:
        alice = tenant_server.async_openai(api_key=ALICE)
        bob = tenant_server.async_openai(api_key=BOB)

        async def ask(client: openai.AsyncOpenAI, n: int) -> object:
            try:
                return await client.completions.create(model="skippy-cache", prompt=f"Count to {n}:", max_tokens=48,
                                                       temperature=0)
            except openai.APIStatusError as exc:
                return exc

        floods = [asyncio.create_task(ask(alice, n)) for n in range(10)]
        await asyncio.sleep(0.2)
        answer = await ask(bob, 99)
        return list(await asyncio.gather(*floods)), answer

    floods, answer = asyncio.run(flood())
    refused = [r for r in floods if isinstance(r, openai.RateLimitError)]
    answered = [r for r in floods if not isinstance(r, Exception)]
    assert len(answered) == TENANT_LIMIT and len(refused) == 10 - TENANT_LIMIT, floods
    assert all(r.response.headers["Retry-After"] == "1" for r in refused)
    assert refused[0].body["code"] == "tenant_limit"
    assert not isinstance(answer, Exception), answer
    tenant_server.wait_idle()
    with tenant_server.http(headers={"Authorization": f"Bearer {ROOT}"}) as http:
        metrics = http.get("/metrics").text
    assert f'skippy_tenant_refused_total{{tenant="alice"}} {10 - TENANT_LIMIT}.0' in metrics
    # Every answered or refused request gave its place back: alice may send again.
    complete(tenant_server, ALICE, "again")


def test_a_request_without_a_key_or_with_a_wrong_one_is_401(tenant_server: LiveServer) -> None:
    for headers in ({}, {"Authorization": "Bearer sk-nobody"}, {"Authorization": f"Bearer {hash_key(ALICE)}"}):
        with tenant_server.http(headers=headers) as http:
            assert http.get("/v1/models").status_code == 401
    assert httpx.get(f"{tenant_server.url}/health", timeout=10).status_code == 200


def test_the_anthropic_and_responses_apis_are_isolated_too(tenant_server: LiveServer) -> None:
    text = prompt("messages")

    def ask(key: str) -> int:
        client = anthropic.Anthropic(base_url=tenant_server.url, api_key=key, max_retries=0)
        out = client.messages.create(model="skippy-cache", max_tokens=2,
                                     messages=[{"role": "user", "content": text}])
        return out.usage.cache_read_input_tokens or 0

    ask(ALICE)
    assert ask(ALICE) > 0
    assert ask(BOB) == 0
    # Alice's prompt renders alike through the Responses API: a hit for her, a miss for carol.
    def respond(key: str) -> int:
        out = tenant_server.openai(api_key=key).responses.create(model="skippy-cache", input=text,
                                                                 max_output_tokens=2, temperature=0)
        return out.usage.input_tokens_details.cached_tokens

    assert respond(ALICE) > 0
    assert respond(CAROL) == 0


@pytest.fixture(scope="module")
def traced_server(engine: Engine, tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[LiveServer, Path]]:
    folder = tmp_path_factory.mktemp("traced")
    (folder / "keys.txt").write_text(key_lines())
    log = folder / "trace.jsonl"
    settings = ServerSettings(ctx_size=2048, lanes=4, queue_size=4, fast=True, api_keys=folder / "keys.txt",
                              trace_log=log)
    for server in run_server(engine, settings):
        yield server, log


def test_the_trace_log_names_tenants_never_keys(traced_server: tuple[LiveServer, Path]) -> None:
    server, log = traced_server
    text = prompt("the trace log")
    outs = [complete(server, key, text) for key in (ALICE, BOB, ALICE)]
    server.wait_idle()
    lines = [json.loads(line) for line in log.read_text().splitlines()]
    assert [line["tenant"] for line in lines[-3:]] == ["alice", "bob", "alice"]
    for line, out in zip(lines[-3:], outs, strict=True):
        assert line["input_length"] == out.usage.prompt_tokens
        assert line["output_length"] == out.usage.completion_tokens
        assert len(line["hash_ids"]) == -(-out.usage.prompt_tokens // 512)
    assert lines[-1]["hash_ids"] == lines[-2]["hash_ids"] == lines[-3]["hash_ids"]
    raw = log.read_text()
    assert all(key not in raw and hash_key(key) not in raw for key in (ALICE, BOB, CAROL, ROOT))
    assert "the trace log" not in raw and "quick brown fox" not in raw


def test_a_request_that_fails_unexpectedly_gives_its_tenants_slots_back(
        tenant_server: LiveServer, engine: Engine, monkeypatch: pytest.MonkeyPatch) -> None:
    """Any exception while a request's choices are submitted hands their slots back: one the server
    did not foresee (its 500) once kept them, and every later request of the tenant was a 429."""
    submit = engine.submit

    def fail_the_second(request, sink):
        if len(calls) == 1:
            calls.append(request)
            raise UnicodeEncodeError("utf-8", "\ud800", 0, 1, "surrogates not allowed")
        calls.append(request)
        return submit(request, sink)

    calls: list[object] = []
    monkeypatch.setattr(engine, "submit", fail_the_second)
    body = {"prompt": "slots", "max_tokens": 2, "n": TENANT_LIMIT}
    # The 500 is sent, then the exception ends the connection: either may reach the client first.
    with (tenant_server.http(headers={"Authorization": f"Bearer {BOB}"}, timeout=60) as http,
          contextlib.suppress(httpx.TransportError)):
        assert http.post("/v1/completions", json=body).status_code == 500
    assert len(calls) == 2
    monkeypatch.setattr(engine, "submit", submit)
    with tenant_server.http(headers={"Authorization": f"Bearer {BOB}"}, timeout=60) as http:
        for _ in range(2):
            answer = http.post("/v1/completions", json=body)
            assert answer.status_code == 200, answer.text
