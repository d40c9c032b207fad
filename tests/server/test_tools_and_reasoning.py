"""Tool calls and reasoning through the chat route, driven by a scripted engine.

The engine is faked at its boundary (the `AsyncLLM` the routes call): it replies with a fixed
text split into pieces, as a model's tokens would arrive, so the test controls exactly what the
parsers see; everything from the HTTP request to the SSE frames is the real server.
"""

from __future__ import annotations

import json
from types import SimpleNamespace

import openai
import pytest
from fastapi.testclient import TestClient

from metrale.engine_args import EngineArgs
from metrale.frontend.output_processor import CompletionDelta
from metrale.server.app import build_app
from metrale.server.state import ServerSettings, ServerState
from metrale.telemetry.hub import Telemetry
from metrale.tokenizer import Tokenizer

WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Weather in a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
        },
    },
}
USER = [{"role": "user", "content": "Weather in Paris?"}]
TOOL_REPLY = (
    "<think>The user wants weather.</think>Let me check.<tool_call>\n"
    '{"name": "get_weather", "arguments": {"city": "Paris", "days": 2}}\n</tool_call>'
)


class ScriptedLLM:
    """Replies to every request with `text`, delivered `piece_len` characters at a time."""

    is_alive = True
    client = SimpleNamespace(kv_cache=None, dead_reason=None, forward=None)

    def __init__(self, text: str, piece_len: int) -> None:
        self.text, self.piece_len = text, piece_len
        self.telemetry = Telemetry(None)

    async def generate(self, request, api="unknown", coalesce=True):
        pieces = [
            self.text[i : i + self.piece_len] for i in range(0, len(self.text), self.piece_len)
        ]
        for i, piece in enumerate(pieces):
            last = i == len(pieces) - 1
            yield CompletionDelta(
                request.request_id,
                [7],
                piece,
                None,
                finish_reason="stop" if last else None,
                num_prompt_tokens=len(request.prompt_token_ids),
            )


def client_for(qwen3_dir, text, piece_len=1, **settings) -> openai.OpenAI:
    config = EngineArgs(
        model_from_path=str(qwen3_dir), device="cpu", max_seq_len=512
    ).create_config()
    tokenizer = Tokenizer.from_dir(qwen3_dir)
    state = ServerState(
        ScriptedLLM(text, piece_len),
        tokenizer,
        config,
        ServerSettings(served_model_name="m", **settings),
    )
    return openai.OpenAI(
        base_url="http://testserver/v1",
        api_key="x",
        max_retries=0,
        http_client=TestClient(build_app(state)),
    )


PARSERS = {"tool_call_parser": "hermes", "reasoning_parser": "qwen3"}


def streamed(client, **kwargs):
    reasoning, content, calls, finish = "", "", {}, None
    for chunk in client.chat.completions.create(model="m", messages=USER, stream=True, **kwargs):
        choice = chunk.choices[0]
        delta = choice.delta
        reasoning += (delta.model_extra or {}).get("reasoning_content") or ""
        content += delta.content or ""
        for call in delta.tool_calls or []:
            entry = calls.setdefault(call.index, {"id": None, "name": None, "arguments": ""})
            if call.id:
                assert entry["id"] is None and entry["arguments"] == "", "name comes first"
                entry["id"], entry["name"] = call.id, call.function.name
            entry["arguments"] += call.function.arguments or ""
        finish = choice.finish_reason or finish
    return reasoning, content, list(calls.values()), finish


@pytest.mark.parametrize("piece_len", [1, 3, 17, 1000])
def test_tool_call_streamed_equals_non_streamed(qwen3_dir, piece_len):
    client = client_for(qwen3_dir, TOOL_REPLY, piece_len, **PARSERS)
    full = client.chat.completions.create(model="m", messages=USER, tools=[WEATHER_TOOL])
    message = full.choices[0].message
    assert full.choices[0].finish_reason == "tool_calls"
    assert message.content == "Let me check."
    assert message.model_extra["reasoning_content"] == "The user wants weather."
    (call,) = message.tool_calls
    assert call.function.name == "get_weather"
    assert json.loads(call.function.arguments) == {"city": "Paris", "days": 2}
    assert full.usage.completion_tokens_details.reasoning_tokens > 0

    reasoning, content, calls, finish = streamed(client, tools=[WEATHER_TOOL])
    assert (reasoning, content, finish) == (
        "The user wants weather.",
        "Let me check.",
        "tool_calls",
    )
    assert [(c["name"], c["arguments"]) for c in calls] == [
        ("get_weather", call.function.arguments)
    ]
    assert calls[0]["id"].startswith("call_") and calls[0]["id"] != call.id  # one per request


