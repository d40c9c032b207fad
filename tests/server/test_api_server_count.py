"""`met serve --api-server-count 2`: two API processes on one port and one engine.

Which process accepts a connection is the kernel's choice; the tests make it theirs by pausing
one process (SIGSTOP) while a request goes in, so the other must serve it whole."""

from __future__ import annotations

import contextlib
import json
import os
import queue
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from metrale.server.openai.responses.background_peers import PEER_TIMEOUT_S
from tests.server.conftest import (
    MODEL_NAME,
    RunningServer,
    hold_the_engine,
    process_running,
    start_server,
    stop_server,
)

SERVE = [sys.executable, "-m", "metrale", "serve"]


def _wait_serving(server: RunningServer) -> None:
    """Until every API process serves (the first logs "serving" then)."""
    deadline = time.monotonic() + 60
    while "serving " not in server.log():
        assert time.monotonic() < deadline and server.process.poll() is None, server.log()
        time.sleep(0.1)


def _pids(server: RunningServer) -> tuple[int, int]:
    """The engine's and the second API process's."""
    log = server.log()
    engine = re.search(r"engine core process (\d+) started", log)
    api = re.search(r"1 more API process started \(pid (\d+)\)", log)
    assert engine and api, log
    return int(engine[1]), int(api[1])


def _assert_gone(*pids: int) -> None:
    """The server's children exit with it (within 10 s)."""
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and any(process_running(p) for p in pids):
        time.sleep(0.1)
    assert not any(process_running(p) for p in pids), "a child left running"


@contextlib.contextmanager
def _paused(pid: int) -> Iterator[None]:
    os.kill(pid, signal.SIGSTOP)
    try:
        yield
    finally:
        os.kill(pid, signal.SIGCONT)


@pytest.fixture(scope="module")
def two(qwen3_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningServer]:
    log = tmp_path_factory.mktemp("two") / "server.log"
    running = start_server(qwen3_dir, log, "--api-server-count", "2")
    _wait_serving(running)
    yield running
    engine, api = _pids(running)
    assert stop_server(running) == 0, running.log()
    _assert_gone(engine, api)


def _complete(server: RunningServer, prompt: str, max_tokens: int = 16) -> openai.types.Completion:
    client = openai.OpenAI(base_url=server.api_url, api_key="x", max_retries=0, timeout=60)
    return client.completions.create(
        model=MODEL_NAME,
        prompt=prompt,
        max_tokens=max_tokens,
        temperature=0.0,
        extra_body={"ignore_eos": True},
    )


def _counter(text: str, family: str, **labels: str) -> float:
    for metric in text_string_to_metric_families(text):
        if metric.name == family:
            return sum(
                s.value
                for s in metric.samples
                if s.name.endswith("_total") and labels.items() <= s.labels.items()
            )
    raise AssertionError(f"no {family} in /metrics")


@contextlib.contextmanager
def _client_of(server: RunningServer, other: int) -> Iterator[openai.OpenAI]:
    """An SDK client whose one connection the process that is not `other` accepted (made while
    `other` is paused, then kept), with `other` running."""
    with httpx.Client(base_url=server.base_url, timeout=60) as http:
        with _paused(other):
            http.get("/health")
        yield openai.OpenAI(base_url=server.api_url, api_key="x", max_retries=0, http_client=http)


