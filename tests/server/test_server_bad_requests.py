"""Client mistakes get a 4xx with an OpenAI-shaped body naming the field; never a 500 or a hang."""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor

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
    # The server's queue holds 4 (conftest.QUEUE): a fifth choice could never be queued, idle or not.
    ("more choices than the queue holds", CHAT, {"messages": USER, "n": 5, "max_tokens": 1}, 400, "n",
     "invalid_value"),
    ("more completions than the queue holds", COMPLETIONS, {"prompt": "x", "n": 5, "max_tokens": 1}, 400, "n",
     "invalid_value"),
    ("stream is a string", CHAT, {"messages": USER, "stream": "yes"}, 400, "stream", "invalid_type"),
    ("message content is a number", CHAT, {"messages": [{"role": "user", "content": 5}]}, 400,
     "messages[0].content", None),
    ("unknown role", CHAT, {"messages": [{"role": "wizard", "content": "x"}]}, 400, "messages[0].role", None),
    ("image part", CHAT,
     {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]}, 400,
     "messages[0].content", None),
    ("unknown field", COMPLETIONS, {"prompt": "x", "max_tokens": 1, "frobnicate": 1}, 400, "frobnicate",
     "unknown_parameter"),
    ("misspelt field", CHAT, {"messages": USER, "max_token": 1}, 400, "max_token", "unknown_parameter"),
    ("unknown field in a message", CHAT, {"messages": [{"role": "user", "content": "x", "mood": "calm"}]}, 400,
     "messages[0].mood", "unknown_parameter"),
    ("unknown field in cache", COMPLETIONS, {"prompt": "x", "cache": {"lookup": True, "keep": 1}}, 400,
     "cache.keep", "unknown_parameter"),
    ("a tool that is not a function", CHAT, {"messages": USER, "tools": [{"type": "web_search"}]}, 400,
     "tools[0].type", None),
    ("tool_choice required without tools", CHAT, {"messages": USER, "tool_choice": "required"}, 400,
     "tool_choice", None),
    ("a legacy function_call naming no function", CHAT,
     {"messages": USER, "functions": [{"name": "f"}], "function_call": {"name": "g"}}, 400, "function_call", None),
    ("tools and the legacy functions together", CHAT,
     {"messages": USER, "functions": [{"name": "f"}], "tools": [{"type": "function", "function": {"name": "g"}}]},
     400, None, None),
    ("reasoning_effort", CHAT, {"messages": USER, "reasoning_effort": "low"}, 400, "reasoning_effort",
     "unsupported_parameter"),
    ("audio modality", CHAT, {"messages": USER, "modalities": ["text", "audio"]}, 400, "modalities[1]", None),
    ("a tool call in the history without its function", CHAT,
     {"messages": [*USER, {"role": "assistant", "tool_calls": [{"id": "1", "type": "function"}]}]}, 400,
     "messages[1].tool_calls[0].function", "missing_required_parameter"),
    ("suffix", COMPLETIONS, {"prompt": "x", "suffix": "end"}, 400, "suffix", "unsupported_parameter"),
    ("best_of > 1", COMPLETIONS, {"prompt": "x", "best_of": 3}, 400, "best_of", "unsupported_parameter"),
    ("n above the limit", COMPLETIONS, {"prompt": "x", "n": 17}, 400, "n", None),
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
    # echo renders the prompt's tokens: an id outside the vocabulary once aborted the process there.
    ("echo of a token id out of vocabulary", COMPLETIONS, {"prompt": [1, 10**9], "echo": True}, 400, "prompt",
     None),
    ("echo of a negative token id", COMPLETIONS, {"prompt": [-3], "echo": True}, 400, "prompt", None),
    ("stop list too long", COMPLETIONS, {"prompt": "x", "stop": ["a", "b", "c", "d", "e"]}, 400, "stop",
     None),
    ("stop of wrong type", COMPLETIONS, {"prompt": "x", "stop": 7}, 400, "stop", None),
    ("empty cache_salt", COMPLETIONS, {"prompt": "x", "cache_salt": ""}, 400, "cache_salt", None),
    ("JSON nested 100,000 deep", COMPLETIONS, '{"prompt": ' + "[" * 100_000 + "]" * 100_000 + "}", 400, None,
     "invalid_json"),
    ("a lone surrogate in a message", CHAT, '{"messages": [{"role": "user", "content": "a\\ud800b"}]}', 400, None,
     "invalid_json"),
    ("a lone surrogate in a prompt", COMPLETIONS, '{"prompt": "x\\udc00"}', 400, None, "invalid_json"),
    ("a logit_bias key that is a superscript digit", COMPLETIONS, {"prompt": "x", "logit_bias": {"\u00b2": 1}},
     400, "logit_bias", None),
    ("a logit_bias key of 5,000 digits", COMPLETIONS, {"prompt": "x", "logit_bias": {"9" * 5000: 1}}, 400,
     "logit_bias", None),
    ("a schema past the grammar limits (an enum of 100,000 values)", CHAT,
     {"messages": USER, "response_format": {"type": "json_schema", "json_schema": {
         "name": "s", "schema": {"enum": [f"v{i}" for i in range(100_000)]}}}}, 400, "response_format", None),
    ("a schema that admits nothing", CHAT,
     {"messages": USER, "response_format": {"type": "json_schema", "json_schema": {
         "name": "s", "schema": {"type": "string", "pattern": "^[^\\x00-\\U0010FFFF]$"}}}}, 400, "response_format",
     None),
    # Compiles, then its first token's mask passes the grammar limits: that request ends, a 400.
    ("a schema pattern repeated 10**9 times", CHAT,
     {"messages": USER, "response_format": {"type": "json_schema", "json_schema": {
         "name": "s", "schema": {"type": "string", "pattern": "^a{1000000000}$"}}}}, 400, None, "invalid_value"),
    ("a tool schema that admits nothing", CHAT,
     {"messages": USER, "tool_choice": "auto", "tools": [{"type": "function", "function": {
         "name": "f", "parameters": {"allOf": [{"type": "string"}, {"type": "integer"}]}}}]}, 400, "tools", None),
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


