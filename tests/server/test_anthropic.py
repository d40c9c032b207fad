"""The Anthropic Messages API, driven by a scripted engine: blocks, events, stops, errors.

As in the chat route's tests, the engine is faked at the `AsyncLLM` boundary and replies with a
fixed text split into pieces, so the test controls what the parsers see; everything from the
HTTP request to the SSE frames is the real server, read raw and through the `anthropic` SDK.
"""

from __future__ import annotations

import json
from types import SimpleNamespace

import anthropic
import pytest
from fastapi.testclient import TestClient

from metrale.engine.client import EngineDeadError
from metrale.engine_args import EngineArgs
from metrale.server.app import build_app
from metrale.server.state import ServerSettings, ServerState
from metrale.tokenizer import Tokenizer
from tests.server.test_tools_and_reasoning import PARSERS, TOOL_REPLY, ScriptedLLM

WEATHER_TOOL = {
    "name": "get_weather",
    "description": "Weather in a city",
    "input_schema": {
        "type": "object",
        "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
    },
}
USER = [{"role": "user", "content": "Weather in Paris?"}]
BILLING = "x-anthropic-billing-header: cc_version=2.1.117.{}; cc_entrypoint=cli; cch={};"


class ScriptedEngine(ScriptedLLM):
    """The chat tests' scripted engine, ending as told, failing if told, keeping its requests."""

    def __init__(
        self,
        text: str,
        piece_len: int,
        finish_reason: str = "stop",
        stop_reason: str | int | None = None,
        num_cached_tokens: int = 0,
        error: Exception | None = None,
    ) -> None:
        super().__init__(text, piece_len)
        self.finish_reason, self.stop_reason = finish_reason, stop_reason
        self.num_cached_tokens, self.error = num_cached_tokens, error
        self.requests = []

    async def generate(self, request, api="unknown", coalesce=True):
        self.requests.append(request)
        async for delta in super().generate(request):
            delta.num_cached_tokens = self.num_cached_tokens
            if delta.finished:
                delta.finish_reason, delta.stop_reason = self.finish_reason, self.stop_reason
            yield delta
            if self.error is not None:
                raise self.error


@pytest.fixture(scope="module")
def serving(qwen3_dir):
    """A function making (engine, HTTP client) pairs that share one config and tokenizer."""
    config = EngineArgs(
        model_from_path=str(qwen3_dir), device="cpu", max_seq_len=512
    ).create_config()
    tokenizer = Tokenizer.from_dir(qwen3_dir)

    def make(text="Hello there.", piece_len=1, settings=PARSERS, **script):
        engine = ScriptedEngine(text, piece_len, **script)
        state = ServerState(
            engine, tokenizer, config, ServerSettings(served_model_name="m", **settings)
        )
        return engine, TestClient(build_app(state))

    make.tokenizer = tokenizer
    return make


def sdk(http: TestClient) -> anthropic.Anthropic:
    return anthropic.Anthropic(
        base_url="http://testserver", api_key="x", max_retries=0, http_client=http
    )


def body(**fields):
    return {"model": "m", "max_tokens": 64, "messages": USER, **fields}


def events(http: TestClient, **fields) -> list[dict]:
    """The stream's events, checking each frame's SSE name against its payload's type."""
    response = http.post("/v1/messages", json=body(stream=True, **fields))
    assert response.status_code == 200, response.text
    assert response.headers["content-type"].startswith("text/event-stream")
    out = []
    for frame in response.text.split("\n\n"):
        if not frame:
            continue
        name_line, data_line = frame.split("\n")
        payload = json.loads(data_line.removeprefix("data: "))
        assert name_line == f"event: {payload['type']}"
        out.append(payload)
    return out


def shape(stream: list[dict]) -> list[tuple]:
    """(type, block index, delta type) of each event, runs of equal ones collapsed to one."""
    steps = [(e["type"], e.get("index"), e.get("delta", {}).get("type")) for e in stream]
    return [step for i, step in enumerate(steps) if i == 0 or step != steps[i - 1]]


def without_ids(message) -> list[dict]:
    return [b.model_dump(exclude={"id"}, exclude_none=True) for b in message.content]


