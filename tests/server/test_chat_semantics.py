"""Chat and completion semantics through the HTTP API: templates, n, stops, penalties, limits."""

from __future__ import annotations

import json
import socket
import time

import httpx
import openai
import pytest

from tests.server.conftest import MODEL_NAME, start_server, stop_server

USER = [{"role": "user", "content": "Name three colours."}]


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.api_url, api_key="unused", max_retries=0)


def prompt_tokens(server, **body) -> int:
    return httpx.post(server.base_url + "/tokenize", json=body).json()["count"]


def test_chat_template_kwargs_reach_the_template(client, server):
    thinking_off = {"enable_thinking": False}
    out = client.chat.completions.create(
        model=MODEL_NAME,
        messages=USER,
        max_tokens=1,
        extra_body={"chat_template_kwargs": thinking_off},
    )
    default = client.chat.completions.create(model=MODEL_NAME, messages=USER, max_tokens=1)
    # The demo template closes an empty think block when thinking is off: more prompt tokens.
    assert out.usage.prompt_tokens > default.usage.prompt_tokens
    assert out.usage.prompt_tokens == prompt_tokens(
        server, messages=USER, chat_template_kwargs=thinking_off
    )


def test_developer_role_is_the_system_turn(server):
    as_developer = [{"role": "developer", "content": "Be brief."}, *USER]
    as_system = [{"role": "system", "content": "Be brief."}, *USER]
    assert prompt_tokens(server, messages=as_developer) == prompt_tokens(server, messages=as_system)


def test_continue_final_message_extends_the_assistant_turn(client, server):
    messages = [*USER, {"role": "assistant", "content": "Red, green and"}]
    out = client.chat.completions.create(
        model=MODEL_NAME,
        messages=messages,
        max_tokens=4,
        temperature=0,
        extra_body={
            "continue_final_message": True,
            "add_generation_prompt": False,
            "ignore_eos": True,
        },
    )
    with_new_turn = prompt_tokens(server, messages=messages, add_generation_prompt=True)
    # Continuing leaves the assistant message open: no end-of-turn, no new assistant header.
    assert out.usage.prompt_tokens < with_new_turn
    assert out.usage.completion_tokens == 4


def test_n_streams_every_choice_to_its_end(client):
    chunks = list(
        client.chat.completions.create(
            model=MODEL_NAME,
            messages=USER,
            n=2,
            max_tokens=6,
            temperature=1.0,
            seed=3,
            stream=True,
            extra_body={"ignore_eos": True},
        )
    )
    finished = {
        c.choices[0].index: c.choices[0].finish_reason
        for c in chunks
        if c.choices and c.choices[0].finish_reason
    }
    assert finished == {0: "length", 1: "length"}
    texts = [
        "".join(
            c.choices[0].delta.content or ""
            for c in chunks
            if c.choices and c.choices[0].index == i
        )
        for i in (0, 1)
    ]
    full = client.chat.completions.create(
        model=MODEL_NAME,
        messages=USER,
        n=2,
        max_tokens=6,
        temperature=1.0,
        seed=3,
        extra_body={"ignore_eos": True},
    )
    assert texts == [c.message.content for c in sorted(full.choices, key=lambda c: c.index)]


def test_stop_token_ids_and_logit_bias(client, server):
    forced = httpx.post(server.base_url + "/tokenize", json={"prompt": " blue"}).json()["tokens"]
    token = forced[-1]
    out = client.chat.completions.create(
        model=MODEL_NAME,
        messages=USER,
        max_tokens=5,
        temperature=0,
        logit_bias={str(token): 100},
        extra_body={"ignore_eos": True},
    )
    text = httpx.post(server.base_url + "/detokenize", json={"tokens": [token]}).json()["prompt"]
    assert out.choices[0].message.content == text * 5
    stopped = client.chat.completions.create(
        model=MODEL_NAME,
        messages=USER,
        max_tokens=5,
        temperature=0,
        logit_bias={str(token): 100},
        extra_body={"stop_token_ids": [token]},
    )
    assert stopped.choices[0].finish_reason == "stop"
    assert stopped.usage.completion_tokens == 1
    assert stopped.choices[0].model_extra["stop_reason"] == token


