"""Each format's forced-call grammar against its own parser.

The grammar must accept the parser's well-formed single-call fixtures, and its multi-call ones
exactly when several calls are allowed; refuse a call to a function it was not given; and,
above all, everything it lets a model write must parse back into exactly one call (one or
more where several are allowed) to an allowed function with arguments the schema accepts. The
last is checked on texts drawn from the grammar itself, token by token over a small
vocabulary, as a model with random weights would write them.
"""

from __future__ import annotations

import json
import random
import re
from typing import Any

import pytest

from metrale.frontend.tool_parsers import (
    collect,
    make_tool_parser,
    tool_parser_class,
    tool_parser_names,
    tool_specs,
)
from tests.frontend.schema_check import assert_valid
from tests.frontend.tool_call_fixtures import FIXTURES, TOOLS

xgrammar = pytest.importorskip("xgrammar")

FORMATS = [name for name in tool_parser_names() if name != "auto"]

# The fixtures of each format that are one well-formed call, in the layout its template writes,
# to a known tool with arguments in the schema's order.
VALID_CALLS = {
    "hermes": [
        "single_call",
        "closing_tag_inside_string",
        "empty_arguments",
        "parameters_member",
        "unicode_arguments",
        "nested_arguments",
    ],
    "qwen3_coder": [
        "single_call",
        "typed_scalars",
        "typed_containers",
        "no_parameters",
        "unicode_values",
        "code_value_keeps_layout",
        "empty_value",
    ],
    "gemma4": [
        "single_call",
        "scalars",
        "empty_arguments",
        "braces_and_quotes_in_string",
        "unicode_values",
    ],
    "mistral": [
        "array_single",
        "v11_single",
        "v11_empty_arguments",
        "opener_inside_string",
        "unicode_arguments",
    ],
    "minimax_xml": [
        "single_invoke",
        "typed_values",
        "no_parameters",
        "unicode_values",
        "code_value_newlines",
    ],
    "poolside_v1": [
        "single_call",
        "inline_name_typed",
        "string_whitespace_kept",
        "typed_string_not_parsed",
        "no_arguments",
        "unicode_values",
    ],
    "bare_json": [
        "object_call",
        "llama_parameters",
        "empty_arguments",
        "unicode_arguments",
        "closing_tag_inside_string",
    ],
}
VALID_CALLS["qwen3_xml"] = VALID_CALLS["qwen3_coder"]

# The fixtures of each format that are several well-formed calls and nothing else, in the
# layout its template writes for parallel calls.
SEVERAL_CALLS = {
    "hermes": ["parallel_calls"],
    "qwen3_coder": ["parallel_calls"],
    "qwen3_xml": ["parallel_calls"],
    "gemma4": ["back_to_back_calls"],
    "mistral": ["array_parallel", "v11_parallel"],
    "minimax_xml": ["two_invokes_one_block"],
    "poolside_v1": ["parallel_calls"],
    "bare_json": ["array_of_full_calls"],
}

# Tools whose schemas exercise what the grammars must keep: required parameters, enums of
# untyped values, bounded numbers, nested objects, nullable values, a parameter-less function.
RICH_TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "book",
            "parameters": {
                "type": "object",
                "properties": {
                    "room": {"enum": ["red", "blue", "true", "42"]},
                    "nights": {"type": "integer", "minimum": 1, "maximum": 30},
                    "late": {"type": "boolean"},
                    "rate": {"type": "number"},
                    "guest": {
                        "type": "object",
                        "properties": {"name": {"type": "string"}, "vip": {"type": "boolean"}},
                        "required": ["name"],
                        "additionalProperties": False,
                    },
                    "tags": {"type": "array", "items": {"enum": ["quiet", "view"]}},
                    "note": {"type": ["string", "null"]},
                    "level": {"type": ["integer", "null"]},
                },
                "required": ["room", "nights"],
                "additionalProperties": False,
            },
        },
    },
    {
        "type": "function",
        "function": {
            "name": "write.file",
            "parameters": {
                "type": "object",
                "properties": {"path": {"type": "string"}, "content": {"type": "string"}},
                "required": ["path", "content"],
                "additionalProperties": False,
            },
        },
    },
    {"type": "function", "function": {"name": "ping"}},
]
RICH_SPECS = tool_specs(RICH_TOOLS)
SCHEMAS = {tool["function"]["name"]: tool["function"].get("parameters") for tool in RICH_TOOLS}