def test_reply_is_thinking_text_and_tool_use_blocks(serving):
    _, http = serving(TOOL_REPLY, 5)
    reply = http.post("/v1/messages", json=body(tools=[WEATHER_TOOL])).json()
    assert reply["id"].startswith("msg_")
    assert (reply["type"], reply["role"], reply["model"]) == ("message", "assistant", "m")
    thinking, text, tool_use = reply["content"]
    assert thinking == {"type": "thinking", "thinking": "The user wants weather.", "signature": ""}
    assert text == {"type": "text", "text": "Let me check."}
    assert tool_use["type"] == "tool_use" and tool_use["id"].startswith("toolu_")
    assert (tool_use["name"], tool_use["input"]) == ("get_weather", {"city": "Paris", "days": 2})
    assert (reply["stop_reason"], reply["stop_sequence"]) == ("tool_use", None)
    assert reply["usage"] == {
        "input_tokens": reply["usage"]["input_tokens"],
        "cache_creation_input_tokens": 0,
        "cache_read_input_tokens": 0,
        "output_tokens": len(range(0, len(TOOL_REPLY), 5)),  # the script's one token a piece
    }


def test_stream_event_sequence_split_at_every_character(serving):
    _, http = serving(TOOL_REPLY, 1)
    stream = events(http, tools=[WEATHER_TOOL])
    assert shape(stream) == [
        ("message_start", None, None),
        ("ping", None, None),
        ("content_block_start", 0, None),
        ("content_block_delta", 0, "thinking_delta"),
        ("content_block_delta", 0, "signature_delta"),
        ("content_block_stop", 0, None),
        ("content_block_start", 1, None),
        ("content_block_delta", 1, "text_delta"),
        ("content_block_stop", 1, None),
        ("content_block_start", 2, None),
        ("content_block_delta", 2, "input_json_delta"),
        ("content_block_stop", 2, None),
        ("message_delta", None, None),
        ("message_stop", None, None),
    ]
    start = stream[0]["message"]
    assert (start["content"], start["stop_reason"], start["stop_sequence"]) == ([], None, None)
    starts = [e["content_block"] for e in stream if e["type"] == "content_block_start"]
    assert starts[2].pop("id").startswith("toolu_")
    assert starts == [
        {"type": "thinking", "thinking": "", "signature": ""},
        {"type": "text", "text": ""},
        {"type": "tool_use", "name": "get_weather", "input": {}},
    ]
    deltas = [e["delta"] for e in stream if e["type"] == "content_block_delta"]
    assert "".join(d.get("thinking", "") for d in deltas) == "The user wants weather."
    assert "".join(d.get("text", "") for d in deltas) == "Let me check."
    arguments = "".join(d.get("partial_json", "") for d in deltas)
    assert json.loads(arguments) == {"city": "Paris", "days": 2}
    end = stream[-2]
    assert end["delta"] == {"stop_reason": "tool_use", "stop_sequence": None}
    assert end["usage"]["output_tokens"] == len(TOOL_REPLY)


@pytest.mark.parametrize("piece_len", [1, 3, 17, 1000])
def test_sdk_stream_assembles_the_same_message(serving, piece_len):
    _, http = serving(TOOL_REPLY, piece_len)
    client = sdk(http)
    whole = client.messages.create(**body(tools=[WEATHER_TOOL]))
    with client.messages.stream(**body(tools=[WEATHER_TOOL])) as stream:
        streamed = stream.get_final_message()
    assert without_ids(streamed) == without_ids(whole)
    assert [b.type for b in whole.content] == ["thinking", "text", "tool_use"]
    assert streamed.stop_reason == whole.stop_reason == "tool_use"
    assert streamed.usage == whole.usage


