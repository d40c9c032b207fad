"""Differential tests: each tool-call fixture, cut every way a stream can cut it, must parse
to the same content and calls, byte for byte, and to what the fixture expects; and to the same
outcome counts (parsed, repaired, text)."""

from __future__ import annotations

import json
import logging
import random
from collections.abc import Sequence
from importlib import resources

import pytest

from metrale.frontend.tool_parsers import (
    CallOutcome,
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


def parse_counted(fmt: str, deltas: Sequence[str]) -> tuple[list[Event], dict[str, int]]:
    """The events and the parser's outcomes once it finished."""
    parser = make_tool_parser(fmt, tools=TOOLS)
    events: list[Event] = []
    for delta in deltas:
        events += parser.feed(delta)
    events += parser.finish()
    return events, parser.outcomes


def parse(fmt: str, deltas: Sequence[str]) -> list[Event]:
    return parse_counted(fmt, deltas)[0]


def check_outcomes(outcomes: dict[str, int], events: list[Event]) -> None:
    """Every call started is counted once, as parsed or repaired."""
    assert sorted(outcomes) == ["parsed", "repaired", "text"]
    num_calls = sum(isinstance(event, ToolCallStart) for event in events)
    assert outcomes["parsed"] + outcomes["repaired"] == num_calls, outcomes


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
    _, whole_outcomes = parse_counted(fmt, [text])
    for split_name, deltas in splittings(text, f"{fmt}-{name}").items():
        events, outcomes = parse_counted(fmt, deltas)
        check_invariants(events)
        assert collect(events) == expected, f"{split_name}: {list(deltas)!r}"
        check_outcomes(outcomes, events)
        assert outcomes == whole_outcomes, split_name


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
            whole, whole_outcomes = parse_counted(fmt, [text])
            check_invariants(whole)
            check_outcomes(whole_outcomes, whole)
            content, calls = collect(whole)
            assert calls or content == text, "output without calls must pass through unchanged"
            for deltas in (list(text), char_bursts(text, rng), char_bursts(text, rng, 3)):
                events, outcomes = parse_counted(fmt, deltas)
                check_invariants(events)
                assert collect(events) == collect(whole), repr(text)
                assert outcomes == whole_outcomes, repr(text)
    assert not caplog.records, caplog.records[0].getMessage()


PARSED, REPAIRED, TEXT = CallOutcome.PARSED, CallOutcome.REPAIRED, CallOutcome.TEXT

# Fixtures that settle exactly one would-be call, by format and outcome. PARSED: written
# well-formed, in a spelling the format accepts (first: the plain one). REPAIRED: cut off
# mid-arguments at the end of generation (first), or otherwise closed or fixed by the parser.
# TEXT: an opener followed by something that is no call, left as content.
SINGLE_OUTCOMES: dict[str, dict[CallOutcome, tuple[str, ...]]] = {
    "hermes": {
        PARSED: ("single_call", "no_arguments_member", "string_encoded_arguments"),
        REPAIRED: (
            "truncated_in_string",
            "truncated_in_key",
            "truncated_in_number",
            "missing_closing_brace",
            "junk_after_arguments",
            "missing_closing_tag_then_text",
            "raw_newline_and_bad_escape_in_string",
        ),
        TEXT: ("garbage_inside_tags", "json_without_name", "truncated_in_name"),
    },
    "qwen3_coder": {
        PARSED: ("single_call", "type_mismatch_stays_string", "stopped_at_call_end"),
        REPAIRED: (
            "truncated_in_value",
            "missing_parameter_close",
            "missing_function_close",
            "literal_close_tag_cuts_value",
        ),
        TEXT: ("garbage_inside_tags", "truncated_in_name"),
    },
    "qwen3_xml": {
        PARSED: ("single_call", "literal_close_tag_kept", "stopped_at_call_end"),
        REPAIRED: ("truncated_in_value", "missing_parameter_close", "missing_function_close"),
        TEXT: ("garbage_inside_tags", "truncated_in_name"),
    },
    "gemma4": {
        PARSED: ("single_call", "bare_word_value", "trailing_comma"),
        REPAIRED: (
            "truncated_in_string",
            "truncated_after_key",
            "truncated_in_bare_value",
            "missing_close_tag",
            "missing_closing_brace",
            "broken_key",
        ),
        TEXT: ("garbage_inside_tags", "truncated_in_name"),
    },
    "mistral": {
        # With no marker after a v11 call, text after it cannot tell: it counts as parsed.
        PARSED: ("v11_single", "array_single", "v11_call_id", "text_after_v11_call"),
        REPAIRED: ("truncated_v11", "truncated_array", "array_not_closed"),
        TEXT: ("garbage_after_opener", "array_without_calls", "truncated_in_name"),
    },
    "minimax_xml": {
        PARSED: ("single_invoke", "quoted_and_bare_names", "stopped_at_call_end"),
        REPAIRED: (
            "truncated_in_value",
            "missing_parameter_close",
            "missing_invoke_close",
            "junk_between_parameters",
        ),
        TEXT: ("garbage_inside_tags", "truncated_in_invoke_name"),
    },
    "poolside_v1": {
        PARSED: ("single_call", "inline_name_typed", "no_arguments"),
        REPAIRED: ("truncated_in_value", "missing_value_close", "key_without_value"),
        TEXT: ("json_inside_tags_is_not_this_format", "truncated_in_name"),
    },
    "bare_json": {
        PARSED: ("object_call", "llama_parameters", "text_after_call"),
        REPAIRED: ("truncated_in_arguments", "broken_after_name"),
        # A JSON answer with no tool's name: the format cannot tell it from a failed call.
        TEXT: ("json_not_a_call", "json_with_a_name_that_is_no_tool", "truncated_in_name"),
    },
}

OUTCOME_CASES = [
    pytest.param(fmt, name, outcome, id=f"{fmt}-{outcome}-{name}")
    for fmt, by_outcome in SINGLE_OUTCOMES.items()
    for outcome, names in by_outcome.items()
    for name in names
]


def test_every_format_shows_every_outcome() -> None:
    assert sorted(SINGLE_OUTCOMES) == sorted(FIXTURES)
    for by_outcome in SINGLE_OUTCOMES.values():
        assert sorted(by_outcome) == sorted(CallOutcome)


@pytest.mark.parametrize(("fmt", "name", "outcome"), OUTCOME_CASES)
def test_single_call_outcome(fmt: str, name: str, outcome: CallOutcome) -> None:
    """The same count whether the text comes whole or a character at a time (or any cut)."""
    (text,) = [fixture[1] for fixture in FIXTURES[fmt] if fixture[0] == name]
    expected = {"parsed": 0, "repaired": 0, "text": 0, outcome.value: 1}
    for split_name, deltas in splittings(text, f"{fmt}-{name}").items():
        assert parse_counted(fmt, deltas)[1] == expected, split_name


def test_outcomes_settle_as_calls_end() -> None:
    """A call is counted once nothing after it can change its outcome: at the end of its block
    or when the next call starts; `finish` settles the rest."""
    parser = make_tool_parser("hermes", tools=TOOLS)
    assert parser.outcomes == {"parsed": 0, "repaired": 0, "text": 0}
    parser.feed('<tool_call>{"name": "get_time"}')
    assert parser.call_outcomes == []  # the closing tag may still be missing
    parser.feed("</tool_call>\n<tool_call>oops</tool_call>\n")
    assert parser.outcomes == {"parsed": 1, "repaired": 0, "text": 1}
    parser.feed('<tool_call>{"name": "get_weather", "arguments": {"city": "Os')
    assert parser.outcomes == {"parsed": 1, "repaired": 0, "text": 1}
    parser.finish()
    assert parser.call_outcomes == [PARSED, REPAIRED]
    assert parser.outcomes == {"parsed": 1, "repaired": 1, "text": 1}


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
    assert parser.outcomes == {"parsed": 0, "repaired": 1, "text": 0}


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
