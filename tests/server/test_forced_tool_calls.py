"""Forced tool calls in every tool-call format, through the real engine with random weights.

The checkpoint's tokenizer has Mistral's and Gemma's markers as special tokens, as their own
tokenizers do, and requests bias the model towards them: the grammar then makes the model write
them as those tokens, and the reply parses only if detokenization keeps them (and only them).
The engine core runs in the test's thread, one request at a time; everything from the HTTP
request to the parsed reply is the real server.

`required` lets the model write one or more calls unless `parallel_tool_calls` is false; a
model with random weights, once allowed, tends to write calls until `max_tokens`.
"""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest
import tokenizers
from fastapi.testclient import TestClient

from metrale.engine.core import EngineCore
from metrale.engine_args import EngineArgs
from metrale.frontend.output_processor import OutputProcessor
from metrale.frontend.tool_parsers import tool_parser_class, tool_parser_names, tool_specs
from metrale.server.app import build_app
from metrale.server.state import ServerSettings, ServerState
from metrale.telemetry.hub import Telemetry
from metrale.tokenizer import IncrementalDetokenizer, Tokenizer
from tests.conftest import build_checkpoint, demo_tokenizer_dir
from tests.frontend.schema_check import assert_valid

FORMATS = [name for name in tool_parser_names() if name != "auto"]
SPECIAL_MARKERS = ["[TOOL_CALLS]", "[ARGS]", "[CALL_ID]", "<|tool_call>", "<tool_call|>", '<|"|>']

PICK = {
    "name": "pick_colour",
    "description": "Pick a colour",
    "parameters": {
        "type": "object",
        "properties": {
            "colour": {"enum": ["red", "green", "blue"]},
            "bright": {"type": "boolean"},
            "shade": {"type": "integer", "minimum": 1, "maximum": 5},
        },
        "required": ["colour", "bright"],
        "additionalProperties": False,
    },
}
CLOCK = {
    "name": "get_time",
    "description": "The time",
    "parameters": {
        "type": "object",
        "properties": {"zone": {"enum": ["utc", "local"]}},
        "additionalProperties": False,
    },
}
TOOLS = [{"type": "function", "function": f} for f in (PICK, CLOCK)]
SCHEMAS = {f["name"]: f["parameters"] for f in (PICK, CLOCK)}
USER = [{"role": "user", "content": "Pick a colour."}]
NAMED = {"type": "function", "function": {"name": "pick_colour"}}
# Each choice's request fields, and whether its grammar lets the model write several calls.
CHOICES = {
    "required": ({"tool_choice": "required"}, True),
    "required_one_call": ({"tool_choice": "required", "parallel_tool_calls": False}, False),
    "named": ({"tool_choice": NAMED}, False),
}


class InlineLLM:
    """The engine core stepped in the caller's thread; keeps each request and its tokens."""

    is_alive = True
    client = SimpleNamespace(kv_cache=None, dead_reason=None)
    telemetry = Telemetry(None)

    def __init__(self, core: EngineCore, tokenizer: Tokenizer) -> None:
        self.core = core
        self.tokenizer = tokenizer
        self.requests = []
        self.token_ids: dict[str, list[int]] = {}

    async def generate(self, request, api="unknown", coalesce=True):
        self.requests.append(request)
        self.token_ids[request.request_id] = []
        outputs = OutputProcessor(self.tokenizer)
        outputs.add_request(
            request.request_id, len(request.prompt_token_ids), request.sampling_params
        )
        self.core.add_request(request)
        while self.core.has_unfinished_requests():
            for output in self.core.step():
                delta = outputs.process(output)
                if delta is None:
                    continue
                self.token_ids[request.request_id] += delta.token_ids
                if delta.abort_in_engine:
                    self.core.abort_request(delta.request_id)
                yield delta


