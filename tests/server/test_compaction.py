"""`--auto-compact`: the steps on crafted conversations (a budget in characters stands in for
the tokenizer), then a real server shortening chat, messages and responses conversations too
long for its context, saying so in a header and the usage; without the flag they stay 400s."""

from __future__ import annotations

import httpx
import pytest

from metrale.server.compaction import OMITTED, compact
from tests.server.conftest import MODEL_NAME, serving


def size(messages) -> int:
    return sum(len(m.get("content") or "") + 10 for m in messages)


def budget(n: int):
    return lambda messages: size(messages) <= n


def conversation(turns: int = 4, tool_chars: int = 3000, system_chars: int = 100) -> list[dict]:
    messages = [{"role": "system", "content": "S" * system_chars}]
    for i in range(turns):
        messages += [
            {"role": "user", "content": f"question {i}"},
            {
                "role": "assistant",
                "content": "",
                "tool_calls": [{"id": f"c{i}", "function": {"name": "f", "arguments": {}}}],
            },
            {"role": "tool", "tool_call_id": f"c{i}", "content": f"{i}" * tool_chars},
            {"role": "assistant", "content": f"answer {i}"},
        ]
    return [*messages, {"role": "user", "content": "the last question"}]


def test_a_conversation_that_fits_after_truncating_tool_results_keeps_every_turn():
    messages = conversation()
    out, steps = compact(messages, budget(4000))
    assert steps == ["truncate_tool_results"]
    assert [m["role"] for m in out] == [m["role"] for m in messages]
    tool = [m for m in out if m["role"] == "tool"]
    assert all(
        len(m["content"]) < 700 and "truncated by auto-compact" in m["content"] for m in tool
    )
    assert tool[0]["content"].startswith("0" * 256) and tool[0]["content"].endswith("0" * 256)
    assert messages[3]["content"] == "0" * 3000  # the request's own messages are not changed


def test_then_tool_results_become_pointers():
    out, steps = compact(conversation(), budget(700))
    assert steps == ["truncate_tool_results", "omit_tool_results"]
    assert [m["content"] for m in out if m["role"] == "tool"] == [OMITTED.format(n=3000)] * 4


def test_then_the_fewest_oldest_turns_go_with_their_tool_calls_and_results():
    messages = conversation(turns=6)
    out, steps = compact(messages, budget(600))
    assert steps == ["truncate_tool_results", "omit_tool_results", "drop_oldest_turns"]
    assert out[0] == messages[0] and out[-1] == messages[-1]  # system and last turn stay
    kept = [m["content"] for m in out if m["role"] == "user"]
    assert kept[-1] == "the last question" and kept[0] != "question 0"
    # a turn is 4 messages of 10 + 10, 10, 10 + 54 (the pointer) and 10 + 8 characters: 112;
    # the system's 110 and the last turn's 27 leave 463, four turns: the two oldest go
    assert kept == [f"question {i}" for i in range(2, 6)] + ["the last question"]
    calls = {c["id"] for m in out for c in m.get("tool_calls", [])}
    assert (
        calls == {m["tool_call_id"] for m in out if m["role"] == "tool"} == {"c2", "c3", "c4", "c5"}
    )


def test_then_the_system_prompt_is_trimmed_then_only_the_last_turn_stays():
    out, steps = compact(conversation(turns=2, system_chars=5000), budget(2300))
    assert steps[-1] == "trim_system" and len(out[0]["content"]) < 2100
    assert [m["content"] for m in out if m["role"] == "user"][-2:] == [
        "question 1",
        "the last question",
    ]
    out, steps = compact(conversation(turns=2, system_chars=5000), budget(2100))
    assert steps[-1] == "last_messages"
    assert [m["role"] for m in out] == ["system", "user"]


def test_nothing_short_enough_is_an_error():
    with pytest.raises(ValueError, match="do not fit"):
        compact(conversation(), budget(50))


LONG_TOOL_RESULT = "the weather report says " * 400  # ~2,400 tokens: over the 512 of the context


