"""The Responses API end to end, through the official `openai` SDK, against `met serve` on a
checkpoint whose weights spell the model's reply (tests/scripted_checkpoint.py).

What the tests know is only what the model writes; the engine, the reasoning and hermes parsers
and the route do the rest. State (storage, conversations, background runs, a restart) is in
test_responses_state.py.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import httpx
import openai
import pytest

from tests.scripted_checkpoint import ScriptedCheckpoint, build_scripted_checkpoint
from tests.server.conftest import MODEL_NAME, RunningServer, serving
from tests.server.test_scripted_tool_calls import FUNCTIONS, SCENARIOS, THOUGHT, Scenario

TOOLS = [{"type": "function", **f} for f in FUNCTIONS]
# A call to a tool offered inside a namespace, by its flattened name.
NAMESPACED = Scenario(
    " variance",
    '<tool_call>\n{"name": "weather.get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>',
    None,
    (("weather.get_weather", {"city": "Oslo"}),),
)
ALL = {**SCENARIOS, "namespaced": NAMESPACED}


@pytest.fixture(scope="module")
def scripted(tmp_path_factory: pytest.TempPathFactory) -> ScriptedCheckpoint:
    replies = {scenario.keyword: scenario.reply for scenario in ALL.values()}
    return build_scripted_checkpoint(tmp_path_factory.mktemp("scripted"), replies)


@pytest.fixture(scope="module")
def scripted_server(
    scripted: ScriptedCheckpoint, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[RunningServer]:
    log_path = tmp_path_factory.mktemp("serve-responses") / "server.log"
    with serving(
        scripted.path, log_path, "--reasoning-parser", "qwen3", "--tool-call-parser", "hermes"
    ) as running:
        yield running


@pytest.fixture(scope="module")
def client(scripted_server: RunningServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=scripted_server.api_url, api_key="none", max_retries=0)


def ask(scenario: Scenario) -> str:
    return f"What is the weather in Paris?{scenario.keyword}"


def call_round_trip(scenario: Scenario, call: Any, *before_call: dict) -> list[dict[str, Any]]:
    """The stateless history of one tool round trip: the question, whatever came before the
    call (a reasoning item), the call, and its output."""
    return [
        {"role": "user", "content": ask(scenario)},
        *before_call,
        {
            "type": "function_call",
            "call_id": call.call_id,
            "name": call.name,
            "arguments": call.arguments,
        },
        {"type": "function_call_output", "call_id": call.call_id, "output": "18C"},
    ]


def reply_tokens(scripted: ScriptedCheckpoint, scenario: Scenario) -> int:
    return len(scripted.replies[scenario.keyword].token_ids) + 1  # and the <|im_end|>


def without_ids(items: list[Any]) -> list[dict[str, Any]]:
    """Items to compare across two responses: everything but the ids generated for each."""
    out = []
    for item in items:
        data = item if isinstance(item, dict) else item.model_dump(exclude_none=True)
        out.append({k: v for k, v in data.items() if k not in ("id", "call_id")})
    return out


def streamed(client: openai.OpenAI, **fields: Any) -> tuple[list[Any], Any]:
    """Every event of a streamed response, and the response the final event carries."""
    with client.responses.create(model=MODEL_NAME, stream=True, **fields) as stream:
        events = list(stream)
    return events, events[-1].response


# --- text ----------------------------------------------------------------------------------------


def test_text_reply_with_usage(client, scripted):
    scenario = SCENARIOS["plain_text"]
    r = client.responses.create(model=MODEL_NAME, input=ask(scenario))
    assert r.status == "completed" and r.object == "response"
    assert r.output_text == scenario.reply
    (message,) = r.output
    assert message.type == "message" and message.role == "assistant"
    assert message.status == "completed" and message.content[0].type == "output_text"
    assert r.usage.output_tokens == reply_tokens(scripted, scenario)
    assert r.usage.total_tokens == r.usage.input_tokens + r.usage.output_tokens
    assert r.usage.output_tokens_details.reasoning_tokens == 0


def test_input_counts_the_same_prompt_as_chat(client, scripted_server):
    """The input tokens are the prompt's, instructions included, as chat renders the same
    conversation."""
    scenario = SCENARIOS["plain_text"]
    plain = client.responses.create(model=MODEL_NAME, input=ask(scenario))
    instructed = client.responses.create(
        model=MODEL_NAME, input=ask(scenario), instructions="Answer in one short sentence."
    )
    chat = client.chat.completions.create(
        model=MODEL_NAME,
        messages=[
            {"role": "system", "content": "Answer in one short sentence."},
            {"role": "user", "content": ask(scenario)},
        ],
    )
    assert instructed.usage.input_tokens == chat.usage.prompt_tokens
    assert instructed.usage.input_tokens > plain.usage.input_tokens
    assert instructed.instructions == "Answer in one short sentence."


def test_message_items_and_developer_role_render_like_chat(client):
    scenario = SCENARIOS["plain_text"]
    items = [
        {"role": "developer", "content": "Be brief."},
        {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "Hi"}]},
        {"role": "assistant", "content": [{"type": "output_text", "text": "Hello."}]},
        {"role": "user", "content": ask(scenario)},
    ]
    r = client.responses.create(model=MODEL_NAME, input=items)
    chat = client.chat.completions.create(
        model=MODEL_NAME,
        messages=[
            {"role": "developer", "content": "Be brief."},
            {"role": "user", "content": "Hi"},
            {"role": "assistant", "content": "Hello."},
            {"role": "user", "content": ask(scenario)},
        ],
    )
    assert r.output_text == scenario.reply == chat.choices[0].message.content
    assert r.usage.input_tokens == chat.usage.prompt_tokens


@pytest.mark.parametrize("limit", [1, 3])
def test_max_output_tokens_makes_it_incomplete(client, limit):
    """Any limit from 1: OpenAI's own minimum of 16 is not ours."""
    scenario = SCENARIOS["plain_text"]
    r = client.responses.create(model=MODEL_NAME, input=ask(scenario), max_output_tokens=limit)
    assert r.status == "incomplete"
    assert r.incomplete_details.reason == "max_output_tokens"
    assert r.usage.output_tokens == limit
    assert scenario.reply.startswith(r.output_text) and r.output_text
    assert r.output[-1].status == "incomplete"


