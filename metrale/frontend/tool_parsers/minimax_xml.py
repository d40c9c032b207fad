"""MiniMax-M2 (and M2.1, M2.5): XML invokes in a ``<minimax:tool_call>`` block.

    <minimax:tool_call>
    <invoke name="get_weather">
    <parameter name="city">Paris</parameter>
    <parameter name="days">3</parameter>
    </invoke>
    </minimax:tool_call>

Source: MiniMax's tool-calling guide (MiniMax-AI/MiniMax-M2.5, docs/tool_calling_guide.md)
and its reference parser: one block may hold several invokes; names may be quoted or bare;
values convert by the parameter's schema type and stay strings without one. The guide's
parser strips values; here a string value loses only one newline on each side (layout), so
code keeps its indentation, while other types ignore surrounding whitespace.

The older MiniMax-M1 / Text-01 wrote JSON lines in ``<tool_calls>``; that is another format
and is not handled here.

A block may hold several invokes, so a reply with one call ends at ``</invoke>``; the grammar
for several calls writes them as invokes of one block, as the guide describes.
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
from metrale.frontend.tool_parsers.tags import match_any, skip_space
from metrale.frontend.tool_parsers.xml_block import XmlCallBlock
from metrale.frontend.tool_parsers.xml_values import (
    ValueRules,
    boundaries,
    parameters_grammar,
)

BLOCK_OPEN = "<minimax:tool_call>"
BLOCK_CLOSE = "</minimax:tool_call>"
INVOKE_OPEN = "<invoke name="
INVOKE_CLOSE = "</invoke>"
PARAM_OPEN = "<parameter name="
PARAM_CLOSE = "</parameter>"

RULES = ValueRules(
    boundaries(PARAM_CLOSE, (PARAM_OPEN, INVOKE_CLOSE, BLOCK_CLOSE)),
    trim_newline=True,
    untyped=Untyped.STRING,
)


def _quoted(opener: str, name: str) -> str:
    return f'{opener}"{name}">'


def _unquote(raw: str) -> str:
    return raw.strip().strip("\"'")


class _State(Enum):
    BLOCK = auto()  # between invokes
    INVOKE_NAME = auto()
    INVOKE = auto()  # between parameters
    PARAM_NAME = auto()
    VALUE = auto()


class MinimaxBlock(XmlCallBlock):
    def __init__(self, sink: EventSink, options: ToolParserOptions) -> None:
        super().__init__(sink, options, RULES)
        self._state = _State.BLOCK

    def read(self, text: str, pos: int, final: bool) -> tuple[int, bool]:
        while True:
            state = self._state
            if state is _State.BLOCK:
                pos, done = self._between_calls(text, pos, final, BLOCK_CLOSE, INVOKE_OPEN)
                if done is not None:
                    return pos, done
                self._state = _State.INVOKE_NAME
            elif state in (_State.INVOKE_NAME, _State.PARAM_NAME):
                status, name, at, _ = scan_name(text, pos, (">",), final, clean=_unquote)
                if status is NameScan.MORE:
                    return pos, False
                if status is NameScan.INVALID:
                    if state is _State.PARAM_NAME:
                        return self._end_call(pos)
                    return pos, True
                pos = at + 1
                if state is _State.INVOKE_NAME:
                    self._start_call(name)
                    self._state = _State.INVOKE
                else:
                    self._open_value(name)
                    self._state = _State.VALUE
            elif state is _State.INVOKE:
                at = skip_space(text, pos)
                tag, more = match_any(text, at, (PARAM_OPEN, INVOKE_CLOSE, BLOCK_CLOSE), final)
                if tag == PARAM_OPEN:
                    pos, self._state = at + len(tag), _State.PARAM_NAME
                    continue
                if more:
                    return at, False
                self._writer.end_call()
                if tag == INVOKE_CLOSE:
                    pos, self._state = at + len(tag), _State.BLOCK
                elif tag == BLOCK_CLOSE:
                    return at + len(tag), True
                else:  # not our syntax: the call ends, the text is read as content
                    return at, True
            else:  # VALUE
                pos, done = self._read_value(text, pos, final)
                if done is not None:
                    return pos, done
                self._state = _State.INVOKE


@register_tool_parser("minimax_xml")
class MinimaxXmlToolParser(BlockParser):
    openers = (BLOCK_OPEN,)
    markers = (BLOCK_OPEN, BLOCK_CLOSE, INVOKE_OPEN, INVOKE_CLOSE, PARAM_OPEN, PARAM_CLOSE)
    call_end = INVOKE_CLOSE

    def open_block(self, opener: str) -> BlockReader:
        return MinimaxBlock(self.sink, self.options)

    @classmethod
    def call_grammar(cls, tools: Sequence[ToolSpec], *, several: bool = False) -> str:
        grammar = GrammarBuilder()
        nl = OPTIONAL_NEWLINE

        def parameter(name: str, value: str) -> str:
            opening = literal(_quoted(PARAM_OPEN, name))
            return f"{opening} {value} {literal(PARAM_CLOSE)} {nl}"

        call = one_call_of(
            tools,
            lambda tool: (
                f"{literal(_quoted(INVOKE_OPEN, checked_name(tool)))} {nl} "
                f"{parameters_grammar(grammar, tool, RULES, parameter)}"
            ),
        )
        invokes = repeat_calls(grammar, f"{call} {literal(INVOKE_CLOSE)} {nl}", several=several)
        return grammar.build(f"{literal(BLOCK_OPEN)} {nl} {invokes} {literal(BLOCK_CLOSE)}")