def chat_body() -> dict:
    return {
        "model": MODEL_NAME,
        "max_tokens": 8,
        "messages": [
            {"role": "system", "content": "You are a helpful assistant."},
            {"role": "user", "content": "What is the weather?"},
            {
                "role": "assistant",
                "content": "",
                "tool_calls": [
                    {"id": "c1", "type": "function", "function": {"name": "w", "arguments": "{}"}}
                ],
            },
            {"role": "tool", "tool_call_id": "c1", "content": LONG_TOOL_RESULT},
            {"role": "assistant", "content": "It is sunny."},
            {"role": "user", "content": "And tomorrow?"},
        ],
    }


def messages_body() -> dict:
    return {
        "model": MODEL_NAME,
        "max_tokens": 8,
        "system": "You are a helpful assistant.",
        "messages": [
            {"role": "user", "content": "What is the weather?"},
            {
                "role": "assistant",
                "content": [{"type": "tool_use", "id": "t1", "name": "w", "input": {}}],
            },
            {
                "role": "user",
                "content": [
                    {"type": "tool_result", "tool_use_id": "t1", "content": LONG_TOOL_RESULT}
                ],
            },
            {"role": "assistant", "content": "It is sunny."},
            {"role": "user", "content": "And tomorrow?"},
        ],
    }


def test_without_the_flag_an_over_long_conversation_is_a_400(server):
    response = httpx.post(server.api_url + "/chat/completions", json=chat_body(), timeout=60)
    assert response.status_code == 400
    assert "maximum context length" in response.json()["error"]["message"]


def test_a_compacting_server_answers_every_api_and_says_so(qwen3_dir, tmp_path):
    with serving(qwen3_dir, tmp_path / "server.log", "--auto-compact") as server:
        chat = httpx.post(server.api_url + "/chat/completions", json=chat_body(), timeout=60)
        assert chat.status_code == 200, chat.text
        assert chat.headers["x-metrale-compacted"] == "truncate_tool_results"
        compacted = chat.json()["usage"]["compacted"]
        assert compacted["steps"] == ["truncate_tool_results"]
        assert compacted["prompt_tokens_before"] > 512 >= compacted["prompt_tokens_after"] + 8
        assert chat.json()["usage"]["prompt_tokens"] == compacted["prompt_tokens_after"]

        headers = {"anthropic-version": "2023-06-01"}
        url = server.base_url + "/v1/messages"
        message = httpx.post(url, json=messages_body(), headers=headers, timeout=60)
        assert message.status_code == 200, message.text
        assert "truncate_tool_results" in message.headers["x-metrale-compacted"]
        assert message.json()["usage"]["compacted"]["messages_before"] >= 5
        counted = httpx.post(url + "/count_tokens", json=messages_body(), headers=headers)
        assert counted.json()["input_tokens"] > 512  # the conversation as sent

        stream = chat_body() | {"stream": True, "stream_options": {"include_usage": True}}
        with httpx.stream("POST", server.api_url + "/chat/completions", json=stream) as r:
            assert r.headers["x-metrale-compacted"] == "truncate_tool_results"
            assert '"compacted"' in r.read().decode()

        response = httpx.post(
            server.api_url + "/responses",
            json={
                "model": MODEL_NAME,
                "max_output_tokens": 8,
                "input": [
                    {"role": "user", "content": "Summarise: " + LONG_TOOL_RESULT},
                    {"role": "assistant", "content": "It is about weather."},
                    {"role": "user", "content": "Thanks. And tomorrow?"},
                ],
            },
            timeout=60,
        )
        assert response.status_code == 200, response.text
        # one turn before the last: nothing to choose among, so only the last turn stays
        assert response.headers["x-metrale-compacted"].endswith("last_messages")
        assert response.json()["usage"]["compacted"]["messages_after"] == 1

        # a single turn too long to shorten stays an error, in the API's shape
        alone = {"model": MODEL_NAME, "messages": [{"role": "user", "content": LONG_TOOL_RESULT}]}
        refused = httpx.post(server.api_url + "/chat/completions", json=alone, timeout=60)
        assert refused.status_code == 400
        assert "could not shorten it enough" in refused.json()["error"]["message"]
