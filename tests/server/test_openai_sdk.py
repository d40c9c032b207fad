"""The official `openai` SDK against `met serve`, unchanged."""

from __future__ import annotations

import asyncio
import json
import os
import time
from pathlib import Path

import httpx
import openai
import pytest

from metrale.engine.allocator import tcmalloc_library
from tests.server.conftest import MODEL_NAME

MESSAGES = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "Tell me about the sea. 🌊"},
]


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.api_url, api_key="unused", max_retries=0)


def greedy_chat(client, stream: bool, **kwargs):
    return client.chat.completions.create(
        model=MODEL_NAME, messages=MESSAGES, temperature=0, max_tokens=24, stream=stream, **kwargs
    )


def test_models(client):
    models = client.models.list()
    assert [m.id for m in models.data] == [MODEL_NAME]
    assert client.models.retrieve(MODEL_NAME).id == MODEL_NAME
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("nope")


def test_streaming_text_equals_non_streaming_for_greedy(client):
    full = greedy_chat(client, stream=False, extra_body={"ignore_eos": True})
    chunks = list(
        greedy_chat(
            client,
            stream=True,
            extra_body={"ignore_eos": True},
            stream_options={"include_usage": True},
        )
    )
    streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert streamed == full.choices[0].message.content
    assert full.choices[0].finish_reason == "length"
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[0].choices[0].delta.role == "assistant"
    usage = chunks[-1].usage
    assert not chunks[-1].choices and usage.completion_tokens == 24
    assert usage.prompt_tokens == full.usage.prompt_tokens
    assert full.usage.total_tokens == full.usage.prompt_tokens + 24


def test_prefix_cache_hits_are_reported_as_cached_tokens(client):
    messages = [{"role": "user", "content": "a long shared prefix " * 20}]
    first = client.chat.completions.create(model=MODEL_NAME, messages=messages, max_tokens=2)
    second = client.chat.completions.create(model=MODEL_NAME, messages=messages, max_tokens=2)
    assert second.usage.prompt_tokens_details.cached_tokens > 0
    assert (
        second.usage.prompt_tokens_details.cached_tokens
        >= first.usage.prompt_tokens_details.cached_tokens
    )


def test_stop_strings_are_cut_and_never_leak_into_the_stream(client):
    text = (
        greedy_chat(client, stream=False, extra_body={"ignore_eos": True})
        .choices[0]
        .message.content
    )
    assert len(text) > 6
    stop = text[3:6]
    cut = text[: text.index(stop)]
    full = greedy_chat(client, stream=False, stop=[stop])
    assert full.choices[0].message.content == cut
    assert full.choices[0].finish_reason == "stop"
    streamed = "".join(
        c.choices[0].delta.content or ""
        for c in greedy_chat(client, stream=True, stop=[stop])
        if c.choices
    )
    assert streamed == cut


def test_logprobs_n_and_seed(client):
    out = greedy_chat(client, stream=False, logprobs=True, top_logprobs=3)
    content = out.choices[0].logprobs.content
    assert len(content) == out.usage.completion_tokens
    for item in content:
        assert len(item.top_logprobs) == 3
        assert item.top_logprobs[0].logprob == pytest.approx(item.logprob)  # greedy: top-1
    many = client.chat.completions.create(
        model=MODEL_NAME, messages=MESSAGES, n=3, seed=7, temperature=1.0, max_tokens=8
    )
    assert sorted(c.index for c in many.choices) == [0, 1, 2]
    again = client.chat.completions.create(
        model=MODEL_NAME, messages=MESSAGES, n=3, seed=7, temperature=1.0, max_tokens=8
    )
    assert [c.message.content for c in many.choices] == [c.message.content for c in again.choices]
    assert many.usage.completion_tokens <= 3 * 8


