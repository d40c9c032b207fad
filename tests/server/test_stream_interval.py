"""`met serve --stream-interval N` through the real server and the official SDKs: fewer, larger
events, the same text."""

from __future__ import annotations

import anthropic
import httpx
import openai
import pytest

from tests.server.conftest import MODEL_NAME, serving

INTERVAL = 4
NUM_TOKENS = 24


@pytest.fixture(scope="module")
def gathered(qwen3_dir, tmp_path_factory):
    log = tmp_path_factory.mktemp("stream-interval") / "server.log"
    with serving(qwen3_dir, log, "--stream-interval", str(INTERVAL)) as server:
        yield server


def test_the_interval_is_in_the_served_config(gathered):
    config = httpx.get(gathered.base_url + "/serve-config").json()
    assert config["server"]["stream_interval"] == INTERVAL


def _chat(client: openai.OpenAI, stream: bool):
    return client.chat.completions.create(
        model=MODEL_NAME,
        messages=[{"role": "user", "content": "Tell me about the sea."}],
        temperature=0,
        max_tokens=NUM_TOKENS,
        stream=stream,
        extra_body={"ignore_eos": True},
        **({"stream_options": {"include_usage": True}} if stream else {}),
    )


def test_chat_streams_in_events_of_the_interval(gathered):
    client = openai.OpenAI(base_url=gathered.api_url, api_key="unused", max_retries=0)
    full = _chat(client, stream=False)
    chunks = list(_chat(client, stream=True))
    text_chunks = [c for c in chunks if c.choices and c.choices[0].delta.content]
    streamed = "".join(c.choices[0].delta.content for c in text_chunks)
    assert streamed == full.choices[0].message.content
    # The first token at once, then events of INTERVAL tokens (an event per token: 24).
    assert 2 <= len(text_chunks) <= 2 + NUM_TOKENS // INTERVAL
    assert chunks[-1].usage.completion_tokens == NUM_TOKENS


def test_anthropic_messages_stream_the_same_text_in_fewer_deltas(gathered):
    client = anthropic.Anthropic(base_url=gathered.base_url, api_key="unused", max_retries=0)
    request = {
        "model": MODEL_NAME,
        "max_tokens": NUM_TOKENS,
        "messages": [{"role": "user", "content": "Tell me about the sea."}],
        # (this SDK has no temperature parameter any more: sent as an extra field)
        "extra_body": {"ignore_eos": True, "temperature": 0},
    }
    full = client.messages.create(**request)
    with client.messages.stream(**request) as stream:
        deltas = [
            e.delta.text
            for e in stream
            if e.type == "content_block_delta" and e.delta.type == "text_delta"
        ]
    assert "".join(deltas) == "".join(b.text for b in full.content if b.type == "text")
    assert len(deltas) <= 2 + NUM_TOKENS // INTERVAL
