"""What the block readers of the XML-style call formats share (Qwen3-Coder's `<function=`,
MiniMax's `<invoke name=`, Poolside's `<arg_key>`): the call being read and its arguments'
writer, and each parameter's value read by a `ValueReader` under the format's rules, typed by
the tool's schema. A format's reader keeps its own states and tags; these are its steps."""

from __future__ import annotations

from metrale.frontend.tool_parsers.base import ToolParserOptions
from metrale.frontend.tool_parsers.block_parser import BlockReader
from metrale.frontend.tool_parsers.sink import EventSink
from metrale.frontend.tool_parsers.tags import match_any, skip_space
from metrale.frontend.tool_parsers.xml_values import ArgumentsWriter, ValueReader, ValueRules


class XmlCallBlock(BlockReader):
    def __init__(self, sink: EventSink, options: ToolParserOptions, rules: ValueRules) -> None:
        self._sink = sink
        self._options = options
        self._rules = rules
        self._function = ""  # the call being read
        self._writer = ArgumentsWriter(sink)
        self._value: ValueReader | None = None
        self.committed = False
        self.closed = False

    def _start_call(self, name: str) -> None:
        self._function = name
        self._writer = ArgumentsWriter.start_call(self._sink, name)
        self.committed = True

    def _end_call(self, pos: int) -> tuple[int, bool]:
        """The call ends at `pos` (the text is not the format's, or the output ended): `read`'s
        answer, the block ended there."""
        self._writer.end_call()
        return pos, True

    def _open_value(self, param: str) -> None:
        """The value of parameter `param` of the call starts: read as its schema types it."""
        spec = self._options.tools.get(self._function)
        schema = spec.params.get(param) if spec is not None else None
        self._value = ValueReader(self._rules, param, schema, self._writer)

    def _read_value(self, text: str, pos: int, final: bool) -> tuple[int, bool | None]:
        """Read the open value from `pos`: (position, None) when it ended at its boundary and
        the call goes on; else `read`'s answer, (position, False) to wait for more text or
        (position, True) when the output ended inside it (the call ended with it)."""
        assert self._value is not None
        pos, boundary, ended = self._value.read(text, pos, final)
        if not ended:
            return pos, False
        if boundary is None:
            return self._end_call(pos)
        return pos, None

    def _between_calls(
        self, text: str, pos: int, final: bool, close: str, next_call: str
    ) -> tuple[int, bool | None]:
        """After a call: the block's closing tag ends the block, closed; the next call's opener
        goes on, (position after it, None). Anything else ends the block where it stands,
        closed only when the output ended there (a reply with one call stops at the format's
        `call_end`); text that may still become a tag waits for more."""
        at = skip_space(text, pos)
        tag, more = match_any(text, at, (close, next_call), final)
        if tag == close:
            self.closed = True
            return at + len(tag), True
        if tag is None:
            self.closed = final and at == len(text)
            return pos, not more
        return at + len(tag), None