@pytest.mark.parametrize(
    "text",
    [
        '<tool_call>{"name": "get_weather", "arguments": {"city": "Par',  # cut off at EOS
        "<tool_call>not json at all</tool_call> and more",
        "<tool_call>",
        "  \n ",
        '<tool_call>{"name": "get_weather", "arguments": {}}</tool_call>\n'
        '<tool_call>{"name": "get_weather", "arguments": {"city": "Rome"}}</tool_call>',
    ],
)
def test_malformed_model_output_still_makes_valid_blocks(serving, text):
    for piece_len in (1, 4, 1000):
        _, http = serving(text, piece_len)
        client = sdk(http)
        whole = client.messages.create(**body(tools=[WEATHER_TOOL]))
        with client.messages.stream(**body(tools=[WEATHER_TOOL])) as stream:
            streamed = stream.get_final_message()
        assert without_ids(streamed) == without_ids(whole)
        for block in whole.content:
            assert block.type in ("text", "tool_use")
            assert block.type != "text" or block.text.strip(), "no whitespace-only text blocks"
            assert block.type != "tool_use" or isinstance(block.input, dict)
        calls = [b for b in whole.content if b.type == "tool_use"]
        assert whole.stop_reason == ("tool_use" if calls else "end_turn")


@pytest.mark.parametrize(
    ("script", "tools", "stop_reason", "stop_sequence"),
    [
        ({}, False, "end_turn", None),
        ({"finish_reason": "length"}, False, "max_tokens", None),
        ({"stop_reason": "END"}, False, "stop_sequence", "END"),
        ({"stop_reason": 151645}, False, "end_turn", None),  # a stop token, not a sequence
        ({"text": TOOL_REPLY}, True, "tool_use", None),
        ({"text": TOOL_REPLY, "finish_reason": "length"}, True, "max_tokens", None),
    ],
)
def test_stop_reason(serving, script, tools, stop_reason, stop_sequence):
    _, http = serving(**script)
    client = sdk(http)
    fields = body(tools=[WEATHER_TOOL] if tools else None, stop_sequences=["END"])
    fields = {k: v for k, v in fields.items() if v is not None}
    whole = client.messages.create(**fields)
    with client.messages.stream(**fields) as stream:
        streamed = stream.get_final_message()
    for message in (whole, streamed):
        assert (message.stop_reason, message.stop_sequence) == (stop_reason, stop_sequence)


def test_max_tokens_past_the_context_window_runs_to_its_end(serving):
    engine, http = serving(finish_reason="length")
    reply = http.post("/v1/messages", json=body(max_tokens=32_000)).json()
    num_prompt = len(engine.requests[-1].prompt_token_ids)
    assert engine.requests[-1].sampling_params.max_tokens == 512 - num_prompt
    assert reply["stop_reason"] == "model_context_window_exceeded"
    reply = http.post("/v1/messages", json=body(max_tokens=512 - num_prompt)).json()
    assert reply["stop_reason"] == "max_tokens"  # the window held all that was asked for


def test_usage_counts_prefix_cache_hits_as_cache_reads(serving):
    _, http = serving(num_cached_tokens=32)
    total = http.post("/v1/messages/count_tokens", json=body()).json()["input_tokens"]
    usage = http.post("/v1/messages", json=body()).json()["usage"]
    assert usage["cache_read_input_tokens"] == 32
    assert usage["input_tokens"] + usage["cache_read_input_tokens"] == total
    stream = events(http)
    assert stream[0]["message"]["usage"]["input_tokens"] == total  # before the cache lookup
    assert stream[-2]["usage"] == usage


def rendered(engine, tokenizer) -> str:
    return tokenizer.decode(engine.requests[-1].prompt_token_ids, skip_special_tokens=False)