def test_a_background_response_answers_from_either_process(qwen3_dir: Path, tmp_path: Path):
    """It runs in the process that took its POST (the second here); the first retrieves it,
    cancels it and follows it as a stream, through the second."""
    server = start_server(
        qwen3_dir, tmp_path / "server.log", "--api-server-count", "2", "--max-num-seqs", "1"
    )
    try:
        _wait_serving(server)
        _, api = _pids(server)
        first = server.process.pid
        holder = hold_the_engine(server)  # the background responses wait behind it
        try:
            with _client_of(server, first) as second:
                queued = second.responses.create(model=MODEL_NAME, input="wait", background=True)
                followed = second.responses.create(
                    model=MODEL_NAME, input="follow", background=True, max_output_tokens=120
                )  # long enough to be running still if the holder ends before it is followed
            with _client_of(server, api) as other:
                waiting = other.responses.retrieve(queued.id).status
                assert waiting in ("queued", "in_progress")  # not "failed": it runs, there
                assert other.responses.cancel(queued.id).status == "cancelled"
                with other.responses.retrieve(followed.id, stream=True) as stream:
                    events = list(stream)
                final = other.responses.retrieve(followed.id)
        finally:
            holder.join()
        assert [e.sequence_number for e in events] == list(range(len(events)))
        assert events[0].type == "response.created"
        assert events[-1].type in ("response.completed", "response.incomplete")
        assert events[-1].response.output_text == final.output_text
        deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")
        assert deltas == final.output_text
    finally:
        assert stop_server(server) == 0, server.log()


def test_a_stopped_owner_of_a_background_response_is_a_503_not_a_hang(
    qwen3_dir: Path, tmp_path: Path
):
    """The process running a background response is stopped (SIGSTOP): cancelling it or
    following it through the other process answers 503 once the owner has not answered for
    `PEER_TIMEOUT_S`; running again, the owner answers."""
    server = start_server(
        qwen3_dir, tmp_path / "server.log", "--api-server-count", "2", "--max-num-seqs", "1"
    )
    try:
        _wait_serving(server)
        _, api = _pids(server)
        holder = hold_the_engine(server)  # the background response waits behind it
        try:
            with _client_of(server, server.process.pid) as second:
                queued = second.responses.create(model=MODEL_NAME, input="wait", background=True)
            with _client_of(server, api) as first:
                with _paused(api):
                    start = time.monotonic()
                    with pytest.raises(openai.InternalServerError) as cancel:
                        first.responses.cancel(queued.id)
                    with pytest.raises(openai.InternalServerError) as follow:
                        first.responses.retrieve(queued.id, stream=True)
                    waited = time.monotonic() - start
                assert first.responses.cancel(queued.id).status == "cancelled"
        finally:
            holder.join()
        for error in (cancel.value, follow.value):
            assert error.status_code == 503
            assert "did not answer in 5 s" in error.message
        assert 2 * PEER_TIMEOUT_S <= waited < 2 * PEER_TIMEOUT_S + 10
    finally:
        assert stop_server(server) == 0, server.log()


def _scrape_from(server: RunningServer, other: int) -> str:
    """/metrics as the process that is not `other` answers it, with `other` running: the
    connection is made while `other` is paused, then kept."""
    with httpx.Client(base_url=server.base_url, timeout=30) as client:
        with _paused(other):
            client.get("/health")
        return client.get("/metrics").text


def test_each_process_serves_alone_and_metrics_add_both_up(two: RunningServer):
    _, api = _pids(two)
    first = two.process.pid
    before = httpx.get(two.base_url + "/metrics").text
    with _paused(first):  # only the second accepts
        by_second = _complete(two, "one two three")
    with _paused(api):  # only the first accepts
        by_first = _complete(two, "one two three")
    # The same greedy tokens from the one engine, whichever process streamed them.
    assert by_second.choices[0].text == by_first.choices[0].text
    assert by_first.usage.completion_tokens == by_second.usage.completion_tokens == 16
    # Either process's scrape holds both processes' requests.
    route = {"route": "/v1/completions", "status": "200"}
    done = _counter(before, "metrale:http_requests", **route)
    generated = _counter(before, "metrale:generation_tokens")
    for scrape in (_scrape_from(two, api), _scrape_from(two, first)):
        assert _counter(scrape, "metrale:http_requests", **route) == done + 2
        assert _counter(scrape, "metrale:generation_tokens") == generated + 32
        # The engine's own figures come from the first process only: counted once.
        steps = next(
            m
            for m in text_string_to_metric_families(scrape)
            if m.name == "metrale:iteration_tokens_total"
        )
        assert any(s.name.endswith("_count") and s.value > 0 for s in steps.samples)


