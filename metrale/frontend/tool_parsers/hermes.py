"""Hermes / Qwen2.5 / Qwen3: one JSON call object per ``<tool_call>`` block.

    Let me check.
    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>

Source: the Qwen2.5 and Qwen3 chat templates ("return a json object with function name and
arguments within <tool_call></tool_call> XML tags"), as in the demo template here. A block
whose JSON has no name stays content, tags included; a ``</tool_call>`` inside a JSON string
is text, since the object is read with its strings. Parallel calls are blocks one after
another, a newline between them.
"""

from __future__ import annotations

from collections.abc import Sequence

from metrale.frontend.tool_parsers.block_parser import BlockParser, BlockReader
from metrale.frontend.tool_parsers.grammar import (
    OPTIONAL_NEWLINE,
    GrammarBuilder,
    literal,
    one_call_of,
    repeat_calls,
)
from metrale.frontend.tool_parsers.json_call import JsonCallBlock, call_object_grammar
from metrale.frontend.tool_parsers.registry import register_tool_parser
from metrale.frontend.tool_parsers.schema import ToolSpec

CALL_OPEN = "<tool_call>"
CALL_CLOSE = "</tool_call>"


@register_tool_parser("hermes")
class HermesToolParser(BlockParser):
    openers = (CALL_OPEN,)
    markers = (CALL_OPEN, CALL_CLOSE)
    call_end = CALL_CLOSE

    def open_block(self, opener: str) -> BlockReader:
        return JsonCallBlock(self.sink, closer=CALL_CLOSE)

    @classmethod
    def call_grammar(cls, tools: Sequence[ToolSpec], *, several: bool = False) -> str:
        grammar = GrammarBuilder()
        call = one_call_of(tools, lambda tool: call_object_grammar(grammar, tool))
        nl = OPTIONAL_NEWLINE
        block = f"{literal(CALL_OPEN)} {nl} {call} {nl} {literal(CALL_CLOSE)}"
        return grammar.build(repeat_calls(grammar, block, several=several, separator=nl))