# --- streaming -----------------------------------------------------------------------------------

# After each kind of item opens, the events it may send before it is done.
ITEM_EVENTS = {
    "message": (
        "response.content_part.added",
        "response.output_text.delta",
        "response.output_text.done",
        "response.content_part.done",
    ),
    "reasoning": (
        "response.content_part.added",
        "response.reasoning_text.delta",
        "response.reasoning_text.done",
        "response.content_part.done",
        "response.reasoning_summary_part.added",
        "response.reasoning_summary_text.delta",
        "response.reasoning_summary_text.done",
        "response.reasoning_summary_part.done",
    ),
    "function_call": (
        "response.function_call_arguments.delta",
        "response.function_call_arguments.done",
    ),
}


def check_event_order(events: list[Any]) -> None:
    """The spec's sequence: created, in_progress, each item from added to done with only its
    own events between (deltas before their done), one final event; sequence numbers 0, 1, ..."""
    assert [e.sequence_number for e in events] == list(range(len(events)))
    types = [e.type for e in events]
    assert types[:2] == ["response.created", "response.in_progress"]
    assert types[-1] in ("response.completed", "response.incomplete", "response.failed")
    assert events[-1].response.status == types[-1].removeprefix("response.")
    open_item, num_items = None, 0
    for event in events[2:-1]:
        if event.type == "response.output_item.added":
            assert open_item is None, "an item opened before the last one was done"
            open_item = event.item
            assert event.output_index == num_items
            num_items += 1
        elif event.type == "response.output_item.done":
            assert open_item is not None and event.item.id == open_item.id
            open_item = None
        else:
            assert open_item is not None, f"{event.type} outside an item"
            assert event.type in ITEM_EVENTS[open_item.type], event.type
            assert event.item_id == open_item.id
    assert open_item is None


def test_stream_order_and_concatenation(client):
    scenario = SCENARIOS["plain_text"]
    events, final = streamed(client, input=ask(scenario))
    check_event_order(events)
    deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    (done,) = [e for e in events if e.type == "response.output_text.done"]
    assert deltas == done.text == final.output_text == scenario.reply
    assert final.status == "completed" and final.usage.output_tokens > 0
    whole = client.responses.create(model=MODEL_NAME, input=ask(scenario))
    assert without_ids(final.output) == without_ids(whole.output)


def test_stream_with_the_sdk_helper(client):
    scenario = SCENARIOS["plain_text"]
    with client.responses.stream(model=MODEL_NAME, input=ask(scenario)) as stream:
        text = "".join(e.delta for e in stream if e.type == "response.output_text.delta")
        final = stream.get_final_response()
    assert text == final.output_text == scenario.reply