def test_a_stored_response_is_read_by_the_other_process(two: RunningServer):
    _, api = _pids(two)

    def client() -> openai.OpenAI:  # a connection of its own: the one the paused one accepted
        return openai.OpenAI(base_url=two.api_url, api_key="x", max_retries=0, timeout=60)

    with _paused(two.process.pid):
        stored = client().responses.create(  # greedy: a sampled EOS made it "completed"
            model=MODEL_NAME, input="hello", max_output_tokens=8, temperature=0
        )
    with _paused(api):
        other = client()
        fetched = other.responses.retrieve(stored.id)
        follow_up = other.responses.create(
            model=MODEL_NAME,
            input="and then?",
            previous_response_id=stored.id,
            max_output_tokens=8,
        )
    assert fetched.id == stored.id and fetched.status == stored.status == "incomplete"
    assert fetched.output_text == stored.output_text
    assert follow_up.previous_response_id == stored.id
    assert follow_up.usage.input_tokens > stored.usage.input_tokens  # the history came along


def test_a_reader_of_one_process_sees_the_other_process_requests(two: RunningServer):
    _, api = _pids(two)
    first = two.process.pid
    finished: queue.Queue[dict] = queue.Queue()

    def read(lines: Iterator[str]) -> None:
        with contextlib.suppress(Exception):  # (the stream closed under it at the end)
            for line in lines:
                if line.startswith("data: ") and '"request.finished"' in line:
                    finished.put(json.loads(line.removeprefix("data: ")))

    with contextlib.ExitStack() as stack:
        client = stack.enter_context(httpx.Client(base_url=two.base_url, timeout=None))
        with _paused(first):  # the reader is the second process's
            reader = stack.enter_context(client.stream("GET", "/v1/events?types=request"))
        threading.Thread(target=read, args=(reader.iter_lines(),), daemon=True).start()
        # Its subscription reaches the first process within moments; a request before it
        # would go untold, so each try is a new request, told or not within its wait.
        for _ in range(5):
            with _paused(api):  # the first alone serves this one
                served = _complete(two, "four five six")
            deadline = time.monotonic() + 5
            event = None
            while event is None and time.monotonic() < deadline:
                with contextlib.suppress(queue.Empty):
                    told = finished.get(timeout=0.5)
                    if told["request_id"].startswith(served.id):
                        event = told
            if event is not None:
                break
        reader.close()
    assert event is not None, "the first process's request never reached the second's reader"
    assert event["finish_reason"] == "length" and event["generated_tokens"] == 16


def test_serve_config_tells_the_processes_and_the_shared_store(two: RunningServer):
    config = httpx.get(two.base_url + "/serve-config").json()
    assert config["server"]["api_server_count"] == 2
    assert config["response_store"].startswith("sqlite:")


def test_two_api_processes_over_two_data_parallel_cores(qwen3_dir: Path, tmp_path: Path):
    server = start_server(
        qwen3_dir,
        tmp_path / "server.log",
        *("--api-server-count", "2", "--data-parallel-size", "2"),
    )
    try:
        _wait_serving(server)
        api = int(re.findall(r"1 more API process started \(pid (\d+)\)", server.log())[0])
        engines = [int(p) for p in re.findall(r"engine core process (\d+) started", server.log())]
        assert len(engines) == 2
        texts = []
        for paused in (server.process.pid, api):
            with _paused(paused):  # each process in turn alone, four requests over the cores
                texts += [_complete(server, "one two three").choices[0].text for _ in range(4)]
        assert len(set(texts)) == 1  # the same greedy tokens on either core, from either process
        scrape = httpx.get(server.base_url + "/metrics", timeout=30).text
        route = {"route": "/v1/completions", "status": "200"}
        assert _counter(scrape, "metrale:http_requests", **route) == 8
    finally:
        assert stop_server(server) == 0, server.log()
    _assert_gone(api, *engines)


