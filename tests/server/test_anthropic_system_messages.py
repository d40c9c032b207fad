"""System messages inside `messages`, as Claude Code 2.1 sends them: kept where they stand.

`chat_request()` is checked on its own (the chat messages, in order), then a real `met serve`
through httpx and the `anthropic` SDK: such a request is answered, its prompt holds the text
at that place (count_tokens grows by exactly its system turn), and a non-text block is a 400.
"""

from __future__ import annotations

import anthropic
import httpx
import pytest

from metrale.server.anthropic.protocol import CountTokensRequest
from metrale.server.anthropic.translate import chat_request
from metrale.server.errors import APIError
from metrale.tokenizer import Tokenizer
from tests.server.conftest import MODEL_NAME

BILLING = "x-anthropic-billing-header: cc_version=2.1.117.48f; cc_entrypoint=cli; cch=71fea;"
NOTE = "The tool list changed: read_file is gone."
HISTORY = [
    {"role": "user", "content": "Hi."},
    {"role": "assistant", "content": "Hello."},
    {"role": "user", "content": "Read a.txt."},
]


def with_system(content, at: int = 2) -> list[dict]:
    return [*HISTORY[:at], {"role": "system", "content": content}, *HISTORY[at:]]


def chat_messages(**fields) -> list[tuple[str, str]]:
    chat = chat_request(CountTokensRequest.model_validate({"model": "m", **fields}))
    return [(m.role, m.content) for m in chat.messages]


def test_a_system_message_stays_where_it_stands():
    assert chat_messages(system="Be terse.", messages=with_system(NOTE)) == [
        ("system", "Be terse."),
        ("user", "Hi."),
        ("assistant", "Hello."),
        ("system", NOTE),
        ("user", "Read a.txt."),
    ]


def test_text_blocks_join_and_lose_the_billing_header():
    blocks = [
        {"type": "text", "text": BILLING},
        {"type": "text", "text": "First.", "cache_control": {"type": "ephemeral"}},
        {"type": "text", "text": f"{BILLING}\nSecond."},
    ]
    assert chat_messages(messages=with_system(blocks))[2] == ("system", "First.\nSecond.")
    # Nothing left but the header: no empty system turn.
    assert chat_messages(messages=with_system(BILLING)) == chat_messages(messages=HISTORY)
    assert chat_messages(messages=with_system([])) == chat_messages(messages=HISTORY)


def test_a_final_system_message_is_no_prefill():
    chat = chat_request(
        CountTokensRequest.model_validate({"model": "m", "messages": with_system(NOTE, at=2)[:3]})
    )
    assert chat.messages[-1].role == "system"
    assert chat.add_generation_prompt and not chat.continue_final_message


@pytest.mark.parametrize(
    "block",
    [
        {"type": "tool_use", "id": "toolu_1", "name": "read_file", "input": {}},
        {"type": "tool_result", "tool_use_id": "toolu_1", "content": "x"},
        {"type": "thinking", "thinking": "hm", "signature": "s"},
        {"type": "redacted_thinking", "data": "opaque"},
        {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "AA=="}},
    ],
    ids=lambda block: block["type"],
)
def test_only_text_belongs_in_a_system_message(block):
    content = [{"type": "text", "text": NOTE}, block]
    body = CountTokensRequest.model_validate({"model": "m", "messages": with_system(content)})
    with pytest.raises(APIError) as raised:
        chat_request(body)
    assert raised.value.param == "messages.2.content.1"
    assert raised.value.message.startswith("messages.2.content.1: a system message holds text")
    assert repr(block["type"]) in raised.value.message


# The real server: Claude Code's first request of a process, through HTTP and the SDK.


def post(server, path: str, **fields) -> httpx.Response:
    payload = {"model": MODEL_NAME, "messages": HISTORY, **fields}
    return httpx.post(server.api_url + path, json=payload, timeout=60)


def count(server, **fields) -> int:
    response = post(server, "/messages/count_tokens", **fields)
    assert response.status_code == 200, response.text
    return response.json()["input_tokens"]


def test_server_renders_a_mid_conversation_system_message_in_place(server, qwen3_dir):
    tokenizer = Tokenizer.from_dir(qwen3_dir)
    turn_ids = tokenizer.encode(f"<|im_start|>system\n{NOTE}<|im_end|>\n", add_special_tokens=False)
    base = count(server, system="Be terse.")
    blocks = [{"type": "text", "text": BILLING}, {"type": "text", "text": NOTE}]
    for messages in (with_system(NOTE), with_system(blocks), with_system(NOTE, at=3)):
        assert count(server, system="Be terse.", messages=messages) == base + len(turn_ids)
    response = post(
        server, "/messages", system="Be terse.", messages=with_system(blocks), max_tokens=4
    )
    assert response.status_code == 200, response.text
    usage = response.json()["usage"]  # prefix-cache hits are counted apart
    assert usage["input_tokens"] + usage["cache_read_input_tokens"] == base + len(turn_ids)
    client = anthropic.Anthropic(base_url=server.base_url, api_key="x", max_retries=0)
    message = client.messages.create(
        model=MODEL_NAME, max_tokens=4, system="Be terse.", messages=with_system(NOTE, at=3)
    )
    assert message.type == "message" and message.stop_reason is not None
    assert message.usage.input_tokens + message.usage.cache_read_input_tokens == base + len(
        turn_ids
    )


@pytest.mark.parametrize("path", ["/messages", "/messages/count_tokens"])
def test_server_refuses_a_non_text_block_in_a_system_message(server, path):
    content = [{"type": "tool_use", "id": "toolu_1", "name": "read_file", "input": {}}]
    response = post(server, path, messages=with_system(content), max_tokens=4)
    assert response.status_code == 400, response.text
    error = response.json()
    assert error["type"] == "error" and set(error["error"]) == {"type", "message"}
    assert error["error"]["type"] == "invalid_request_error"
    assert error["error"]["message"].startswith("messages.2.content.0: a system message")
