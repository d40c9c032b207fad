"""Tool calls end to end: `met serve` on a checkpoint whose weights spell the model's reply.

The checkpoint (tests/scripted_checkpoint.py) answers a chat prompt with the fixed text of the
keyword in the user's message. Nothing is faked: the engine samples the model's tokens, the
detokenizer, the reasoning parser and the hermes parser read them, and the OpenAI and Anthropic
routes frame them; what the tests know is only what the model writes.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import anthropic
import httpx
import pytest

from tests.scripted_checkpoint import ScriptedCheckpoint, build_scripted_checkpoint
from tests.server.conftest import MODEL_NAME, RunningServer, serving

WEATHER_CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
TAXI_CALL = (
    '<tool_call>\n{"name": "book_taxi", "arguments": {"destination": "Louvre", "passengers": 2}}'
    "\n</tool_call>"
)
WEATHER = ("get_weather", {"city": "Paris"})
TAXI = ("book_taxi", {"destination": "Louvre", "passengers": 2})
THOUGHT = "The user wants the weather in Paris."


@dataclass(frozen=True)
class Scenario:
    keyword: str  # one demo-tokenizer token that picks the reply; in no reply and no tool
    reply: str  # what the model writes, byte for byte
    content: str | None  # what is left of it for `message.content`
    calls: tuple[tuple[str, dict[str, Any]], ...] = ()
    reasoning: str | None = None


SCENARIOS = {
    "one_call": Scenario(" harmonic", WEATHER_CALL, None, (WEATHER,)),
    # The text before a call keeps its newline, as vLLM's hermes parser keeps it.
    "text_then_call": Scenario(
        " median",
        "Let me check the weather.\n" + WEATHER_CALL,
        "Let me check the weather.\n",
        (WEATHER,),
    ),
    "two_calls": Scenario(" percentile", WEATHER_CALL + "\n" + TAXI_CALL, None, (WEATHER, TAXI)),
    "thinking_then_call": Scenario(
        " deviation", f"<think>\n{THOUGHT}\n</think>\n\n{WEATHER_CALL}", None, (WEATHER,), THOUGHT
    ),
    "plain_text": Scenario(" correlation", "It is sunny in Paris.", "It is sunny in Paris."),
}
CALL_SCENARIOS = [name for name, scenario in SCENARIOS.items() if scenario.calls]

FUNCTIONS = [
    {
        "name": "get_weather",
        "description": "Weather in a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
    },
    {
        "name": "book_taxi",
        "description": "Book a taxi",
        "parameters": {
            "type": "object",
            "properties": {"destination": {"type": "string"}, "passengers": {"type": "integer"}},
        },
    },
]
TOOLS = [{"type": "function", "function": f} for f in FUNCTIONS]
ANTHROPIC_TOOLS = [
    {"name": f["name"], "description": f["description"], "input_schema": f["parameters"]}
    for f in FUNCTIONS
]


@pytest.fixture(scope="module")
def scripted(tmp_path_factory: pytest.TempPathFactory) -> ScriptedCheckpoint:
    replies = {scenario.keyword: scenario.reply for scenario in SCENARIOS.values()}
    return build_scripted_checkpoint(tmp_path_factory.mktemp("scripted"), replies)


@pytest.fixture(scope="module")
def scripted_server(
    scripted: ScriptedCheckpoint, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[RunningServer]:
    log_path = tmp_path_factory.mktemp("serve-scripted") / "server.log"
    with serving(
        scripted.path, log_path, "--reasoning-parser", "qwen3", "--tool-call-parser", "hermes"
    ) as running:
        yield running


@pytest.fixture(scope="module")
def http(scripted_server: RunningServer) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=scripted_server.base_url, timeout=60) as client:
        yield client


def messages_for(scenario: Scenario) -> list[dict[str, Any]]:
    return [{"role": "user", "content": f"What is the weather in Paris?{scenario.keyword}"}]


def num_reply_tokens(scripted: ScriptedCheckpoint, scenario: Scenario) -> int:
    """The reply's tokens and the <|im_end|> that ends it."""
    return len(scripted.replies[scenario.keyword].token_ids) + 1


# --- OpenAI chat completions -----------------------------------------------------------------


def chat(http: httpx.Client, scenario: Scenario, **fields: Any) -> dict[str, Any]:
    body = {"model": MODEL_NAME, "messages": messages_for(scenario), "tools": TOOLS, **fields}
    response = http.post("/v1/chat/completions", json=body)
    assert response.status_code == 200, response.text
    return response.json()


