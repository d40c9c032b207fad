"""A property-based fuzzer over every route of a real `met serve`: hostile bodies, streaming and
not, must each get a 2xx or a 4xx in the route's error shape, never a 5xx or a reset
connection; afterwards the server is healthy and holds no KV blocks.

Bodies start from a valid request of the route and take up to four mutations: a field set to
a hostile value (integers past int64, lone surrogates, NaN, huge or empty strings, deep or
wrong-typed structures), a field dropped, a nested field (a message's content, a tool's name)
replaced; a few are raw bytes that are not JSON at all. The default run sends 1,000 bodies;
`-m slow` sends 6,000. schemathesis adds bodies drawn from each route's schema in the server's
OpenAPI document, valid ones and ones that break it.
"""

from __future__ import annotations

import copy
import json
import time

import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.server.conftest import MODEL_NAME, start_server, stop_server

USER = [{"role": "user", "content": "hi"}]
TOOL = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}

# (path, a valid body, the fields a mutation may set)
ROUTES = {
    "chat": (
        "/v1/chat/completions",
        {"model": MODEL_NAME, "messages": USER, "max_tokens": 2},
        [
            "model", "messages", "max_tokens", "max_completion_tokens", "temperature", "top_p",
            "top_k", "min_p", "n", "seed", "stop", "stop_token_ids", "presence_penalty",
            "frequency_penalty", "repetition_penalty", "logit_bias", "logprobs", "top_logprobs",
            "tools", "tool_choice", "parallel_tool_calls", "response_format",
            "structured_outputs", "chat_template_kwargs", "reasoning_effort", "stream_options",
            "min_tokens", "ignore_eos", "echo", "add_generation_prompt",
            "continue_final_message", "store", "metadata", "user", "skip_special_tokens",
            "include_stop_str_in_output", "stream",
        ],
    ),
    "completions": (
        "/v1/completions",
        {"model": MODEL_NAME, "prompt": "hi", "max_tokens": 2},
        [
            "model", "prompt", "max_tokens", "temperature", "top_p", "top_k", "n", "seed",
            "stop", "stop_token_ids", "logit_bias", "logprobs", "echo", "suffix",
            "stream_options", "min_tokens", "ignore_eos", "stream",
        ],
    ),
    "messages": (
        "/v1/messages",
        {"model": MODEL_NAME, "max_tokens": 2, "messages": USER},
        [
            "model", "messages", "max_tokens", "system", "stop_sequences", "temperature",
            "top_p", "top_k", "tools", "tool_choice", "thinking", "metadata", "stream",
        ],
    ),
    "count_tokens": (
        "/v1/messages/count_tokens",
        {"model": MODEL_NAME, "messages": USER},
        ["model", "messages", "system", "tools", "tool_choice", "thinking"],
    ),
    "tokenize": (
        "/tokenize",
        {"model": MODEL_NAME, "prompt": "hi"},
        ["model", "prompt", "messages", "add_special_tokens", "add_generation_prompt",
         "chat_template_kwargs"],
    ),
    "detokenize": ("/detokenize", {"model": MODEL_NAME, "tokens": [1, 2]}, ["model", "tokens"]),
    "responses": (
        "/v1/responses",
        {"model": MODEL_NAME, "input": [{"role": "user", "content": "hi"}], "max_output_tokens": 2},
        [
            "model", "input", "instructions", "max_output_tokens", "temperature", "top_p",
            "tools", "tool_choice", "parallel_tool_calls", "reasoning", "text", "store",
            "background", "stream", "metadata", "include", "truncation",
            "previous_response_id", "conversation", "prompt_cache_key", "client_metadata",
        ],
    ),
    "conversations": (
        "/v1/conversations",
        {"items": [{"role": "user", "content": "hi"}], "metadata": {"k": "v"}},
        ["items", "metadata"],
    ),
}  # fmt: skip

# Places inside a body where a hostile value does the most harm.
NESTED = {
    "chat": [
        ("messages", 0, "content"),
        ("messages", 0, "role"),
        ("messages", 0, "tool_calls"),
        ("messages", 0, "name"),
        ("tools", 0, "function", "name"),
        ("tools", 0, "function", "parameters"),
        ("response_format", "json_schema", "schema"),
        ("logit_bias", "5"),
    ],
    "completions": [("prompt", 0), ("logit_bias", "5")],
    "messages": [
        ("messages", 0, "content"),
        ("messages", 0, "content", 0, "type"),
        ("tools", 0, "name"),
        ("tools", 0, "input_schema"),
        ("thinking", "budget_tokens"),
        ("system", 0, "text"),
    ],
    "count_tokens": [("messages", 0, "content"), ("tools", 0, "input_schema")],
    "tokenize": [("messages", 0, "content"), ("chat_template_kwargs", "enable_thinking")],
    "detokenize": [("tokens", 0)],
    "responses": [
        ("input", 0, "content"),
        ("input", 0, "type"),
        ("input", 0, "content", 0, "type"),
        ("tools", 0, "name"),
        ("tools", 0, "parameters"),
        ("text", "format", "schema"),
        ("reasoning", "effort"),
    ],
    "conversations": [("items", 0, "content"), ("items", 0, "role")],
}

