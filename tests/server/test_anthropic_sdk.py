"""The official `anthropic` SDK against `met serve`, unchanged.

The tiny checkpoint has random weights, so these tests check structure and consistency, never
words.
"""

from __future__ import annotations

import itertools

import anthropic
import pytest

from tests.server.conftest import MODEL_NAME

USER = [{"role": "user", "content": "Tell me about the sea."}]
# SDK 2.x dropped temperature from its signatures; the API still takes it.
GREEDY = {"temperature": 0}
READ_TOOL = {
    "name": "read_file",
    "description": "Read a file",
    "input_schema": {"type": "object", "properties": {"path": {"type": "string"}}},
}


@pytest.fixture(scope="module")
def client(server) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=server.base_url, api_key="x", max_retries=0)


def greedy(client, **fields):
    return client.messages.create(
        **{"model": MODEL_NAME, "max_tokens": 24, "messages": USER, "extra_body": GREEDY, **fields}
    )


def text_of(message) -> str:
    return "".join(b.text for b in message.content if b.type == "text")


def test_streaming_text_equals_non_streaming_at_temperature_0(client):
    whole = greedy(client)
    with client.messages.stream(
        model=MODEL_NAME, max_tokens=24, messages=USER, extra_body=GREEDY
    ) as stream:
        streamed_text = "".join(stream.text_stream)
        streamed = stream.get_final_message()
    assert text_of(whole) and streamed_text == text_of(streamed) == text_of(whole)
    assert whole.id.startswith("msg_") and whole.model == MODEL_NAME
    assert streamed.stop_reason == whole.stop_reason
    assert whole.stop_reason in ("end_turn", "max_tokens")
    assert streamed.usage.output_tokens == whole.usage.output_tokens <= 24
    prompt_tokens = whole.usage.input_tokens + whole.usage.cache_read_input_tokens
    assert streamed.usage.input_tokens + streamed.usage.cache_read_input_tokens == prompt_tokens


def test_stop_sequences(client):
    text = text_of(greedy(client))
    assert len(text) > 6
    stop = text[3:6]
    cut = greedy(client, stop_sequences=[stop])
    assert (cut.stop_reason, cut.stop_sequence) == ("stop_sequence", stop)
    assert text_of(cut) == text[: text.index(stop)]
    with client.messages.stream(
        model=MODEL_NAME, max_tokens=24, messages=USER, extra_body=GREEDY, stop_sequences=[stop]
    ) as stream:
        streamed = stream.get_final_message()
    assert (streamed.stop_reason, streamed.stop_sequence, text_of(streamed)) == (
        "stop_sequence",
        stop,
        text_of(cut),
    )


def test_count_tokens_equals_the_prompt_usage_reports(client):
    system = "You are a careful assistant."
    count = client.messages.count_tokens(model=MODEL_NAME, messages=USER, system=system)
    usage = greedy(client, system=system, max_tokens=1).usage
    assert count.input_tokens > 0
    # Anthropic's accounting: the prompt is input + cache reads + cache writes.
    assert count.input_tokens == (
        usage.input_tokens + usage.cache_read_input_tokens + usage.cache_creation_input_tokens
    )


def test_max_tokens_past_the_context_window_is_served(client):
    # The SDK insists on streaming for a max_tokens this large.
    with client.messages.stream(
        model=MODEL_NAME, max_tokens=32_000, messages=USER, extra_body=GREEDY
    ) as stream:
        reply = stream.get_final_message()
    assert reply.stop_reason in ("end_turn", "model_context_window_exceeded")
    assert (
        reply.usage.input_tokens + reply.usage.cache_read_input_tokens + (reply.usage.output_tokens)
        <= 512
    )  # the server's --max-seq-len