# Every marker as one token, as tokenizers have them, plus characters to spell the rest.
MARKERS = sorted({m for name in FORMATS for m in tool_parser_class(name).markers})
STOP = "<eos>"
# A number past a double's range: JSON has no infinity, so the XML readers keep it as text.
HUGE_NUMBER = re.compile(r"[0-9][eE][+-]?[0-9]{3}")
VOCAB = [chr(c) for c in range(32, 127)] + ["\n", "\t", "é", "東", *MARKERS, STOP]


@pytest.fixture(scope="module")
def compiler():
    info = xgrammar.TokenizerInfo(VOCAB, stop_token_ids=[VOCAB.index(STOP)])
    return xgrammar.GrammarCompiler(info)


def compiled(compiler, fmt: str, specs, several: bool = False) -> Any:
    return compiler.compile_grammar(
        xgrammar.Grammar.from_ebnf(tool_parser_class(fmt).call_grammar(specs, several=several))
    )


def accepts(grammar, text: str) -> bool:
    matcher = xgrammar.GrammarMatcher(grammar)
    return matcher.accept_string(text) and matcher.is_completed()


def parse(fmt: str, text: str, specs) -> tuple[str, list]:
    parser = make_tool_parser(fmt, tools=specs)
    return collect([*parser.feed(text), *parser.finish()])


@pytest.mark.parametrize("several", [False, True])
@pytest.mark.parametrize("fmt", FORMATS)
def test_grammar_accepts_the_parsers_single_calls(compiler, fmt, several):
    grammar = compiled(compiler, fmt, TOOLS, several)
    fixtures = {name: text for name, text, _, _ in FIXTURES[fmt]}
    for name in VALID_CALLS[fmt]:
        assert accepts(grammar, fixtures[name]), f"{fmt} grammar refuses fixture {name}"


@pytest.mark.parametrize("fmt", FORMATS)
def test_grammar_accepts_several_calls_only_where_allowed(compiler, fmt):
    one, several = compiled(compiler, fmt, TOOLS), compiled(compiler, fmt, TOOLS, several=True)
    fixtures = {name: (text, calls) for name, text, _, calls in FIXTURES[fmt]}
    for name in SEVERAL_CALLS[fmt]:
        text, calls = fixtures[name]
        text = text.rstrip("\n")  # hermes's fixture ends in a newline no template writes
        assert len(calls) > 1
        assert accepts(several, text), f"{fmt} grammar refuses fixture {name}"
        assert not accepts(one, text), f"{fmt} one-call grammar accepts fixture {name}"


@pytest.mark.parametrize("several", [False, True])
@pytest.mark.parametrize("fmt", FORMATS)
def test_grammar_refuses_other_functions_and_more_calls(compiler, fmt, several):
    only_time = [tool for tool in TOOLS if tool.name == "get_time"]
    grammar = compiled(compiler, fmt, only_time, several)
    fixtures = {name: text for name, text, _, _ in FIXTURES[fmt]}
    call = fixtures[VALID_CALLS[fmt][0]]  # a call to get_weather
    assert "get_weather" in call and not accepts(grammar, call)
    renamed = call.replace("get_weather", "get_timer")
    assert not accepts(compiled(compiler, fmt, TOOLS, several), renamed), "an unknown function"
    if not several:
        assert not accepts(compiled(compiler, fmt, TOOLS), call + call), "two calls"


