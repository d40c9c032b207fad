"""The chat output parser's caps: on tool calls (`parallel_tool_calls: false`), for every format,
and on the prose between calls (`max_inter_tool_prose`).

The engine stops after the first call only where the format marks a call's end; the parser
keeps the first call of every format, and the stream must agree with the whole text.
"""

from __future__ import annotations

import pytest

from metrale.frontend.chat_output import ChatOutputParser
from metrale.frontend.output_processor import CompletionDelta
from metrale.frontend.tool_parsers import make_tool_parser, tool_parser_names
from metrale.frontend.tool_parsers.schema import tool_specs
from tests.frontend.splits import splittings, token_deltas

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


# A call, `prose` words of prose, then a second call with a long argument.
def _call_prose_call(name: str, prose_words: int) -> str:
    first, second = TWO_CALLS[name], TWO_CALLS[name]
    if name == "mistral":  # one call per [TOOL_CALLS] block, so prose can come between
        first = '[TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Paris"}}]'
        second = '[TOOL_CALLS] [{"name": "get_time", "arguments": {"city": "' + "Oslo " * 60
        second += '"}}]'
    else:
        end = second.index("</tool_call>") + len("</tool_call>")
        first = second[:end]
        second = second[end:].lstrip("\n").replace("Oslo", "Oslo " * 60)
    return first + "\n" + " ".join(["word"] * prose_words) + "\n" + second


def _take_tokens(parser: ChatOutputParser, text: str) -> tuple[str, list[str], CompletionDelta]:
    """Feed `text` a token a delta, as the server does; stop where a delta is finished."""
    content, names = "", []
    pieces = token_deltas(text)
    for i, piece in enumerate(pieces):
        delta = CompletionDelta("r", [i], piece, None)
        parsed = parser.take(delta)
        if delta.finished or i == len(pieces) - 1:
            parsed = merge_all(parsed, parser.finish())
        content += parsed.content
        names += [call.name for call in parsed.tool_calls if call.name is not None]
        if delta.finished:
            return content, names, delta
    return content, names, delta


def merge_all(a, b):
    a.content += b.content
    a.tool_calls += b.tool_calls
    return a


@pytest.mark.parametrize("name", sorted(TWO_CALLS))
def test_prose_between_calls_past_the_bound_ends_the_turn(name):
    parser = ChatOutputParser(None, make_tool_parser(name, tools=TOOLS), max_inter_tool_prose=20)
    content, names, last = _take_tokens(parser, _call_prose_call(name, 200))
    assert names == ["get_weather"]
    assert (last.finish_reason, last.stop_reason, last.watchdog) == (
        "stop",
        "inter_tool_prose",
        "inter_tool_prose",
    )
    assert parser.prose_tokens == 20
    assert 0 < content.count("word") <= 20


@pytest.mark.parametrize("name", sorted(TWO_CALLS))
def test_prose_within_the_bound_and_long_calls_are_not_cut(name):
    """Only prose after a call counts, from the last call on: a call's own text never does."""
    for bound in (None, 40):
        parser = ChatOutputParser(
            None, make_tool_parser(name, tools=TOOLS), max_inter_tool_prose=bound
        )
        _, names, last = _take_tokens(parser, _call_prose_call(name, 10))
        assert names == ["get_weather", "get_time"]
        assert not last.finished
        assert parser.prose_tokens < 5  # reset at the second call; only the layout after it


def test_prose_before_the_first_call_is_not_bounded():
    parser = ChatOutputParser(None, make_tool_parser("hermes", tools=TOOLS), max_inter_tool_prose=5)
    content, names, last = _take_tokens(parser, "word " * 50 + TWO_CALLS["hermes"])
    assert names == ["get_weather", "get_time"] and not last.finished
    assert content.count("word") == 50


def test_only_a_bounded_tool_turn_needs_its_deltas_as_the_engine_made_them():
    """The prose bound ends a choice at a delta's end, so its stream must not merge deltas
    (`AsyncLLM.generate`'s coalescing); everything else parses the text however it is split."""
    hermes = make_tool_parser("hermes", tools=TOOLS)
    assert ChatOutputParser(None, hermes, max_inter_tool_prose=5).counts_per_delta
    assert not ChatOutputParser(None, hermes).counts_per_delta
    assert not ChatOutputParser(None, hermes, max_inter_tool_prose=0).counts_per_delta
    assert not ChatOutputParser(None, None, max_inter_tool_prose=5).counts_per_delta
