"""API keys, rate limits, the queue bound, the body limit and the last-resort handler, through
the real app in process: the engine is scripted at the `AsyncLLM` boundary (as in the chat
tests) and the limiter runs on a clock the test moves, so every figure is exact. The same
behaviour against a real `met serve` is in test_security_server.py."""

from __future__ import annotations

import json
import logging

import anthropic
import openai
import pytest
from fastapi.testclient import TestClient

from metrale.engine_args import EngineArgs
from metrale.server.anthropic import messages as anthropic_messages
from metrale.server.app import build_app
from metrale.server.security.config import SecurityConfig
from metrale.server.security.guard import Guard
from metrale.server.state import ServerSettings, ServerState
from metrale.tokenizer import Tokenizer
from tests.server.test_tools_and_reasoning import ScriptedLLM

KEYS = ("sk-first", "sk-second")
USER = [{"role": "user", "content": "hi"}]
CHAT = {"model": "m", "messages": USER, "max_tokens": 20}
MESSAGE = {"model": "m", "max_tokens": 20, "messages": USER}


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


class QueueingLLM(ScriptedLLM):
    """A scripted engine that says how many requests wait (the queue bound reads it)."""

    num_waiting = 0


@pytest.fixture(scope="module")
def base(qwen3_dir):
    config = EngineArgs(
        model_from_path=str(qwen3_dir), device="cpu", max_seq_len=512
    ).create_config()
    return config, Tokenizer.from_dir(qwen3_dir)


@pytest.fixture
def make(base):
    """(engine, clock, client) for a server with these security settings."""
    config, tokenizer = base

    def build(text="one two three four five", **security):
        engine, clock = QueueingLLM(text, piece_len=5), Clock()
        state = ServerState(
            engine,
            tokenizer,
            config,
            ServerSettings(served_model_name="m"),
            serve_config={"server": {}},
            guard=Guard(SecurityConfig(**security), clock=clock),
        )
        return engine, clock, TestClient(build_app(state), raise_server_exceptions=False)

    return build


def bearer(key):
    return {"authorization": f"Bearer {key}"}


# --- API keys ---------------------------------------------------------------------------------


def test_a_missing_or_wrong_key_is_401_in_each_api_s_shape(make):
    _, _, http = make(api_keys=KEYS)
    for headers in (
        {},
        bearer("sk-wrong"),
        bearer("sk-first-but-longer"),
        {"authorization": "sk-first"},
    ):
        response = http.post("/v1/chat/completions", json=CHAT, headers=headers)
        assert response.status_code == 401, response.text
        assert response.json()["error"]["type"] == "invalid_request_error"
        assert response.json()["error"]["code"] == "invalid_api_key"
        response = http.post("/v1/messages", json=MESSAGE, headers=headers)
        assert response.status_code == 401
        assert response.json() == {
            "type": "error",
            "error": {
                "type": "authentication_error",
                "message": response.json()["error"]["message"],
            },
        }
    for key in KEYS:
        assert http.post("/v1/chat/completions", json=CHAT, headers=bearer(key)).status_code == 200


def test_keys_guard_every_v1_path_before_routing(make):
    _, _, http = make(api_keys=KEYS)
    for method, path in [
        ("GET", "/v1/models"),
        ("GET", "/v1/no-such-route"),
        ("POST", "/v1/embeddings"),
        ("POST", "/v1/messages/count_tokens"),
        ("GET", "/v1"),
    ]:
        response = http.request(method, path)
        assert response.status_code == 401, (path, response.text)
    assert http.get("/v1/no-such-route", headers=bearer("sk-first")).status_code == 404
    # without --require-auth the operator routes and /tokenize stay open
    assert http.get("/health").status_code == 200
    assert http.post("/tokenize", json={"prompt": "x"}).status_code == 200
    assert http.get("/serve-config").status_code == 200


def test_require_auth_gates_the_operator_routes_but_not_health(make):
    _, _, http = make(api_keys=KEYS, require_auth=True)
    for method, path in [
        ("POST", "/tokenize"),
        ("POST", "/detokenize"),
        ("GET", "/serve-config"),
        ("GET", "/hardware"),
        ("GET", "/memory"),
        ("GET", "/metrics"),
        ("GET", "/no-such-route"),
    ]:
        assert http.request(method, path).status_code == 401, path
    assert (
        http.post("/tokenize", json={"prompt": "x"}, headers=bearer("sk-second")).status_code == 200
    )
    assert http.get("/health").status_code == 200
    assert http.get("/health/live").status_code == 200
    with pytest.raises(ValueError, match="at least one API key"):
        SecurityConfig(require_auth=True)


def test_x_api_key_is_read_on_anthropic_routes_only(make):
    _, _, http = make(api_keys=KEYS)
    assert (
        http.post("/v1/messages", json=MESSAGE, headers={"x-api-key": "sk-first"}).status_code
        == 200
    )
    assert (
        http.post("/v1/chat/completions", json=CHAT, headers={"x-api-key": "sk-first"}).status_code
        == 401
    )


