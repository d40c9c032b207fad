"""`/metrics`, `/v1/events`, `/forward` and the access log of a real `met serve`.

Counters are checked exact against the usage the responses report: the test reads the
exposition before and after known traffic and compares the growth. The server logs JSON
(`--log-format json`) so the access lines can be read back field by field.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator

import anthropic
import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.server.conftest import MODEL_NAME, RunningServer, start_server, stop_server

KEY = "sk-observe"
AUTH = {"authorization": f"Bearer {KEY}"}
LONG_PROMPT = " ".join(f"word{i}" for i in range(60))  # several full KV blocks


@pytest.fixture(scope="module")
def observed(qwen3_dir, tmp_path_factory) -> Iterator[RunningServer]:
    running = start_server(
        qwen3_dir,
        tmp_path_factory.mktemp("observe") / "server.log",
        "--api-key",
        KEY,
        "--log-format",
        "json",
    )
    yield running
    assert stop_server(running) == 0, running.log()


def scrape(server: RunningServer) -> dict[str, float]:
    """Every sample of /metrics as {name{sorted labels}: value}; the text must parse."""
    text = httpx.get(server.base_url + "/metrics").text
    samples = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            labels = ",".join(f"{k}={v}" for k, v in sorted(s.labels.items()) if k != "model_name")
            assert s.labels.get("model_name") == MODEL_NAME, s
            samples[f"{s.name}{{{labels}}}"] = s.value
    return samples


def grew(before: dict[str, float], after: dict[str, float], key: str) -> float:
    return after.get(key, 0.0) - before.get(key, 0.0)


def wait_idle(server: RunningServer, timeout_s: float = 10.0) -> dict[str, float]:
    deadline = time.monotonic() + timeout_s
    while True:
        now = scrape(server)
        running = now["metrale:num_requests_running{}"]
        waiting = now["metrale:num_requests_waiting{}"]
        if (running, waiting) == (0, 0) or time.monotonic() > deadline:
            return now
        time.sleep(0.05)


def test_counters_are_exact_against_the_usage_responses_report(observed):
    client = openai.OpenAI(base_url=observed.api_url, api_key=KEY)
    before = wait_idle(observed)
    usages, reasons = [], []
    for max_tokens in (3, 7):
        r = client.chat.completions.create(
            model=MODEL_NAME, messages=[{"role": "user", "content": "hi"}], max_tokens=max_tokens
        )
        usages.append(r.usage)
        reasons.append(r.choices[0].finish_reason)
    stream = client.chat.completions.create(
        model=MODEL_NAME,
        messages=[{"role": "user", "content": "count"}],
        max_tokens=6,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    usages.append(chunks[-1].usage)
    reasons += [
        c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason
    ]
    for _ in range(2):  # the same long prompt twice: the second is served from the cache
        r = client.completions.create(model=MODEL_NAME, prompt=LONG_PROMPT, max_tokens=4)
        usages.append(r.usage)
        reasons.append(r.choices[0].finish_reason)
    message = anthropic.Anthropic(base_url=observed.base_url, api_key=KEY).messages.create(
        model=MODEL_NAME, max_tokens=5, messages=[{"role": "user", "content": "hello"}]
    )
    after = wait_idle(observed)

    message_cached = message.usage.cache_read_input_tokens or 0
    prompt = sum(u.prompt_tokens for u in usages) + message.usage.input_tokens + message_cached
    generated = sum(u.completion_tokens for u in usages) + message.usage.output_tokens
    cached = sum(u.prompt_tokens_details.cached_tokens for u in usages) + message_cached
    n = len(usages) + 1
    assert cached > 0  # the second long prompt hit the prefix cache
    assert grew(before, after, "metrale:prompt_tokens_total{}") == prompt
    assert grew(before, after, "metrale:generation_tokens_total{}") == generated
    assert grew(before, after, "metrale:prefix_cache_hits_total{}") == cached
    assert grew(before, after, "metrale:prefix_cache_queries_total{}") >= prompt
    reasons.append("length" if message.stop_reason == "max_tokens" else "stop")
    for reason in ("stop", "length", "abort"):
        key = f"metrale:request_success_total{{finished_reason={reason}}}"
        assert grew(before, after, key) == reasons.count(reason), reason
    # One observation per request; one inter-token latency per token after each first.
    for histogram in (
        "time_to_first_token_seconds",
        "e2e_request_latency_seconds",
        "request_queue_time_seconds",
        "request_prefill_time_seconds",
        "request_decode_time_seconds",
        "request_prompt_tokens",
        "request_generation_tokens",
    ):
        assert grew(before, after, f"metrale:{histogram}_count{{}}") == n, histogram
    assert grew(before, after, "metrale:inter_token_latency_seconds_count{}") == generated - n
    assert grew(before, after, "metrale:request_prompt_tokens_sum{}") == prompt
    assert grew(before, after, "metrale:request_generation_tokens_sum{}") == generated
    # Each engine step is one observation of its tokens; together they computed every token
    # not served from the cache (the last generated token of each request is never computed).
    steps = grew(before, after, "metrale:iteration_tokens_total_count{}")
    assert steps >= generated
    computed = prompt - cached + generated - n
    assert grew(before, after, "metrale:iteration_tokens_total_sum{}") == computed
    for part in ("host", "device"):
        assert grew(before, after, f"metrale:engine_step_seconds_count{{part={part}}}") == steps
    # Gauges are back at zero once idle.
    assert after["metrale:num_requests_running{}"] == 0
    assert after["metrale:num_requests_waiting{}"] == 0
    assert after["metrale:kv_cache_usage_perc{}"] == 0
    route = "metrale:http_requests_total{route=/v1/chat/completions,status=200}"
    assert grew(before, after, route) == 3
    assert grew(before, after, "metrale:http_requests_total{route=/v1/messages,status=200}") == 1


def test_refusals_count_by_route_status_and_reason(observed):
    before = scrape(observed)
    body = {"model": MODEL_NAME, "messages": [{"role": "user", "content": "x"}]}
    assert httpx.post(observed.api_url + "/chat/completions", json=body).status_code == 401
    r = httpx.post(observed.api_url + "/chat/completions", json={"model": 3}, headers=AUTH)
    assert r.status_code == 400
    assert httpx.get(observed.base_url + "/nowhere").status_code == 404
    after = scrape(observed)
    chat = "metrale:http_requests_total{route=/v1/chat/completions,status=%s}"
    assert grew(before, after, chat % 401) == 1
    assert grew(before, after, chat % 400) == 1
    assert grew(before, after, "metrale:http_requests_total{route=unmatched,status=404}") == 1
    assert grew(before, after, "metrale:rejected_requests_total{reason=invalid_api_key}") == 1


def read_events(
    server: RunningServer,
    query: str,
    stop: threading.Event,
    into: list[dict],
    ready: threading.Event,
) -> None:
    with httpx.stream(
        "GET", f"{server.api_url}/events{query}", headers=AUTH, timeout=30
    ) as response:
        assert response.status_code == 200
        assert response.headers["content-type"].startswith("text/event-stream")
        ready.set()
        event_type = None
        for line in response.iter_lines():
            if line.startswith("event: "):
                event_type = line.removeprefix("event: ")
            elif line.startswith("data: "):
                data = json.loads(line.removeprefix("data: "))
                assert data["type"] == event_type
                into.append(data)
            if stop.is_set():
                return


def test_events_tell_each_request_and_summarize_steps(observed):
    got: list[dict] = []
    stop, ready = threading.Event(), threading.Event()
    reader = threading.Thread(target=read_events, args=(observed, "", stop, got, ready))
    reader.start()
    assert ready.wait(10)
    client = openai.OpenAI(base_url=observed.api_url, api_key=KEY)
    r = client.chat.completions.create(
        model=MODEL_NAME, messages=[{"role": "user", "content": "tell me"}], max_tokens=12
    )

    def told_all() -> bool:  # the request's end, and the summary of the engine going idle
        finished = [i for i, e in enumerate(got) if e["type"] == "request.finished"]
        return bool(finished) and any(
            e["type"] == "step" and e["running"] == 0 for e in got[finished[0] :]
        )

    deadline = time.monotonic() + 10
    while not told_all() and time.monotonic() < deadline:
        time.sleep(0.05)
    stop.set()
    client.models.list()  # a request, so the stream sends something and the reader sees stop
    reader.join(10)
    types = [e["type"] for e in got]
    # Startup is replayed to a late reader: every phase began and ended, in order.
    phases = [e for e in got if e["type"] == "phase"]
    assert [p["index"] for p in phases if p["duration_s"] is not None] == list(range(1, 11))
    request_id = f"{r.id}-0"
    mine = [e for e in got if e.get("request_id") == request_id]
    assert [e["type"] for e in mine] == [
        "request.admitted",
        "request.first_token",
        "request.finished",
    ]
    admitted, first, finished = mine
    assert admitted["api"] == "chat" and admitted["prompt_tokens"] == r.usage.prompt_tokens
    assert finished["generated_tokens"] == r.usage.completion_tokens
    assert finished["finish_reason"] == r.choices[0].finish_reason
    assert 0 < first["ttft_s"] == finished["ttft_s"] <= finished["e2e_s"]
    assert finished["queue_s"] >= 0 and finished["decode_s"] >= 0
    summaries = [e for e in got if e["type"] == "step"]
    assert summaries and summaries[-1]["running"] == 0  # a last one when the engine went idle
    assert "step" in types


def test_events_filter_by_type_and_refuse_unknown_types(observed):
    r = httpx.get(observed.api_url + "/events?types=request.finished,nonsense", headers=AUTH)
    assert r.status_code == 400
    assert "nonsense" in r.json()["error"]["message"]
    assert r.json()["error"]["param"] == "types"
    assert httpx.get(observed.api_url + "/events?queue=0", headers=AUTH).status_code == 400
    assert httpx.get(observed.api_url + "/events").status_code == 401  # under /v1: a key
    got: list[dict] = []
    stop, ready = threading.Event(), threading.Event()
    reader = threading.Thread(
        target=read_events, args=(observed, "?types=request.finished", stop, got, ready)
    )
    reader.start()
    assert ready.wait(10)
    client = openai.OpenAI(base_url=observed.api_url, api_key=KEY)
    for _ in range(2):
        client.completions.create(model=MODEL_NAME, prompt="a b", max_tokens=2)
    deadline = time.monotonic() + 10
    while len(got) < 2 and time.monotonic() < deadline:
        time.sleep(0.05)
    stop.set()
    client.completions.create(model=MODEL_NAME, prompt="a b", max_tokens=1)
    reader.join(10)
    assert len(got) >= 2 and {e["type"] for e in got} == {"request.finished"}


def test_forward_describes_the_model(observed):
    forward = httpx.get(observed.base_url + "/forward").json()
    assert forward["model"] == MODEL_NAME
    assert forward["architecture"] == "Qwen3ForCausalLM"
    assert forward["attention_backend"] == "torch" and forward["kernels"]["attention"]
    assert forward["dtype"] == "float32" and forward["kv_cache_dtype"] == "float32"
    assert forward["num_kv_blocks"] == 256 and forward["kv_block_size"] == 16
    assert forward["cuda_graph_batch_sizes"] == [] and forward["tensor_parallel_size"] == 1
    assert forward["cuda_graph_token_counts"] == []
    assert forward["compiled_decode"] is False  # the suite runs CPU decode steps eagerly
    assert forward["quantization"] is None
    assert forward["num_layers"] >= 1 and forward["num_kv_heads"] <= forward["num_heads"]


def test_one_json_access_line_per_request_with_its_id(observed):
    client = openai.OpenAI(base_url=observed.api_url, api_key=KEY)
    raw = client.chat.completions.with_raw_response.create(
        model=MODEL_NAME,
        messages=[{"role": "user", "content": "log me"}],
        max_tokens=4,
        extra_headers={"x-request-id": "my-trace-42"},
    )
    assert raw.headers["x-request-id"] == "my-trace-42"
    usage = raw.parse().usage
    time.sleep(0.2)
    lines = [json.loads(line) for line in observed.log().splitlines() if line.startswith("{")]
    access = [e for e in lines if e["logger"] == "metrale.access"]
    mine = [e for e in access if e["request_id"] == "my-trace-42"]
    assert len(mine) == 1
    (entry,) = mine
    assert entry["route"] == "/v1/chat/completions" and entry["status"] == 200
    assert entry["prompt_tokens"] == usage.prompt_tokens
    assert entry["generated_tokens"] == usage.completion_tokens
    assert entry["cached_tokens"] == usage.prompt_tokens_details.cached_tokens
    assert 0 < entry["ttft_s"] <= entry["total_s"]
    assert entry["finish_reason"] in ("stop", "length")
    assert "my-trace-42" in entry["message"]
    # Every other log line of the API process is JSON too.
    assert all(e["level"] in ("debug", "info", "warning", "error", "critical") for e in lines)


def test_disable_log_stats_turns_the_statistics_off_not_the_events(qwen3_dir, tmp_path):
    """vLLM's `--disable-log-stats`: no Prometheus series and no step timing in the engine;
    requests are served, logged and told on `/v1/events` as before."""
    running = start_server(qwen3_dir, tmp_path / "server.log", "--disable-log-stats")
    try:
        r = httpx.get(running.base_url + "/metrics")
        assert r.status_code == 404
        assert "metrics are off" in r.json()["error"]["message"]
        config = httpx.get(running.base_url + "/serve-config").json()
        assert config["engine"]["log_stats"] is False
        got: list[dict] = []
        stop, ready = threading.Event(), threading.Event()
        args = (running, "?types=request.finished", stop, got, ready)
        reader = threading.Thread(target=read_events, args=args)
        reader.start()
        assert ready.wait(10)
        client = openai.OpenAI(base_url=running.api_url, api_key="unused")
        done = client.completions.create(model=MODEL_NAME, prompt="a b", max_tokens=5)
        deadline = time.monotonic() + 10
        while not got and time.monotonic() < deadline:
            time.sleep(0.05)
        stop.set()
        client.models.list()
        reader.join(10)
        assert [e["generated_tokens"] for e in got] == [done.usage.completion_tokens]
    finally:
        assert stop_server(running) == 0, running.log()
