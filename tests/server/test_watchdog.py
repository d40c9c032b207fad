"""The watchdogs end to end. The content loop: a scripted checkpoint whose reply says one
sentence nine times; with the watchdog on, the reply ends once the sentence has looped, as
`stop` with `stop_reason` content_loop, and `/metrics` counts it; a request can turn it off or
on. The inter-tool prose bound: a reply that calls a tool, drifts into prose, then calls
another ends in the prose, on every API, streaming or not, for each of `n` choices."""

from __future__ import annotations

import json
from collections.abc import Iterator

import httpx
import pytest

from tests.scripted_checkpoint import ScriptedCheckpoint, build_scripted_checkpoint
from tests.server.conftest import MODEL_NAME, RunningServer, serving

KEYWORD = " harmonic"
SENTENCE = "I will check it now. "  # 6 tokens; after the first copy it starts with " I"
REPLY = SENTENCE * 9 + "Done."
# Period 6 needs max(4, ceil(32 / 6)) = 6 copies: 36 tokens whose every token equals the one 6
# before it. The first copy's first token ("I", not " I") starts no such run, so the run starts
# at the first copy's second token and the 37th output token completes the loop.
LOOP_ENDS_AT = 37


THINKING_KEYWORD = " median"
THINKING_REPLY = "<think>\n" + SENTENCE * 9 + "</think>\n\nDone."

PROSE_KEYWORD = " percentile"
PROSE = (
    "Now that the forecast is known, let me explain at some length what it means for your "
    "plans, and why a taxi might be wise before we book anything at all."
)
PROSE_REPLY = (
    '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
    + PROSE
    + '\n<tool_call>\n{"name": "book_taxi", "arguments": {"destination": "Louvre"}}\n</tool_call>'
)
MAX_PROSE = 12  # tokens; the prose is over twice as long
FUNCTIONS = [
    {"name": name, "parameters": {"type": "object", "properties": {key: {"type": "string"}}}}
    for name, key in (("get_weather", "city"), ("book_taxi", "destination"))
]


@pytest.fixture(scope="module")
def scripted(tmp_path_factory: pytest.TempPathFactory) -> ScriptedCheckpoint:
    replies = {KEYWORD: REPLY, THINKING_KEYWORD: THINKING_REPLY, PROSE_KEYWORD: PROSE_REPLY}
    return build_scripted_checkpoint(tmp_path_factory.mktemp("looping"), replies)


@pytest.fixture(scope="module")
def watched(scripted, tmp_path_factory) -> Iterator[RunningServer]:
    log_path = tmp_path_factory.mktemp("serve-watchdog") / "server.log"
    args = (
        "--content-loop-watchdog",
        "on",
        "--reasoning-parser",
        "qwen3",
        "--tool-call-parser",
        "hermes",
        "--max-inter-tool-prose",
        str(MAX_PROSE),
    )
    with serving(scripted.path, log_path, *args) as running:
        yield running


def chat(server: RunningServer, keyword: str = KEYWORD, **extra) -> dict:
    body = {
        "model": MODEL_NAME,
        "messages": [{"role": "user", "content": f"Check it{keyword}"}],
        "max_tokens": 200,
        **extra,
    }
    response = httpx.post(server.api_url + "/chat/completions", json=body, timeout=60)
    assert response.status_code == 200, response.text
    return response.json()


def fires(server: RunningServer, watchdog: str = "content_loop") -> float:
    text = httpx.get(server.base_url + "/metrics", timeout=10).text
    for line in text.splitlines():
        if line.startswith("metrale:watchdog_fires_total{") and f'watchdog="{watchdog}"' in line:
            return float(line.rsplit(" ", 1)[1])
    return 0.0


def test_a_looping_reply_ends_with_the_watchdogs_stop_reason(watched, scripted):
    before = fires(watched)
    reply = chat(watched)
    (choice,) = reply["choices"]
    assert choice["finish_reason"] == "stop" and choice["stop_reason"] == "content_loop"
    assert reply["usage"]["completion_tokens"] == LOOP_ENDS_AT
    assert REPLY.startswith(choice["message"]["content"])
    assert fires(watched) == before + 1
    config = httpx.get(watched.base_url + "/serve-config").json()
    assert config["behavior_sources"]["content_loop_watchdog"] == "--content-loop-watchdog"


def test_a_request_may_turn_the_watchdog_off_or_ask_for_more_repeats(watched, scripted):
    whole = chat(watched, content_loop_watchdog=False)
    (choice,) = whole["choices"]
    assert choice["message"]["content"] == REPLY and choice["stop_reason"] is None
    # eight copies asked for: 48 tokens of period 6 from the first copy's second token
    later = chat(watched, content_loop_min_repeats=8)
    assert later["usage"]["completion_tokens"] == 1 + 48
    assert later["choices"][0]["stop_reason"] == "content_loop"