def test_history_is_rendered_through_the_chat_template(serving):
    engine, http = serving()
    history = [
        {"role": "user", "content": "Weather in Paris?"},
        {
            "role": "assistant",
            "content": [
                {"type": "thinking", "thinking": "Look it up.", "signature": "sig"},
                {"type": "redacted_thinking", "data": "opaque"},
                {"type": "text", "text": "Checking."},
                {
                    "type": "tool_use",
                    "id": "toolu_1",
                    "name": "get_weather",
                    "input": {"city": "Paris"},
                },
            ],
        },
        {
            "role": "user",
            "content": [
                {
                    "type": "tool_result",
                    "tool_use_id": "toolu_1",
                    "content": [{"type": "text", "text": "Sunny"}, {"type": "text", "text": "20C"}],
                },
                {
                    "type": "tool_result",
                    "tool_use_id": "toolu_2",
                    "content": "Windy",
                    "is_error": True,
                },
                {"type": "text", "text": "And tomorrow?"},
            ],
        },
    ]
    system = [
        {"type": "text", "text": BILLING.format("48f", "71fea")},
        {"type": "text", "text": "Be terse."},
    ]
    response = http.post(
        "/v1/messages", json=body(system=system, messages=history, tools=[WEATHER_TOOL])
    )
    assert response.status_code == 200, response.text
    prompt = rendered(engine, serving.tokenizer)
    assert "billing" not in prompt
    assert prompt.startswith("<|im_start|>system\nBe terse.\n\n# Tools")
    assert '"name": "get_weather", "description": "Weather in a city"' in prompt
    # The template shows reasoning only after the last user query, as Qwen3's does.
    assert (
        "<|im_start|>assistant\nChecking.\n<tool_call>\n"
        '{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call><|im_end|>'
    ) in prompt
    assert (
        "<|im_start|>user\n<tool_response>\nSunny\n20C\n</tool_response>\n"
        "<tool_response>\nWindy\n</tool_response><|im_end|>\n"
        "<|im_start|>user\nAnd tomorrow?<|im_end|>\n<|im_start|>assistant\n"
    ) in prompt
    assert "opaque" not in prompt
    count = http.post(
        "/v1/messages/count_tokens",
        json=body(system=system, messages=history, tools=[WEATHER_TOOL]),
    ).json()
    assert count["input_tokens"] == len(engine.requests[-1].prompt_token_ids)


def test_thinking_config_and_prefill(serving):
    engine, http = serving()
    http.post("/v1/messages", json=body(thinking={"type": "disabled"}))
    assert rendered(engine, serving.tokenizer).endswith("assistant\n<think>\n\n</think>\n\n")
    http.post("/v1/messages", json=body(thinking={"type": "enabled", "budget_tokens": 2048}))
    assert rendered(engine, serving.tokenizer).endswith("<|im_start|>assistant\n")
    prefill = [*USER, {"role": "assistant", "content": "It is"}]
    http.post("/v1/messages", json=body(messages=prefill))
    assert rendered(engine, serving.tokenizer).endswith("</think>\n\nIt is")  # no turn end


def test_system_message_in_messages_is_rendered_where_it_stands(serving):
    engine, http = serving()
    note = [
        {"type": "text", "text": BILLING.format("48f", "71fea")},
        {"type": "text", "text": "Tools changed.", "cache_control": {"type": "ephemeral"}},
        {"type": "text", "text": "read_file is gone."},
    ]
    history = [
        *USER,
        {"role": "assistant", "content": "Sunny."},
        {"role": "system", "content": note},
        {"role": "user", "content": "And Rome?"},
    ]
    response = http.post("/v1/messages", json=body(system="Be terse.", messages=history))
    assert response.status_code == 200, response.text
    prompt = rendered(engine, serving.tokenizer)
    assert prompt.startswith("<|im_start|>system\nBe terse.<|im_end|>\n<|im_start|>user\n")
    assert (
        "<|im_start|>assistant\nSunny.<|im_end|>\n"
        "<|im_start|>system\nTools changed.\nread_file is gone.<|im_end|>\n"
        "<|im_start|>user\nAnd Rome?<|im_end|>\n<|im_start|>assistant\n"
    ) in prompt
    assert "billing" not in prompt
    count = http.post(COUNT, json=body(system="Be terse.", messages=history)).json()
    assert count["input_tokens"] == len(engine.requests[-1].prompt_token_ids)
    # Last, it is no prefill; first, with no top-level system, it is the system prompt.
    http.post("/v1/messages", json=body(messages=[*USER, {"role": "system", "content": "Hi"}]))
    assert rendered(engine, serving.tokenizer).endswith(
        "<|im_start|>system\nHi<|im_end|>\n<|im_start|>assistant\n"
    )
    http.post("/v1/messages", json=body(messages=[{"role": "system", "content": "Hi"}, *USER]))
    assert rendered(engine, serving.tokenizer).startswith(
        "<|im_start|>system\nHi<|im_end|>\n<|im_start|>user\nWeather in Paris?"
    )