@dataclass
class StreamedChoice:
    content: str = ""
    reasoning: str = ""
    calls: list[dict[str, str]] = field(default_factory=list)  # id, name, arguments
    finish_reason: str | None = None


def chat_stream(http: httpx.Client, scenario: Scenario, **fields: Any) -> StreamedChoice:
    """The streamed choice, checking that each call opens with its index, id, type and name
    and then only appends arguments, one call after another."""
    body = {
        "model": MODEL_NAME,
        "messages": messages_for(scenario),
        "tools": TOOLS,
        "stream": True,
        **fields,
    }
    response = http.post("/v1/chat/completions", json=body)
    assert response.status_code == 200, response.text
    frames = [frame for frame in response.text.split("\n\n") if frame]
    assert frames[-1] == "data: [DONE]"
    out = StreamedChoice()
    for frame in frames[:-1]:
        (choice,) = json.loads(frame.removeprefix("data: "))["choices"]
        delta = choice["delta"]
        out.content += delta.get("content") or ""
        out.reasoning += delta.get("reasoning_content") or ""
        for piece in delta.get("tool_calls") or []:
            if piece["index"] == len(out.calls):
                assert set(piece) == {"index", "id", "type", "function"}, piece
                assert piece["type"] == "function" and piece["function"]["name"], piece
                function = piece["function"]
                out.calls.append(
                    {
                        "id": piece["id"],
                        "name": function["name"],
                        "arguments": function.get("arguments") or "",
                    }
                )
            else:
                assert piece["index"] == len(out.calls) - 1, "a call reopened or skipped ahead"
                assert set(piece) == {"index", "function"}, piece
                assert set(piece["function"]) == {"arguments"}, piece
                out.calls[-1]["arguments"] += piece["function"]["arguments"]
        if choice["finish_reason"] is not None:
            assert out.finish_reason is None, "finish_reason comes once"
            out.finish_reason = choice["finish_reason"]
    return out


def call_pairs(message: dict[str, Any]) -> list[tuple[str, str]]:
    return [(c["function"]["name"], c["function"]["arguments"]) for c in message["tool_calls"]]


@pytest.mark.parametrize("name", list(SCENARIOS))
def test_the_model_writes_its_reply_through_the_engine(http, scripted, name):
    """tool_choice none leaves the text alone: the whole reply, then a stop at <|im_end|>."""
    scenario = SCENARIOS[name]
    response = chat(http, scenario, tool_choice="none")
    (choice,) = response["choices"]
    reasoning = choice["message"].get("reasoning_content")
    text = choice["message"]["content"]
    if scenario.reasoning is None:
        assert (reasoning, text) == (None, scenario.reply)
    else:
        assert (reasoning, text) == (scenario.reasoning, scenario.reply.split("</think>\n\n")[1])
    assert choice["finish_reason"] == "stop" and "tool_calls" not in choice["message"]
    assert response["usage"]["completion_tokens"] == num_reply_tokens(scripted, scenario)


@pytest.mark.parametrize("name", CALL_SCENARIOS)
def test_chat_tool_calls_streamed_equal_non_streamed(http, scripted, name):
    scenario = SCENARIOS[name]
    response = chat(http, scenario)
    (choice,) = response["choices"]
    message = choice["message"]
    assert choice["finish_reason"] == "tool_calls"
    assert message["content"] == scenario.content
    assert message.get("reasoning_content") == scenario.reasoning
    calls = message["tool_calls"]
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls] == list(
        scenario.calls
    )
    assert all(c["type"] == "function" and c["id"].startswith("call_") for c in calls)
    assert len({c["id"] for c in calls}) == len(calls)
    usage = response["usage"]
    assert usage["completion_tokens"] == num_reply_tokens(scripted, scenario)
    assert (usage["completion_tokens_details"]["reasoning_tokens"] > 0) == (
        scenario.reasoning is not None
    )

    streamed = chat_stream(http, scenario)
    assert streamed.finish_reason == "tool_calls"
    assert streamed.content == (scenario.content or "")
    assert streamed.reasoning == (scenario.reasoning or "")
    assert [(c["name"], c["arguments"]) for c in streamed.calls] == call_pairs(message)
    assert all(c["id"].startswith("call_") for c in streamed.calls)
    assert len({c["id"] for c in streamed.calls}) == len(streamed.calls)