def test_tool_choice_none_leaves_the_text_alone(qwen3_dir):
    client = client_for(qwen3_dir, TOOL_REPLY, 5, **PARSERS)
    out = client.chat.completions.create(
        model="m", messages=USER, tools=[WEATHER_TOOL], tool_choice="none"
    )
    assert out.choices[0].message.tool_calls is None
    assert "<tool_call>" in out.choices[0].message.content
    assert out.choices[0].finish_reason == "stop"


def test_forced_tool_choice_needs_a_format_and_a_known_tool(qwen3_dir):
    client = client_for(qwen3_dir, TOOL_REPLY, 5)  # no tool-call parser
    with pytest.raises(openai.BadRequestError, match="needs a tool-call format"):
        client.chat.completions.create(
            model="m", messages=USER, tools=[WEATHER_TOOL], tool_choice="required"
        )
    client = client_for(qwen3_dir, TOOL_REPLY, 5, **PARSERS)
    with pytest.raises(openai.BadRequestError, match="not among the tools"):
        client.chat.completions.create(
            model="m",
            messages=USER,
            tools=[WEATHER_TOOL],
            tool_choice={"type": "function", "function": {"name": "nope"}},
        )


@pytest.mark.parametrize(
    "text",
    [
        '<tool_call>{"name": "get_weather", "arguments": {"city": "Par',  # cut off at EOS
        "<tool_call>not json at all</tool_call> and more",
        "<tool_call>",
        '<tool_call>{"name": "get_weather", "arguments": {}}</tool_call>'
        '<tool_call>{"name": "get_weather", "arguments": {"city": "Rome"}}</tool_call>',
    ],
)
def test_malformed_model_output_never_breaks_the_response(qwen3_dir, text):
    for piece_len in (1, 4, 1000):
        client = client_for(qwen3_dir, text, piece_len, **PARSERS)
        full = client.chat.completions.create(model="m", messages=USER, tools=[WEATHER_TOOL])
        _, content, calls, _ = streamed(client, tools=[WEATHER_TOOL])
        message = full.choices[0].message
        assert content == (message.content or "")
        assert [(c["name"], c["arguments"]) for c in calls] == [
            (c.function.name, c.function.arguments) for c in message.tool_calls or []
        ]
        for call in message.tool_calls or []:
            json.loads(call.function.arguments)  # always valid JSON when it is a call


def test_reasoning_field_choice(qwen3_dir):
    client = client_for(
        qwen3_dir, "<think>hmm</think>Hi!", 2, reasoning_parser="qwen3", reasoning_field="both"
    )
    message = client.chat.completions.create(model="m", messages=USER).choices[0].message
    assert message.content == "Hi!"
    assert message.model_extra["reasoning_content"] == message.model_extra["reasoning"] == "hmm"
    plain = client_for(qwen3_dir, "<think>hmm</think>Hi!", 2)
    assert (
        plain.chat.completions.create(model="m", messages=USER).choices[0].message.content
        == "<think>hmm</think>Hi!"
    )


class RecordingLLM(ScriptedLLM):
    """A scripted engine that keeps the requests it was given."""

    def __init__(self, text: str, piece_len: int) -> None:
        super().__init__(text, piece_len)
        self.requests = []
        self.coalesced = []  # whether each request's deltas may be merged

    async def generate(self, request, api="unknown", coalesce=True):
        self.requests.append(request)
        self.coalesced.append(coalesce)
        async for delta in super().generate(request):
            yield delta


def recording_client(qwen3_dir, **settings):
    config = EngineArgs(
        model_from_path=str(qwen3_dir), device="cpu", max_seq_len=512
    ).create_config()
    llm = RecordingLLM("<think>x</think>y", 4)
    state = ServerState(
        llm,
        Tokenizer.from_dir(qwen3_dir),
        config,
        ServerSettings(served_model_name="m", **settings),
    )
    return llm, TestClient(build_app(state))


def test_reasoning_effort_and_server_cap_become_a_thinking_budget(qwen3_dir):
    llm, http = recording_client(qwen3_dir, reasoning_parser="qwen3", max_thinking_budget=2000)
    body = {"model": "m", "messages": USER, "max_tokens": 5}
    assert http.post("/v1/chat/completions", json={**body, "reasoning_effort": "low"}).is_success
    assert http.post("/v1/chat/completions", json={**body, "reasoning_effort": "high"}).is_success
    assert http.post("/v1/chat/completions", json=body).is_success
    budgets = [r.sampling_params.thinking for r in llm.requests]
    assert [b.max_tokens for b in budgets] == [1024, 2000, 2000]  # the tighter limit wins
    tokenizer = Tokenizer.from_dir(qwen3_dir)
    assert budgets[0].start_token_id == tokenizer.token_to_id("<think>")
    assert budgets[0].end_token_id == tokenizer.token_to_id("</think>")