def test_billing_header_does_not_change_the_prompt(serving):
    engine, http = serving()
    prompts = []
    for version, nonce in [("48f", "71fea"), ("01c", "36ee5")]:
        header = BILLING.format(version, nonce)
        for system in (
            [{"type": "text", "text": header}, {"type": "text", "text": "Hi"}],
            f"{header}\nHi",
        ):
            assert http.post("/v1/messages", json=body(system=system)).status_code == 200
            prompts.append(engine.requests[-1].prompt_token_ids)
    assert all(p == prompts[0] for p in prompts)
    assert "Hi" in serving.tokenizer.decode(prompts[0])


def test_tool_choice(serving):
    _, http = serving(TOOL_REPLY, 4)
    reply = http.post(
        "/v1/messages", json=body(tools=[WEATHER_TOOL], tool_choice={"type": "none"})
    ).json()
    assert [b["type"] for b in reply["content"]] == ["thinking", "text"]
    assert "<tool_call>" in reply["content"][1]["text"]
    assert reply["stop_reason"] == "end_turn"
    auto = {"type": "auto", "disable_parallel_tool_use": True}
    reply = http.post("/v1/messages", json=body(tools=[WEATHER_TOOL], tool_choice=auto)).json()
    assert reply["stop_reason"] == "tool_use"


def test_sdk_headers_and_beta_query_are_accepted(serving):
    _, http = serving()
    client = sdk(http)
    message = client.beta.messages.create(
        **body(), betas=["interleaved-thinking-2025-05-14"], metadata={"user_id": "u"}
    )
    assert message.content[0].text == "Hello there."
    count = client.beta.messages.count_tokens(model="m", messages=USER)
    assert count.input_tokens == message.usage.input_tokens
    response = http.post(
        "/v1/messages?beta=true",
        json=body(),
        headers={"x-api-key": "k", "anthropic-version": "2023-06-01", "anthropic-beta": "x"},
    )
    assert response.status_code == 200


def test_dead_engine_is_refused_before_streaming(serving):
    engine, http = serving()
    engine.is_alive = False
    engine.client = SimpleNamespace(dead_reason="killed")
    for stream in (False, True):
        response = http.post("/v1/messages", json=body(stream=stream))
        assert response.status_code == 503
        assert response.json()["error"]["type"] == "api_error"
        assert "killed" in response.json()["error"]["message"]


def test_engine_failure_mid_stream_is_an_error_event(serving):
    _, http = serving(error=EngineDeadError("the engine core died"))
    stream = events(http)
    assert [e["type"] for e in stream[:2]] == ["message_start", "ping"]
    assert stream[-1] == {
        "type": "error",
        "error": {"type": "api_error", "message": stream[-1]["error"]["message"]},
    }
    assert "died" in stream[-1]["error"]["message"]
    assert "message_stop" not in [e["type"] for e in stream]
    _, http = serving(error=EngineDeadError("gone"))
    with pytest.raises(anthropic.APIStatusError, match="gone"):
        sdk(http).messages.create(**body())


MESSAGES = "/v1/messages"
COUNT = "/v1/messages/count_tokens"


def user(*blocks):
    return body(messages=[{"role": "user", "content": list(blocks)}])


TOOL_USE_BLOCK = {"type": "tool_use", "id": "toolu_1", "name": "get_weather", "input": {}}
TOOL_RESULT_BLOCK = {"type": "tool_result", "tool_use_id": "toolu_1", "content": "Sunny"}
THINKING_BLOCK = {"type": "thinking", "thinking": "Hm.", "signature": "sig"}
IMAGE_BLOCK = {
    "type": "image",
    "source": {"type": "base64", "media_type": "image/png", "data": "AA=="},
}


