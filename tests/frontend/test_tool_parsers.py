"""Differential tests: each tool-call fixture, cut every way a stream can cut it, must parse
to the same content and calls, byte for byte, and to what the fixture expects."""

from __future__ import annotations

import json
import logging
import random
from collections.abc import Sequence
from importlib import resources

import pytest

from metrale.frontend.tool_parsers import (
    ContentDelta,
    Event,
    ToolCall,
    ToolCallArguments,
    ToolCallStart,
    ToolSpec,
    collect,
    detect_tool_parser,
    make_tool_parser,
    tool_parser_names,
)
from metrale.frontend.tool_parsers.schema import ParamSchema, Untyped, convert_value
from tests.frontend.splits import char_bursts, splittings
from tests.frontend.tool_call_fixtures import FIXTURES, TOOLS, Fixture

MIN_FIXTURES_PER_FORMAT = 15

CASES = [
    pytest.param(fmt, fixture, id=f"{fmt}-{fixture[0]}")
    for fmt, fixtures in FIXTURES.items()
    for fixture in fixtures
]


def parse(fmt: str, deltas: Sequence[str]) -> list[Event]:
    parser = make_tool_parser(fmt, tools=TOOLS)
    events: list[Event] = []
    for delta in deltas:
        events += parser.feed(delta)
    events += parser.finish()
    return events


def strict_json(text: str) -> object:
    def refuse(constant: str) -> None:
        raise ValueError(f"{constant} is not JSON")

    return json.loads(text, parse_constant=refuse)


def check_invariants(events: list[Event]) -> None:
    """What every event stream promises, beyond its folded result."""
    open_index = -1
    for event in events:
        if isinstance(event, ContentDelta):
            assert event.text
        elif isinstance(event, ToolCallStart):
            assert event.index == open_index + 1 and event.id == f"call_{event.index}"
            assert event.name
            open_index = event.index
        else:
            assert isinstance(event, ToolCallArguments)
            assert event.text and event.index == open_index
    for call in collect(events)[1]:
        assert isinstance(strict_json(call.arguments), dict), call


def expected_result(fixture: Fixture) -> tuple[str, list[ToolCall]]:
    _, _, content, calls = fixture
    return content, [ToolCall(f"call_{i}", name, args) for i, (name, args) in enumerate(calls)]


@pytest.mark.parametrize(("fmt", "fixture"), CASES)
def test_every_splitting_parses_to_the_expected_result(fmt: str, fixture: Fixture) -> None:
    name, text, _, _ = fixture
    expected = expected_result(fixture)
    for expected_args in (args for _, args in fixture[3]):
        assert isinstance(strict_json(expected_args), dict)
    for split_name, deltas in splittings(text, f"{fmt}-{name}").items():
        events = parse(fmt, deltas)
        check_invariants(events)
        assert collect(events) == expected, f"{split_name}: {list(deltas)!r}"


@pytest.mark.parametrize("fmt", sorted(FIXTURES))
def test_each_format_has_enough_fixtures(fmt: str) -> None:
    names = [fixture[0] for fixture in FIXTURES[fmt]]
    assert len(names) >= MIN_FIXTURES_PER_FORMAT
    assert len(set(names)) == len(names)


def test_every_registered_format_has_fixtures() -> None:
    assert sorted(FIXTURES) == [name for name in tool_parser_names() if name != "auto"]


# Mutations a model (or a sampler) could make: cut short, drop or repeat a piece, splice in a
# fragment of some format's syntax.
SYNTAX_FRAGMENTS = [
    "<tool_call>", "</tool_call>", "<function=", "</parameter>", "<parameter=x>", '"', "{", "}",
    "[", "]", ",", ":", "\\", "\n", '<|"|>', "<|tool_call>", "<tool_call|>", "[TOOL_CALLS]",
    "[ARGS]", "<minimax:tool_call>", '<invoke name="', "<arg_key>", "</arg_value>", "é", "🏔",
]  # fmt: skip


