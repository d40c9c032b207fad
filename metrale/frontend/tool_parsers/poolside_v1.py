"""Poolside v1 (Laguna): GLM-4.5/4.7-style key/value tags.

    <tool_call>get_weather
    <arg_key>city</arg_key><arg_value>Paris</arg_value>
    <arg_key>days</arg_key><arg_value>3</arg_value>
    </tool_call>

Source: vLLM's ``poolside_v1`` parser and the Laguna parser ports in TensorRT-LLM, Dynamo
and mlx-vlm, which describe it as the GLM-4.7 tool-call format: the name follows
``<tool_call>`` directly, ended by a newline or the first ``<arg_key>``. A value whose schema
type is string is kept verbatim, whitespace included (source code); any other value is
parsed as JSON or a Python literal when it is one, typed or not, else kept as a string.
Poolside publishes no description of its own; this follows those implementations. Parallel
calls are blocks one after another, a newline between them.
"""

from __future__ import annotations

from collections.abc import Sequence
from enum import Enum, auto

from metrale.frontend.tool_parsers.base import ToolParserOptions
from metrale.frontend.tool_parsers.block_parser import BlockParser, BlockReader
from metrale.frontend.tool_parsers.grammar import (
    OPTIONAL_NEWLINE,
    GrammarBuilder,
    checked_name,
    literal,
    one_call_of,
    repeat_calls,
)
from metrale.frontend.tool_parsers.names import NameScan, scan_name
from metrale.frontend.tool_parsers.registry import register_tool_parser
from metrale.frontend.tool_parsers.schema import ToolSpec, Untyped
from metrale.frontend.tool_parsers.sink import EventSink
from metrale.frontend.tool_parsers.tags import Match, match_any, match_tag, skip_space
from metrale.frontend.tool_parsers.xml_block import XmlCallBlock
from metrale.frontend.tool_parsers.xml_values import (
    ValueRules,
    boundaries,
    parameters_grammar,
)

CALL_OPEN = "<tool_call>"
CALL_CLOSE = "</tool_call>"
KEY_OPEN = "<arg_key>"
KEY_CLOSE = "</arg_key>"
VALUE_OPEN = "<arg_value>"
VALUE_CLOSE = "</arg_value>"

RULES = ValueRules(
    boundaries(VALUE_CLOSE, (KEY_OPEN, CALL_CLOSE)), trim_newline=False, untyped=Untyped.JSON
)


class _State(Enum):
    NAME = auto()
    BODY = auto()  # between arguments
    KEY = auto()
    BEFORE_VALUE = auto()
    VALUE = auto()


class PoolsideBlock(XmlCallBlock):
    def __init__(self, sink: EventSink, options: ToolParserOptions) -> None:
        super().__init__(sink, options, RULES)
        self._state = _State.NAME
        self._key = ""

    def read(self, text: str, pos: int, final: bool) -> tuple[int, bool]:
        while True:
            state = self._state
            if state is _State.NAME:
                start = skip_space(text, pos)
                if start == len(text) and not final:
                    return pos, False
                status, name, at, delimiter = scan_name(
                    text, start, ("\n", KEY_OPEN, CALL_CLOSE), final
                )
                if status is not NameScan.FOUND:
                    return pos, status is NameScan.INVALID
                self._start_call(name)
                pos = at + 1 if delimiter == "\n" else at
                self._state = _State.BODY
            elif state is _State.BODY:
                at = skip_space(text, pos)
                tag, more = match_any(text, at, (KEY_OPEN, CALL_CLOSE), final)
                if tag == KEY_OPEN:
                    pos, self._state = at + len(tag), _State.KEY
                elif tag == CALL_CLOSE:
                    self.closed = True
                    return self._end_call(at + len(tag))
                elif more:
                    return at, False
                else:  # not our syntax: the call ends, the text is read as content
                    return self._end_call(at)
            elif state is _State.KEY:
                status, key, at, _ = scan_name(text, pos, (KEY_CLOSE,), final)
                if status is NameScan.MORE:
                    return pos, False
                if status is NameScan.INVALID:
                    return self._end_call(pos)
                self._key = key
                pos, self._state = at + len(KEY_CLOSE), _State.BEFORE_VALUE
            elif state is _State.BEFORE_VALUE:
                at = skip_space(text, pos)
                match = match_tag(text, at, VALUE_OPEN, final)
                if match is Match.MORE:
                    return at, False
                if match is Match.NO:  # a key without a value: dropped, a repair
                    self._sink.note_repair()
                    pos, self._state = at, _State.BODY
                    continue
                self._open_value(self._key)
                pos, self._state = at + len(VALUE_OPEN), _State.VALUE
            else:  # VALUE
                pos, done = self._read_value(text, pos, final)
                if done is not None:
                    return pos, done
                self._state = _State.BODY


@register_tool_parser("poolside_v1")
class PoolsideV1ToolParser(BlockParser):
    openers = (CALL_OPEN,)
    markers = (CALL_OPEN, CALL_CLOSE, KEY_OPEN, KEY_CLOSE, VALUE_OPEN, VALUE_CLOSE)
    call_end = CALL_CLOSE

    def open_block(self, opener: str) -> BlockReader:
        return PoolsideBlock(self.sink, self.options)

    @classmethod
    def call_grammar(cls, tools: Sequence[ToolSpec], *, several: bool = False) -> str:
        grammar = GrammarBuilder()
        nl = OPTIONAL_NEWLINE

        def argument(name: str, value: str) -> str:
            key = literal(KEY_OPEN + name + KEY_CLOSE)
            return f"{key} {nl} {literal(VALUE_OPEN)} {value} {literal(VALUE_CLOSE)} {nl}"

        call = one_call_of(
            tools,
            lambda tool: (
                f"{literal(checked_name(tool))} {nl} "
                f"{parameters_grammar(grammar, tool, RULES, argument)}"
            ),
        )
        block = f"{literal(CALL_OPEN)} {call} {literal(CALL_CLOSE)}"
        return grammar.build(repeat_calls(grammar, block, several=several, separator=nl))