def test_frequency_penalty_changes_greedy_output(client):
    plain = client.chat.completions.create(
        model=MODEL_NAME,
        messages=USER,
        max_tokens=30,
        temperature=0,
        extra_body={"ignore_eos": True},
    )
    penalised = client.chat.completions.create(
        model=MODEL_NAME,
        messages=USER,
        max_tokens=30,
        temperature=0,
        frequency_penalty=2.0,
        extra_body={"ignore_eos": True},
    )
    assert plain.choices[0].message.content != penalised.choices[0].message.content


def test_non_streaming_client_that_gives_up_frees_its_blocks(server):
    # The client leaves once the engine runs its request, however fast this machine decodes
    # (a fixed client timeout raced 490 tokens on a fast one), and the request must end as an
    # abort, not by finishing its tokens while the test waits.
    aborted = finished(server, "abort")
    body = {"model": MODEL_NAME, "messages": USER, "max_tokens": 490, "ignore_eos": True}
    payload = json.dumps(body).encode()
    host, port = server.base_url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port))) as conn:
        conn.sendall(
            b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            + f"Content-Length: {len(payload)}\r\n\r\n".encode()
            + payload
        )
        deadline = time.monotonic() + 10
        while httpx.get(server.base_url + "/memory").json()["requests"]["running"] == 0:
            assert time.monotonic() < deadline, "the request never ran"
            time.sleep(0.005)
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        memory = httpx.get(server.base_url + "/memory").json()
        if memory["kv_cache"]["blocks_used"] == 0:
            break
        time.sleep(0.05)
    assert memory["kv_cache"]["blocks_used"] == 0
    assert memory["requests"]["running"] == 0
    assert finished(server, "abort") == aborted + 1


def finished(server, reason: str) -> float:
    text = httpx.get(server.base_url + "/metrics", timeout=10).text
    for line in text.splitlines():
        if line.startswith("metrale:request_success_total{") and f'"{reason}"' in line:
            return float(line.rsplit(" ", 1)[1])
    return 0.0


def test_request_timeout(qwen3_dir, tmp_path):
    server = start_server(qwen3_dir, tmp_path / "server.log", "--request-timeout", "0.05")
    try:
        # Four choices of 480 tokens: ~0.4 s on the fastest 2-core VM seen (one took 0.28 s),
        # ~1.5 s on a slow one, far past the 0.05 s limit either way.
        body = {
            "model": MODEL_NAME,
            "messages": USER,
            "max_tokens": 480,
            "n": 4,
            "ignore_eos": True,
        }
        response = httpx.post(server.api_url + "/chat/completions", json=body, timeout=30)
        assert response.status_code == 408
        assert "timed out" in response.json()["error"]["message"]
    finally:
        assert stop_server(server) == 0, server.log()


def test_always_include_usage(qwen3_dir, tmp_path):
    server = start_server(qwen3_dir, tmp_path / "server.log", "--always-include-usage")
    try:
        body = {"model": MODEL_NAME, "messages": USER, "max_tokens": 2, "stream": True}
        with httpx.stream(
            "POST", server.api_url + "/chat/completions", json=body, timeout=30
        ) as streamed:
            lines = [line for line in streamed.iter_lines() if line.startswith("data: {")]
        assert '"usage":{"prompt_tokens"' in lines[-1], "no usage chunk without asking for it"
    finally:
        assert stop_server(server) == 0, server.log()