def test_completions_string_tokens_batch_and_echo(client, server):
    full = client.completions.create(
        model=MODEL_NAME,
        prompt="Once upon a time",
        max_tokens=10,
        temperature=0,
        extra_body={"ignore_eos": True},
    )
    streamed = "".join(
        c.choices[0].text
        for c in client.completions.create(
            model=MODEL_NAME,
            prompt="Once upon a time",
            max_tokens=10,
            temperature=0,
            stream=True,
            extra_body={"ignore_eos": True},
        )
    )
    assert streamed == full.choices[0].text
    ids = httpx.post(server.base_url + "/tokenize", json={"prompt": "Once upon a time"}).json()[
        "tokens"
    ]
    by_ids = client.completions.create(
        model=MODEL_NAME, prompt=ids, max_tokens=10, temperature=0, extra_body={"ignore_eos": True}
    )
    assert by_ids.choices[0].text == full.choices[0].text
    batch = client.completions.create(
        model=MODEL_NAME, prompt=["Once upon a time", "Hello"], max_tokens=5, temperature=0
    )
    assert sorted(c.index for c in batch.choices) == [0, 1]
    echoed = client.completions.create(
        model=MODEL_NAME,
        prompt="Once upon a time",
        max_tokens=10,
        temperature=0,
        echo=True,
        extra_body={"ignore_eos": True},
    )
    assert echoed.choices[0].text == "Once upon a time" + full.choices[0].text
    with_lp = client.completions.create(
        model=MODEL_NAME, prompt="Hi", max_tokens=4, temperature=0, logprobs=2
    )
    lp = with_lp.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 4


def test_stored_completion_can_be_fetched(client, server):
    out = greedy_chat(client, stream=False, store=True)
    fetched = httpx.get(f"{server.api_url}/chat/completions/{out.id}").json()
    assert fetched["choices"][0]["message"]["content"] == out.choices[0].message.content
    missing = httpx.get(f"{server.api_url}/chat/completions/chatcmpl-nope")
    assert missing.status_code == 404 and "error" in missing.json()


def test_32_concurrent_streams_all_complete(server):
    async def one(client: openai.AsyncOpenAI, i: int) -> str:
        stream = await client.chat.completions.create(
            model=MODEL_NAME,
            messages=[{"role": "user", "content": f"request {i}"}],
            max_tokens=16,
            temperature=0,
            stream=True,
            extra_body={"ignore_eos": True},
        )
        finish = None
        async for chunk in stream:
            if chunk.choices and chunk.choices[0].finish_reason:
                finish = chunk.choices[0].finish_reason
        return finish

    async def main() -> list[str]:
        async with openai.AsyncOpenAI(
            base_url=server.api_url, api_key="x", max_retries=0
        ) as client:
            return await asyncio.gather(*(one(client, i) for i in range(32)))

    assert asyncio.run(main()) == ["length"] * 32


def test_disconnected_streams_free_their_blocks(server):
    async def leave_early(client: httpx.AsyncClient, i: int) -> None:
        body = {
            "model": MODEL_NAME,
            "messages": [{"role": "user", "content": f"go {i}"}],
            "max_tokens": 400,
            "stream": True,
            "ignore_eos": True,
        }
        async with client.stream("POST", "/v1/chat/completions", json=body) as response:
            assert response.status_code == 200
            async for _ in response.aiter_lines():
                break  # first chunk received: hang up mid-stream

    async def main() -> None:
        async with httpx.AsyncClient(base_url=server.base_url, timeout=30) as client:
            await asyncio.gather(*(leave_early(client, i) for i in range(20)))

    asyncio.run(main())
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        memory = httpx.get(server.base_url + "/memory").json()
        if memory["kv_cache"]["blocks_used"] == 0 and memory["requests"]["running"] == 0:
            break
        time.sleep(0.1)
    assert memory["kv_cache"]["blocks_used"] == 0, memory
    assert memory["requests"] == {
        "running": 0,
        "waiting": 0,
        "preemptions": memory["requests"]["preemptions"],
        "recomputed_tokens": memory["requests"]["recomputed_tokens"],
    }