def test_plain_text_with_tools_offered_is_content(http, scripted):
    scenario = SCENARIOS["plain_text"]
    response = chat(http, scenario)
    (choice,) = response["choices"]
    assert choice["message"]["content"] == scenario.reply
    assert choice["message"].get("tool_calls") is None
    assert choice["finish_reason"] == "stop"
    streamed = chat_stream(http, scenario)
    assert (streamed.content, streamed.calls, streamed.finish_reason) == (
        scenario.reply,
        [],
        "stop",
    )


@pytest.mark.parametrize("tool_choice", ["auto", "required"])
def test_no_parallel_tool_calls_ends_the_reply_after_the_first_call(http, tool_choice):
    scenario = SCENARIOS["two_calls"]
    fields = {"tool_choice": tool_choice, "parallel_tool_calls": False}
    response = chat(http, scenario, **fields)
    (choice,) = response["choices"]
    assert choice["finish_reason"] == "tool_calls"
    assert [(name, json.loads(args)) for name, args in call_pairs(choice["message"])] == [WEATHER]
    streamed = chat_stream(http, scenario, **fields)
    assert streamed.finish_reason == "tool_calls"
    assert [(c["name"], c["arguments"]) for c in streamed.calls] == call_pairs(choice["message"])


def test_required_admits_the_models_parallel_calls(http, scripted):
    """With parallel calls allowed, the grammar takes the second call too, token for token:
    the reply is what tool_choice auto gives."""
    scenario = SCENARIOS["two_calls"]
    auto = chat(http, scenario)
    forced = chat(http, scenario, tool_choice="required")
    (choice,) = forced["choices"]
    assert choice["finish_reason"] == "tool_calls"
    calls = call_pairs(choice["message"])
    assert [(name, json.loads(args)) for name, args in calls] == [WEATHER, TAXI]
    assert calls == call_pairs(auto["choices"][0]["message"])
    assert forced["usage"]["completion_tokens"] == num_reply_tokens(scripted, scenario)
    streamed = chat_stream(http, scenario, tool_choice="required")
    assert streamed.finish_reason == "tool_calls"
    assert [(c["name"], c["arguments"]) for c in streamed.calls] == calls


@pytest.mark.parametrize(
    "tool_choice", ["required", {"type": "function", "function": {"name": "get_weather"}}]
)
def test_forced_tool_choice_admits_the_models_own_call(http, scripted, tool_choice):
    """The grammar accepts the call token for token: the reply is what tool_choice auto gives."""
    scenario = SCENARIOS["one_call"]
    auto = chat(http, scenario)
    forced = chat(http, scenario, tool_choice=tool_choice)
    (choice,) = forced["choices"]
    assert choice["finish_reason"] == "tool_calls"
    assert call_pairs(choice["message"]) == call_pairs(auto["choices"][0]["message"])
    assert forced["usage"]["completion_tokens"] == num_reply_tokens(scripted, scenario)


@pytest.mark.parametrize("fields", [{}, {"reasoning_effort": "high"}])
def test_forced_tool_choice_lets_the_model_think_first(http, fields):
    scenario = SCENARIOS["thinking_then_call"]
    (choice,) = chat(http, scenario, tool_choice="required", **fields)["choices"]
    assert choice["message"].get("reasoning_content") == THOUGHT
    assert call_pairs(choice["message"])[0][0] == "get_weather"


# --- Anthropic messages ----------------------------------------------------------------------


def messages_body(scenario: Scenario, **fields: Any) -> dict[str, Any]:
    return {
        "model": MODEL_NAME,
        "max_tokens": 256,
        "messages": messages_for(scenario),
        "tools": ANTHROPIC_TOOLS,
        **fields,
    }


def expected_blocks(scenario: Scenario) -> list[dict[str, Any]]:
    """The reply's content blocks, tool_use ids left out."""
    blocks: list[dict[str, Any]] = []
    if scenario.reasoning is not None:
        blocks.append({"type": "thinking", "thinking": scenario.reasoning, "signature": ""})
    if scenario.content is not None:
        blocks.append({"type": "text", "text": scenario.content})
    blocks += [{"type": "tool_use", "name": name, "input": args} for name, args in scenario.calls]
    return blocks


