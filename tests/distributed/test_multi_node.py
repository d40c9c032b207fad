"""Tensor parallelism over two "nodes" of this host: `met serve --nnodes 2 --node-rank 1` runs
rank 1 and serves no API; node 0's server runs rank 0 and meets it at --master-addr:port. A
request is served across both; a node whose checkpoint or flags differ is refused at startup,
by name; node 1 going away fails requests (no hang) and turns /health red."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import openai
import pytest

from tests.server.conftest import MODEL_NAME, free_port, start_server, stop_server


def node_flags(port: int, rank: int) -> list[str]:
    return [
        *("--tensor-parallel-size", "2", "--nnodes", "2", "--node-rank", str(rank)),
        *("--master-addr", "127.0.0.1", "--master-port", str(port)),
    ]


def start_node(model_dir: Path, log_path: Path, port: int, *extra: str) -> subprocess.Popen:
    """Node 1, with the flags the conftest's server gets (they must match node 0's)."""
    cmd = [sys.executable, "-m", "metrale", "serve", "--model-from-path", str(model_dir)]
    cmd += ["--max-seq-len", "512", "--num-kv-blocks", "256", "--dtype", "float32"]
    cmd += [*node_flags(port, 1), *extra]
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    return subprocess.Popen(cmd, stdout=log_path.open("w"), stderr=subprocess.STDOUT, env=env)


def test_two_nodes_serve_together_and_node_1_leaving_fails_requests(qwen3_dir, tmp_path):
    port = free_port()
    node1 = start_node(qwen3_dir, tmp_path / "node1.log", port)
    server = start_server(qwen3_dir, tmp_path / "node0.log", *node_flags(port, 0))
    try:
        client = openai.OpenAI(base_url=server.api_url, api_key="x", max_retries=0)
        reply = client.chat.completions.create(
            model=MODEL_NAME, max_tokens=6, messages=[{"role": "user", "content": "hi"}]
        )
        assert reply.usage.completion_tokens == 6 or reply.choices[0].finish_reason == "stop"
        forward = httpx.get(server.base_url + "/forward").json()
        assert forward["rank_devices"] == ["cpu", "node1:cpu"]
        node1_log = (tmp_path / "node1.log").read_text()
        assert "node 1 of 2: tensor-parallel ranks 1-1 of 2" in node1_log
        assert node1.poll() is None
        node1.send_signal(signal.SIGKILL)  # its rank follows within a second (parent gone)
        node1.wait(10)
        time.sleep(1.5)
        start = time.monotonic()
        with pytest.raises(openai.APIError):
            client.chat.completions.create(
                model=MODEL_NAME, max_tokens=6, messages=[{"role": "user", "content": "hi"}]
            )
        assert time.monotonic() - start < 30, "a request hung on a rank that is gone"
        deadline = time.monotonic() + 10
        while httpx.get(server.base_url + "/health").status_code == 200:
            assert time.monotonic() < deadline, "/health still green with node 1 gone"
            time.sleep(0.1)
    finally:
        node1.kill()
        stop_server(server)


def test_a_node_with_other_flags_is_refused_by_name(qwen3_dir, tmp_path):
    port = free_port()
    node1 = start_node(qwen3_dir, tmp_path / "node1.log", port, "--max-num-batched-tokens", "999")
    node0 = start_node_0_expecting_failure(qwen3_dir, tmp_path / "node0.log", port)
    try:
        assert node0.wait(120) != 0
        log = (tmp_path / "node0.log").read_text()
        assert "disagree with rank 0" in log and "config: ranks [1]" in log, log
        assert "checkpoint: ranks" not in log
        assert node1.wait(60) != 0  # it is told the same and leaves
    finally:
        node0.kill()
        node1.kill()


def start_node_0_expecting_failure(model_dir: Path, log_path: Path, port: int) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "metrale", "serve", "--model-from-path", str(model_dir)]
    cmd += ["--max-seq-len", "512", "--num-kv-blocks", "256", "--dtype", "float32"]
    cmd += ["--port", str(free_port()), *node_flags(port, 0)]
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    return subprocess.Popen(cmd, stdout=log_path.open("w"), stderr=subprocess.STDOUT, env=env)
