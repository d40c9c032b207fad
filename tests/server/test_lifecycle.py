"""The server's life: clean shutdown on SIGINT, and a dead engine reported, not hung on."""

from __future__ import annotations

import os
import signal
import threading
import time

import httpx
import openai
import pytest

from tests.server.conftest import MODEL_NAME, process_running, start_server, stop_server


def test_sigint_shuts_down_cleanly(qwen3_dir, tmp_path):
    server = start_server(qwen3_dir, tmp_path / "server.log")
    engine_pid = server.engine_pid()
    server.process.send_signal(signal.SIGINT)
    assert server.process.wait(timeout=30) == 0, server.log()
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and process_running(engine_pid):
        time.sleep(0.1)
    assert not process_running(engine_pid), "engine core left running"


def test_engine_death_fails_requests_and_turns_health_red(qwen3_dir, tmp_path):
    server = start_server(qwen3_dir, tmp_path / "server.log")
    try:
        client = openai.OpenAI(base_url=server.api_url, api_key="x", max_retries=0)
        stream = client.chat.completions.create(
            model=MODEL_NAME,
            messages=[{"role": "user", "content": "go on"}],
            max_tokens=400,
            stream=True,
            extra_body={"ignore_eos": True},
        )
        first = next(iter(stream))
        assert first.choices[0].delta.role == "assistant"
        error: list[BaseException] = []

        def drain() -> None:
            try:
                for _ in stream:
                    pass
            except BaseException as e:  # the SDK raises on an error event in the stream
                error.append(e)

        reader = threading.Thread(target=drain)
        reader.start()
        killed_at = time.monotonic()
        os.kill(server.engine_pid(), signal.SIGKILL)
        while httpx.get(server.base_url + "/health").status_code == 200:
            assert time.monotonic() - killed_at < 1.0, "/health still green a second later"
            time.sleep(0.02)
        health = httpx.get(server.base_url + "/health")
        assert health.status_code == 503 and "engine" in health.json()["reason"]
        reader.join(timeout=10)
        assert not reader.is_alive(), "the open stream hung after the engine died"
        assert error and "engine" in str(error[0]).lower()
        with pytest.raises(openai.InternalServerError) as refused:
            client.chat.completions.create(
                model=MODEL_NAME, max_tokens=2, messages=[{"role": "user", "content": "hi"}]
            )
        assert refused.value.status_code == 503
        assert httpx.get(server.base_url + "/health/live").status_code == 200
    finally:
        assert stop_server(server) == 0, server.log()