@pytest.fixture(scope="module")
def marker_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny Qwen3 checkpoint whose tokenizer has the tool markers as special tokens."""
    backend = tokenizers.Tokenizer.from_file(str(demo_tokenizer_dir() / "tokenizer.json"))
    backend.add_special_tokens(
        [tokenizers.AddedToken(m, special=True, normalized=False) for m in SPECIAL_MARKERS]
    )
    out = tmp_path_factory.mktemp("markers")
    build_checkpoint(out, "qwen3", vocab_size=backend.get_vocab_size(with_added_tokens=True))
    backend.save(str(out / "tokenizer.json"))
    return out


@pytest.fixture(scope="module")
def llm(marker_dir: Path) -> InlineLLM:
    config = EngineArgs(
        model_from_path=str(marker_dir),
        device="cpu",
        dtype="float32",
        max_seq_len=1024,
        num_kv_blocks=256,
    ).create_config()
    return InlineLLM(EngineCore.from_config(config, progress=False), Tokenizer.from_dir(marker_dir))


def http_for(llm: InlineLLM, fmt: str | None) -> TestClient:
    settings = ServerSettings(served_model_name="m", tool_call_parser=fmt)
    state = ServerState(llm, llm.tokenizer, llm.core.config, settings)
    return TestClient(build_app(state))


def marker_bias(llm: InlineLLM) -> dict[str, float]:
    return {str(llm.tokenizer.token_to_id(m)): 30.0 for m in SPECIAL_MARKERS}


def end_bias(llm: InlineLLM) -> dict[str, float]:
    """The end of the turn, as soon as the grammar lets the reply end: after its first call."""
    return {str(i): 100.0 for i in llm.core.config.eos_token_ids}


def engine_grammar(llm: InlineLLM) -> str | None:
    structured = llm.requests[-1].sampling_params.structured
    return None if structured is None else structured.spec


def expected_grammar(fmt: str, names: list[str], several: bool) -> str | None:
    tools = [tool for tool in TOOLS if tool["function"]["name"] in names]
    return tool_parser_class(fmt).call_grammar(tool_specs(tools), several=several)


def streamed(http: TestClient, body: dict) -> tuple[str, list[tuple[str, str]], str | None]:
    content, calls, finish = "", {}, None
    with http.stream("POST", "/v1/chat/completions", json={**body, "stream": True}) as response:
        for line in response.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            choice = json.loads(line[len("data: ") :])["choices"][0]
            content += choice["delta"].get("content") or ""
            for call in choice["delta"].get("tool_calls") or []:
                entry = calls.setdefault(call["index"], ["", ""])
                entry[0] += call["function"].get("name") or ""
                entry[1] += call["function"].get("arguments") or ""
            finish = choice["finish_reason"] or finish
    return content, [tuple(entry) for entry in calls.values()], finish


@pytest.mark.parametrize("choice", CHOICES)
@pytest.mark.parametrize("fmt", FORMATS)
def test_forced_call_in_every_format(llm, fmt, choice):
    http = http_for(llm, fmt)
    fields, several = CHOICES[choice]
    body = {
        "model": "m",
        "messages": USER,
        "tools": TOOLS,
        **fields,
        "max_tokens": 200,
        "temperature": 0,
        "logit_bias": {**marker_bias(llm), **end_bias(llm)},
    }
    reply = http.post("/v1/chat/completions", json=body)
    assert reply.status_code == 200, reply.text
    names = ["pick_colour"] if choice == "named" else list(SCHEMAS)
    assert engine_grammar(llm) == expected_grammar(fmt, names, several)
    (result,) = reply.json()["choices"]
    message = result["message"]
    assert result["finish_reason"] == "tool_calls", message
    assert message["content"] is None  # no markers, no end-of-turn token in the text
    (call,) = message["tool_calls"]
    name, arguments = call["function"]["name"], call["function"]["arguments"]
    assert name == "pick_colour" if choice == "named" else name in SCHEMAS
    assert_valid(json.loads(arguments), SCHEMAS[name], f"{fmt}: {arguments}")

    generated = llm.token_ids[llm.requests[-1].request_id]
    special = {llm.tokenizer.token_to_id(m) for m in tool_parser_class(fmt).markers}
    if fmt in ("gemma4", "mistral"):  # the opener was written as its special token
        assert special & set(generated), llm.tokenizer.decode(generated, False)

    assert streamed(http, body) == ("", [(name, arguments)], "tool_calls")


def test_required_writes_several_calls_unless_parallel_calls_are_off(llm):
    """Left to itself, the model writes call after call where the grammar allows it; every
    call it finished is valid, and with `parallel_tool_calls: false` there is one."""
    num_calls = {}
    for fmt in FORMATS:
        http = http_for(llm, fmt)
        for parallel in (True, False):
            body = {
                "model": "m",
                "messages": USER,
                "tools": TOOLS,
                "tool_choice": "required",
                "parallel_tool_calls": parallel,
                "max_tokens": 200,
                "temperature": 0,
                "logit_bias": marker_bias(llm),
            }
            (result,) = http.post("/v1/chat/completions", json=body).json()["choices"]
            assert engine_grammar(llm) == expected_grammar(fmt, list(SCHEMAS), parallel)
            message, finish = result["message"], result["finish_reason"]
            calls = [
                (c["function"]["name"], c["function"]["arguments"]) for c in message["tool_calls"]
            ]
            if finish == "length":
                # Cut short, and so may be its last call (or that call's name, left as content).
                assert parallel
                calls_done = calls[:-1]
            else:
                assert (finish, message["content"]) == ("tool_calls", None), result
                calls_done = calls
            for name, arguments in calls_done:
                assert_valid(json.loads(arguments), SCHEMAS[name], f"{fmt}: {arguments}")
            assert streamed(http, body) == (message["content"] or "", calls, finish)
            num_calls[fmt, parallel] = len(calls)
    assert all(num_calls[fmt, False] == 1 for fmt in FORMATS), num_calls
    assert all(num_calls[fmt, True] >= 1 for fmt in FORMATS), num_calls
    assert sum(num_calls[fmt, True] > 1 for fmt in FORMATS) >= 4, num_calls


@pytest.mark.parametrize("fmt", FORMATS)
def test_anthropic_forced_tool_use(llm, fmt):
    http = http_for(llm, fmt)
    tools = [{"name": f["name"], "input_schema": f["parameters"]} for f in (PICK, CLOCK)]
    choices = [
        ({"type": "any"}, True),
        ({"type": "any", "disable_parallel_tool_use": True}, False),
        ({"type": "tool", "name": "get_time"}, False),
    ]
    for choice, several in choices:
        reply = http.post(
            "/v1/messages",
            json={
                "model": "m",
                "max_tokens": 200,
                "messages": USER,
                "tools": tools,
                "tool_choice": choice,
                "temperature": 0,
            },
        ).json()
        names = [choice["name"]] if choice["type"] == "tool" else list(SCHEMAS)
        assert engine_grammar(llm) == expected_grammar(fmt, names, several)
        blocks = [b for b in reply["content"] if b["type"] == "tool_use"]
        assert reply["stop_reason"] in (("tool_use", "max_tokens") if several else ("tool_use",))
        assert (len(blocks) >= 1) if several else (len(blocks) == 1), reply
        finished = blocks[:-1] if reply["stop_reason"] == "max_tokens" else blocks
        for block in finished:
            assert choice["type"] == "any" or block["name"] == "get_time"
            assert_valid(block["input"], SCHEMAS[block["name"]], f"{fmt}: {block}")


def test_a_tool_the_format_cannot_write_is_a_400(llm):
    tool = {"type": "function", "function": {"name": "two words", "parameters": {}}}
    body = {"model": "m", "messages": USER, "tools": [tool], "tool_choice": "required"}
    reply = http_for(llm, "qwen3_coder").post("/v1/chat/completions", json=body)
    assert reply.status_code == 400 and "cannot be written" in reply.json()["error"]["message"]
    assert (
        http_for(llm, "hermes")
        .post("/v1/chat/completions", json={**body, "max_tokens": 1})
        .is_success
    )


def test_parallel_tool_calls_false_stops_at_each_formats_call_end(llm):
    stops = {}
    for fmt in FORMATS:
        http = http_for(llm, fmt)
        body = {"model": "m", "messages": USER, "tools": TOOLS, "max_tokens": 1}
        assert http.post(
            "/v1/chat/completions", json={**body, "parallel_tool_calls": False}
        ).is_success
        params = llm.requests[-1].sampling_params
        stops[fmt] = (params.stop, params.include_stop_str_in_output)
    assert stops == {
        "bare_json": ((), False),  # no marker ends one call
        "gemma4": (("<tool_call|>",), True),
        "hermes": (("</tool_call>",), True),
        "minimax_xml": (("</invoke>",), True),
        "mistral": ((), False),  # no marker ends one call
        "poolside_v1": (("</tool_call>",), True),
        "qwen3_coder": (("</function>",), True),
        "qwen3_xml": (("</function>",), True),
    }


def test_only_special_markers_of_the_active_format_are_kept(llm):
    def kept(fmt, **extra):
        body = {"model": "m", "messages": USER, "tools": TOOLS, "max_tokens": 1, **extra}
        assert http_for(llm, fmt).post("/v1/chat/completions", json=body).is_success
        params = llm.requests[-1].sampling_params
        return {llm.tokenizer.decode([i], False) for i in params.kept_special_token_ids}

    assert kept("gemma4") == {"<|tool_call>", "<tool_call|>", '<|"|>'}
    assert kept("mistral") == {"[TOOL_CALLS]", "[ARGS]", "[CALL_ID]"}
    assert kept("hermes") == set()  # <tool_call> is an added token, not a special one
    assert kept("mistral", tool_choice="none") == set()
    assert kept(None) == set()


def test_detokenizer_keeps_the_kept_special_tokens_and_drops_the_rest(llm):
    tokenizer = llm.tokenizer
    text = "Sure.[TOOL_CALLS]pick[ARGS]{}<|im_end|>"
    token_ids = tokenizer.encode(text, add_special_tokens=False)
    kept = [tokenizer.token_to_id("[TOOL_CALLS]"), tokenizer.token_to_id("[ARGS]")]
    assert set(kept) <= set(token_ids) and set(kept) <= set(tokenizer.all_special_ids)
    for chunk in (1, 3, len(token_ids)):
        detokenizer = IncrementalDetokenizer(tokenizer, True, kept)
        pieces = [
            detokenizer.push(token_ids[i : i + chunk]) for i in range(0, len(token_ids), chunk)
        ]
        assert "".join(pieces) + detokenizer.finish() == "Sure.[TOOL_CALLS]pick[ARGS]{}"
    assert tokenizer.decode(token_ids) == "Sure.pick{}"  # what skipping them all leaves
    detokenizer = IncrementalDetokenizer(tokenizer, False, kept)
    assert detokenizer.push(token_ids) + detokenizer.finish() == text
