"""Fuzz the HTTP API from its own OpenAPI document (schemathesis) against a live server.

Every operation the document lists gets generated requests, valid by the
schema and not: whatever they hold, the answer is never a 5xx, and every
error is in the shape of the route's API (OpenAI's, or Anthropic's on /v1/messages). Generation is kept cheap: the document's
`max_tokens` is capped at 2 for the fuzzer, and chat requests that give none
get 2 (the server's `default_max_tokens`).
"""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from live_server import LiveServer, run_server
from schemathesis import GenerationMode

from skippy_cache.runtime import Engine
from skippy_cache.server import ServerSettings

pytestmark = [pytest.mark.model, pytest.mark.timeout(600)]

#: Requests per operation and mode.
EXAMPLES = 60
#: Tokens a fuzzed generation may ask for.
MAX_TOKENS = 2


@pytest.fixture(scope="module")
def fuzz_server(engine: Engine) -> Iterator[LiveServer]:
    settings_ = ServerSettings(ctx_size=engine.info.n_ctx, lanes=engine.info.lanes, queue_size=64,
                               default_max_tokens=MAX_TOKENS, fast=True)
    yield from run_server(engine, settings_)


def cap_generation(node: object) -> None:
    """Give every `max_tokens`-like property of the document a maximum, in place."""
    if isinstance(node, dict):
        props = node.get("properties")
        if isinstance(props, dict):
            for name in ("max_tokens", "max_completion_tokens", "max_output_tokens"):
                if name in props:
                    props[name] = {"anyOf": [{"type": "integer", "minimum": 1, "maximum": MAX_TOKENS},
                                             {"type": "null"}]}
        for value in node.values():
            cap_generation(value)
    elif isinstance(node, list):
        for value in node:
            cap_generation(value)


@pytest.fixture(scope="module")
def api_schema(fuzz_server: LiveServer) -> schemathesis.BaseSchema:
    document = httpx.get(f"{fuzz_server.url}/openapi.json", timeout=30).json()
    assert "requestBody" in document["paths"]["/v1/chat/completions"]["post"], "bodies must be documented"
    cap_generation(document)
    schema = schemathesis.openapi.from_dict(document)
    schema.config.update(base_url=fuzz_server.url, request_timeout=120)
    return schema


def check_answer(case: schemathesis.Case) -> None:
    response = case.call()
    where = f"{case.operation.label} {case.body!r:.300}"
    assert response.status_code < 500, f"{where}: {response.status_code} {response.text[:500]}"
    if response.status_code < 400:
        return
    body = response.json()
    if case.operation.path.startswith("/v1/messages"):
        # Anthropic's shape, which the anthropic client parses.
        assert set(body) == {"type", "error"} and body["type"] == "error", (where, body)
        assert set(body["error"]) == {"type", "message"} and body["error"]["message"], (where, body)
        assert body["error"]["type"] == "invalid_request_error", (where, body)
        return
    assert set(body) == {"error"}, (where, body)
    error = body["error"]
    assert set(error) == {"message", "type", "param", "code"}, (where, error)
    assert isinstance(error["message"], str) and error["message"], (where, error)
    assert error["type"] == "invalid_request_error", (where, error)
    assert error["param"] is None or isinstance(error["param"], str), (where, error)
    assert error["code"] is None or isinstance(error["code"], str), (where, error)


# schemathesis' pytest loaders (`parametrize`, `from_fixture`) do not run under this pytest
# (they set a node attribute pytest 9 no longer has); its strategies drive Hypothesis directly.
@pytest.mark.parametrize("mode", [GenerationMode.POSITIVE, GenerationMode.NEGATIVE])
def test_no_5xx_and_every_error_is_in_its_apis_shape(api_schema: schemathesis.BaseSchema,
                                                  mode: GenerationMode) -> None:
    operations = [result.ok() for result in api_schema.get_all_operations()]
    labels = {op.label for op in operations}
    assert {"POST /v1/completions", "POST /v1/chat/completions", "GET /v1/cache"} <= labels, labels
    for operation in operations:
        if mode is GenerationMode.NEGATIVE and not len(operation.body):
            # Nothing to get wrong: no parameters (GET /health), or a string in the path, which any value is.
            continue
        strategy = operation.as_strategy(generation_mode=mode)

        @given(case=strategy)
        @settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=list(HealthCheck),
                  derandomize=True, database=None)
        def fuzz(case: schemathesis.Case) -> None:
            check_answer(case)

        fuzz()


# -- generated JSON schemas, in response_format and in tools ----------------------------------------

#: Counts small, large and past anything a grammar could write out (llama.cpp's converter once
#: ended the process at 200,000), and negative and fractional ones no schema should hold.
_COUNTS = st.one_of(st.integers(0, 12), st.sampled_from([1000, 200_000, 50_000_000, 10**12]), st.integers(-3, -1),
                    st.just(2.5))
