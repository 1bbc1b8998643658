"""With an API key, /v1/* needs `Authorization: Bearer <key>`; /health and /metrics stay open."""

from __future__ import annotations

import openai
import pytest
from live_server import API_KEY, LiveServer

pytestmark = [pytest.mark.model, pytest.mark.timeout(120)]


@pytest.mark.parametrize(
    "headers",
    [{}, {"Authorization": "Bearer wrong"}, {"Authorization": API_KEY},
     {"Authorization": f"Basic {API_KEY}"}],
    ids=["no header", "wrong key", "no scheme", "basic scheme"],
)
@pytest.mark.parametrize(("method", "path"), [("GET", "/v1/models"), ("POST", "/v1/chat/completions"),
                                              ("GET", "/v1/cache")])
def test_missing_or_wrong_key_is_401(key_server: LiveServer, headers: dict, method: str, path: str) -> None:
    with key_server.http() as http:
        body = {"messages": [{"role": "user", "content": "x"}]}
        response = http.request(method, path, headers=headers, json=body)
    assert response.status_code == 401
    assert response.headers["WWW-Authenticate"] == "Bearer"
    error = response.json()["error"]
    assert error["code"] == "invalid_api_key" and error["type"] == "invalid_request_error"


def test_openai_client_with_the_key(key_server: LiveServer) -> None:
    client = key_server.openai(api_key=API_KEY)
    assert [m.id for m in client.models.list().data] == [key_server.model_id]
    out = client.chat.completions.create(model="skippy-cache", messages=[{"role": "user", "content": "Hi"}],
                                         max_tokens=2, temperature=0)
    assert out.usage.completion_tokens <= 2


def test_openai_client_with_a_wrong_key(key_server: LiveServer) -> None:
    with pytest.raises(openai.AuthenticationError):
        key_server.openai(api_key="nope").models.list()


def test_health_and_metrics_need_no_key(key_server: LiveServer) -> None:
    with key_server.http() as http:
        assert http.get("/health").status_code == 200
        assert http.get("/metrics").status_code == 200