# (name, path, body (dict, or bytes sent raw), status, Anthropic error type, a word in the message)
BAD_REQUESTS = [
    ("invalid json", MESSAGES, b'{"model": ', 400, "invalid_request_error", "JSON"),
    ("invalid utf-8", MESSAGES, b'{"model": "\xff"}', 400, "invalid_request_error", "UTF-8"),
    ("json array body", MESSAGES, b"[1]", 400, "invalid_request_error", "object"),
    (
        "absurd nesting",
        MESSAGES,
        b'{"x": ' + b"[" * 5000 + b"]" * 5000 + b"}",
        400,
        "invalid_request_error",
        "nested",
    ),
    (
        "missing max_tokens",
        MESSAGES,
        {"model": "m", "messages": USER},
        400,
        "invalid_request_error",
        "max_tokens",
    ),
    ("max_tokens zero", MESSAGES, body(max_tokens=0), 400, "invalid_request_error", "max_tokens"),
    (
        "max_tokens as string",
        MESSAGES,
        body(max_tokens="9"),
        400,
        "invalid_request_error",
        "max_tokens",
    ),
    (
        "prompt past the context",
        MESSAGES,
        body(messages=[{"role": "user", "content": "word " * 600}]),
        400,
        "invalid_request_error",
        "prompt is too long",
    ),
    (
        "missing model",
        MESSAGES,
        {"max_tokens": 5, "messages": USER},
        400,
        "invalid_request_error",
        "model",
    ),
    (
        "unknown model",
        MESSAGES,
        body(model="claude-opus-9"),
        404,
        "not_found_error",
        "claude-opus-9",
    ),
    (
        "missing messages",
        MESSAGES,
        {"model": "m", "max_tokens": 5},
        400,
        "invalid_request_error",
        "messages",
    ),
    ("empty messages", MESSAGES, body(messages=[]), 400, "invalid_request_error", "messages"),
    (
        "content of wrong type",
        MESSAGES,
        body(messages=[{"role": "user", "content": 5}]),
        400,
        "invalid_request_error",
        "content",
    ),
    (
        "unknown block type",
        MESSAGES,
        user({"type": "hologram"}),
        400,
        "invalid_request_error",
        "hologram",
    ),
    (
        "tool_result without tool_use_id",
        MESSAGES,
        user({"type": "tool_result", "content": "x"}),
        400,
        "invalid_request_error",
        "tool_use_id",
    ),
    (
        "tool_use without input",
        MESSAGES,
        body(
            messages=[
                {"role": "assistant", "content": [{"type": "tool_use", "id": "t", "name": "f"}]}
            ]
        ),
        400,
        "invalid_request_error",
        "input",
    ),
    (
        "tool_use in a user message",
        MESSAGES,
        user({"type": "tool_use", "id": "t", "name": "f", "input": {}}),
        400,
        "invalid_request_error",
        "assistant",
    ),
    (
        "image block",
        MESSAGES,
        user({"type": "image", "source": {"type": "url", "url": "http://x/y.png"}}),
        400,
        "invalid_request_error",
        "vision",
    ),
    (
        "document in a tool result",
        MESSAGES,
        user(
            {
                "type": "tool_result",
                "tool_use_id": "t",
                "content": [{"type": "document", "source": {}}],
            }
        ),
        400,
        "invalid_request_error",
        "vision",
    ),
    ("system of wrong type", MESSAGES, body(system=5), 400, "invalid_request_error", "system"),
    (
        "temperature above 1",
        MESSAGES,
        body(temperature=1.5),
        400,
        "invalid_request_error",
        "temperature",
    ),
    ("top_k negative", MESSAGES, body(top_k=-1), 400, "invalid_request_error", "top_k"),
    (
        "empty stop sequence",
        MESSAGES,
        body(stop_sequences=[""]),
        400,
        "invalid_request_error",
        "stop_sequences",
    ),
    (
        "tool without input_schema",
        MESSAGES,
        body(tools=[{"name": "f"}]),
        400,
        "invalid_request_error",
        "input_schema",
    ),
    (
        "server tool",
        MESSAGES,
        body(tools=[{"type": "web_search_20250305", "name": "web_search"}]),
        400,
        "invalid_request_error",
        "server tools",
    ),
    (
        "tool_choice tool without a name",
        MESSAGES,
        body(tools=[WEATHER_TOOL], tool_choice={"type": "tool"}),
        400,
        "invalid_request_error",
        "name",
    ),
    (
        "tool_choice naming an unknown tool",
        MESSAGES,
        body(tools=[WEATHER_TOOL], tool_choice={"type": "tool", "name": "launch_rockets"}),
        400,
        "invalid_request_error",
        "not among the tools",
    ),
    (
        "unknown tool_choice",
        MESSAGES,
        body(tool_choice={"type": "sometimes"}),
        400,
        "invalid_request_error",
        "tool_choice",
    ),
    (
        "thinking without budget",
        MESSAGES,
        body(thinking={"type": "enabled"}),
        400,
        "invalid_request_error",
        "budget_tokens",
    ),
    (
        "thinking budget too small",
        MESSAGES,
        body(thinking={"type": "enabled", "budget_tokens": 10}),
        400,
        "invalid_request_error",
        "budget_tokens",
    ),
    ("stream not a bool", MESSAGES, body(stream="yes"), 400, "invalid_request_error", "stream"),
    (
        "tool_use in a system message",
        MESSAGES,
        body(messages=[*USER, {"role": "system", "content": [TOOL_USE_BLOCK]}]),
        400,
        "invalid_request_error",
        "messages.1.content.0: a system message holds text blocks only",
    ),
    (
        "tool_result in a system message",
        COUNT,
        {
            "model": "m",
            "messages": [
                {"role": "system", "content": [{"type": "text", "text": "Hi"}, TOOL_RESULT_BLOCK]},
                *USER,
            ],
        },
        400,
        "invalid_request_error",
        "messages.0.content.1: a system message holds text blocks only",
    ),
    (
        "thinking in a system message",
        MESSAGES,
        body(messages=[*USER, {"role": "system", "content": [THINKING_BLOCK]}, *USER]),
        400,
        "invalid_request_error",
        "messages.1.content.0: a system message holds text blocks only, not 'thinking'",
    ),
    (
        "image in a system message",
        MESSAGES,
        body(messages=[*USER, {"role": "system", "content": [IMAGE_BLOCK]}]),
        400,
        "invalid_request_error",
        "messages.1.content.0: a system message holds text blocks only, not 'image'",
    ),
    (
        "unknown role",
        MESSAGES,
        body(messages=[{"role": "developer", "content": "Hi"}]),
        400,
        "invalid_request_error",
        "messages.0.role",
    ),
    (
        "count_tokens without messages",
        COUNT,
        {"model": "m"},
        400,
        "invalid_request_error",
        "messages",
    ),
    (
        "count_tokens unknown model",
        COUNT,
        {"model": "x", "messages": USER},
        404,
        "not_found_error",
        "x",
    ),
]