def mutate(text: str, rng: random.Random) -> str:
    for _ in range(rng.randint(1, 3)):
        at = rng.randint(0, len(text))
        kind = rng.randrange(4)
        if kind == 0:
            text = text[:at]
        elif kind == 1:
            text = text[:at] + text[at + rng.randint(1, 8) :]
        elif kind == 2:
            text = text[:at] + text[at : at + rng.randint(1, 12)] + text[at:]
        else:
            text = text[:at] + rng.choice(SYNTAX_FRAGMENTS) + text[at:]
    return text


@pytest.mark.parametrize("fmt", sorted(FIXTURES))
def test_mutated_outputs_never_disagree(fmt: str, caplog: pytest.LogCaptureFixture) -> None:
    """Malformed output: whatever the parse, every splitting gives the same one, output that
    holds no call is content unchanged, and the parser never faults (that would log an
    error)."""
    rng = random.Random(f"mutations-{fmt}")
    texts = [fixture[1] for fixtures in FIXTURES.values() for fixture in fixtures]
    own = [fixture[1] for fixture in FIXTURES[fmt]]
    with caplog.at_level(logging.ERROR):
        for _ in range(120):
            text = mutate(rng.choice(own if rng.random() < 0.7 else texts), rng)
            whole = parse(fmt, [text])
            check_invariants(whole)
            content, calls = collect(whole)
            assert calls or content == text, "output without calls must pass through unchanged"
            for deltas in (list(text), char_bursts(text, rng), char_bursts(text, rng, 3)):
                events = parse(fmt, deltas)
                check_invariants(events)
                assert collect(events) == collect(whole), repr(text)
    assert not caplog.records, caplog.records[0].getMessage()


def test_arguments_stream_before_the_call_ends() -> None:
    prefixes = {
        "hermes": '<tool_call>\n{"name": "write_file", "arguments": {"content": "hello wo',
        "mistral": '[TOOL_CALLS]write_file[ARGS]{"content": "hello wo',
        "bare_json": '{"name": "write_file", "arguments": {"content": "hello wo',
        "qwen3_coder": "<tool_call>\n<function=write_file>\n<parameter=content>\nhello wo",
        "qwen3_xml": "<tool_call>\n<function=write_file>\n<parameter=content>\nhello wo",
        "minimax_xml": '<minimax:tool_call><invoke name="write_file"><parameter name="content">'
        "hello wo",
        "poolside_v1": "<tool_call>write_file<arg_key>content</arg_key><arg_value>hello wo",
        "gemma4": '<|tool_call>call:write_file{content:<|"|>hello wo',
    }
    assert sorted(prefixes) == sorted(FIXTURES)
    for fmt, prefix in prefixes.items():
        parser = make_tool_parser(fmt, tools=TOOLS)
        events = parser.feed(prefix)
        assert events[0] == ToolCallStart(0, "call_0", "write_file"), fmt
        streamed = "".join(e.text for e in events if isinstance(e, ToolCallArguments))
        assert streamed.endswith("hello wo"), (fmt, streamed)


def test_partial_opener_is_held_not_emitted() -> None:
    parser = make_tool_parser("hermes")
    assert parser.feed("Answer <tool_") == [ContentDelta("Answer ")]
    assert parser.feed("callx") == [ContentDelta("<tool_callx")]
    assert parser.finish() == []


def test_ids_take_the_prefix() -> None:
    parser = make_tool_parser("hermes", id_prefix="call_req7_")
    events = parser.feed('<tool_call>{"name": "get_time"}</tool_call>') + parser.finish()
    assert collect(events)[1] == [ToolCall("call_req7_0", "get_time", "{}")]


def test_fault_is_contained(monkeypatch: pytest.MonkeyPatch) -> None:
    """A bug inside a parser must not surface as an exception: the open call is closed with
    valid arguments and the rest of the output passes through as content."""
    from metrale.frontend.tool_parsers.json_call import ArgumentsStream

    real_push = ArgumentsStream.push

    def push(self: ArgumentsStream, ch: str) -> object:
        if ch == "!":
            raise RuntimeError("injected fault")
        return real_push(self, ch)

    monkeypatch.setattr(ArgumentsStream, "push", push)
    parser = make_tool_parser("hermes")
    events = parser.feed('<tool_call>{"name": "f", "arguments": {"a": "x') + parser.feed("y!z")
    events += parser.feed(" more") + parser.finish()
    # The delta that faulted is passed through whole: its "y" had not reached the call yet.
    assert collect(events) == ("y!z more", [ToolCall("call_0", "f", '{"a": "x"}')])


