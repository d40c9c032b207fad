"""The chat output parser's cap on tool calls (`parallel_tool_calls: false`), for every format.

The engine stops after the first call only where the format marks a call's end; the parser
keeps the first call of every format, and the stream must agree with the whole text.
"""

from __future__ import annotations

import pytest

from metrale.frontend.chat_output import ChatOutputParser
from metrale.frontend.tool_parsers import make_tool_parser, tool_parser_names
from metrale.frontend.tool_parsers.schema import tool_specs
from tests.frontend.splits import splittings

TOOLS = tool_specs(
    [
        {
            "type": "function",
            "function": {
                "name": name,
                "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
            },
        }
        for name in ("get_weather", "get_time")
    ]
)

TWO_CALLS = {
    "hermes": '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
    '<tool_call>\n{"name": "get_time", "arguments": {"city": "Oslo"}}\n</tool_call>',
    "mistral": '[TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Paris"}}, '
    '{"name": "get_time", "arguments": {"city": "Oslo"}}]',
    "qwen3_coder": "<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n"
    "</function>\n</tool_call>\n<tool_call>\n<function=get_time>\n<parameter=city>\nOslo\n"
    "</parameter>\n</function>\n</tool_call>",
}


def parse(name: str, deltas, max_tool_calls):
    parser = ChatOutputParser(
        None, make_tool_parser(name, tools=TOOLS, id_prefix="call_"), max_tool_calls=max_tool_calls
    )
    content, calls = "", {}
    for delta in [parser.feed(d) for d in deltas] + [parser.finish()]:
        content += delta.content
        for call in delta.tool_calls:
            entry = calls.setdefault(call.index, {"name": None, "arguments": ""})
            entry["name"] = entry["name"] or call.name
            entry["arguments"] += call.arguments
    return content, calls, parser.num_tool_calls


@pytest.mark.parametrize("name", sorted(TWO_CALLS))
def test_a_cap_of_one_keeps_the_first_call_whatever_the_split(name):
    assert name in tool_parser_names()
    text = TWO_CALLS[name]
    _, uncapped, num_uncapped = parse(name, [text], None)
    assert num_uncapped == 2 and [c["name"] for c in uncapped.values()] == [
        "get_weather",
        "get_time",
    ]
    for how, deltas in splittings(text, name).items():
        content, calls, num_calls = parse(name, deltas, 1)
        assert num_calls == 1, how
        assert calls == {0: uncapped[0]}, how
        assert content.strip() == "", how


# A well-formed call, an opener left as text, then a call cut off mid-arguments.
CALL_TEXT_CUT = {
    "hermes": '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
    '<tool_call>oops</tool_call>\n<tool_call>\n{"name": "get_time", "arguments": {"city": "Os',
    "mistral": '[TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}[TOOL_CALLS] sorry '
    '[TOOL_CALLS]get_time[ARGS]{"city": "Os',
}


@pytest.mark.parametrize("name", sorted(CALL_TEXT_CUT))
def test_outcomes_count_only_the_delivered_calls(name):
    """Calls dropped by max_tool_calls are left out of the outcomes; text is still counted."""
    text = CALL_TEXT_CUT[name]
    for how, deltas in splittings(text, name).items():
        for max_tool_calls, expected in (
            (None, {"parsed": 1, "repaired": 1, "text": 1}),
            (1, {"parsed": 1, "repaired": 0, "text": 1}),
        ):
            parser = ChatOutputParser(
                None, make_tool_parser(name, tools=TOOLS), max_tool_calls=max_tool_calls
            )
            for delta in deltas:
                parser.feed(delta)
            parser.finish()
            assert parser.tool_call_outcomes == expected, (how, max_tool_calls)


def test_no_tool_parser_no_outcomes():
    parser = ChatOutputParser(None, None)
    parser.feed("<tool_call>")
    parser.finish()
    assert parser.tool_call_outcomes == {}