def test_a_tool_turn_with_a_prose_bound_takes_its_deltas_unmerged(qwen3_dir):
    """The prose bound ends a choice at a delta's end, so a stream that falls behind must not
    merge its deltas there; every other chat may."""
    llm, http = recording_client(qwen3_dir, tool_call_parser="hermes", max_inter_tool_prose=64)
    body = {"model": "m", "messages": USER, "max_tokens": 5}
    assert http.post("/v1/chat/completions", json=body).is_success
    assert http.post("/v1/chat/completions", json={**body, "tools": [WEATHER_TOOL]}).is_success
    unbounded = {**body, "tools": [WEATHER_TOOL], "max_inter_tool_prose": 0}
    assert http.post("/v1/chat/completions", json=unbounded).is_success
    function = WEATHER_TOOL["function"]
    tool = {"name": function["name"], "input_schema": function["parameters"]}
    anthropic = {"model": "m", "max_tokens": 5, "messages": USER, "tools": [tool]}
    assert http.post("/v1/messages", json=anthropic).is_success
    assert llm.coalesced == [True, False, True, False]


def test_disable_thinking_renders_every_prompt_without_it(qwen3_dir):
    llm, http = recording_client(qwen3_dir, reasoning_parser="qwen3", disable_thinking=True)
    http.post(
        "/v1/chat/completions",
        json={
            "model": "m",
            "messages": USER,
            "max_tokens": 5,
            "chat_template_kwargs": {"enable_thinking": True},
        },
    )
    tokenizer = Tokenizer.from_dir(qwen3_dir)
    prompt = tokenizer.decode(llm.requests[0].prompt_token_ids, skip_special_tokens=False)
    assert prompt.endswith("<think>\n\n</think>\n\n"), "the template's thinking-off form"


def test_anthropic_thinking_budget_tokens_become_the_engine_budget(qwen3_dir):
    llm, http = recording_client(qwen3_dir, reasoning_parser="qwen3", max_thinking_budget=3000)
    body = {"model": "m", "max_tokens": 20, "messages": USER}
    for thinking in (
        {"type": "enabled", "budget_tokens": 2048},
        {"type": "enabled", "budget_tokens": 8192},
        {"type": "disabled"},
    ):
        assert http.post("/v1/messages", json={**body, "thinking": thinking}).is_success
    assert [r.sampling_params.thinking.max_tokens for r in llm.requests] == [2048, 3000, 3000]


def test_no_parallel_tool_calls_stops_after_the_first_call(qwen3_dir):
    llm, http = recording_client(qwen3_dir, tool_call_parser="hermes")
    chat = {"model": "m", "messages": USER, "max_tokens": 50, "tools": [WEATHER_TOOL]}
    assert http.post("/v1/chat/completions", json={**chat, "parallel_tool_calls": False}).is_success
    assert http.post("/v1/chat/completions", json=chat).is_success
    tool = {"name": "get_weather", "input_schema": WEATHER_TOOL["function"]["parameters"]}
    messages = {
        "model": "m",
        "max_tokens": 50,
        "messages": USER,
        "tools": [tool],
        "tool_choice": {"type": "auto", "disable_parallel_tool_use": True},
    }
    assert http.post("/v1/messages", json=messages).is_success
    stops = [
        (r.sampling_params.stop, r.sampling_params.include_stop_str_in_output) for r in llm.requests
    ]
    assert stops == [(("</tool_call>",), True), ((), False), (("</tool_call>",), True)]


def test_a_grammar_may_start_with_a_blank_line_only_when_the_model_may_think(qwen3_dir):
    """Thinking templates write `</think>\\n\\n`: the grammar allows that blank line, but not for
    a reply that cannot think, where it would land in the content."""
    schema = {"type": "json_schema", "json_schema": {"name": "n", "schema": {"type": "object"}}}
    body = {"model": "m", "messages": USER, "max_tokens": 5, "response_format": schema}
    llm, http = recording_client(qwen3_dir, reasoning_parser="qwen3")
    for extra in ({}, {"chat_template_kwargs": {"enable_thinking": False}}):
        assert http.post("/v1/chat/completions", json={**body, **extra}).is_success
    llm_plain, plain = recording_client(qwen3_dir)
    assert plain.post("/v1/chat/completions", json=body).is_success
    leads = [r.sampling_params.structured.max_leading_newlines for r in llm.requests]
    assert leads == [2, 0]
    assert llm_plain.requests[0].sampling_params.structured.max_leading_newlines == 0
