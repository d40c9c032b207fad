"""API keys, the queue bound and the body limit on a real `met serve` (uvicorn, the engine in
its own process, keys from both the flag and METRALE_API_KEY), with the official SDKs."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys

import anthropic
import httpx
import openai
import pytest

from tests.server.conftest import MODEL_NAME, free_port, start_server, stop_server

FLAG_KEY, ENV_KEYS = "sk-flag-0123", ("sk-env-4567", "sk-env-89ab")
USER = [{"role": "user", "content": "hi"}]


@pytest.fixture(scope="module")
def guarded(qwen3_dir, tmp_path_factory):
    with pytest.MonkeyPatch.context() as env:
        env.setenv("METRALE_API_KEY", ",".join(ENV_KEYS))
        running = start_server(
            qwen3_dir,
            tmp_path_factory.mktemp("guarded") / "server.log",
            "--api-key",
            FLAG_KEY,
            "--require-auth",
            "--max-queued-requests",
            "3",
            "--max-request-bytes",
            "64KiB",
        )
    yield running
    assert stop_server(running) == 0, running.log()


def headers(key: str) -> dict[str, str]:
    return {"authorization": f"Bearer {key}"}


def test_require_auth_without_a_key_refuses_to_start(qwen3_dir):
    env = {k: v for k, v in os.environ.items() if k != "METRALE_API_KEY"}
    cmd = [sys.executable, "-m", "metrale", "serve", "--model-from-path", str(qwen3_dir)]
    done = subprocess.run(
        [*cmd, "--require-auth", "--port", str(free_port())],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
    )
    assert done.returncode == 2, done.stderr
    assert "--require-auth needs at least one API key" in done.stderr
    assert "Traceback" not in done.stderr


def test_every_key_from_flag_and_environment_works_with_the_sdks(guarded):
    for key in (FLAG_KEY, *ENV_KEYS):
        client = openai.OpenAI(base_url=guarded.api_url, api_key=key, max_retries=0)
        reply = client.chat.completions.create(model=MODEL_NAME, messages=USER, max_tokens=3)
        assert reply.choices[0].message.role == "assistant"
    claude = anthropic.Anthropic(base_url=guarded.base_url, api_key=ENV_KEYS[0], max_retries=0)
    assert claude.messages.create(model=MODEL_NAME, max_tokens=3, messages=USER).content
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=guarded.api_url, api_key="sk-flag-0124", max_retries=0).models.list()
    with pytest.raises(anthropic.AuthenticationError):
        anthropic.Anthropic(
            base_url=guarded.base_url, api_key="nope", max_retries=0
        ).messages.create(model=MODEL_NAME, max_tokens=3, messages=USER)


def test_operator_routes_need_a_key_and_never_show_one(guarded):
    assert httpx.get(guarded.base_url + "/serve-config").status_code == 401
    assert httpx.get(guarded.base_url + "/health").status_code == 200
    config = httpx.get(guarded.base_url + "/serve-config", headers=headers(FLAG_KEY)).json()
    assert config["security"]["api_keys"] == 3 and config["security"]["require_auth"] is True
    text = json.dumps(config) + guarded.log()
    assert not any(key in text for key in (FLAG_KEY, *ENV_KEYS))


def test_a_body_past_the_limit_is_413_before_it_is_read(guarded):
    big = {"model": MODEL_NAME, "messages": [{"role": "user", "content": "x" * 100_000}]}
    for path, field in (("/v1/chat/completions", "code"), ("/v1/messages", "type")):
        response = httpx.post(guarded.base_url + path, json=big, headers=headers(FLAG_KEY))
        assert response.status_code == 413
        assert response.json()["error"][field] == "request_too_large"


def test_past_the_queue_bound_requests_are_shed_with_retry_after(guarded):
    """30 streams at once against a bound of 3 waiting: the extra ones are refused at once
    (429 on OpenAI's routes, 529 on Anthropic's), every admitted one completes."""

    async def one(client: httpx.AsyncClient, i: int) -> tuple[int, str, dict]:
        if i % 2:
            path = "/v1/messages"
            body = {"model": MODEL_NAME, "max_tokens": 24, "messages": USER, "stream": True}
        else:
            path = "/v1/chat/completions"
            body = {"model": MODEL_NAME, "messages": USER, "max_tokens": 24, "stream": True}
        response = await client.post(path, json=body, headers=headers(FLAG_KEY))
        return response.status_code, response.text, dict(response.headers)

    async def burst() -> list[tuple[int, str, dict]]:
        async with httpx.AsyncClient(base_url=guarded.base_url, timeout=120) as client:
            return await asyncio.gather(*(one(client, i) for i in range(30)))

    results = asyncio.run(burst())
    statuses = [status for status, *_ in results]
    assert statuses.count(200) >= 3
    assert set(statuses) <= {200, 429, 529}
    assert 429 in statuses or 529 in statuses
    for status, text, response_headers in results:
        if status == 200:
            assert "data: [DONE]" in text or "event: message_stop" in text
        else:
            assert int(response_headers["retry-after"]) >= 1
            error = json.loads(text)
            if status == 529:
                assert error["error"]["type"] == "overloaded_error"
            else:
                assert error["error"]["code"] == "server_overloaded"
    memory = httpx.get(guarded.base_url + "/memory", headers=headers(FLAG_KEY)).json()
    assert memory["kv_cache"]["blocks_used"] == 0


def test_a_hostile_chat_template_is_stopped_and_the_server_stays_up(qwen3_dir, tmp_path):
    endless = tmp_path / "endless.jinja"
    endless.write_text(
        "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}"
    )
    running = start_server(qwen3_dir, tmp_path / "server.log", "--chat-template", str(endless))
    try:
        chat = {"model": MODEL_NAME, "messages": USER, "max_tokens": 2}
        response = httpx.post(running.api_url + "/chat/completions", json=chat, timeout=30)
        assert response.status_code == 400
        assert "budget" in response.json()["error"]["message"]
        assert httpx.get(running.base_url + "/health").status_code == 200
        completion = {"model": MODEL_NAME, "prompt": "hi", "max_tokens": 2}
        assert httpx.post(running.api_url + "/completions", json=completion).status_code == 200
    finally:
        assert stop_server(running) == 0, running.log()

    reader = tmp_path / "reader.jinja"
    reader.write_text("{% include '/etc/passwd' %}")
    cmd = [sys.executable, "-m", "metrale", "serve", "--model-from-path", str(qwen3_dir)]
    done = subprocess.run(
        [*cmd, "--chat-template", str(reader), "--port", str(free_port())],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 2
    assert "cannot read other templates or files" in done.stderr
    assert "root:" not in done.stderr + done.stdout
