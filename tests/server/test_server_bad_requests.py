"""Client mistakes get a 4xx with an OpenAI-shaped body naming the field; never a 500 or a hang."""

from __future__ import annotations

import json

import pytest
from live_server import LiveServer

pytestmark = [pytest.mark.model, pytest.mark.timeout(120)]

COMPLETIONS = "/v1/completions"
CHAT = "/v1/chat/completions"
USER = [{"role": "user", "content": "hi"}]
TOO_MANY_TOKENS = 4096  # the test context holds 2048

# (name, path, raw body, status, param, code or None for "any")
CASES = [
    ("malformed JSON", COMPLETIONS, '{"prompt": "x", ', 400, None, "invalid_json"),
    ("body not an object", COMPLETIONS, "[1, 2]", 400, None, "invalid_json"),
    ("empty body", CHAT, "", 400, None, "invalid_json"),
    ("missing prompt", COMPLETIONS, {"max_tokens": 4}, 400, "prompt", "missing_required_parameter"),
    ("missing messages", CHAT, {"max_tokens": 4}, 400, "messages", "missing_required_parameter"),
    ("empty messages", CHAT, {"messages": []}, 400, "messages", None),
    ("prompt is a number", COMPLETIONS, {"prompt": 42}, 400, "prompt", None),
    ("prompt batch of two", COMPLETIONS, {"prompt": ["a", "b"]}, 400, "prompt", None),
    ("prompt mixes ids and text", COMPLETIONS, {"prompt": [1, "a"]}, 400, "prompt", None),
    ("empty prompt", COMPLETIONS, {"prompt": ""}, 400, "prompt", None),
    ("empty token list", COMPLETIONS, {"prompt": []}, 400, "prompt", None),
    ("max_tokens is a string", COMPLETIONS, {"prompt": "x", "max_tokens": "8"}, 400, "max_tokens",
     "invalid_type"),
    ("temperature is a string", COMPLETIONS, {"prompt": "x", "temperature": "hot"}, 400, "temperature", None),
    ("temperature out of range", COMPLETIONS, {"prompt": "x", "temperature": 3.5}, 400, "temperature", None),
    ("stream is a string", CHAT, {"messages": USER, "stream": "yes"}, 400, "stream", "invalid_type"),
    ("message content is a number", CHAT, {"messages": [{"role": "user", "content": 5}]}, 400,
     "messages[0].content", None),
    ("unknown role", CHAT, {"messages": [{"role": "wizard", "content": "x"}]}, 400, "messages[0].role", None),
    ("image part", CHAT,
     {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]}, 400,
     "messages[0].content", None),
    ("unknown model", COMPLETIONS, {"prompt": "x", "model": "gpt-4o"}, 404, "model", "model_not_found"),
    ("unknown model (chat)", CHAT, {"messages": USER, "model": "nope"}, 404, "model", "model_not_found"),
    ("n > 1", COMPLETIONS, {"prompt": "x", "n": 2}, 400, "n", None),
    ("negative max_tokens", COMPLETIONS, {"prompt": "x", "max_tokens": -5}, 400, "max_tokens", None),
    ("zero max_completion_tokens", CHAT, {"messages": USER, "max_completion_tokens": 0}, 400,
     "max_completion_tokens", None),
    ("prompt + max_tokens beyond the context", COMPLETIONS, {"prompt": "x", "max_tokens": TOO_MANY_TOKENS},
     400, "max_tokens", "context_length_exceeded"),
    ("chat + max_tokens beyond the context", CHAT, {"messages": USER, "max_tokens": TOO_MANY_TOKENS}, 400,
     "max_tokens", "context_length_exceeded"),
    ("prompt alone beyond the context", COMPLETIONS, {"prompt": [1] * 2100}, 400, "prompt",
     "context_length_exceeded"),
    ("token id out of vocabulary", COMPLETIONS, {"prompt": [1, 10**9]}, 400, "prompt", None),
    ("negative token id", COMPLETIONS, {"prompt": [-3]}, 400, "prompt", None),
    ("stop list too long", COMPLETIONS, {"prompt": "x", "stop": ["a", "b", "c", "d", "e"]}, 400, "stop",
     None),
    ("stop of wrong type", COMPLETIONS, {"prompt": "x", "stop": 7}, 400, "stop", None),
    ("empty cache_salt", COMPLETIONS, {"prompt": "x", "cache_salt": ""}, 400, "cache_salt", None),
    ("stream_options wrong type", CHAT, {"messages": USER, "stream_options": {"include_usage": "y"}}, 400,
     "stream_options.include_usage", None),
]


@pytest.mark.parametrize(("name", "path", "body", "status", "param", "code"), CASES,
                         ids=[c[0] for c in CASES])
def test_bad_request(server: LiveServer, name: str, path: str, body: object, status: int, param: str | None,
                     code: str | None) -> None:
    raw = body if isinstance(body, str) else json.dumps(body)
    with server.http(timeout=30) as http:
        response = http.post(path, content=raw, headers={"Content-Type": "application/json"})
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["type"] == "invalid_request_error"
    assert error["param"] == param
    assert error["message"]
    if code is not None:
        assert error["code"] == code


def test_unknown_route_and_method_are_openai_shaped(server: LiveServer) -> None:
    with server.http(timeout=30) as http:
        missing = http.get("/v1/nothing-here")
        wrong_method = http.get(COMPLETIONS)
    assert missing.status_code == 404 and missing.json()["error"]["code"] == "not_found"
    assert wrong_method.status_code == 405 and "error" in wrong_method.json()


def test_extra_openai_fields_are_ignored(server: LiveServer) -> None:
    body = {"prompt": "Hi", "max_tokens": 1, "presence_penalty": 0.5, "logit_bias": {}, "user": "u-1"}
    with server.http(timeout=60) as http:
        response = http.post(COMPLETIONS, json=body)
    assert response.status_code == 200, response.text


def test_healthy_after_bad_requests(server: LiveServer) -> None:
    with server.http(timeout=30) as http:
        for _name, path, body, *_ in CASES:
            http.post(path, content=body if isinstance(body, str) else json.dumps(body))
        health = http.get("/health")
    assert health.status_code == 200 and health.json()["status"] == "ok"
    out = server.openai().completions.create(model=server.model_id, prompt="One, two,", max_tokens=2,
                                             temperature=0)
    assert out.choices[0].finish_reason in ("stop", "length")
    server.wait_idle()
