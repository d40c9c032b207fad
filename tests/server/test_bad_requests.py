"""A table of bad requests: each gets a 4xx with an OpenAI-shaped JSON error, never a 500,
and the server answers normally afterwards."""

from __future__ import annotations

import httpx
import pytest

from tests.server.conftest import MODEL_NAME

CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
USER = [{"role": "user", "content": "hi"}]


def chat(**fields):
    return {"model": MODEL_NAME, "messages": USER, **fields}


def completion(**fields):
    return {"model": MODEL_NAME, "prompt": "hi", **fields}


# (name, path, body (dict, or bytes sent raw), expected status, a word the message must contain)
CASES = [
    ("invalid json", CHAT, b'{"model": ', 400, "JSON"),
    ("invalid utf-8", CHAT, b'{"model": "\xff\xfe"}', 400, "UTF-8"),
    ("empty body", CHAT, b"", 400, "JSON"),
    ("json array body", CHAT, b"[1, 2]", 400, "object"),
    ("json string body", CHAT, b'"hello"', 400, "object"),
    ("absurd nesting", CHAT, b'{"x": ' + b"[" * 100_000 + b"]" * 100_000 + b"}", 400, "nested"),
    ("deep but parseable nesting", CHAT, b'{"x": ' + b"[" * 200 + b"]" * 200 + b"}", 400, "nested"),
    ("missing messages", CHAT, {"model": MODEL_NAME}, 400, "messages"),
    ("empty messages", CHAT, chat(messages=[]), 400, "messages"),
    ("messages not a list", CHAT, chat(messages="hi"), 400, "messages"),
    ("message not an object", CHAT, chat(messages=["hi"]), 400, "messages"),
    ("unknown role", CHAT, chat(messages=[{"role": "wizard", "content": "x"}]), 400, "role"),
    ("missing role", CHAT, chat(messages=[{"content": "x"}]), 400, "role"),
    ("user without content", CHAT, chat(messages=[{"role": "user"}]), 400, "content"),
    (
        "content of wrong type",
        CHAT,
        chat(messages=[{"role": "user", "content": 5}]),
        400,
        "content",
    ),
    (
        "image content part",
        CHAT,
        chat(
            messages=[
                {
                    "role": "user",
                    "content": [{"type": "image_url", "image_url": {"url": "http://x/y.png"}}],
                }
            ]
        ),
        400,
        "image_url",
    ),
    (
        "part without type",
        CHAT,
        chat(messages=[{"role": "user", "content": [{"text": "x"}]}]),
        400,
        "type",
    ),
    ("unknown model", CHAT, chat(model="gpt-17"), 404, "gpt-17"),
    ("model of wrong type", CHAT, chat(model=5), 400, "model"),
    ("temperature negative", CHAT, chat(temperature=-1), 400, "temperature"),
    ("temperature too high", CHAT, chat(temperature=3), 400, "temperature"),
    ("temperature as string", CHAT, chat(temperature="0.5"), 400, "temperature"),
    (
        "temperature NaN",
        CHAT,
        b'{"messages": [{"role": "user", "content": "x"}], "temperature": NaN}',
        400,
        "temperature",
    ),
    ("top_p zero", CHAT, chat(top_p=0), 400, "top_p"),
    ("top_p above one", CHAT, chat(top_p=1.5), 400, "top_p"),
    ("top_k below -1", CHAT, chat(top_k=-2), 400, "top_k"),
    ("min_p above one", CHAT, chat(min_p=1.5), 400, "min_p"),
    ("typical_p zero", CHAT, chat(typical_p=0), 400, "typical_p"),
    ("negative penalty window", CHAT, chat(repetition_penalty_window=-2), 400, "window"),
    ("xtc_probability above one", COMPLETIONS, completion(xtc_probability=1.5), 400, "xtc"),
    ("top_n_sigma not a number", CHAT, chat(top_n_sigma="wide"), 400, "top_n_sigma"),
    ("dry_base below one", CHAT, chat(dry_multiplier=0.8, dry_base=0.5), 400, "dry_base"),
    ("negative dry_multiplier", COMPLETIONS, completion(dry_multiplier=-1), 400, "dry_multiplier"),
    ("dry_penalty_last_n below -1", CHAT, chat(dry_penalty_last_n=-2), 400, "dry_penalty_last_n"),
    ("empty dry breaker", CHAT, chat(dry_sequence_breakers=["\n", ""]), 400, "dry_sequence"),
    ("dry breakers not strings", CHAT, chat(dry_sequence_breakers=[5]), 400, "dry_sequence"),
    ("too many dry breakers", CHAT, chat(dry_sequence_breakers=["a"] * 33), 400, "dry_sequence"),
    ("negative lz_penalty", COMPLETIONS, completion(lz_penalty=-0.5), 400, "lz_penalty"),
    ("max_tokens zero", CHAT, chat(max_tokens=0), 400, "max_tokens"),
    ("max_tokens negative", CHAT, chat(max_tokens=-5), 400, "max_tokens"),
    ("max_tokens float", CHAT, chat(max_tokens=1.5), 400, "max_tokens"),
    (
        "max_completion_tokens zero",
        CHAT,
        chat(max_completion_tokens=0),
        400,
        "max_completion_tokens",
    ),
    ("max_tokens past max_seq_len", CHAT, chat(max_tokens=100_000), 400, "512"),
    ("n zero", CHAT, chat(n=0), 400, "n"),
    ("n huge", CHAT, chat(n=10_000), 400, "n"),
    ("presence_penalty out of range", CHAT, chat(presence_penalty=5), 400, "presence_penalty"),
    ("frequency_penalty out of range", CHAT, chat(frequency_penalty=-3), 400, "frequency_penalty"),
    ("repetition_penalty zero", CHAT, chat(repetition_penalty=0), 400, "repetition_penalty"),
    ("logit_bias non-integer key", CHAT, chat(logit_bias={"abc": 1}), 400, "logit_bias"),
    ("logit_bias value out of range", CHAT, chat(logit_bias={"5": 500}), 400, "logit_bias"),
    ("logit_bias token past vocab", CHAT, chat(logit_bias={"99999999": 1}), 400, "logit_bias"),
    ("top_logprobs without logprobs", CHAT, chat(top_logprobs=3), 400, "logprobs"),
    ("top_logprobs too many", CHAT, chat(logprobs=True, top_logprobs=50), 400, "top_logprobs"),
    ("logprobs of wrong type", CHAT, chat(logprobs="yes"), 400, "logprobs"),
    ("stop of wrong type", CHAT, chat(stop=5), 400, "stop"),
    ("empty stop string", CHAT, chat(stop=[""]), 400, "stop"),
    ("too many stop strings", CHAT, chat(stop=[str(i) for i in range(20)]), 400, "stop"),
    ("stop_token_ids negative", CHAT, chat(stop_token_ids=[-1]), 400, "stop_token_ids"),
    ("stream of wrong type", CHAT, chat(stream="yes"), 400, "stream"),
    (
        "stream_options of wrong type",
        CHAT,
        chat(stream=True, stream_options=5),
        400,
        "stream_options",
    ),
    ("seed of wrong type", CHAT, chat(seed="x"), 400, "seed"),
    ("min_tokens negative", CHAT, chat(min_tokens=-1), 400, "min_tokens"),
    (
        "tool call without function",
        CHAT,
        chat(messages=[{"role": "assistant", "tool_calls": [{"id": "1", "type": "function"}]}]),
        400,
        "function",
    ),
    (
        "continue_final_message on user turn",
        CHAT,
        chat(continue_final_message=True, add_generation_prompt=False),
        400,
        "assistant",
    ),
    (
        "chat_template_kwargs of wrong type",
        CHAT,
        chat(chat_template_kwargs=[1]),
        400,
        "chat_template_kwargs",
    ),
    (
        "prompt too long (chat)",
        CHAT,
        chat(messages=[{"role": "user", "content": "word " * 2000}]),
        400,
        "512",
    ),
    (
        "streaming request with bad field",
        CHAT,
        chat(stream=True, temperature=-1),
        400,
        "temperature",
    ),
    ("completions without prompt", COMPLETIONS, {"model": MODEL_NAME}, 400, "prompt"),
    ("completions empty prompt", COMPLETIONS, completion(prompt=""), 400, "prompt"),
    ("completions empty token list", COMPLETIONS, completion(prompt=[]), 400, "prompt"),
    ("completions negative token id", COMPLETIONS, completion(prompt=[1, -2]), 400, "prompt"),
    (
        "completions token id past vocab",
        COMPLETIONS,
        completion(prompt=[1, 10_000_000]),
        400,
        "out of range",
    ),
    ("completions prompt of wrong type", COMPLETIONS, completion(prompt={"a": 1}), 400, "prompt"),
    ("completions mixed batch", COMPLETIONS, completion(prompt=["a", [1, 2]]), 400, "prompt"),
    (
        "completions prompt too long",
        COMPLETIONS,
        completion(prompt=list(range(5, 700))),
        400,
        "512",
    ),
    ("completions logprobs too many", COMPLETIONS, completion(logprobs=10), 400, "logprobs"),
    ("completions echo with logprobs", COMPLETIONS, completion(echo=True, logprobs=1), 400, "echo"),
    ("completions suffix", COMPLETIONS, completion(suffix="x"), 400, "suffix"),
    ("completions unknown model", COMPLETIONS, completion(model="other"), 404, "other"),
    (
        "completions streaming bad max_tokens",
        COMPLETIONS,
        completion(stream=True, max_tokens=0),
        400,
        "max_tokens",
    ),
    ("tokenize neither prompt nor messages", "/tokenize", {}, 400, "prompt"),
    ("tokenize both", "/tokenize", {"prompt": "x", "messages": USER}, 400, "prompt"),
    ("detokenize negative id", "/detokenize", {"tokens": [-1]}, 400, "tokens"),
    ("detokenize id past vocab", "/detokenize", {"tokens": [10**9]}, 400, "out of range"),
    ("unknown route", "/v1/nothing-here", {}, 404, "Not Found"),
    # Each of these once answered 500 or reset the connection.
    ("completions token id past int64", COMPLETIONS, completion(prompt=[2**70]), 400, "64 bits"),
    (
        "batched completions token id past int64",
        COMPLETIONS,
        completion(prompt=[[1, 2], [2**70]]),
        400,
        "prompt.1.0",
    ),
    (
        "completions token id past 32 bits",
        COMPLETIONS,
        completion(prompt=[10**15]),
        400,
        "out of range",
    ),
    (
        "batched completions token id past 32 bits",
        COMPLETIONS,
        completion(prompt=[[1, 2], [10**15]]),
        400,
        "out of range",
    ),
    (
        "lone surrogate in chat content",
        CHAT,
        b'{"messages": [{"role": "user", "content": "\\ud800 hi"}]}',
        400,
        "unicode",
    ),
    (
        "lone surrogate in a key",
        CHAT,
        b'{"messages": [{"role": "user", "content": "x"}], "\\udfff": 1}',
        400,
        "unicode",
    ),
    ("lone surrogate in a prompt", COMPLETIONS, b'{"prompt": "\\udfff"}', 400, "unicode"),
    ("lone surrogate to tokenize", "/tokenize", b'{"prompt": "a\\ud800"}', 400, "unicode"),
    ("seed past int64", CHAT, chat(seed=2**64), 400, "seed"),
    ("max_tokens past int64", CHAT, chat(max_tokens=2**63), 400, "max_tokens"),
    ("infinite temperature", CHAT, b'{"messages": [], "temperature": Infinity}', 400, "finite"),
    (
        "tool without a function name",
        CHAT,
        chat(tools=[{"type": "function", "function": {"parameters": {}}}]),
        400,
        "tools.0.function.name",
    ),
    (
        "tool without a function, streaming",
        CHAT,
        chat(stream=True, tools=[{"type": "function"}]),
        400,
        "tools.0.function",
    ),
    ("tool function not an object", CHAT, chat(tools=[{"function": 5}]), 400, "tools.0"),
    ("tool of unknown type", CHAT, chat(tools=[{"type": "web", "function": {}}]), 400, "tools"),
    (
        "too many tools",
        CHAT,
        chat(tools=[{"type": "function", "function": {"name": f"f{i}"}} for i in range(200)]),
        400,
        "tools",
    ),
    ("tool_choice unknown word", CHAT, chat(tool_choice="sometimes"), 400, "tool_choice"),
    (
        "tool_choice without function",
        CHAT,
        chat(tool_choice={"type": "function"}),
        400,
        "tool_choice.function",
    ),
    (
        "response_format schema not an object",
        CHAT,
        chat(response_format={"type": "json_schema", "json_schema": 5}),
        400,
        "response_format.json_schema",
    ),
    ("response_format unknown type", CHAT, chat(response_format={"type": "xml"}), 400, "type"),
    (
        "structured_outputs of two kinds",
        CHAT,
        chat(structured_outputs={"regex": "a", "grammar": "b"}),
        400,
        "structured_outputs",
    ),
    (
        "chat_template_kwargs overriding messages",
        CHAT,
        chat(chat_template_kwargs={"messages": 5}),
        400,
        "chat_template_kwargs",
    ),
    (
        "tokenize chat_template_kwargs overriding tools",
        "/tokenize",
        {"messages": USER, "chat_template_kwargs": {"tools": 5}},
        400,
        "chat_template_kwargs",
    ),
    (
        "stream_options without stream (chat)",
        CHAT,
        chat(stream_options={"include_usage": True}),
        400,
        "stream_options",
    ),
    (
        "stream_options without stream (completions)",
        COMPLETIONS,
        completion(stream_options={"include_usage": True}),
        400,
        "stream_options",
    ),
    (
        "too many logit_bias entries",
        CHAT,
        chat(logit_bias={str(i): 1 for i in range(400)}),
        400,
        "logit_bias",
    ),
    ("logit_bias negative token", CHAT, chat(logit_bias={"-3": 1}), 400, "logit_bias"),
    (
        "too many stop_token_ids",
        CHAT,
        chat(stop_token_ids=list(range(300))),
        400,
        "stop_token_ids",
    ),
]

