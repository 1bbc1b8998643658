"""What a request may send: the fields the official client sends, model names, and the request limits."""

from __future__ import annotations

import json
import logging
from collections.abc import Iterator

import httpx
import openai
import pytest
from live_server import LiveServer, run_server

from skippy_cache.runtime import Engine
from skippy_cache.server import ServerSettings
from skippy_cache.server.modelnames import MAX_LOGGED_NAMES, ModelNames

pytestmark = [pytest.mark.model, pytest.mark.timeout(300)]

COMPLETIONS = "/v1/completions"
CHAT = "/v1/chat/completions"
USER = [{"role": "user", "content": "hi"}]
MIB = 1024 * 1024
PROMPT_CAP = 64


@pytest.fixture(scope="module")
def limited(engine: Engine) -> Iterator[LiveServer]:
    """The session's engine behind an app with small limits and strict model names."""
    settings = ServerSettings(ctx_size=engine.info.n_ctx, lanes=engine.info.lanes, max_body_mib=1,
                              max_prompt_tokens=PROMPT_CAP, max_stop=2, max_stop_chars=8, max_messages=3,
                              strict_model_names=True, fast=True)
    yield from run_server(engine, settings)


def assert_openai_error(response: httpx.Response, status: int, code: str | None, param: str | None) -> dict:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["type"] == "invalid_request_error" and error["message"]
    assert (error["code"], error["param"]) == (code, param)
    return error


# -- what clients send ---------------------------------------------------------


def test_fields_the_official_client_sends_are_accepted(server: LiveServer) -> None:
    client = server.openai()
    chat = client.chat.completions.create(
        model="gpt-4o-mini", messages=USER, max_completion_tokens=2, temperature=0, user="u-1",
        metadata={"app": "test"}, store=False, service_tier="auto", safety_identifier="s-1",
        prompt_cache_key="k-1", parallel_tool_calls=False, modalities=["text"],
        stream_options=None,
    )
    assert chat.choices[0].finish_reason in ("stop", "length")
    stream = client.chat.completions.create(
        model="gpt-4o-mini", messages=USER, max_tokens=2, temperature=0, stream=True,
        stream_options={"include_usage": True, "include_obfuscation": False},
    )
    chunks = list(stream)
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens >= 1
    completion = client.completions.create(model="gpt-3.5-turbo-instruct", prompt="One,", max_tokens=2,
                                           temperature=0, user="u-1")
    assert completion.choices[0].finish_reason in ("stop", "length")


def test_an_unsupported_field_from_the_client_is_a_400_naming_it(server: LiveServer) -> None:
    prediction = {"type": "content", "content": "Hello"}  # predicted output: not done here
    with pytest.raises(openai.BadRequestError) as err:
        server.openai().chat.completions.create(model=server.model_id, messages=USER, prediction=prediction)
    assert err.value.body["param"] == "prediction" and err.value.body["code"] == "unsupported_parameter"
    assert "'prediction'" in err.value.body["message"]


# -- model names ---------------------------------------------------------------


def test_any_model_name_is_served_and_reported_as_ours(server: LiveServer) -> None:
    reply = server.openai().chat.completions.create(model="gpt-4o-mini", messages=USER, max_tokens=1)
    assert reply.model == server.model_id
    card = server.openai().models.retrieve("gpt-4o-mini")
    assert card.id == server.model_id


def test_an_unknown_model_name_is_logged_once(server: LiveServer, caplog: pytest.LogCaptureFixture) -> None:
    name = "logged-once-model"
    with caplog.at_level(logging.INFO, logger="skippy_cache.server"), server.http(timeout=60) as http:
        for _ in range(3):
            reply = http.post(COMPLETIONS, json={"model": name, "prompt": "x", "max_tokens": 1})
            assert reply.status_code == 200, reply.text
    lines = [r.getMessage() for r in caplog.records if name in r.getMessage()]
    assert len(lines) == 1 and "--strict-model-names" in lines[0]


def test_unknown_model_names_logged_are_bounded(caplog: pytest.LogCaptureFixture) -> None:
    models = ModelNames("the-model", "alias", strict=False)
    with caplog.at_level(logging.INFO, logger="skippy_cache.server"):
        for _ in range(2):
            for i in range(MAX_LOGGED_NAMES + 20):
                models.check(f"name-{i}")
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == MAX_LOGGED_NAMES + 1
    assert "no longer logging" in lines[-1]
    assert len(models._logged) == MAX_LOGGED_NAMES + 1


def test_strict_model_names_refuse_other_names(limited: LiveServer) -> None:
    with limited.http(timeout=60) as http:
        for path, body in ((COMPLETIONS, {"prompt": "x", "model": "gpt-4o"}),
                           (CHAT, {"messages": USER, "model": "nope"})):
            assert_openai_error(http.post(path, json=body), 404, "model_not_found", "model")
        assert http.get("/v1/models/gpt-4o").status_code == 404
        for name in (limited.model_id, limited.settings.model_alias):
            reply = http.post(COMPLETIONS, json={"prompt": "x", "model": name, "max_tokens": 1})
            assert reply.status_code == 200, reply.text
            assert reply.json()["model"] == limited.model_id


# -- limits --------------------------------------------------------------------