#: Regexes real schemas use, counted ones, impossible ones, and text that is no regex at all.
_PATTERNS = st.one_of(
    st.sampled_from(["^[a-z]+$", "^\\d{3}-\\d{4}$", "^a{1000000000}$", "^(a|aa)*b$", "^[^\\x00-\\U0010FFFF]$",
                     "(?=x)y", "^\\p{L}+$", "[", "a{5,2}"]),
    st.text(alphabet="ab()[]{}|*+?^$\\.,-0123456789", max_size=12))
_JSON_VALUES = st.recursive(st.none() | st.booleans() | st.integers(-10**6, 10**6) | st.text(max_size=8),
                            lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=4), inner,
                                                                                       max_size=3),
                            max_leaves=6)
_KEYS = st.text(alphabet="abcdefxyz_\u00e9\U0001f600\"\\", min_size=1, max_size=6)
_LEAVES = st.one_of(
    st.fixed_dictionaries({"type": st.just("string")}, optional={
        "minLength": _COUNTS, "maxLength": _COUNTS, "pattern": _PATTERNS,
        "format": st.sampled_from(["date-time", "date", "uri", "email", "uuid", "ipv4", "x-unknown"])}),
    st.fixed_dictionaries({"type": st.sampled_from(["integer", "number"])}, optional={
        "minimum": st.integers(-10**15, 10**15), "maximum": st.integers(-10**15, 10**15),
        "exclusiveMinimum": st.integers(-5, 5), "multipleOf": st.sampled_from([0, 1, 3, 0.5, -2])}),
    st.fixed_dictionaries({"type": st.sampled_from(["boolean", "null", "nothing", ["string", "integer"]])}),
    st.fixed_dictionaries({"enum": st.lists(_JSON_VALUES, max_size=12)}),
    st.fixed_dictionaries({"const": _JSON_VALUES}),
    st.sampled_from([{}, {"$ref": "#"}, {"$ref": "#/$defs/missing"}, {"$ref": "https://example.com/s.json"},
                     {"description": "anything at all"}]),
)
SCHEMAS = st.recursive(_LEAVES, lambda children: st.one_of(
    st.fixed_dictionaries({"type": st.just("array"), "items": children}, optional={
        "minItems": _COUNTS, "maxItems": _COUNTS, "uniqueItems": st.booleans(),
        "prefixItems": st.lists(children, max_size=3)}),
    st.fixed_dictionaries({"type": st.just("object"), "properties": st.dictionaries(_KEYS, children, max_size=4)},
                          optional={"required": st.lists(_KEYS, max_size=3),
                                    "additionalProperties": st.booleans() | children,
                                    "minProperties": _COUNTS, "maxProperties": _COUNTS}),
    st.sampled_from(["anyOf", "oneOf", "allOf"]).flatmap(
        lambda keyword: st.fixed_dictionaries({keyword: st.lists(children, min_size=1, max_size=3)})),
    st.fixed_dictionaries({"not": children}),
    st.fixed_dictionaries({"$defs": st.dictionaries(_KEYS, children, max_size=2), "$ref": st.just("#/$defs/a")}),
), max_leaves=10)


def _schema_body(schema: object, where: str) -> dict:
    messages = [{"role": "user", "content": "Answer in JSON."}]
    if where == "response_format":
        return {"messages": messages, "max_tokens": MAX_TOKENS, "response_format": {
            "type": "json_schema", "json_schema": {"name": "fuzzed", "schema": schema}}}
    return {"messages": messages, "max_tokens": MAX_TOKENS, "tool_choice": "required", "tools": [
        {"type": "function", "function": {"name": "fuzzed", "parameters": schema}}]}


@pytest.mark.parametrize("where", ["response_format", "tools"])
def test_generated_schemas_get_an_answer_or_a_400_naming_their_field(fuzz_server: LiveServer, where: str) -> None:
    """Whatever schema a tenant sends, it compiles within the grammar limits and is answered, or is
    a 400 naming where it was sent (or, passing the limits mid-output, a 400 of its own); never a
    5xx, and the server keeps answering /health between them."""
    with fuzz_server.http(timeout=120) as http, fuzz_server.http(timeout=30) as health:

        @given(schema=SCHEMAS)
        @settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=list(HealthCheck),
                  derandomize=True, database=None)
        def fuzz(schema: object) -> None:
            response = http.post("/v1/chat/completions", json=_schema_body(schema, where))
            assert response.status_code in (200, 400), (schema, response.status_code, response.text[:500])
            if response.status_code == 400:
                error = response.json()["error"]
                assert error["param"] in (where, None) and error["message"], (schema, error)
            assert health.get("/health").status_code == 200

        fuzz()


def test_the_server_is_idle_and_healthy_after_fuzzing(fuzz_server: LiveServer) -> None:
    fuzz_server.wait_idle()
    with fuzz_server.http(timeout=30) as http:
        assert http.get("/health").json()["status"] == "ok"
        audit = http.get("/v1/cache").json()["pool"]["audit"]
    assert (audit["lane_cells"], audit["unowned_cells"], audit["native_mismatches"]) == (0, 0, 0), audit