def test_the_official_sdks_see_an_authentication_error(make):
    _, _, http = make(api_keys=KEYS)
    good = openai.OpenAI(base_url="http://testserver/v1", api_key="sk-first", http_client=http)
    assert good.chat.completions.create(model="m", messages=USER).choices[0].message.content
    bad = openai.OpenAI(
        base_url="http://testserver/v1", api_key="sk-nope", http_client=http, max_retries=0
    )
    with pytest.raises(openai.AuthenticationError) as raised:
        bad.chat.completions.create(model="m", messages=USER)
    assert raised.value.code == "invalid_api_key"
    claude = anthropic.Anthropic(
        base_url="http://testserver", api_key="sk-second", http_client=http, max_retries=0
    )
    assert claude.messages.create(model="m", max_tokens=20, messages=USER).content
    wrong = anthropic.Anthropic(
        base_url="http://testserver", api_key="sk-nope", http_client=http, max_retries=0
    )
    with pytest.raises(anthropic.AuthenticationError):
        wrong.messages.create(model="m", max_tokens=20, messages=USER)


def test_keys_are_never_logged_nor_reported(make, caplog):
    _, _, http = make(api_keys=KEYS)
    caplog.set_level(logging.DEBUG)
    http.post("/v1/chat/completions", json=CHAT, headers=bearer("sk-first"))
    http.post("/v1/chat/completions", json=CHAT, headers=bearer("sk-guess"))
    config = SecurityConfig(api_keys=KEYS)
    assert "sk-first" not in repr(config) and "sk-first" not in json.dumps(config.describe())
    assert not any("sk-" in record.getMessage() for record in caplog.records)


# --- rate limits ------------------------------------------------------------------------------


def test_requests_per_minute_per_key(make):
    _, clock, http = make(api_keys=KEYS, rate_limit_rpm=2)
    first, second = bearer("sk-first"), bearer("sk-second")
    ok = http.post("/v1/chat/completions", json=CHAT, headers=first)
    assert ok.status_code == 200
    assert ok.headers["x-ratelimit-limit-requests"] == "2"
    assert ok.headers["x-ratelimit-remaining-requests"] == "1"
    assert ok.headers["x-ratelimit-reset-requests"] == "30s"
    assert http.post("/v1/chat/completions", json=CHAT, headers=first).status_code == 200
    refused = http.post("/v1/chat/completions", json=CHAT, headers=first)
    assert refused.status_code == 429
    assert refused.headers["retry-after"] == "30"
    assert refused.headers["x-ratelimit-remaining-requests"] == "0"
    assert refused.json()["error"]["type"] == "requests"
    assert refused.json()["error"]["code"] == "rate_limit_exceeded"
    anthropic_refused = http.post("/v1/messages", json=MESSAGE, headers=first)
    assert anthropic_refused.status_code == 429
    assert anthropic_refused.json()["error"]["type"] == "rate_limit_error"
    assert http.post("/v1/chat/completions", json=CHAT, headers=second).status_code == 200
    clock.now += 30
    assert http.post("/v1/chat/completions", json=CHAT, headers=first).status_code == 200
    # GETs are not charged
    assert all(http.get("/v1/models", headers=first).status_code == 200 for _ in range(5))


def test_tokens_per_minute_charge_the_prompt_and_max_tokens_and_refund_the_unused(make):
    _, clock, http = make(api_keys=KEYS, rate_limit_tpm=400)
    key = bearer("sk-first")
    prompt_tokens = http.post("/tokenize", json={"messages": USER}).json()["count"]
    # the scripted reply is 5 pieces of one token each: 195 of 200 charged are refunded
    ok = http.post("/v1/chat/completions", json={**CHAT, "max_tokens": 200}, headers=key)
    assert ok.status_code == 200
    assert ok.json()["usage"]["completion_tokens"] == 5
    remaining = 400 - prompt_tokens - 5
    # a whole reply is sent once it is generated, so its headers count the refund already
    assert ok.headers["x-ratelimit-remaining-tokens"] == str(remaining)
    stream = http.post(
        "/v1/chat/completions", json={**CHAT, "max_tokens": 200, "stream": True}, headers=key
    )
    assert stream.status_code == 200 and "[DONE]" in stream.text
    remaining -= prompt_tokens + 5
    left = http.get("/v1/models", headers=key).headers["x-ratelimit-remaining-tokens"]
    assert int(left) == remaining
    too_much = remaining - prompt_tokens + 10
    refused = http.post("/v1/chat/completions", json={**CHAT, "max_tokens": too_much}, headers=key)
    assert refused.status_code == 429, refused.text
    assert refused.json()["error"]["type"] == "tokens"
    assert int(refused.headers["retry-after"]) == 2  # 10 tokens at 400/60 a second: 1.5 s
    clock.now += 1.5
    ok = http.post("/v1/chat/completions", json={**CHAT, "max_tokens": too_much}, headers=key)
    assert ok.status_code == 200
    # more than a minute's allowance can never fit
    huge = http.post(
        "/v1/completions", json={"prompt": "x", "max_tokens": 150, "n": 3}, headers=key
    )
    assert huge.status_code == 429 and "too large" in huge.json()["error"]["message"]


