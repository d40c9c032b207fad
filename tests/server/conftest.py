"""A real `met serve` subprocess on a tiny checkpoint, for the API tests."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

MODEL_NAME = "tiny-qwen3"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class RunningServer:
    process: subprocess.Popen
    base_url: str
    log_path: Path

    @property
    def api_url(self) -> str:
        return self.base_url + "/v1"

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def engine_pid(self) -> int:
        """The engine-core child of the server process."""
        children = Path(f"/proc/{self.process.pid}/task/{self.process.pid}/children")
        for pid in children.read_text().split():
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
            if b"spawn_main" in cmdline and b"resource_tracker" not in cmdline:
                return int(pid)
        raise AssertionError("no engine-core process found")


def process_running(pid: int) -> bool:
    """Alive and not a zombie waiting to be reaped."""
    stat = Path(f"/proc/{pid}/stat")
    return stat.exists() and stat.read_text().rsplit(")", 1)[1].split()[0] != "Z"


def start_server(model_dir: Path, log_path: Path, *extra: str) -> RunningServer:
    port = free_port()
    cmd = [
        sys.executable,
        "-m",
        "metrale",
        "serve",
        "--model-from-path",
        str(model_dir),
        "--served-model-name",
        MODEL_NAME,
        "--port",
        str(port),
        "--max-seq-len",
        "512",
        "--num-kv-blocks",
        "256",
        "--dtype",
        "float32",
        # Random weights emit <think> now and then; reasoning has its own tests.
        "--reasoning-parser",
        "none",
        *extra,
    ]
    log = log_path.open("w")
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    process = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env)
    server = RunningServer(process, f"http://127.0.0.1:{port}", log_path)
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise AssertionError(f"met serve exited with {process.returncode}:\n{server.log()}")
        try:
            if httpx.get(server.base_url + "/health", timeout=1).status_code == 200:
                return server
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    process.kill()
    raise AssertionError(f"met serve did not become healthy:\n{server.log()}")


def kill_and_expect_a_red_health(server: RunningServer, pid: int, reason: str) -> None:
    """SIGKILL `pid` (an engine process, a rank); within a second /health must be red,
    naming `reason`, and a request must get a 503."""
    import openai

    killed_at = time.monotonic()
    os.kill(pid, signal.SIGKILL)
    while httpx.get(server.base_url + "/health").status_code == 200:
        assert time.monotonic() - killed_at < 1.0, "/health still green a second later"
        time.sleep(0.02)
    assert reason in httpx.get(server.base_url + "/health").json()["reason"]
    client = openai.OpenAI(base_url=server.api_url, api_key="x", max_retries=0)
    with pytest.raises(openai.InternalServerError) as refused:
        client.chat.completions.create(
            model=MODEL_NAME, max_tokens=2, messages=[{"role": "user", "content": "hi"}]
        )
    assert refused.value.status_code == 503


def stop_server(server: RunningServer, sig: signal.Signals = signal.SIGTERM) -> int:
    if server.process.poll() is None:
        server.process.send_signal(sig)
        try:
            server.process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            server.process.kill()
            server.process.wait()
    return server.process.returncode


@contextlib.contextmanager
def serving(model_dir: Path, log_path: Path, *extra: str) -> Iterator[RunningServer]:
    """A server for a fixture's lifetime, which must shut down cleanly at its end."""
    running = start_server(model_dir, log_path, *extra)
    yield running
    code = stop_server(running)
    assert code == 0, f"met serve did not shut down cleanly ({code}):\n{running.log()}"


@pytest.fixture(scope="session")
def server(qwen3_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningServer]:
    """The shared server schedules async, as on a GPU: the API tests then cover the engine
    loop's one-step lag (the servers other modules start run the CPU default, sync)."""
    running = start_server(
        qwen3_dir,
        tmp_path_factory.mktemp("serve") / "server.log",
        "--scheduler-config",
        "async",
    )
    yield running
    code = stop_server(running)
    assert code == 0, f"met serve did not shut down cleanly ({code}):\n{running.log()}"


def hold_the_engine(server: RunningServer, max_tokens: int = 480) -> threading.Thread:
    """A long chat stream in a server's one sequence slot (`--max-num-seqs 1`), read slowly in a
    thread: what comes after it waits in the queue until it ends. Join the thread."""
    ready = threading.Event()
    body = {
        "model": MODEL_NAME,
        "messages": [{"role": "user", "content": "go"}],
        "max_tokens": max_tokens,
        "ignore_eos": True,
        "stream": True,
    }

    def run() -> None:
        url = server.api_url + "/chat/completions"
        with httpx.stream("POST", url, json=body, timeout=120) as r:
            for _ in r.iter_lines():
                ready.set()
                time.sleep(0.005)

    thread = threading.Thread(target=run)
    thread.start()
    assert ready.wait(30)
    return thread