def test_stream_cut_short_ends_incomplete(client):
    scenario = SCENARIOS["plain_text"]
    events, final = streamed(client, input=ask(scenario), max_output_tokens=2)
    check_event_order(events)
    assert events[-1].type == "response.incomplete"
    assert final.incomplete_details.reason == "max_output_tokens"
    done = [e for e in events if e.type == "response.output_item.done"]
    assert done[-1].item.status == "incomplete"


# --- tools ---------------------------------------------------------------------------------------

CALLS = [name for name, scenario in SCENARIOS.items() if scenario.calls]


@pytest.mark.parametrize("name", CALLS)
def test_function_calls_streamed_equal_non_streamed(client, name):
    scenario = SCENARIOS[name]
    whole = client.responses.create(model=MODEL_NAME, input=ask(scenario), tools=TOOLS)
    calls = [item for item in whole.output if item.type == "function_call"]
    assert [(c.name, json.loads(c.arguments)) for c in calls] == list(scenario.calls)
    assert all(c.call_id and c.status == "completed" for c in calls)
    assert whole.status == "completed"
    events, final = streamed(client, input=ask(scenario), tools=TOOLS)
    check_event_order(events)
    for call in [item for item in final.output if item.type == "function_call"]:
        pieces = [
            e.delta
            for e in events
            if e.type == "response.function_call_arguments.delta" and e.item_id == call.id
        ]
        (done,) = [
            e
            for e in events
            if e.type == "response.function_call_arguments.done" and e.item_id == call.id
        ]
        assert "".join(pieces) == done.arguments == call.arguments
    assert without_ids(final.output) == without_ids(whole.output)


def test_text_then_call_is_a_message_then_a_function_call(client):
    scenario = SCENARIOS["text_then_call"]
    r = client.responses.create(model=MODEL_NAME, input=ask(scenario), tools=TOOLS)
    assert [item.type for item in r.output] == ["message", "function_call"]
    assert r.output_text == scenario.content


def test_tool_choice_none_leaves_the_call_as_text(client):
    scenario = SCENARIOS["one_call"]
    r = client.responses.create(
        model=MODEL_NAME, input=ask(scenario), tools=TOOLS, tool_choice="none"
    )
    assert [item.type for item in r.output] == ["message"]
    assert r.output_text == scenario.reply


def test_namespace_tools_are_flattened_and_named_back(client):
    tools = [
        {
            "type": "namespace",
            "name": "weather",
            "description": "Weather tools",
            "tools": [{"type": "function", **FUNCTIONS[0]}],
        }
    ]
    for stream in (False, True):
        body = {"input": ask(NAMESPACED), "tools": tools}
        r = (
            streamed(client, **body)[1]
            if stream
            else client.responses.create(model=MODEL_NAME, **body)
        )
        (call,) = r.output
        assert call.type == "function_call"
        assert (call.namespace, call.name) == ("weather", "get_weather")
        assert json.loads(call.arguments) == {"city": "Oslo"}


def test_hosted_tools_are_left_out_with_a_warning(scripted_server):
    """Codex sends web_search with every request: not an error, a warning."""
    scenario = SCENARIOS["one_call"]
    body = {
        "model": MODEL_NAME,
        "input": ask(scenario),
        "tools": [{"type": "web_search", "external_web_access": False}, *TOOLS],
    }
    r = httpx.post(scripted_server.api_url + "/responses", json=body, timeout=60)
    assert r.status_code == 200, r.text
    out = r.json()
    assert any("web_search" in w for w in out["warnings"])
    assert [item["type"] for item in out["output"]] == ["function_call"]


def test_function_call_output_continues_the_turn(client):
    scenario = SCENARIOS["one_call"]
    first = client.responses.create(model=MODEL_NAME, input=ask(scenario), tools=TOOLS)
    (call,) = first.output
    second = client.responses.create(
        model=MODEL_NAME,
        previous_response_id=first.id,
        tools=TOOLS,
        input=[{"type": "function_call_output", "call_id": call.call_id, "output": "18C"}],
    )
    assert second.status == "completed"
    assert second.usage.input_tokens > first.usage.input_tokens + first.usage.output_tokens - 1
    stateless = client.responses.create(
        model=MODEL_NAME,
        store=False,
        tools=TOOLS,
        input=call_round_trip(scenario, call),
    )
    assert stateless.usage.input_tokens == second.usage.input_tokens