def test_an_unknown_field_is_named_in_the_message(server: LiveServer) -> None:
    with server.http(timeout=30) as http:
        response = http.post(CHAT, json={"messages": USER, "max_tokens": 1, "temprature": 0})
    assert response.status_code == 400
    assert response.json()["error"]["message"] == "unknown field 'temprature'"


def test_unsupported_fields_with_a_value_that_asks_for_nothing_are_accepted(server: LiveServer) -> None:
    chat = {"messages": [*USER, {"role": "assistant", "content": "hello", "tool_calls": [], "refusal": None}],
            "max_tokens": 1, "tools": [], "tool_choice": "none", "audio": None}
    completion = {"prompt": "Hi", "max_tokens": 1, "suffix": "", "best_of": 1}
    with server.http(timeout=60) as http:
        assert http.post(CHAT, json=chat).status_code == 200
        assert http.post(COMPLETIONS, json=completion).status_code == 200


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


@pytest.mark.parametrize("path", [CHAT, "/v1/messages", "/v1/responses"], ids=["chat", "messages", "responses"])
@pytest.mark.parametrize("raw", [
    '{"model": "m", "max_tokens": 4, "input": ' + "[" * 100_000 + "]" * 100_000 + "}",
    '{"model": "m", "max_tokens": 4, "messages": [{"role": "user", "content": "a\\ud800b"}], "input": "a\\udfffb"}',
], ids=["nested-100000-deep", "lone-surrogate"])
def test_a_body_no_api_can_read_is_a_400_in_each_apis_shape(server: LiveServer, path: str, raw: str) -> None:
    with server.http(timeout=30) as http:
        response = http.post(path, content=raw, headers={"Content-Type": "application/json"})
    assert response.status_code == 400, response.text
    body = response.json()
    if path == "/v1/messages":
        assert body["type"] == "error" and body["error"]["type"] == "invalid_request_error", body
    else:
        assert body["error"]["type"] == "invalid_request_error" and body["error"]["code"] == "invalid_json", body


#: Counts llama.cpp's grammar wrote out rule by rule: at 200,000 its parser overflowed the stack and
#: ended the process; 50,000,000 took 10 s and 2.4 GB. Compiled within limits now, they are answered.
EXPANDING = [
    ("a schema string of 200,000 characters at most", CHAT,
     {"messages": USER, "response_format": {"type": "json_schema", "json_schema": {
         "name": "s", "schema": {"type": "string", "maxLength": 200_000}}}}),
    ("a schema string of 50,000,000 characters at least", COMPLETIONS,
     {"prompt": "x", "response_format": {"type": "json_schema", "json_schema": {
         "name": "s", "schema": {"type": "string", "minLength": 50_000_000}}}}),
    ("a tool parameter of 200,000 items at most", CHAT,
     {"messages": USER, "tool_choice": "required", "tools": [{"type": "function", "function": {
         "name": "f", "parameters": {"type": "object", "properties": {
             "xs": {"type": "array", "items": {"type": "integer"}, "maxItems": 200_000}}}}}]}),
    ("a schema that holds itself", CHAT,
     {"messages": USER, "response_format": {"type": "json_schema", "json_schema": {
         "name": "s", "schema": {"type": "array", "items": {"$ref": "#"}, "minItems": 100_000}}}}),
]


