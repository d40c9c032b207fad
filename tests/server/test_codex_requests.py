"""The requests Codex CLI 0.169 really sends (captured verbatim in
fixtures/codex_requests.json: its ~17 KB developer prompt, namespace and hosted tools, a
function call and its output), replayed against `met serve`: every one is served, with the
events Codex needs. The real client runs in test_codex.py (slow, it needs npm's codex).
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.conftest import build_checkpoint
from tests.server.conftest import MODEL_NAME, RunningServer, serving

FIXTURE = Path(__file__).parent / "fixtures" / "codex_requests.json"
WINDOW = 16384  # Codex's default request is about 10k tokens


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningServer]:
    model_dir = build_checkpoint(
        tmp_path_factory.mktemp("long-qwen3"), "qwen3", max_position_embeddings=WINDOW
    )
    with serving(
        model_dir,
        tmp_path_factory.mktemp("serve-codex-requests") / "server.log",
        "--max-seq-len",
        str(WINDOW),
        "--num-kv-blocks",
        str(WINDOW // 16 + 64),
        "--tool-call-parser",
        "hermes",
    ) as running:
        yield running


def captured() -> list[dict[str, Any]]:
    return [request["body"] for request in json.loads(FIXTURE.read_text())["requests"]]


def events_of(response: httpx.Response) -> list[dict[str, Any]]:
    events = []
    for frame in response.text.split("\n\n"):
        lines = frame.strip().splitlines()
        if not lines:
            continue
        name = lines[0].removeprefix("event: ")
        data = json.loads(lines[1].removeprefix("data: "))
        assert data["type"] == name
        events.append(data)
    return events


@pytest.mark.parametrize("turn", [0, 1], ids=["first turn", "after a function call"])
def test_captured_codex_request_is_served(served, turn):
    body = {**captured()[turn], "model": MODEL_NAME, "max_output_tokens": 8}
    # What Codex's default config adds to the tools (the capture's config turned it off).
    body["tools"] = [*body["tools"], {"type": "web_search", "external_web_access": True}]
    response = httpx.post(served.api_url + "/responses", json=body, timeout=120)
    assert response.status_code == 200, response.text
    assert response.headers["content-type"].startswith("text/event-stream")
    events = events_of(response)
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    assert events[0]["type"] == "response.created"
    final = events[-1]
    assert final["type"] in ("response.completed", "response.incomplete"), final
    assert final["response"]["id"] and final["response"]["usage"]["input_tokens"] > 5000
    # Every item is announced before its deltas and completed with the whole item.
    added = [e["item"]["id"] for e in events if e["type"] == "response.output_item.added"]
    done = {e["item"]["id"]: e["item"] for e in events if e["type"] == "response.output_item.done"}
    assert added == list(done) and [i["id"] for i in final["response"]["output"]] == added
    # Codex's hosted tools are left out, not refused.
    hosted = [t["type"] for t in body["tools"] if t["type"] not in ("function", "namespace")]
    warnings = final["response"].get("warnings", [])
    assert hosted and all(any(kind in w for w in warnings) for kind in hosted)