RESPONSES = "/v1/responses"
CONVERSATIONS = "/v1/conversations"


def response(**fields):
    return {"model": MODEL_NAME, "input": "hi", "max_output_tokens": 4, **fields}


def user_item(*parts):
    return {"type": "message", "role": "user", "content": list(parts)}


# The Responses API and conversations, in OpenAI's error shape.
RESPONSES_CASES = [
    ("invalid json", RESPONSES, b'{"model": ', 400, "JSON"),
    ("no input at all", RESPONSES, {"model": MODEL_NAME}, 400, "input"),
    ("empty dry breaker", RESPONSES, response(dry_sequence_breakers=[""]), 400, "dry_sequence"),
    ("input a number", RESPONSES, response(input=5), 400, "input"),
    ("max_output_tokens zero", RESPONSES, response(max_output_tokens=0), 400, "max_output_tokens"),
    ("unknown role", RESPONSES, response(input=[{"role": "wizard", "content": "x"}]), 400, "role"),
    (
        "image part",
        RESPONSES,
        response(input=[user_item({"type": "input_image", "image_url": "http://x/y.png"})]),
        400,
        "input_image",
    ),
    ("unknown item type", RESPONSES, response(input=[{"type": "teleport"}]), 400, "teleport"),
    (
        "item_reference",
        RESPONSES,
        response(input=[{"type": "item_reference", "id": "msg_1"}]),
        400,
        "item_reference",
    ),
    (
        "function_call without call_id",
        RESPONSES,
        response(input=[{"type": "function_call", "name": "f", "arguments": "{}"}]),
        400,
        "call_id",
    ),
    (
        "function tool without a name",
        RESPONSES,
        response(tools=[{"type": "function", "parameters": {}}]),
        400,
        "tools.0.name",
    ),
    (
        "function tool parameters not an object",
        RESPONSES,
        response(tools=[{"type": "function", "name": "f", "parameters": "x"}]),
        400,
        "parameters",
    ),
    ("tool without a type", RESPONSES, response(tools=[{"name": "f"}]), 400, "type"),
    (
        "namespace without tools",
        RESPONSES,
        response(tools=[{"type": "namespace", "name": "ns"}]),
        400,
        "namespace",
    ),
    (
        "duplicate tool names",
        RESPONSES,
        response(tools=[{"type": "function", "name": "f"}, {"type": "function", "name": "f"}]),
        400,
        "unique",
    ),
    (
        "tool_choice names no tool",
        RESPONSES,
        response(
            tools=[{"type": "function", "name": "f"}],
            tool_choice={"type": "function", "name": "g"},
        ),
        400,
        "tool_choice",
    ),
    (
        "tool_choice a hosted tool",
        RESPONSES,
        response(tools=[{"type": "web_search"}], tool_choice={"type": "web_search"}),
        400,
        "tool_choice",
    ),
    (
        "json_schema without a schema",
        RESPONSES,
        response(text={"format": {"type": "json_schema", "name": "x"}}),
        400,
        "schema",
    ),
    ("unknown text format", RESPONSES, response(text={"format": {"type": "xml"}}), 400, "format"),
    (
        "previous_response_id and conversation",
        RESPONSES,
        response(previous_response_id="resp_1", conversation="conv_1"),
        400,
        "conversation",
    ),
    ("background unstored", RESPONSES, response(background=True, store=False), 400, "store"),
    (
        "unknown previous_response_id",
        RESPONSES,
        response(previous_response_id="resp_nope"),
        404,
        "resp_nope",
    ),
    ("unknown conversation", RESPONSES, response(conversation="conv_nope"), 404, "conv_nope"),
    (
        "too many metadata keys",
        RESPONSES,
        response(metadata={str(i): "v" for i in range(17)}),
        400,
        "metadata",
    ),
    ("reasoning effort unknown", RESPONSES, response(reasoning={"effort": "max"}), 400, "effort"),
    (
        "input past the context window",
        RESPONSES,
        response(input="word " * 2000),
        400,
        "context length",
    ),
    ("conversation items not a list", CONVERSATIONS, {"items": "hi"}, 400, "items"),
    (
        "conversation with an image",
        CONVERSATIONS,
        {"items": [user_item({"type": "input_image", "image_url": "http://x"})]},
        400,
        "input_image",
    ),
    (
        "too many conversation items",
        CONVERSATIONS,
        {"items": [{"role": "user", "content": "x"}] * 21},
        400,
        "items",
    ),
    ("add no items", CONVERSATIONS + "/conv_nope/items", {"items": []}, 400, "items"),
    ("cancel an unknown response", RESPONSES + "/resp_nope/cancel", {}, 404, "resp_nope"),
    ("typical_p above one", RESPONSES, response(typical_p=1.5), 400, "typical_p"),
]


