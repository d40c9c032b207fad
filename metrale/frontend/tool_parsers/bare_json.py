"""Bare JSON: the whole output is one call object (or an array of them), else content.

    {"name": "get_weather", "arguments": {"city": "Paris"}}

For models prompted to answer with a JSON call and nothing else (Llama 3.x JSON tool calling
writes ``"parameters"`` for the arguments; guided ``tool_choice="required"`` output is an
array of such objects). Only output that starts, after whitespace, with ``{`` or ``[`` is
looked at, and since a JSON answer may well have a "name" member, the name must be one of the
request's tools when tools are given. Anything else stays content, as does text after the
call. A JSON value that is no call counts as text: this format cannot tell a JSON answer from a
call it failed to read.

The format has no markers: nothing ends one call but the JSON itself, so no stop string can
cut a reply after its first call (with `parallel_tool_calls: false` the chat output parser
keeps only the first call). The grammar that forces a call writes the
object alone; where several calls are allowed, the object or an array of one or more, the
array being how vLLM's guided ``tool_choice="required"`` writes them.
"""

from __future__ import annotations

from collections.abc import Sequence

from metrale.frontend.tool_parsers.base import ToolParserOptions
from metrale.frontend.tool_parsers.block_parser import BlockParser, BlockReader
from metrale.frontend.tool_parsers.grammar import GrammarBuilder, one_call_of
from metrale.frontend.tool_parsers.json_call import (
    JsonCallsBlock,
    call_array_grammar,
    call_object_grammar,
)
from metrale.frontend.tool_parsers.registry import register_tool_parser
from metrale.frontend.tool_parsers.schema import ToolSpec
from metrale.frontend.tool_parsers.tags import skip_space


@register_tool_parser("bare_json")
class BareJsonToolParser(BlockParser):
    def __init__(self, options: ToolParserOptions) -> None:
        super().__init__(options)
        self._looked = False  # whether the first non-space character was seen

    def locate_block(self, text: str, final: bool) -> tuple[int, str | None]:
        if self._looked:
            return len(text), None
        start = skip_space(text, 0)
        if start == len(text):
            return (len(text) if final else 0), None
        self._looked = True
        return (0, "") if text[start] in "{[" else (len(text), None)

    def open_block(self, opener: str) -> BlockReader:
        return JsonCallsBlock(self.sink, self.options.tools.keys() or None)

    @classmethod
    def call_grammar(cls, tools: Sequence[ToolSpec], *, several: bool = False) -> str:
        grammar = GrammarBuilder()
        call = one_call_of(tools, lambda tool: call_object_grammar(grammar, tool))
        if not several:
            return grammar.build(call)
        return grammar.build(f"{call} | {call_array_grammar(grammar, call, several=True)}")