@pytest.mark.parametrize(("name", "path", "body"), EXPANDING, ids=[c[0] for c in EXPANDING])
def test_schemas_that_expanded_llama_cpps_grammar_are_answered(server: LiveServer, name: str, path: str,
                                                               body: dict) -> None:
    with server.http(timeout=60) as http:
        response = http.post(path, json={**body, "max_tokens": 6})
        assert response.status_code == 200, response.text
        choice = response.json()["choices"][0]
        # Six tokens cannot reach a lower bound; an upper bound allows closing early, and then
        # what came back must be the JSON the schema asks for.
        if choice["finish_reason"] == "tool_calls":
            assert name.endswith("at most"), choice
            for call in choice["message"]["tool_calls"]:
                assert isinstance(json.loads(call["function"]["arguments"])["xs"], list), choice
        elif choice["finish_reason"] != "length":
            assert name.endswith("at most") and choice["finish_reason"] == "stop", choice
            assert isinstance(json.loads(choice["message"]["content"]), str), choice
        assert http.get("/health").status_code == 200


HOSTILE = [
    (CHAT, json.dumps({"messages": USER, "max_tokens": 8, "response_format": {"type": "json_schema", "json_schema": {
        "name": "s", "schema": {"enum": [f"v{i}" for i in range(100_000)]}}}})),
    (CHAT, json.dumps({"messages": USER, "max_tokens": 8, "response_format": {"type": "json_schema", "json_schema": {
        "name": "s", "schema": {"type": "string", "pattern": "^[^\\x00-\\U0010FFFF]$"}}}})),
    (COMPLETIONS, '{"prompt": ' + "[" * 100_000 + "]" * 100_000 + "}"),
    (CHAT, '{"messages": [{"role": "user", "content": "a\\ud800b"}]}'),
    (COMPLETIONS, '{"prompt": "x", '),
    # Compiles, then passes the grammar limits on its first token: its own lane ends, a 400.
    (CHAT, json.dumps({"messages": USER, "max_tokens": 8, "response_format": {"type": "json_schema", "json_schema": {
        "name": "s", "schema": {"type": "string", "pattern": "^a{1000000000}$"}}}})),
    # The same in tools: a huge enum, a schema that admits nothing, a runaway pattern under required.
    (CHAT, json.dumps({"messages": USER, "max_tokens": 8, "tool_choice": "auto", "tools": [
        {"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {
            "x": {"enum": [f"v{i}" for i in range(100_000)]}}}}}]})),
    (CHAT, json.dumps({"messages": USER, "max_tokens": 8, "tools": [{"type": "function", "function": {
        "name": "f", "parameters": {"allOf": [{"type": "string"}, {"type": "integer"}]}}}]})),
    # (max_tokens past the call's fixed opening, where the pattern starts)
    (CHAT, json.dumps({"messages": USER, "max_tokens": 48, "tool_choice": "required", "tools": [
        {"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {
            "x": {"type": "string", "pattern": "^a{1000000000}$"}}, "required": ["x"]}}}]})),
]


def test_hostile_requests_leave_a_stream_beside_them_untouched(exact_server: LiveServer) -> None:
    """While one request streams, another client sends each hostile body above: each gets a 4xx
    (the impossible grammar too: its own request ends, a 400), and the stream's text is what it is
    alone."""
    # Exact mode: the second stream's hit gives the first one's text bit for bit, whatever runs beside it.
    body = {"model": "m", "prompt": "Once upon a time", "max_tokens": 48, "temperature": 0, "stream": True}

    def streamed(http) -> str:
        text = ""
        with http.stream("POST", COMPLETIONS, json=body) as response:
            assert response.status_code == 200, response.read()
            for line in response.iter_lines():
                if line.startswith("data: {"):
                    text += json.loads(line[6:])["choices"][0]["text"]
        return text

    with exact_server.http(timeout=120) as http:
        alone = streamed(http)
        statuses: list[int] = []
        with ThreadPoolExecutor(1) as pool:
            beside = pool.submit(streamed, exact_server.http(timeout=120))
            with exact_server.http(timeout=60) as hostile:
                for path, raw in HOSTILE:
                    answer = hostile.post(path, content=raw, headers={"Content-Type": "application/json"})
                    statuses.append(answer.status_code)
                    assert hostile.get("/health").status_code == 200
            assert beside.result(timeout=120) == alone
        assert all(400 <= s < 500 for s in statuses), list(zip(statuses, [raw[:160] for _, raw in HOSTILE], strict=True))
        assert http.get("/health").status_code == 200