def test_operational_routes(server):
    assert httpx.get(server.base_url + "/health").json()["status"] == "ok"
    assert httpx.get(server.base_url + "/health/live").status_code == 200
    config = httpx.get(server.base_url + "/serve-config").json()
    assert config["server"]["served_model_name"] == MODEL_NAME
    assert config["engine"]["scheduler"]["max_seq_len"] == 512
    assert config["server"]["event_loop"] == "uvloop"  # uvicorn[standard] installs it
    assert config["server"]["stream_interval"] == 1  # an event per token unless asked
    threads = config["cpu_threads"]  # the engine process's, not this one's
    assert threads["torch_threads"] >= 1 and 1 <= threads["cores_usable"] <= os.cpu_count()
    assert threads["omp_num_threads"] is None
    # the engine process runs on tcmalloc where the system has it (engine/allocator.py)
    maps = Path(f"/proc/{server.engine_pid()}/maps").read_text()
    if tcmalloc_library() is None:
        assert threads["allocator"] == "glibc" and "tcmalloc" not in maps
    else:
        assert "tcmalloc" in threads["allocator"] and "tcmalloc" in maps
    # every linear layer of the tiny Qwen3 (qkv, o, gate_up, down; a tied head is the embedding)
    forward = httpx.get(server.base_url + "/forward").json()
    assert threads == forward["cpu_threads"]
    assert threads["onednn_linear_layers"] + threads["panel_linear_layers"] in (
        4 * forward["num_layers"],
        4 * forward["num_layers"] + 1,
    )
    # float32: Metrale's panels where its CPU kernels build, else oneDNN, never both
    assert 0 in (threads["onednn_linear_layers"], threads["panel_linear_layers"])
    hardware = httpx.get(server.base_url + "/hardware").json()
    assert hardware["cpu"]["cores"] >= 1 and "torch" in hardware["versions"]
    full_memory = httpx.get(server.base_url + "/memory").json()
    assert (
        full_memory["device"]["device"] == "cpu" and full_memory["device"]["budget_bytes"] is None
    )
    memory = full_memory["kv_cache"]
    assert memory["blocks_total"] == 256 and 0 <= memory["usage"] <= 1
    for path in (
        "/v1/embeddings",
        "/v1/files",
        "/v1/audio/speech",
        "/v1/images/generations",
        "/v1/moderations",
        "/v1/batches",
    ):
        response = httpx.post(server.base_url + path, json={})
        assert response.status_code == 501, path
        assert "not supported" in response.json()["error"]["message"]


def test_tokenize_detokenize_round_trip(server):
    tokens = httpx.post(server.base_url + "/tokenize", json={"prompt": "héllo wörld"}).json()
    assert tokens["count"] == len(tokens["tokens"])
    text = httpx.post(server.base_url + "/detokenize", json={"tokens": tokens["tokens"]}).json()
    assert text["prompt"] == "héllo wörld"
    chat = httpx.post(server.base_url + "/tokenize", json={"messages": MESSAGES}).json()
    completion = httpx.post(
        server.api_url + "/chat/completions", json={"messages": MESSAGES, "max_tokens": 1}
    ).json()
    assert chat["count"] == completion["usage"]["prompt_tokens"]


COLOUR_TOOL = {
    "type": "function",
    "function": {
        "name": "pick_colour",
        "parameters": {
            "type": "object",
            "properties": {
                "colour": {"enum": ["red", "green", "blue"]},
                "bright": {"type": "boolean"},
            },
            "required": ["colour", "bright"],
            "additionalProperties": False,
        },
    },
}


@pytest.mark.parametrize(
    "choice", ["required", {"type": "function", "function": {"name": "pick_colour"}}]
)
def test_forced_tool_choice_is_enforced_by_the_grammar(client, choice):
    """Random weights, yet the reply is always one well-formed call (hermes format): a named
    function gets one call, and so does `required` without parallel calls (with them it may
    make several: tests/server/test_forced_tool_calls.py)."""
    kwargs = {
        "model": MODEL_NAME,
        "messages": MESSAGES,
        "tools": [COLOUR_TOOL],
        "tool_choice": choice,
        "parallel_tool_calls": False,
        "max_tokens": 100,
        "temperature": 1.0,
        "seed": 5,
    }
    out = client.chat.completions.create(**kwargs)
    (call,) = out.choices[0].message.tool_calls
    assert call.function.name == "pick_colour"
    assert out.choices[0].finish_reason == "tool_calls"
    value = json.loads(call.function.arguments)
    assert value["colour"] in ("red", "green", "blue") and isinstance(value["bright"], bool)

    chunks = list(client.chat.completions.create(stream=True, **kwargs))
    deltas = [tc for c in chunks if c.choices for tc in c.choices[0].delta.tool_calls or []]
    assert [tc.function.name for tc in deltas if tc.function.name] == ["pick_colour"]
    assert "".join(tc.function.arguments or "" for tc in deltas) == call.function.arguments
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "tool_calls"


def test_response_format_json_schema(client):
    schema = {
        "type": "object",
        "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 99}},
        "required": ["n"],
        "additionalProperties": False,
    }
    out = client.chat.completions.create(
        model=MODEL_NAME,
        messages=MESSAGES,
        max_tokens=40,
        temperature=1.0,
        seed=2,
        response_format={"type": "json_schema", "json_schema": {"name": "n", "schema": schema}},
    )
    assert 0 <= json.loads(out.choices[0].message.content)["n"] <= 99
    with pytest.raises(openai.BadRequestError, match="cannot compile"):
        client.chat.completions.create(
            model=MODEL_NAME,
            messages=MESSAGES,
            max_tokens=5,
            extra_body={"structured_outputs": {"regex": "(["}},
        )