# --- reasoning -----------------------------------------------------------------------------------


def test_reasoning_item_before_the_call(client):
    scenario = SCENARIOS["thinking_then_call"]
    r = client.responses.create(model=MODEL_NAME, input=ask(scenario), tools=TOOLS)
    reasoning, call = r.output
    assert reasoning.type == "reasoning" and reasoning.summary == []
    assert reasoning.content[0].type == "reasoning_text"
    assert reasoning.content[0].text.strip() == THOUGHT
    assert call.type == "function_call" and call.name == "get_weather"
    assert r.usage.output_tokens_details.reasoning_tokens > 0
    events, final = streamed(client, input=ask(scenario), tools=TOOLS)
    check_event_order(events)
    text = "".join(e.delta for e in events if e.type == "response.reasoning_text.delta")
    assert text == final.output[0].content[0].text == reasoning.content[0].text
    assert without_ids(final.output) == without_ids(r.output)


def test_reasoning_summary_and_encrypted_content(client):
    """Asked for a summary, the thinking is the summary; asked for encrypted content, it is
    carried there too, and a reasoning item holding only that is read back."""
    scenario = SCENARIOS["thinking_then_call"]
    fields = {
        "input": ask(scenario),
        "tools": TOOLS,
        "reasoning": {"effort": "medium", "summary": "auto"},
        "include": ["reasoning.encrypted_content"],
    }
    events, final = streamed(client, **fields)
    check_event_order(events)
    reasoning = final.output[0]
    assert reasoning.summary[0].text.strip() == THOUGHT and not reasoning.content
    summary = "".join(e.delta for e in events if e.type == "response.reasoning_summary_text.delta")
    assert summary == reasoning.summary[0].text
    assert reasoning.encrypted_content
    whole = client.responses.create(model=MODEL_NAME, **fields)
    assert without_ids(whole.output)[0]["summary"] == without_ids(final.output)[0]["summary"]
    # Codex keeps only the encrypted content and sends it back, stateless: the thinking is
    # in the prompt again (the template shows it in the turn after the last user message).
    call = final.output[1]

    def continued(reasoning_item: dict[str, Any] | None) -> Any:
        items = call_round_trip(scenario, call, *([reasoning_item] if reasoning_item else []))
        r = client.responses.create(model=MODEL_NAME, store=False, tools=TOOLS, input=items)
        assert r.status == "completed"
        return r.usage.input_tokens

    encrypted = {
        "type": "reasoning",
        "summary": [],
        "encrypted_content": reasoning.encrypted_content,
    }
    foreign = {"type": "reasoning", "summary": [], "encrypted_content": "gAAAAABo-opaque"}
    assert continued(encrypted) > continued(None) == continued(foreign)


def test_max_tool_calls_and_parallel_tool_calls_bound_the_calls(client):
    scenario = SCENARIOS["two_calls"]
    for fields in ({"max_tool_calls": 1}, {"parallel_tool_calls": False}):
        r = client.responses.create(model=MODEL_NAME, input=ask(scenario), tools=TOOLS, **fields)
        calls = [item for item in r.output if item.type == "function_call"]
        assert [(c.name, json.loads(c.arguments)) for c in calls] == list(scenario.calls[:1])
    r = client.responses.create(
        model=MODEL_NAME, input=ask(scenario), tools=TOOLS, max_tool_calls=2
    )
    assert len([item for item in r.output if item.type == "function_call"]) == 2


@pytest.mark.parametrize("effort", ["none", "low", "high"])
def test_reasoning_effort_renders_and_budgets_as_on_chat(client, effort):
    """`reasoning.effort` is chat's `reasoning_effort`: "none" renders the prompt without
    thinking, the others set the thinking budget; the prompts are the same on both routes."""
    scenario = SCENARIOS["thinking_then_call"]
    r = client.responses.create(
        model=MODEL_NAME, input=ask(scenario), tools=TOOLS, reasoning={"effort": effort}
    )
    chat = client.chat.completions.create(
        model=MODEL_NAME,
        messages=[{"role": "user", "content": ask(scenario)}],
        tools=[{"type": "function", "function": f} for f in FUNCTIONS],
        reasoning_effort=effort,
    )
    assert r.usage.input_tokens == chat.usage.prompt_tokens
    assert r.usage.output_tokens == chat.usage.completion_tokens
    assert r.reasoning.effort == effort