def test_feed_after_finish_is_a_programming_error() -> None:
    parser = make_tool_parser("hermes")
    parser.finish()
    with pytest.raises(RuntimeError):
        parser.feed("x")


TEMPLATES = {
    "qwen3_coder": "{{- '<tool_call>\\n<function=' + tool_call.name + '>\\n' }}",
    "hermes": '<tool_call>\\n{"name": <function-name>, "arguments": <args-json-object>}',
    "mistral": "{{- '[TOOL_CALLS]' + tool_calls | tojson }}",
    "minimax_xml": '<minimax:tool_call>\\n<invoke name="tool-name-1">',
    "gemma4": "{{- '<|tool_call>call:' + function['name'] + '{' -}}",
    "poolside_v1": "<tool_call>{{ tc.name }}<arg_key>{{ k }}</arg_key><arg_value>",
}


@pytest.mark.parametrize(("expected", "template"), TEMPLATES.items())
def test_detect_tool_parser(expected: str, template: str) -> None:
    assert detect_tool_parser(template) == expected


def test_detect_without_markers_and_auto() -> None:
    assert detect_tool_parser("{{ messages[0].content }}") is None
    with pytest.raises(ValueError, match="no tool-call markers"):
        make_tool_parser("auto", chat_template="{{ messages }}")
    parser = make_tool_parser("auto", chat_template=TEMPLATES["gemma4"])
    events = parser.feed("<|tool_call>call:get_time{}<tool_call|>") + parser.finish()
    assert collect(events)[1] == [ToolCall("call_0", "get_time", "{}")]


def test_unknown_parser_names_the_known_ones() -> None:
    with pytest.raises(ValueError, match="hermes"):
        make_tool_parser("hermez")


def test_demo_template_is_detected_as_hermes() -> None:
    template = (resources.files("metrale.demo") / "tokenizer" / "chat_template.jinja").read_text()
    assert detect_tool_parser(template) == "hermes"


@pytest.mark.parametrize(
    ("text", "schema", "untyped", "expected"),
    [
        ("3", ParamSchema("integer"), Untyped.STRING, 3),
        (" 3.0 ", ParamSchema("number"), Untyped.STRING, 3.0),
        ("1e999", ParamSchema("number"), Untyped.STRING, "1e999"),
        ("٣", ParamSchema("integer"), Untyped.STRING, "٣"),
        ("FALSE", ParamSchema("boolean"), Untyped.STRING, False),
        ("[1, 2]", ParamSchema("object"), Untyped.STRING, "[1, 2]"),
        ("None", ParamSchema("string", nullable=True), Untyped.STRING, None),
        ("None", ParamSchema("string"), Untyped.STRING, "None"),
        ("{1, 2}", None, Untyped.JSON, "{1, 2}"),
        ("NaN", None, Untyped.JSON, "NaN"),
        (" 7 ", None, Untyped.JSON, 7),
        (" 7 ", None, Untyped.STRING, " 7 "),
    ],
)
def test_convert_value(
    text: str, schema: ParamSchema | None, untyped: Untyped, expected: object
) -> None:
    assert convert_value(text, schema, untyped) == expected


def test_tool_spec_reads_openai_schemas() -> None:
    spec = ToolSpec.from_openai(
        {
            "type": "function",
            "function": {
                "name": "f",
                "parameters": {
                    "properties": {
                        "a": {"type": ["integer", "null"]},
                        "b": {"anyOf": [{"type": "null"}, {"type": "array"}]},
                        "c": {"properties": {}},
                        "d": {"description": "no type"},
                    }
                },
            },
        }
    )
    assert spec.params == {
        "a": ParamSchema("integer", nullable=True),
        "b": ParamSchema("array", nullable=True),
        "c": ParamSchema("object"),
        "d": ParamSchema(None),
    }
    with pytest.raises(ValueError, match="no function name"):
        ToolSpec.from_openai({"type": "function"})