# What a nested path's parents are made of when the base body lacks them.
SEEDS = {
    "tools": [TOOL],
    "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {}}},
    "logit_bias": {"5": 1},
    "thinking": {"type": "enabled", "budget_tokens": 2048},
    "system": [{"type": "text", "text": "be brief"}],
    "chat_template_kwargs": {"enable_thinking": False},
    "text": {"format": {"type": "json_schema", "name": "x", "schema": {}}},
    "reasoning": {"effort": "low"},
}

HOSTILE = st.sampled_from(
    [
        None, True, False, 0, -1, 1, 2, 17, 2**31, -(2**31) - 1, 2**63 - 1, 2**63, -(2**63) - 1,
        2**64, 10**30, 1e308, -1e308, 0.5, -0.0, float("nan"), float("inf"), float("-inf"),
        "", " ", "\x00", "\ud800", "\udfff x", "x" * 5000, "<|im_start|>", "{{ 7 * 7 }}",
        "{% for i in range(10**9) %}{% endfor %}", "'; DROP TABLE", "\u202e", "😀" * 10,
        [], {}, [[]], [{}], {"": None}, [None], ["a"] * 40, list(range(100)),
        {"type": "function"}, {"type": "text", "text": 5}, [{"type": "image_url"}],
        {"role": "user", "content": None}, [{"role": "tool", "content": "x"}],
        [{"role": "assistant", "tool_calls": [{"function": {"name": "f", "arguments": "{"}}]}],
        {"type": "json_schema", "json_schema": {"schema": {"type": "nope"}}},
        {"type": "enabled", "budget_tokens": 10**9}, "auto", "required", "none",
        {"type": "tool", "name": "missing"},
    ]
)  # fmt: skip
SCALARS = st.one_of(
    HOSTILE,
    st.integers(),
    st.integers(-2, 600),
    st.floats(allow_nan=True, allow_infinity=True),
    st.floats(-3, 3),
    st.text(max_size=20),
    st.text(st.characters(categories=["Cs", "Co", "Cc"]), max_size=5),
)
VALUES = st.recursive(
    SCALARS,
    lambda inner: (
        st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4)
    ),
    max_leaves=12,
)
RAW = st.sampled_from(
    [
        b"",
        b"{",
        b"null",
        b"[1]",
        b'{"model": "\xff"}',
        b'{"a": ' + b"[" * 5000 + b"]" * 5000 + b"}",
        b'{"messages": [{"role": "user", "content": "\\ud800"}], "max_tokens": 1}',
        b'{"prompt": "x", "max_tokens": 1e400}',
        b'{"prompt": [1, 2, 3' ,
    ]
)  # fmt: skip


def _set(body: dict, path: tuple, value: object) -> None:
    """Set `body[path]`, building missing parents (lists of one, dicts) on the way."""
    node: object = body
    for i, key in enumerate(path[:-1]):
        following = path[i + 1]
        empty: object = [{}] if isinstance(following, int) else {}
        if isinstance(node, dict):
            if not isinstance(node.get(key), list | dict):
                node[key] = json.loads(json.dumps(SEEDS.get(key, empty)))
            node = node[key]
        elif isinstance(node, list) and isinstance(key, int):
            if not node:
                node.append(empty if not isinstance(following, int) else [])
            node = node[min(key, len(node) - 1)]
        else:
            return
    last = path[-1]
    if isinstance(node, dict):
        node[last] = value
    elif isinstance(node, list) and node and isinstance(last, int):
        node[min(last, len(node) - 1)] = value