@pytest.mark.parametrize(
    ("name", "path", "body", "status", "word"),
    RESPONSES_CASES,
    ids=[c[0] for c in RESPONSES_CASES],
)
def test_bad_responses_request_gets_a_clear_4xx(server, name, path, body, status, word):
    response = post(server, path, body)
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) >= {"message", "type", "param", "code"}
    assert word.lower() in error["message"].lower(), error


@pytest.mark.parametrize(
    ("method", "path"),
    [
        ("GET", RESPONSES + "/resp_nope"),
        ("DELETE", RESPONSES + "/resp_nope"),
        ("GET", RESPONSES + "/resp_nope/input_items"),
        ("GET", CONVERSATIONS + "/conv_nope"),
        ("DELETE", CONVERSATIONS + "/conv_nope"),
        ("GET", CONVERSATIONS + "/conv_nope/items"),
        ("GET", CONVERSATIONS + "/conv_nope/items/msg_1"),
        ("GET", CHAT + "/chatcmpl-nope"),
        ("DELETE", CHAT + "/chatcmpl-nope"),
        ("GET", CHAT + "/chatcmpl-nope/messages"),
    ],
)
def test_unknown_ids_are_404s_in_openai_shape(server, method, path):
    response = httpx.request(method, server.base_url + path, timeout=30)
    assert response.status_code == 404, response.text
    assert "nope" in response.json()["error"]["message"]