def streamed_blocks(http: httpx.Client, scenario: Scenario) -> tuple[list[dict[str, Any]], dict]:
    """The blocks the stream's events build, with each tool_use's raw `partial_json` text,
    and the `message_delta` event."""
    response = http.post("/v1/messages", json=messages_body(scenario, stream=True))
    assert response.status_code == 200, response.text
    events = []
    for frame in response.text.split("\n\n"):
        if frame:
            name_line, data_line = frame.split("\n")
            event = json.loads(data_line.removeprefix("data: "))
            assert name_line == f"event: {event['type']}"
            events.append(event)
    assert [e["type"] for e in events[:2]] == ["message_start", "ping"]
    assert [e["type"] for e in events[-2:]] == ["message_delta", "message_stop"]
    blocks: list[dict[str, Any]] = []
    for event in events[2:-2]:
        if event["type"] == "content_block_start":
            assert event["index"] == len(blocks)
            blocks.append(dict(event["content_block"]))
            if blocks[-1]["type"] == "tool_use":
                assert blocks[-1].pop("input") == {}
                blocks[-1]["partial_json"] = ""
        elif event["type"] == "content_block_delta":
            assert event["index"] == len(blocks) - 1
            delta, block = event["delta"], blocks[-1]
            key = {
                "text_delta": "text",
                "thinking_delta": "thinking",
                "signature_delta": "signature",
                "input_json_delta": "partial_json",
            }[delta["type"]]
            block[key] += delta[key]
        else:
            assert event == {"type": "content_block_stop", "index": len(blocks) - 1}
    return blocks, events[-2]


@pytest.mark.parametrize("name", [*CALL_SCENARIOS, "plain_text"])
def test_messages_tool_use_streamed_equals_non_streamed(http, scripted, name):
    scenario = SCENARIOS[name]
    response = http.post("/v1/messages", json=messages_body(scenario))
    assert response.status_code == 200, response.text
    reply = response.json()
    tool_uses = [b for b in reply["content"] if b["type"] == "tool_use"]
    assert all(b.pop("id").startswith("toolu_") for b in tool_uses)
    assert reply["content"] == expected_blocks(scenario)
    stop_reason = "tool_use" if scenario.calls else "end_turn"
    assert (reply["stop_reason"], reply["stop_sequence"]) == (stop_reason, None)
    assert reply["usage"]["output_tokens"] == num_reply_tokens(scripted, scenario)

    blocks, message_delta = streamed_blocks(http, scenario)
    streamed_uses = [b for b in blocks if b["type"] == "tool_use"]
    assert all(b.pop("id").startswith("toolu_") for b in streamed_uses)
    for block in streamed_uses:
        block["input"] = json.loads(block.pop("partial_json"))
    assert blocks == reply["content"]
    assert message_delta["delta"] == {"stop_reason": stop_reason, "stop_sequence": None}
    assert message_delta["usage"]["output_tokens"] == reply["usage"]["output_tokens"]


@pytest.mark.parametrize("name", CALL_SCENARIOS)
def test_anthropic_sdk_stream_assembles_the_same_message(scripted_server, name):
    scenario = SCENARIOS[name]
    client = anthropic.Anthropic(base_url=scripted_server.base_url, api_key="x", max_retries=0)
    whole = client.messages.create(**messages_body(scenario))
    with client.messages.stream(**messages_body(scenario)) as stream:
        streamed = stream.get_final_message()

    def blocks(message: anthropic.types.Message) -> list[dict[str, Any]]:
        return [b.model_dump(exclude={"id"}, exclude_none=True) for b in message.content]

    assert blocks(streamed) == blocks(whole) == expected_blocks(scenario)
    assert streamed.stop_reason == whole.stop_reason == "tool_use"


def test_anthropic_tool_choice_any_admits_the_models_own_call(http):
    scenario = SCENARIOS["one_call"]
    body = messages_body(scenario, tool_choice={"type": "any"})
    reply = http.post("/v1/messages", json=body).json()
    assert [(b["type"], b["name"], b["input"]) for b in reply["content"]] == [
        ("tool_use", *WEATHER)
    ]
    assert reply["stop_reason"] == "tool_use"


@pytest.mark.parametrize(
    ("disable_parallel", "calls"), [(False, [WEATHER, TAXI]), (True, [WEATHER])]
)
def test_anthropic_tool_choice_any_and_parallel_tool_use(http, disable_parallel, calls):
    scenario = SCENARIOS["two_calls"]
    choice = {"type": "any", "disable_parallel_tool_use": disable_parallel}
    reply = http.post("/v1/messages", json=messages_body(scenario, tool_choice=choice)).json()
    assert [(b["type"], b["name"], b["input"]) for b in reply["content"]] == [
        ("tool_use", *call) for call in calls
    ]
    assert reply["stop_reason"] == "tool_use"
