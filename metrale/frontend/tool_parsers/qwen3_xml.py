"""Qwen3-Coder's XML tool calls, and the ``qwen3_xml`` reading of the same grammar.

    <tool_call>
    <function=get_weather>
    <parameter=city>
    Paris
    </parameter>
    <parameter=days>
    3
    </parameter>
    </function>
    </tool_call>

Source: the Qwen3-Coder chat template, which writes ``'<parameter=' + name + '>\\n'``, the
value (strings raw, mappings and lists with ``tojson``, anything else with ``| string``), then
``'\\n</parameter>\\n'``. So one newline on each side of a value is layout, and only the
tool's JSON schema tells the integer 3 from the string "3": values convert by schema type;
with no type they stay strings. Qwen3.5 templates write the same syntax.

``qwen3_xml`` is vLLM's name for a second parser of this very grammar (built on a streaming
XML parser); it is not another syntax. Here the two share this code and differ only in
tolerance, which the `ValueRules` carry:
  * ``qwen3_coder`` ends a value at the first ``</parameter>``; if that tag is missing, at the
    next ``<parameter=``, ``</function>`` or ``</tool_call>``.
  * ``qwen3_xml`` looks ahead: ``</parameter>`` ends a value only when another parameter, the
    end of the function, or the end of the output follows; ``</function>`` only before
    ``</tool_call>``; a missing close is recovered at a ``<parameter=`` that starts a line.
    A value may then quote those tags (code that documents this format), at the price of
    holding them back until what follows shows they were text.

One ``<tool_call>`` block holds one function in the template, but the reader takes more, so a
reply with one call ends at ``</function>``. The grammar that forces a call keeps every tag out
of string values, which both readings then end at their ``</parameter>``; several calls are
blocks one after another, a newline between them, as the template writes them.
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
    Boundary,
    ValueRules,
    boundaries,
    parameters_grammar,
)

CALL_OPEN = "<tool_call>"
CALL_CLOSE = "</tool_call>"
FUNCTION_OPEN = "<function="
FUNCTION_CLOSE = "</function>"
PARAM_OPEN = "<parameter="
PARAM_CLOSE = "</parameter>"

CODER_RULES = ValueRules(
    boundaries(PARAM_CLOSE, (PARAM_OPEN, FUNCTION_CLOSE, CALL_CLOSE)),
    trim_newline=True,
    untyped=Untyped.STRING,
)
XML_RULES = ValueRules(
    boundaries(
        PARAM_CLOSE,
        (PARAM_OPEN, FUNCTION_CLOSE, CALL_CLOSE),
        lookahead=(
            Boundary(PARAM_CLOSE, closes=True, followers=(PARAM_OPEN, FUNCTION_CLOSE, CALL_CLOSE)),
            Boundary(PARAM_OPEN, at_line_start=True),
            Boundary(FUNCTION_CLOSE, followers=(CALL_CLOSE,)),
        ),
    ),
    trim_newline=True,
    untyped=Untyped.STRING,
)


class _State(Enum):
    FUNCTION = auto()  # before '<function='
    NAME = auto()
    BODY = auto()  # between parameters
    PARAM_NAME = auto()
    VALUE = auto()
    AFTER_FUNCTION = auto()  # after '</function>': '</tool_call>', or another function


class Qwen3Block(XmlCallBlock):
    def __init__(self, sink: EventSink, options: ToolParserOptions, rules: ValueRules) -> None:
        super().__init__(sink, options, rules)
        self._state = _State.FUNCTION

    def read(self, text: str, pos: int, final: bool) -> tuple[int, bool]:
        while True:
            state = self._state
            if state is _State.FUNCTION:
                at = skip_space(text, pos)
                match = match_tag(text, at, FUNCTION_OPEN, final)
                if match is not Match.YES:
                    return pos, match is Match.NO
                pos, self._state = at + len(FUNCTION_OPEN), _State.NAME
            elif state is _State.NAME:
                status, name, at, _ = scan_name(text, pos, (">",), final)
                if status is not NameScan.FOUND:
                    return pos, status is NameScan.INVALID
                self._start_call(name)
                pos, self._state = at + 1, _State.BODY
            elif state is _State.BODY:
                at = skip_space(text, pos)
                tag, more = match_any(text, at, (PARAM_OPEN, FUNCTION_CLOSE, CALL_CLOSE), final)
                if tag == PARAM_OPEN:
                    pos, self._state = at + len(tag), _State.PARAM_NAME
                elif tag == FUNCTION_CLOSE:
                    self._writer.end_call()
                    pos, self._state = at + len(tag), _State.AFTER_FUNCTION
                elif tag == CALL_CLOSE:
                    return self._end_call(at + len(tag))
                elif more:
                    return at, False
                else:  # not our syntax: the call ends, the text is read as content
                    return self._end_call(at)
            elif state is _State.PARAM_NAME:
                status, name, at, _ = scan_name(text, pos, (">",), final)
                if status is NameScan.MORE:
                    return pos, False
                if status is NameScan.INVALID:
                    return self._end_call(pos)
                self._open_value(name)
                pos, self._state = at + 1, _State.VALUE
            elif state is _State.VALUE:
                pos, done = self._read_value(text, pos, final)
                if done is not None:
                    return pos, done
                self._state = _State.BODY
            else:  # AFTER_FUNCTION
                pos, done = self._between_calls(text, pos, final, CALL_CLOSE, FUNCTION_OPEN)
                if done is not None:
                    return pos, done
                self._state = _State.NAME


@register_tool_parser("qwen3_coder")
class Qwen3CoderToolParser(BlockParser):
    openers = (CALL_OPEN,)
    markers = (CALL_OPEN, CALL_CLOSE, FUNCTION_OPEN, FUNCTION_CLOSE, PARAM_OPEN, PARAM_CLOSE)
    call_end = FUNCTION_CLOSE
    rules = CODER_RULES

    def open_block(self, opener: str) -> BlockReader:
        return Qwen3Block(self.sink, self.options, self.rules)

    @classmethod
    def call_grammar(cls, tools: Sequence[ToolSpec], *, several: bool = False) -> str:
        grammar = GrammarBuilder()
        nl = OPTIONAL_NEWLINE

        def parameter(name: str, value: str) -> str:
            return f"{literal(PARAM_OPEN + name + '>')} {value} {literal(PARAM_CLOSE)} {nl}"

        call = one_call_of(
            tools,
            lambda tool: (
                f"{literal(checked_name(tool) + '>')} {nl} "
                f"{parameters_grammar(grammar, tool, cls.rules, parameter)}"
            ),
        )
        block = (
            f"{literal(CALL_OPEN)} {nl} {literal(FUNCTION_OPEN)} {call} "
            f"{literal(FUNCTION_CLOSE)} {nl} {literal(CALL_CLOSE)}"
        )
        return grammar.build(repeat_calls(grammar, block, several=several, separator=nl))


@register_tool_parser("qwen3_xml")
class Qwen3XmlToolParser(Qwen3CoderToolParser):
    rules = XML_RULES