def test_the_watchdog_is_off_by_default_and_a_request_can_turn_it_on(scripted, tmp_path):
    with serving(scripted.path, tmp_path / "server.log") as plain:
        assert chat(plain)["choices"][0]["message"]["content"] == REPLY
        on = chat(plain, content_loop_watchdog=True)
        assert on["usage"]["completion_tokens"] == LOOP_ENDS_AT
        bad = httpx.post(
            plain.api_url + "/chat/completions",
            json={"model": MODEL_NAME, "messages": [], "content_loop_min_repeats": 1},
            timeout=30,
        )
        assert bad.status_code == 400


def test_a_looping_thinking_block_is_closed_not_the_reply(watched):
    """In a thinking block the watchdog forces </think> (the scripted model, past its script,
    then ends the turn): the reasoning is cut where it looped and the reply was not stopped."""
    before = fires(watched, "thinking_loop")
    reply = chat(watched, THINKING_KEYWORD)
    (choice,) = reply["choices"]
    reasoning = choice["message"]["reasoning_content"]
    assert SENTENCE * 5 in reasoning and SENTENCE * 9 not in reasoning
    assert choice["stop_reason"] != "content_loop"
    assert fires(watched, "thinking_loop") == before + 1


def finished(server: RunningServer, reason: str) -> float:
    text = httpx.get(server.base_url + "/metrics", timeout=10).text
    for line in text.splitlines():
        if line.startswith("metrale:request_success_total{") and f'"{reason}"' in line:
            return float(line.rsplit(" ", 1)[1])
    return 0.0


def tool_chat(server: RunningServer, **extra) -> dict:
    tools = [{"type": "function", "function": f} for f in FUNCTIONS]
    return chat(server, PROSE_KEYWORD, tools=tools, **extra)


def test_prose_between_tool_calls_past_the_bound_ends_the_turn(watched):
    before, aborts = fires(watched, "inter_tool_prose"), finished(watched, "abort")
    reply = tool_chat(watched, n=2)
    for choice in reply["choices"]:
        assert choice["finish_reason"] == "tool_calls"
        assert choice["stop_reason"] == "inter_tool_prose"
        message = choice["message"]
        assert [c["function"]["name"] for c in message["tool_calls"]] == ["get_weather"]
        assert PROSE.startswith(message["content"].strip()) and message["content"].strip()
    # the first call is 19 tokens, then the prose up to the bound (and the newline after it)
    assert reply["usage"]["completion_tokens"] <= 2 * (19 + MAX_PROSE + 2)
    assert fires(watched, "inter_tool_prose") == before + 2
    assert finished(watched, "abort") == aborts  # ended, not aborted
    config = httpx.get(watched.base_url + "/serve-config").json()
    assert config["behavior_sources"]["max_inter_tool_prose"] == "--max-inter-tool-prose"
    assert config["server"]["max_inter_tool_prose"] == MAX_PROSE


def test_a_request_may_lift_the_bound(watched):
    (choice,) = tool_chat(watched, max_inter_tool_prose=0)["choices"]
    assert choice["finish_reason"] == "tool_calls" and choice["stop_reason"] is None
    calls = choice["message"]["tool_calls"]
    assert [c["function"]["name"] for c in calls] == ["get_weather", "book_taxi"]
    bad = httpx.post(
        watched.api_url + "/chat/completions",
        json={"model": MODEL_NAME, "messages": [], "max_inter_tool_prose": -1},
        timeout=30,
    )
    assert bad.status_code == 400


def test_the_bound_ends_a_stream_and_the_other_apis_too(watched):
    tools = [{"type": "function", "function": f} for f in FUNCTIONS]
    messages = [{"role": "user", "content": f"Check it{PROSE_KEYWORD}"}]
    body = {"model": MODEL_NAME, "messages": messages, "tools": tools, "stream": True}
    names, reasons = [], []
    with httpx.stream("POST", watched.api_url + "/chat/completions", json=body, timeout=60) as r:
        for line in r.iter_lines():
            if not line.startswith("data: {"):
                continue
            for choice in json.loads(line[6:])["choices"]:
                names += [c["function"].get("name") for c in choice["delta"].get("tool_calls", [])]
                reasons.append(choice["finish_reason"])
    assert [n for n in names if n] == ["get_weather"] and reasons[-1] == "tool_calls"

    anthropic_tools = [{"name": f["name"], "input_schema": f["parameters"]} for f in FUNCTIONS]
    body = {"model": MODEL_NAME, "messages": messages, "tools": anthropic_tools, "max_tokens": 200}
    message = httpx.post(watched.base_url + "/v1/messages", json=body, timeout=60).json()
    assert message["stop_reason"] == "tool_use"
    assert [b["name"] for b in message["content"] if b["type"] == "tool_use"] == ["get_weather"]

    response_tools = [{"type": "function", **f} for f in FUNCTIONS]
    body = {"model": MODEL_NAME, "input": messages[0]["content"], "tools": response_tools}
    response = httpx.post(watched.api_url + "/responses", json=body, timeout=60).json()
    assert response["status"] == "completed"
    calls = [item["name"] for item in response["output"] if item["type"] == "function_call"]
    assert calls == ["get_weather"]