def test_llama_cpp_truncation_knobs_reach_the_sampler_on_every_api(client, server):
    """top_n_sigma near 0 leaves only the top logit: hot sampling gives the greedy reply, through
    chat (the SDK's extra_body), completions, Anthropic messages and responses."""
    greedy = client.chat.completions.create(
        model=MODEL_NAME, messages=USER, max_tokens=8, temperature=0
    )
    expected = greedy.choices[0].message.content
    hot = {"top_n_sigma": 1e-4, "seed": 5}
    chat = client.chat.completions.create(
        model=MODEL_NAME, messages=USER, max_tokens=8, temperature=1.5, extra_body=hot
    )
    assert chat.choices[0].message.content == expected
    anthropic_body = {
        "model": MODEL_NAME,
        "max_tokens": 8,
        "messages": USER,
        "temperature": 1.0,
        "top_n_sigma": 1e-4,
    }
    message = httpx.post(server.base_url + "/v1/messages", json=anthropic_body, timeout=60).json()
    text = "".join(b.get("text", "") for b in message["content"] if b["type"] == "text")
    assert text == expected
    response_body = {
        "model": MODEL_NAME,
        "input": USER[0]["content"],
        "max_output_tokens": 8,
        "temperature": 1.5,
        **hot,
    }
    response = httpx.post(server.api_url + "/responses", json=response_body, timeout=60).json()
    items = [i for i in response["output"] if i["type"] == "message"]
    assert "".join(c["text"] for c in items[0]["content"]) == expected


REPEAT_KNOBS = {
    "dry_multiplier": 3.0,
    "dry_allowed_length": 1,
    "dry_sequence_breakers": ["\n", "."],
    "lz_penalty": 0.8,
}


def test_dry_and_lz_reach_the_sampler_on_every_api(client, server, qwen3_dir):
    """With DRY and the LZ penalty, a completion from token ids and a chat turn say what the
    offline engine says on the same checkpoint, prompt and knobs (the completion not what
    greedy says); Anthropic messages and responses say what chat says."""
    from metrale import LLM, SamplingParams

    llm = LLM(model_from_path=str(qwen3_dir), dtype="float32", max_seq_len=512)
    knobs = {**REPEAT_KNOBS, "dry_sequence_breakers": tuple(REPEAT_KNOBS["dry_sequence_breakers"])}

    def offline(prompt: list[int]) -> str:
        params = SamplingParams(temperature=0, max_tokens=12, **knobs)
        return llm.generate([prompt], params, use_tqdm=False)[0].outputs[0].text

    prompt = [17, 93, 4, 17, 93, 4, 17, 93, 4, 17, 93]
    body = {"model": MODEL_NAME, "prompt": prompt, "max_tokens": 12, "temperature": 0}
    completions = server.api_url + "/completions"
    text = httpx.post(completions, json={**body, **REPEAT_KNOBS}, timeout=60).json()
    greedy = httpx.post(completions, json=body, timeout=60).json()
    assert text["choices"][0]["text"] == offline(prompt)
    assert greedy["choices"][0]["text"] != offline(prompt)

    chat = client.chat.completions.create(
        model=MODEL_NAME, messages=USER, max_tokens=12, temperature=0, extra_body=REPEAT_KNOBS
    )
    expected = chat.choices[0].message.content
    chat_ids = httpx.post(
        server.base_url + "/tokenize", json={"model": MODEL_NAME, "messages": USER}
    ).json()["tokens"]
    assert expected == offline(chat_ids)
    anthropic_body = {"model": MODEL_NAME, "max_tokens": 12, "messages": USER, "temperature": 0}
    message = httpx.post(
        server.base_url + "/v1/messages", json={**anthropic_body, **REPEAT_KNOBS}, timeout=60
    ).json()
    assert "".join(b.get("text", "") for b in message["content"] if b["type"] == "text") == expected
    response_body = {"model": MODEL_NAME, "input": USER[0]["content"], "max_output_tokens": 12}
    response = httpx.post(
        server.api_url + "/responses",
        json={**response_body, "temperature": 0, **REPEAT_KNOBS},
        timeout=60,
    ).json()
    items = [i for i in response["output"] if i["type"] == "message"]
    assert "".join(c["text"] for c in items[0]["content"]) == expected
