"""`met serve --data-parallel-size 2`: two engine cores behind one API server. The server
test suite's concurrency tests pass against it; a conversation's next turn goes to the core
that holds its prefix (a prefix-cache hit every time); /memory, /metrics and /v1/events sum the
cores and show each; one core killed turns /health red and fails requests."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator

import httpx
import openai
import pytest

from tests.server import test_openai_sdk
from tests.server.conftest import MODEL_NAME, RunningServer, serving
from tests.server.test_observability import read_events


@pytest.fixture(scope="module")
def dp_server(qwen3_dir, tmp_path_factory) -> Iterator[RunningServer]:
    log_path = tmp_path_factory.mktemp("serve-dp") / "server.log"
    with serving(qwen3_dir, log_path, "--data-parallel-size", "2") as running:
        yield running


def test_32_concurrent_streams_all_complete(dp_server):
    test_openai_sdk.test_32_concurrent_streams_all_complete(dp_server)


def test_disconnected_streams_free_their_blocks(dp_server):
    test_openai_sdk.test_disconnected_streams_free_their_blocks(dp_server)


def test_the_next_turn_finds_its_prefix_on_its_core(dp_server):
    """The first turn goes to core 0 (both idle); then a long stream with nothing in common
    takes core 0 too (a tie again), so by load alone the next turn would go to core 1, where
    none of its prompt is cached: it goes back to core 0, and its prompt comes from the cache."""
    client = openai.OpenAI(base_url=dp_server.api_url, api_key="x", max_retries=0)
    system = {"role": "system", "content": "You answer in one short line. " * 12}
    messages = [system, {"role": "user", "content": "Tell me about tides, please."}]
    first = client.chat.completions.create(
        model=MODEL_NAME, messages=messages, max_tokens=8, temperature=0
    )
    messages += [
        {"role": "assistant", "content": first.choices[0].message.content},
        {"role": "user", "content": "And then?"},
    ]
    body = {
        "model": MODEL_NAME,
        "messages": [{"role": "user", "content": "Count slowly to a thousand."}],
        "max_tokens": 400,
        "stream": True,
        "ignore_eos": True,
    }
    with (
        httpx.Client(base_url=dp_server.base_url, timeout=30) as http,
        http.stream("POST", "/v1/chat/completions", json=body) as long_stream,
    ):
        assert long_stream.status_code == 200
        lines = long_stream.iter_lines()
        while '"content"' not in next(lines):  # its tokens are coming: admitted, running
            pass
        second = client.chat.completions.create(
            model=MODEL_NAME, messages=messages, max_tokens=8, temperature=0
        )
    cached = second.usage.prompt_tokens_details.cached_tokens
    assert cached >= first.usage.prompt_tokens - 16, cached


def test_memory_metrics_and_events_sum_the_cores_and_show_each(dp_server):
    got: list[dict] = []
    stop, ready = threading.Event(), threading.Event()
    reader = threading.Thread(target=read_events, args=(dp_server, "", stop, got, ready))
    reader.start()
    assert ready.wait(10)
    test_openai_sdk.test_32_concurrent_streams_all_complete(dp_server)  # both cores busy
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and not any(e.get("engines") for e in got):
        time.sleep(0.05)
    stop.set()
    httpx.get(dp_server.api_url + "/models")  # wakes the stream so the reader sees stop
    reader.join(10)
    loads = [e["engines"] for e in got if e["type"] == "step" and e["engines"]]
    assert loads and {load["engine"] for load in loads[-1]} <= {0, 1}
    memory = httpx.get(dp_server.base_url + "/memory").json()
    engines = memory["engines"]
    assert len(engines) == 2 and all(e is not None for e in engines)
    for figure in ("blocks_total", "blocks_used"):
        assert memory["kv_cache"][figure] == sum(e["kv_cache"][figure] for e in engines)
    assert memory["prefix_cache"]["queried_tokens"] == sum(
        e["prefix_cache"]["queried_tokens"] for e in engines
    )
    assert all(e["prefix_cache"]["queried_tokens"] > 0 for e in engines)  # both served
    text = httpx.get(dp_server.base_url + "/metrics").text
    for engine in ("0", "1"):
        assert f'metrale:kv_cache_usage_perc_per_engine{{engine="{engine}"' in text.replace(
            f'model_name="{MODEL_NAME}",', ""
        )
    forward = httpx.get(dp_server.base_url + "/forward").json()
    assert forward["data_parallel_size"] == 2
    config = httpx.get(dp_server.base_url + "/serve-config").json()
    assert config["parallelism"]["data_parallel_size"] == 2


def test_a_dead_core_turns_health_red_and_fails_requests(qwen3_dir, tmp_path):
    from tests.server.conftest import kill_and_expect_a_red_health, start_server, stop_server

    server = start_server(qwen3_dir, tmp_path / "server.log", "--data-parallel-size", "2")
    try:
        client = openai.OpenAI(base_url=server.api_url, api_key="x", max_retries=0)
        client.chat.completions.create(
            model=MODEL_NAME, max_tokens=2, messages=[{"role": "user", "content": "hi"}]
        )
        kill_and_expect_a_red_health(server, server.engine_pid(), "engine core")  # one of two
    finally:
        assert stop_server(server) == 0, server.log()