@pytest.mark.parametrize(
    "query", ["limit=0", "limit=101", "order=sideways", "after=msg_nope", "limit=abc"]
)
def test_bad_list_parameters_are_400s(server, query):
    conversation = httpx.post(server.base_url + CONVERSATIONS, json={}, timeout=30).json()
    path = f"{CONVERSATIONS}/{conversation['id']}/items?{query}"
    response = httpx.get(server.base_url + path, timeout=30)
    assert response.status_code == 400, response.text
    assert "error" in response.json()


MESSAGES = "/v1/messages"


def message(**fields):
    return {"model": MODEL_NAME, "max_tokens": 8, "messages": USER, **fields}


# Anthropic's routes: the same classes, in Anthropic's error shape.
ANTHROPIC_CASES = [
    ("max_tokens far past the context", MESSAGES, message(max_tokens=10**12), 400, "max_tokens"),
    ("max_tokens past int64", MESSAGES, message(max_tokens=2**63), 400, "max_tokens"),
    ("metadata not an object", MESSAGES, message(metadata="abc"), 400, "metadata"),
    (
        "lone surrogate in content",
        MESSAGES,
        b'{"model": "m", "max_tokens": 5, "messages": [{"role": "user", "content": "\\ud800"}]}',
        400,
        "unicode",
    ),
    ("tool without a name", MESSAGES, message(tools=[{"input_schema": {}}]), 400, "tools.0.name"),
    (
        "count_tokens tool without a name",
        MESSAGES + "/count_tokens",
        message(tools=[{"input_schema": {}}]),
        400,
        "tools.0.name",
    ),
    ("invalid json", MESSAGES, b'{"model": ', 400, "JSON"),
    ("xtc_threshold above one", MESSAGES, message(xtc_threshold=2), 400, "xtc_threshold"),
    ("dry_base below one", MESSAGES, message(dry_base=0.2), 400, "dry_base"),
    ("negative lz_penalty", MESSAGES, message(lz_penalty=-1), 400, "lz_penalty"),
]


