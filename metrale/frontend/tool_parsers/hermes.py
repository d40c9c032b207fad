"""Hermes / Qwen2.5 / Qwen3: one JSON call object per ``<tool_call>`` block.

    Let me check.
    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>

Source: the Qwen2.5 and Qwen3 chat templates ("return a json object with function name and
arguments within <tool_call></tool_call> XML tags"), as in the demo template here. A block
whose JSON has no name stays content, tags included; a ``</tool_call>`` inside a JSON string
is text, since the object is read with its strings.
"""

from __future__ import annotations

from metrale.frontend.tool_parsers.block_parser import BlockParser, BlockReader
from metrale.frontend.tool_parsers.json_call import JsonCallBlock
from metrale.frontend.tool_parsers.registry import register_tool_parser


@register_tool_parser("hermes")
class HermesToolParser(BlockParser):
    openers = ("<tool_call>",)

    def open_block(self, opener: str) -> BlockReader:
        return JsonCallBlock(self.sink, closer="</tool_call>")