def test_without_keys_clients_are_limited_by_address(make):
    _, _, http = make(rate_limit_rpm=1)
    assert http.post("/v1/chat/completions", json=CHAT).status_code == 200
    # a key that is not checked does not buy a new bucket
    response = http.post("/v1/chat/completions", json=CHAT, headers=bearer("anything"))
    assert response.status_code == 429


# --- load shedding and caps -------------------------------------------------------------------


def test_a_full_queue_is_429_on_openai_routes_and_529_on_anthropic(make):
    engine, _, http = make(max_queued_requests=4)
    engine.num_waiting = 3
    assert http.post("/v1/chat/completions", json=CHAT).status_code == 200
    refused = http.post("/v1/chat/completions", json={**CHAT, "n": 2})  # 3 + 2 > 4
    assert refused.status_code == 429
    assert refused.json()["error"]["code"] == "server_overloaded"
    assert refused.headers["retry-after"] == "1"
    engine.num_waiting = 4
    overloaded = http.post("/v1/messages", json=MESSAGE)
    assert overloaded.status_code == 529
    assert overloaded.json()["error"]["type"] == "overloaded_error"
    assert overloaded.headers["retry-after"] == "1"
    engine.num_waiting = 0
    assert http.post("/v1/messages", json=MESSAGE).status_code == 200
    too_many = http.post("/v1/chat/completions", json={**CHAT, "n": 5})  # can never fit
    assert too_many.status_code == 400 and "--max-queued-requests" in too_many.text


def test_admitted_requests_count_as_waiting_until_their_streams_start():
    guard = Guard(SecurityConfig(max_queued_requests=2), clock=Clock())
    first = guard.admit(None, 10, 10, num_waiting=0, n=2)
    with pytest.raises(Exception, match="overloaded"):
        guard.admit(None, 10, 10, num_waiting=0, n=1)
    first.started()  # the engine client counts them now
    guard.admit(None, 10, 10, num_waiting=0, n=1)
    guard.clock.now += 60  # a stream that never started stops counting
    guard.admit(None, 10, 10, num_waiting=0, n=2)


def test_body_size_limit_is_413_in_each_shape(make):
    _, _, http = make(max_request_bytes=1000)
    big = {**CHAT, "messages": [{"role": "user", "content": "x" * 2000}]}
    response = http.post("/v1/chat/completions", json=big)
    assert response.status_code == 413
    assert response.json()["error"]["code"] == "request_too_large"
    response = http.post("/v1/messages", json={**MESSAGE, "messages": big["messages"]})
    assert response.status_code == 413
    assert response.json()["error"]["type"] == "request_too_large"

    def chunks():  # no Content-Length: the limit counts the bytes as they arrive
        payload = json.dumps(big).encode()
        for i in range(0, len(payload), 100):
            yield payload[i : i + 100]

    response = http.post("/v1/chat/completions", content=chunks())
    assert response.status_code == 413
    assert http.post("/v1/chat/completions", json=CHAT).status_code == 200


# --- the last-resort handler ------------------------------------------------------------------


def test_an_unexpected_error_is_a_500_in_the_route_s_shape_with_a_request_id(
    make, monkeypatch, caplog
):
    _, _, http = make()
    state = http.app.state.server

    def broken(*args, **kwargs):
        raise RuntimeError("tokenizer exploded")

    monkeypatch.setattr(state.tokenizer, "encode", broken)
    response = http.post("/v1/chat/completions", json=CHAT, headers={"x-request-id": "abc-123"})
    assert response.status_code == 500
    assert response.headers["x-request-id"] == "abc-123"
    assert "abc-123" in response.json()["error"]["message"]
    assert "RuntimeError" in response.json()["error"]["message"]
    assert any("abc-123" in record.getMessage() for record in caplog.records)
    response = http.post("/v1/messages", json=MESSAGE)
    assert response.status_code == 500
    assert response.json()["error"]["type"] == "api_error"
    assert response.headers["x-request-id"].startswith("req_")
    assert http.get("/health").status_code == 200


def test_an_error_after_a_stream_began_ends_it_with_an_error_event(make, monkeypatch):
    _, _, http = make()

    def broken(self):
        raise RuntimeError("no message")

    monkeypatch.setattr(anthropic_messages._Reply, "message", broken)
    response = http.post("/v1/messages", json={**MESSAGE, "stream": True})
    assert response.status_code == 200
    frames = [f for f in response.text.split("\n\n") if f]
    assert frames[-1].startswith("event: error\n")
    error = json.loads(frames[-1].split("data: ", 1)[1])
    assert error["type"] == "error" and error["error"]["type"] == "api_error"