@pytest.mark.parametrize(
    ("path", "payload", "status", "error_type", "word"),
    [case[1:] for case in BAD_REQUESTS],
    ids=[case[0] for case in BAD_REQUESTS],
)
def test_bad_requests_get_anthropic_shaped_errors(serving, path, payload, status, error_type, word):
    _, http = serving()
    if isinstance(payload, bytes):
        response = http.post(path, content=payload, headers={"content-type": "application/json"})
    else:
        response = http.post(path, json=payload)
    assert response.status_code == status, response.text
    error = response.json()
    assert set(error) == {"type", "error"} and error["type"] == "error"
    assert set(error["error"]) == {"type", "message"}
    assert error["error"]["type"] == error_type
    assert word.lower() in error["error"]["message"].lower()
    assert http.post(MESSAGES, json=body()).status_code == 200, "the server answers normally"


def test_error_shape_follows_the_route(serving):
    _, http = serving()
    wrong_method = http.get(MESSAGES)
    assert wrong_method.status_code == 405
    assert wrong_method.json()["error"]["type"] == "invalid_request_error"
    openai_error = http.post(
        "/v1/chat/completions", content=b"{", headers={"content-type": "application/json"}
    )
    assert openai_error.status_code == 400
    assert "type" not in openai_error.json() and openai_error.json()["error"]["param"] is None
    with pytest.raises(anthropic.NotFoundError):
        sdk(http).messages.create(**body(model="nope"))
    with pytest.raises(anthropic.BadRequestError, match="vision"):
        sdk(http).messages.create(
            **user(
                {
                    "type": "image",
                    "source": {"type": "base64", "media_type": "image/png", "data": "AA=="},
                }
            )
        )