def test_an_api_process_that_dies_takes_the_server_down(qwen3_dir: Path, tmp_path: Path):
    server = start_server(qwen3_dir, tmp_path / "server.log", "--api-server-count", "2")
    _wait_serving(server)
    engine, api = _pids(server)
    os.kill(api, signal.SIGKILL)
    try:
        assert server.process.wait(timeout=30) == 1, server.log()
    finally:
        stop_server(server)
    assert "API process 1 exited" in server.log()
    _assert_gone(engine)


def test_an_engine_in_a_thread_is_refused_at_start(qwen3_dir: Path):
    result = subprocess.run(
        [*SERVE, "--model-from-path", str(qwen3_dir), "--api-server-count=2", "--engine-in-thread"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode != 0
    assert "not with --engine-in-thread" in result.stderr


def test_requests_per_minute_hold_across_the_processes(
    qwen3_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
):
    monkeypatch.setenv("METRALE_RATE_LIMIT_RPM", "3")
    server = start_server(qwen3_dir, tmp_path / "server.log", "--api-server-count", "2")
    try:
        _wait_serving(server)
        _, api = _pids(server)
        body = {"model": MODEL_NAME, "prompt": "hi", "max_tokens": 2}
        statuses = []
        for paused in (server.process.pid, api, server.process.pid, api):
            with _paused(paused):  # the processes in turn
                reply = httpx.post(server.api_url + "/completions", json=body, timeout=30)
                statuses.append(reply.status_code)
        assert statuses == [200, 200, 200, 429]  # one client's 3 a minute, not 3 a process
        assert reply.json()["error"]["code"] == "rate_limit_exceeded"
        assert reply.headers["x-ratelimit-remaining-requests"] == "0"
    finally:
        assert stop_server(server) == 0, server.log()


def test_the_queue_bound_counts_every_process_waiting_requests(qwen3_dir: Path, tmp_path: Path):
    server = start_server(
        qwen3_dir, tmp_path / "server.log", "--api-server-count", "2", "--max-queued-requests", "2"
    )
    engine, api = _pids(server)
    body = {"model": MODEL_NAME, "prompt": "hi", "max_tokens": 2}
    replies: list[httpx.Response] = []

    def post_in_background() -> threading.Thread:
        thread = threading.Thread(
            target=lambda: replies.append(
                httpx.post(server.api_url + "/completions", json=body, timeout=60)
            )
        )
        thread.start()
        return thread

    try:
        _wait_serving(server)
        waiting = []
        with _paused(engine):  # nothing gets a first token: admitted requests wait
            with _paused(server.process.pid):
                waiting.append(post_in_background())  # the second's
                time.sleep(2.0)  # admitted there
            with _paused(api):
                waiting.append(post_in_background())  # the first's: 1 + 1 waiting
                time.sleep(2.0)
                refused = httpx.post(server.api_url + "/completions", json=body, timeout=30)
        for thread in waiting:
            thread.join(60)
        assert refused.status_code == 429, refused.text
        assert refused.json()["error"]["code"] == "server_overloaded"
        assert [r.status_code for r in replies] == [200, 200]  # both ran once the engine did
    finally:
        assert stop_server(server) == 0, server.log()


def test_a_stopped_api_process_does_not_stop_the_others(two: RunningServer):
    """The engine sends every process the pool's state each step; one that stops reading
    (SIGSTOP) fills its socket within a few thousand steps, and the engine keeps serving the
    other meanwhile (the stopped one's batches wait, merged, until it reads again)."""
    _, api = _pids(two)
    with _paused(api):  # only the first accepts, and the second reads nothing
        for _ in range(12):  # ~6,000 steps
            done = _complete(two, "one two three", max_tokens=500)
            assert done.usage.completion_tokens == 500
    # The second reads its backlog and serves again.
    with _paused(two.process.pid):
        assert _complete(two, "one two three").usage.completion_tokens == 16