@pytest.mark.parametrize(
    ("name", "path", "body", "status", "word"),
    ANTHROPIC_CASES,
    ids=[c[0] for c in ANTHROPIC_CASES],
)
def test_bad_anthropic_request_gets_a_clear_4xx(server, name, path, body, status, word):
    response = post(server, path, body)
    assert response.status_code == status, response.text
    body = response.json()
    assert body["type"] == "error"
    assert body["error"]["type"] == "invalid_request_error"
    assert word.lower() in body["error"]["message"].lower(), body


def test_large_max_tokens_within_anthropics_ceiling_runs_to_the_window(server):
    """Claude Code asks for 32k tokens whatever the window: that is no error."""
    response = httpx.post(server.base_url + MESSAGES, json=message(max_tokens=32_000), timeout=60)
    assert response.status_code == 200, response.text


def post(server, path: str, body: dict | bytes) -> httpx.Response:
    """`body` as JSON, or as raw bytes labelled JSON."""
    kwargs = (
        {"content": body, "headers": {"content-type": "application/json"}}
        if isinstance(body, bytes)
        else {"json": body}
    )
    return httpx.post(server.base_url + path, timeout=30, **kwargs)


@pytest.mark.parametrize(
    ("name", "path", "body", "status", "word"), CASES, ids=[c[0] for c in CASES]
)
def test_bad_request_gets_a_clear_4xx(server, name, path, body, status, word):
    response = post(server, path, body)
    assert response.status_code == status, response.text
    assert response.headers["content-type"].startswith("application/json")
    error = response.json()["error"]
    assert set(error) >= {"message", "type", "param", "code"}
    assert word.lower() in error["message"].lower(), error


def test_table_is_large_enough():
    assert len(CASES) >= 50


@pytest.mark.parametrize(("method", "path"), [("PUT", CHAT), ("GET", COMPLETIONS)])
def test_wrong_method_is_an_api_error(server, method, path):
    response = httpx.request(method, server.base_url + path)
    assert response.status_code == 405
    assert "error" in response.json()


def test_server_answers_normally_after_the_bad_requests(server):
    for _name, path, body, *_ in CASES[:10]:
        kwargs = {"content": body} if isinstance(body, bytes) else {"json": body}
        httpx.post(server.base_url + path, timeout=30, **kwargs)
    response = httpx.post(server.base_url + CHAT, json=chat(max_tokens=3), timeout=30)
    assert response.status_code == 200
    assert response.json()["choices"][0]["message"]["role"] == "assistant"
    assert httpx.get(server.base_url + "/health").status_code == 200