def draw(grammar, rng: random.Random, max_tokens: int = 400) -> str | None:
    """A text the grammar accepts, drawn a token at a time; None if it did not end in time."""
    matcher = xgrammar.GrammarMatcher(grammar)
    bitmask = xgrammar.allocate_token_bitmask(1, len(VOCAB))
    pieces: list[str] = []
    for _ in range(max_tokens):
        matcher.fill_next_token_bitmask(bitmask)
        words = bitmask[0].tolist()
        allowed = [i for i in range(len(VOCAB)) if (words[i // 32] >> (i % 32)) & 1]
        if VOCAB.index(STOP) in allowed and (len(allowed) == 1 or rng.random() < 0.7):
            return "".join(pieces)
        allowed = [i for i in allowed if VOCAB[i] != STOP]
        markers = [i for i in allowed if len(VOCAB[i]) > 1]
        token = rng.choice(markers if markers and rng.random() < 0.5 else allowed)
        assert matcher.accept_token(token)
        pieces.append(VOCAB[token])
    return None


@pytest.mark.parametrize("several", [False, True])
@pytest.mark.parametrize("fmt", FORMATS)
def test_whatever_the_grammar_allows_parses_to_valid_calls(compiler, fmt, several):
    rng = random.Random(f"{fmt}-several" if several else fmt)
    num_with_several = 0
    for specs, named in [(RICH_SPECS, None), (RICH_SPECS[:1], "book"), (TOOLS, None)]:
        grammar = compiled(compiler, fmt, specs, several)
        num_drawn = 0
        for _ in range(12):
            text = draw(grammar, rng)
            if text is None or HUGE_NUMBER.search(text):
                continue
            num_drawn += 1
            content, calls = parse(fmt, text, specs)
            num_allowed = len(calls) >= 1 if several else len(calls) == 1
            assert content == "" and num_allowed, f"{fmt}: {text!r} -> {content!r}, {calls}"
            num_with_several += len(calls) > 1
            for call in calls:
                assert call.name in {spec.name for spec in specs}
                assert named is None or call.name == named
                arguments = json.loads(call.arguments)
                spec = next(s for s in specs if s.name == call.name)
                schema = SCHEMAS.get(call.name) or spec.schema
                assert_valid(arguments, schema or {"type": "object"}, f"{fmt}: {text!r}")
        assert num_drawn >= 6, f"{fmt}: too few drawn texts ended"
    assert (num_with_several > 0) == several, f"{fmt}: {num_with_several} drawn with 2+ calls"


def test_gemma_arguments_have_no_whitespace(compiler):
    """The template writes none, and the reader ends a mapping at a newline before a colon."""
    grammar = compiled(compiler, "gemma4", TOOLS)
    q = '<|"|>'
    assert accepts(grammar, f"<|tool_call>call:get_weather{{city:{q}Paris{q},days:3}}<tool_call|>")
    assert not accepts(grammar, f"<|tool_call>call:get_weather{{city\n:{q}Paris{q}}}<tool_call|>")
    assert not accepts(grammar, f"<|tool_call>call:get_weather{{city: {q}Paris{q}}}<tool_call|>")


def test_every_format_has_markers_and_a_grammar():
    for fmt in FORMATS:
        parser_class = tool_parser_class(fmt)
        assert parser_class.call_grammar(TOOLS)
        assert fmt == "bare_json" or parser_class.markers
        assert parser_class.call_end is None or parser_class.call_end in parser_class.markers
    no_call_end = {fmt for fmt in FORMATS if tool_parser_class(fmt).call_end is None}
    assert no_call_end == {"bare_json", "mistral"}  # nothing closes one call there


def test_names_a_format_cannot_write_are_refused():
    bad = tool_specs([{"type": "function", "function": {"name": "two words"}}])
    with pytest.raises(ValueError, match="cannot be written"):
        tool_parser_class("qwen3_coder").call_grammar(bad)
    assert tool_parser_class("hermes").call_grammar(bad)  # JSON strings can hold anything
    required = tool_specs(
        [
            {
                "type": "function",
                "function": {
                    "name": "f",
                    "parameters": {
                        "type": "object",
                        "properties": {"a b": {"type": "string"}},
                        "required": ["a b"],
                    },
                },
            }
        ]
    )
    with pytest.raises(ValueError, match="required parameter 'a b'"):
        tool_parser_class("minimax_xml").call_grammar(required)