@st.composite
def requests(draw) -> tuple[str, str, bytes, bool]:
    """(route name, path, body bytes, streamed)."""
    name = draw(st.sampled_from(sorted(ROUTES)))
    path, base, fields = ROUTES[name]
    if draw(st.integers(0, 19)) == 0:
        return name, path, draw(RAW), False
    body = json.loads(json.dumps(base))
    if "stream" in fields:
        body["stream"] = draw(st.booleans())
    for _ in range(draw(st.sampled_from([0, 1, 1, 1, 2, 2, 3, 4]))):
        action = draw(st.sampled_from(["set", "set", "nested", "drop"]))
        value = copy.deepcopy(draw(VALUES))  # the samples are shared: never mutate one
        if action == "set":
            body[draw(st.sampled_from(fields))] = value
        elif action == "nested":
            _set(body, draw(st.sampled_from(NESTED[name])), value)
        elif body:
            body.pop(draw(st.sampled_from(sorted(body))), None)
    streamed = isinstance(body, dict) and body.get("stream") is True
    return name, path, json.dumps(body, allow_nan=True).encode(), streamed


def _check_shape(
    path: str, status: int, content_type: str, text: str, cut_short: bool = False
) -> None:
    """A 4xx in the route's error shape, or a 2xx; a stream ends with its route's terminal event
    and carries no server error. `cut_short`: the client stopped reading the stream early (its
    end is not there to check)."""
    assert status < 500, (path, status, text[:500])
    if status >= 400:
        body = json.loads(text)
        if path.startswith("/v1/messages"):
            assert body["type"] == "error" and set(body["error"]) >= {"type", "message"}, text
        else:
            assert set(body["error"]) >= {"message", "type", "param", "code"}, text
    elif content_type.startswith("text/event-stream"):
        ends = ("data: [DONE]", "event: message_stop", "event: response.completed",
                "event: response.incomplete", "event: response.failed")  # fmt: skip
        last = text.rstrip("\n").rsplit("\n\n", 1)[-1]
        assert cut_short or any(last.startswith(end) for end in ends), text[-500:]
        assert '"type":"server_error"' not in text and '"api_error"' not in text, text[-500:]
        assert '"code":"server_error"' not in text, text[-500:]


def _fuzz(server, examples: int) -> None:
    client = httpx.Client(base_url=server.base_url, timeout=60)
    sent: list[str] = []

    @settings(
        max_examples=examples,
        deadline=None,
        database=None,
        suppress_health_check=list(HealthCheck),
    )
    @given(requests())
    def one(request: tuple[str, str, bytes, bool]) -> None:
        name, path, content, _ = request
        sent.append(name)
        headers = {"content-type": "application/json"}
        with client.stream("POST", path, content=content, headers=headers) as response:
            text = response.read().decode("utf-8")
        _check_shape(path, response.status_code, response.headers.get("content-type", ""), text)

    one()
    assert len(sent) >= examples
    assert set(sent) == set(ROUTES)
    assert client.get("/health").status_code == 200
    deadline = time.monotonic() + 10
    while True:
        memory = client.get("/memory").json()
        used, running = memory["kv_cache"]["blocks_used"], memory["requests"]["running"]
        if (used, running) == (0, 0) or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    assert (used, running) == (0, 0), memory


@pytest.fixture(scope="module")
def fuzz_server(qwen3_dir, tmp_path_factory):
    running = start_server(
        qwen3_dir,
        tmp_path_factory.mktemp("fuzz") / "server.log",
        "--tool-call-parser",
        "hermes",
        "--request-timeout",
        "10",
    )
    yield running
    assert stop_server(running) == 0, running.log()
    assert "Traceback" not in running.log(), running.log()[-5000:]


def test_hostile_bodies_never_reach_a_5xx(fuzz_server):
    _fuzz(fuzz_server, 1000)


@pytest.mark.slow
def test_hostile_bodies_never_reach_a_5xx_long(fuzz_server):
    _fuzz(fuzz_server, 6000)


@pytest.fixture(scope="module")
def api_schema(fuzz_server):
    """The server's own OpenAPI document: every route's body schema (server/openapi.py)."""
    return schemathesis.openapi.from_url(fuzz_server.base_url + "/openapi.json")


schema = schemathesis.pytest.from_fixture("api_schema")


@schema.include(method="POST").parametrize()
@settings(max_examples=25, deadline=None, suppress_health_check=list(HealthCheck))
def test_schema_driven_bodies_never_reach_a_5xx(case):
    """schemathesis draws bodies from each route's schema, valid and not: none is a 5xx.

    schemathesis stops reading an event stream after its 20th event (`stream_cut_short`): such a
    stream is checked for what was read. The hostile-bodies test reads every stream to its end."""
    response = case.call(timeout=60)
    content_type = (response.headers.get("content-type") or [""])[0]
    try:
        _check_shape(
            case.operation.path,
            response.status_code,
            content_type,
            response.text,
            cut_short=response.stream_cut_short,
        )
    except AssertionError as e:  # with the body schemathesis drew, which it does not print
        raise AssertionError(f"body {str(case.body)[:2000]!r}: {e}") from None