def test_a_body_past_the_limit_is_a_413_before_parsing(limited: LiveServer) -> None:
    big = json.dumps({"prompt": "x" * (MIB + 10), "max_tokens": 1}).encode()
    with limited.http(timeout=60) as http:
        error = assert_openai_error(http.post(COMPLETIONS, content=big,
                                              headers={"Content-Type": "application/json"}),
                                    413, "request_too_large", None)
        assert "--max-body-mib" in error["message"]
        # Not even JSON: refused on its size, not its syntax.
        assert_openai_error(http.post(CHAT, content=b"{" * (MIB + 1)), 413, "request_too_large", None)


def test_a_chunked_body_past_the_limit_is_a_413(limited: LiveServer) -> None:
    def chunks() -> Iterator[bytes]:
        # No Content-Length: the server can only count as the chunks come.
        yield b'{"prompt": "'
        for _ in range(20):
            yield b"y" * (64 * 1024)
        yield b'", "max_tokens": 1}'

    with limited.http(timeout=60) as http:
        response = http.post(COMPLETIONS, content=chunks(), headers={"Content-Type": "application/json"})
        assert "content-length" not in response.request.headers
        assert_openai_error(response, 413, "request_too_large", None)


def test_a_chunked_body_under_the_limit_is_served(limited: LiveServer) -> None:
    def chunks() -> Iterator[bytes]:
        yield b'{"prompt": "One, two,'
        yield b' three,", "max_tokens": 1}'

    with limited.http(timeout=60) as http:
        response = http.post(COMPLETIONS, content=chunks(), headers={"Content-Type": "application/json"})
    assert response.status_code == 200, response.text


def test_the_default_body_limit_takes_a_large_prompt(server: LiveServer) -> None:
    # 2 MiB of token ids (over the 1 MiB of the limited server, under the default 8 MiB):
    # the body is taken, and the prompt is refused on its length.
    body = json.dumps({"prompt": [1] * (3 * MIB // 4), "max_tokens": 1})
    assert len(body) > 2 * MIB
    with server.http(timeout=60) as http:
        response = http.post(COMPLETIONS, content=body, headers={"Content-Type": "application/json"})
    assert_openai_error(response, 400, "context_length_exceeded", "prompt")


def test_prompt_tokens_past_the_cap(limited: LiveServer) -> None:
    with limited.http(timeout=60) as http:
        error = assert_openai_error(http.post(COMPLETIONS, json={"prompt": [1] * (PROMPT_CAP + 1)}), 400,
                                    "context_length_exceeded", "prompt")
        assert f"at most {PROMPT_CAP}" in error["message"] and "--max-prompt-tokens" in error["message"]
        long_chat = [{"role": "user", "content": "word " * (2 * PROMPT_CAP)}]
        assert_openai_error(http.post(CHAT, json={"messages": long_chat}), 400, "context_length_exceeded",
                            "messages")
        ok = http.post(COMPLETIONS, json={"prompt": [1] * PROMPT_CAP, "max_tokens": 1})
        assert ok.status_code == 200, ok.text


def test_a_prompt_past_the_context_is_context_length_exceeded(server: LiveServer) -> None:
    n_ctx = server.engine.info.n_ctx
    with server.http(timeout=60) as http:
        error = assert_openai_error(http.post(COMPLETIONS, json={"prompt": [1] * (n_ctx + 1)}), 400,
                                    "context_length_exceeded", "prompt")
    assert str(n_ctx) in error["message"]


def test_stop_strings_past_the_limits(limited: LiveServer) -> None:
    with limited.http(timeout=60) as http:
        error = assert_openai_error(http.post(COMPLETIONS, json={"prompt": "x", "stop": ["a", "b", "c"]}), 400,
                                    "invalid_value", "stop")
        assert "--max-stop" in error["message"]
        error = assert_openai_error(http.post(CHAT, json={"messages": USER, "stop": "123456789"}), 400,
                                    "invalid_value", "stop")
        assert "--max-stop-chars" in error["message"]
        ok = http.post(COMPLETIONS, json={"prompt": "x", "stop": ["12345678", "b"], "max_tokens": 1})
        assert ok.status_code == 200, ok.text


def test_the_default_stop_limits(server: LiveServer) -> None:
    with server.http(timeout=60) as http:
        assert_openai_error(http.post(COMPLETIONS, json={"prompt": "x", "stop": ["a"] * 5}), 400,
                            "invalid_value", "stop")
        assert_openai_error(http.post(COMPLETIONS, json={"prompt": "x", "stop": "s" * 257}), 400,
                            "invalid_value", "stop")
        ok = http.post(COMPLETIONS, json={"prompt": "x", "stop": ["s" * 256] * 4, "max_tokens": 1})
        assert ok.status_code == 200, ok.text


def test_messages_past_the_limit(limited: LiveServer) -> None:
    four = [{"role": "user", "content": str(i)} for i in range(4)]
    with limited.http(timeout=60) as http:
        error = assert_openai_error(http.post(CHAT, json={"messages": four}), 400, "invalid_value", "messages")
        assert "--max-messages" in error["message"]
        explain = http.post("/v1/cache/explain", json={"messages": four})
        assert_openai_error(explain, 400, "invalid_value", "messages")
        ok = http.post(CHAT, json={"messages": four[:3], "max_tokens": 1})
        assert ok.status_code == 200, ok.text


def test_limits_are_counted_and_leave_the_server_healthy(limited: LiveServer) -> None:
    with limited.http(timeout=60) as http:
        http.post(COMPLETIONS, content=b"x" * (MIB + 1))
        metrics = limited.metrics()
        assert metrics[("skippy_requests_total", (("endpoint", COMPLETIONS), ("status", "413")))] >= 1
        assert http.get("/health").json()["status"] == "ok"
    limited.wait_idle()
