"""Soak: 200 concurrent streams on the demo model with disconnects mid-stream, rate-limited
keys and bad bodies mixed in, for a bounded time. Afterwards the server holds no KV blocks and
no engine requests, its memory grew by less than `RSS_GROWTH_BOUND`, and every good request
came back complete and token-for-token what it gives alone (greedy)."""

from __future__ import annotations

import asyncio
import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from tests.server.conftest import free_port

pytestmark = pytest.mark.slow

STREAMS = 200
DURATION_S = 90.0
RSS_GROWTH_BOUND = 256 * 2**20
GOOD_KEYS = [f"sk-good-{i}" for i in range(STREAMS)]  # one a stream: well within the limit
HOT_KEY = "sk-hot"  # shared by every stream: far past its per-minute limit
RPM = 60
PROMPTS = [f"Story number {i}: once upon a time" for i in range(16)]
BAD_BODIES = [
    b"{",
    b'{"model": "metrale-demo", "prompt": [99999999999999999999999]}',
    b'{"model": "metrale-demo", "messages": [{"role": "user", "content": "\\ud800"}]}',
    b'{"model": "metrale-demo", "messages": [], "max_tokens": -1}',
    json.dumps({"model": "metrale-demo", "prompt": "x", "stream_options": {}}).encode(),
]


def rss_bytes(pid: int) -> int:
    """Resident memory of `pid` and its children (the engine core)."""
    total = 0
    pids = [pid, *map(int, Path(f"/proc/{pid}/task/{pid}/children").read_text().split())]
    for p in pids:
        for line in Path(f"/proc/{p}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                total += int(line.split()[1]) * 1024
    return total


def body(prompt: str, stream: bool = True) -> dict:
    return {
        "model": "metrale-demo",
        "prompt": prompt,
        "max_tokens": 16,
        "temperature": 0,
        "ignore_eos": True,
        "stream": stream,
    }


def text_of(stream_text: str) -> str:
    out = []
    for line in stream_text.splitlines():
        if line.startswith("data: {"):
            chunk = json.loads(line[6:])
            out += [choice["text"] for choice in chunk["choices"]]
    return "".join(out)


@pytest.fixture(scope="module")
def demo_server(tmp_path_factory):
    port = free_port()
    log = (tmp_path_factory.mktemp("soak") / "server.log").open("w")
    env = {
        **os.environ,
        "METRALE_API_KEY": ",".join([*GOOD_KEYS, HOT_KEY]),
        "METRALE_RATE_LIMIT_RPM": str(RPM),
        "PYTHONUNBUFFERED": "1",
        "METRALE_DEMO": "random",  # the machinery under load, not a model's speed
    }
    process = subprocess.Popen(
        [sys.executable, "-m", "metrale", "serve", "--port", str(port), "--max-num-seqs", "256"],
        stdout=log,
        stderr=subprocess.STDOUT,
        env=env,
    )
    base = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 180
    while time.monotonic() < deadline:
        assert process.poll() is None, Path(log.name).read_text()
        try:
            if httpx.get(base + "/health", timeout=1).status_code == 200:
                break
        except httpx.HTTPError:
            pass
        time.sleep(0.3)
    yield base, process, Path(log.name)
    process.send_signal(signal.SIGTERM)
    assert process.wait(timeout=60) == 0


def test_soak(demo_server):
    base, process, log_path = demo_server
    auth = {"authorization": f"Bearer {GOOD_KEYS[0]}"}
    # Each prompt's greedy text, alone, before the load.
    with httpx.Client(base_url=base, timeout=120, headers=auth) as client:
        expected = {
            p: client.post("/v1/completions", json=body(p, stream=False)).json()["choices"][0][
                "text"
            ]
            for p in PROMPTS
        }
    rss_before = rss_bytes(process.pid)
    rng = random.Random(0)
    outcomes: dict[str, int] = {}
    wrong: list[tuple[str, str, str]] = []

    async def worker(client: httpx.AsyncClient, index: int, stop_at: float) -> None:
        while time.monotonic() < stop_at:
            kind = rng.choices(["good", "disconnect", "hot", "bad"], [5, 2, 2, 1])[0]
            key = HOT_KEY if kind == "hot" else GOOD_KEYS[index]
            headers = {"authorization": f"Bearer {key}"}
            prompt = rng.choice(PROMPTS)
            if kind == "bad":
                content = rng.choice(BAD_BODIES)
                response = await client.post(
                    "/v1/completions",
                    content=content,
                    headers=headers | {"content-type": "application/json"},
                )
                assert 400 <= response.status_code < 500, response.text
                outcomes["bad"] = outcomes.get("bad", 0) + 1
                continue
            async with client.stream(
                "POST", "/v1/completions", json=body(prompt), headers=headers
            ) as response:
                if response.status_code == 429:
                    assert kind == "hot", await response.aread()
                    assert int(response.headers["retry-after"]) >= 1
                    outcomes["limited"] = outcomes.get("limited", 0) + 1
                    continue
                assert response.status_code == 200, await response.aread()
                if kind == "disconnect":
                    async for _ in response.aiter_lines():
                        if rng.random() < 0.3:
                            break
                    outcomes["disconnected"] = outcomes.get("disconnected", 0) + 1
                    continue
                text = (await response.aread()).decode()
            assert text.rstrip().endswith("data: [DONE]"), text[-300:]
            if text_of(text) != expected[prompt]:
                wrong.append((prompt, text_of(text), expected[prompt]))
            outcomes[kind] = outcomes.get(kind, 0) + 1

    async def run() -> None:
        # Idle connections expire on our side first (the server closes them after 5 s; a request
        # sent on one as it closes would fail, as with any HTTP/1.1 server).
        limits = httpx.Limits(
            max_connections=STREAMS + 10, max_keepalive_connections=STREAMS, keepalive_expiry=1
        )
        async with httpx.AsyncClient(base_url=base, timeout=300, limits=limits) as client:
            stop_at = time.monotonic() + DURATION_S
            await asyncio.gather(*(worker(client, i, stop_at) for i in range(STREAMS)))

    asyncio.run(run())
    assert not wrong, wrong[:3]
    assert outcomes.get("good", 0) >= STREAMS, outcomes
    assert outcomes.get("limited", 0) > 0 and outcomes.get("disconnected", 0) > 0, outcomes
    with httpx.Client(base_url=base, timeout=30, headers=auth) as client:
        deadline = time.monotonic() + 30
        while True:
            memory = client.get("/memory").json()
            state = (memory["kv_cache"]["blocks_used"], memory["requests"]["running"])
            state += (memory["requests"]["waiting"],)
            if state == (0, 0, 0) or time.monotonic() > deadline:
                break
            time.sleep(0.5)
        assert state == (0, 0, 0), memory
        assert client.get("/health").status_code == 200
    growth = rss_bytes(process.pid) - rss_before
    print(f"soak: {outcomes}; RSS growth {growth / 2**20:.1f} MiB")
    assert growth < RSS_GROWTH_BOUND, f"RSS grew by {growth / 2**20:.1f} MiB"
    assert "Traceback" not in log_path.read_text()