def test_tool_round_trip(client):
    history = [
        {"role": "user", "content": "What is in notes.txt?"},
        {
            "role": "assistant",
            "content": [
                {"type": "text", "text": "Let me read it."},
                {
                    "type": "tool_use",
                    "id": "toolu_01",
                    "name": "read_file",
                    "input": {"path": "notes.txt"},
                },
            ],
        },
        {
            "role": "user",
            "content": [{"type": "tool_result", "tool_use_id": "toolu_01", "content": "buy milk"}],
        },
    ]
    reply = greedy(client, messages=history, tools=[READ_TOOL])
    assert reply.role == "assistant"
    assert reply.stop_reason in ("end_turn", "max_tokens", "tool_use")
    for block in reply.content:
        assert block.type in ("text", "tool_use")


def test_errors(client):
    with pytest.raises(anthropic.NotFoundError) as not_found:
        greedy(client, model="no-such-model")
    assert not_found.value.body["error"]["type"] == "not_found_error"
    with pytest.raises(anthropic.BadRequestError, match="prompt is too long"):
        greedy(client, messages=[{"role": "user", "content": "sea " * 600}])
    with pytest.raises(anthropic.BadRequestError, match="vision"):
        greedy(
            client,
            messages=[
                {
                    "role": "user",
                    "content": [
                        {
                            "type": "image",
                            "source": {"type": "base64", "media_type": "image/png", "data": "AA=="},
                        }
                    ],
                }
            ],
        )


PICK_TOOL = {
    "name": "pick_colour",
    "description": "Pick a colour",
    "input_schema": {
        "type": "object",
        "properties": {"colour": {"enum": ["red", "green", "blue"]}, "bright": {"type": "boolean"}},
        "required": ["colour", "bright"],
        "additionalProperties": False,
    },
}


@pytest.mark.parametrize(
    "choice",
    [{"type": "any", "disable_parallel_tool_use": True}, {"type": "tool", "name": "pick_colour"}],
)
def test_forced_tool_choice_always_yields_a_valid_call(client, choice):
    """The grammar forces one well-formed call even from random weights (`any` with parallel
    calls may make several: tests/server/test_forced_tool_calls.py)."""
    reply = greedy(client, tools=[PICK_TOOL], tool_choice=choice, max_tokens=200)
    (call,) = [b for b in reply.content if b.type == "tool_use"]
    assert reply.stop_reason == "tool_use"
    assert call.name == "pick_colour"
    assert call.input["colour"] in ("red", "green", "blue")
    assert isinstance(call.input["bright"], bool)


def test_claude_code_tool_session_reuses_the_prefix_cache(client):
    """Each turn resends the whole history under a new billing-header hash, as Claude Code
    does; with the header normalized, every turn starts with the previous turn's prompt."""
    system = [
        None,  # the billing header, new every request
        {"type": "text", "text": "You are a coding agent. Use the tools to inspect files."},
    ]
    messages = [{"role": "user", "content": "Summarize the files in this project, one by one."}]
    cache_reads = []
    for turn in range(4):
        system[0] = {
            "type": "text",
            "text": f"x-anthropic-billing-header: cc_version=2.1.{turn}.a{turn}f; "
            f"cc_entrypoint=cli; cch={turn:05x};",
        }
        reply = greedy(client, system=system, messages=messages, tools=[READ_TOOL], max_tokens=2)
        cache_reads.append(reply.usage.cache_read_input_tokens)
        call_id = f"toolu_turn{turn}"
        messages += [
            {
                "role": "assistant",
                "content": [
                    {"type": "text", "text": f"Reading file number {turn}."},
                    {
                        "type": "tool_use",
                        "id": call_id,
                        "name": "read_file",
                        "input": {"path": f"src/module_{turn}.py"},
                    },
                ],
            },
            {
                "role": "user",
                "content": [
                    {
                        "type": "tool_result",
                        "tool_use_id": call_id,
                        "content": f"def handler_{turn}(request):\n    return respond(request, "
                        f"status={200 + turn}, body='module {turn} done')\n",
                    }
                ],
            },
        ]
    assert all(b > a for a, b in itertools.pairwise(cache_reads)), cache_reads
