"""Gemma 4: ``<|tool_call>call:NAME{key:value,...}<tool_call|>``, in Gemma's own value syntax.

    <|tool_call>call:get_weather{city:<|"|>Paris<|"|>,days:3}<tool_call|>

Source: the Gemma 4 chat template, which writes ``'<|tool_call>call:' + name + '{'``, then
``key:`` + ``format_argument(value)`` joined by commas, then ``'}<tool_call|>'``; and vLLM's
``gemma4`` parser. Keys are bare; strings are delimited by the ``<|"|>`` token (so they need no
escaping); mappings are ``{k:v}`` with bare keys, lists ``[a,b]``; numbers and booleans are
bare. Calls follow each other with no separator.

`GemmaArguments` translates that syntax to JSON as it arrives. A bare value is written once
its end is seen: JSON numbers, true, false and null as they are (``None`` as null), any other
bare text as a string. A mapping cut short or broken, or a call without ``<tool_call|>``,
counts as repaired; bare text and a trailing comma count as parsed, the syntax having bare
values (nothing tells a bare word from a forgotten quote).

The markers are special tokens in Gemma's tokenizer. The grammar that forces a call writes the
arguments in xgrammar's Gemma style of JSON schema, which is this syntax, and several calls
back to back, as the template does.
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from enum import Enum, auto

from metrale.frontend.tool_parsers.block_parser import BlockParser, BlockReader
from metrale.frontend.tool_parsers.grammar import (
    GrammarBuilder,
    arguments_schema,
    checked_name,
    literal,
    one_call_of,
    repeat_calls,
)
from metrale.frontend.tool_parsers.json_scanner import MAX_DEPTH
from metrale.frontend.tool_parsers.names import NameScan, scan_name
from metrale.frontend.tool_parsers.registry import register_tool_parser
from metrale.frontend.tool_parsers.schema import ToolSpec
from metrale.frontend.tool_parsers.sink import EventSink
from metrale.frontend.tool_parsers.tags import Match, match_tag, partial_tail_len, skip_space

CALL_OPEN = "<|tool_call>"
CALL_CLOSE = "<tool_call|>"
CALL_PREFIX = "call:"
QUOTE = '<|"|>'

_BARE_ENDS = ",}]<"
_JSON_NUMBER = re.compile(r"-?(?:0|[1-9][0-9]*)(?:\.[0-9]+)?(?:[eE][+-]?[0-9]+)?")
_BARE_NULLS = ("null", "None")


def _bare_json(text: str) -> str:
    if text in ("true", "false") or _JSON_NUMBER.fullmatch(text):
        return text
    if text in _BARE_NULLS:
        return "null"
    return json.dumps(text, ensure_ascii=False)


class _State(Enum):
    FIRST_KEY = auto()  # after '{': a key or '}'
    KEY = auto()  # after ',' in a mapping, or inside a key
    VALUE = auto()  # a value must start (or, in a list, ']')
    STRING = auto()
    BARE = auto()
    AFTER_VALUE = auto()
    DONE = auto()


class GemmaArguments:
    """Reads Gemma's argument mapping from just after its '{' and writes it as JSON.

    Like `JsonScanner`, it releases text only up to safe points, so it can close what it
    wrote if the mapping is cut short or broken.
    """

    def __init__(self, sink: EventSink) -> None:
        self._sink = sink
        self._state = _State.FIRST_KEY
        self._closers = "}"  # closing brackets of the open containers, innermost first
        self._num_items = [0]  # values written in each open container, innermost last
        self._pieces: list[str] = ["{"]
        self._safe_len = 1  # pieces sent or safe to send
        self._safe_suffix = "}"
        self._num_sent = 0
        self._key: list[str] = []
        self._bare: list[str] = []

    def read(self, text: str, pos: int, final: bool) -> tuple[int, bool]:
        """(position reached, whether the mapping ended: closed, broken, or out of text)."""
        pos, ended = self._read(text, pos, final)
        if ended and self._state is not _State.DONE:
            self._send(self._safe_len, self._safe_suffix)
            self._sink.note_repair()
        else:
            self._send(self._safe_len, "")
        return pos, ended

    def _send(self, upto: int, suffix: str) -> None:
        self._sink.arguments("".join(self._pieces[self._num_sent : upto]) + suffix)
        self._num_sent = upto

    def _mark_safe(self, in_string: bool = False) -> None:
        self._safe_len = len(self._pieces)
        self._safe_suffix = ('"' if in_string else "") + self._closers

    def _read(self, text: str, pos: int, final: bool) -> tuple[int, bool]:
        while True:
            state = self._state
            if state is _State.DONE:
                return pos, True
            if state is _State.STRING:
                pos, ended = self._read_string(text, pos, final)
            elif state is _State.BARE:
                pos, ended = self._read_bare(text, pos, final)
            elif state is _State.KEY:
                pos, ended = self._read_key(text, pos, final)
            else:
                pos, ended = self._read_structure(text, pos, final)
            if ended is not None:
                return pos, ended

    # Each _read_* returns (position reached, None to go on, else whether the mapping ended).

    def _read_string(self, text: str, pos: int, final: bool) -> tuple[int, bool | None]:
        end = text.find(QUOTE, pos)
        if end == -1:
            stop = len(text) if final else len(text) - partial_tail_len(text, pos, (QUOTE,))
            self._string_piece(text[pos:stop])
            return stop, final
        self._string_piece(text[pos:end])
        self._pieces.append('"')
        self._end_value()
        return end + len(QUOTE), None

    def _read_bare(self, text: str, pos: int, final: bool) -> tuple[int, bool | None]:
        end = pos
        while end < len(text) and text[end] not in _BARE_ENDS and not text[end].isspace():
            end += 1
        self._bare.append(text[pos:end])
        if end == len(text) and not final:
            return end, False
        self._pieces.append(_bare_json("".join(self._bare)))
        self._bare.clear()
        self._end_value()
        return end, None

    def _read_key(self, text: str, pos: int, final: bool) -> tuple[int, bool | None]:
        if not self._key:
            pos = skip_space(text, pos)
        end = pos
        while end < len(text) and text[end] not in ":,{}[]<>\n":
            end += 1
        if end > pos:
            self._key.append(text[pos:end])
        if end == len(text):
            return end, final
        key = "".join(self._key).strip().strip('"')
        if text[end] == "}" and not key and self._num_items[-1]:
            self._state = _State.AFTER_VALUE  # a trailing comma: '}' ends the mapping
            return end, None
        if text[end] != ":" or not key:
            return end, True
        self._member_key(key)
        return end + 1, None

    def _read_structure(self, text: str, pos: int, final: bool) -> tuple[int, bool | None]:
        """Brackets, commas, and the start of a value."""
        pos = skip_space(text, pos)
        if pos == len(text):
            return pos, final
        ch, state = text[pos], self._state
        if state is _State.FIRST_KEY:
            if ch == "}":
                return self._close(pos), None
            self._state = _State.KEY
            return pos, None
        if state is _State.AFTER_VALUE:
            if ch == ",":
                self._state = _State.VALUE if self._in_array else _State.KEY
                return pos + 1, None
            return (self._close(pos), None) if ch == self._closers[0] else (pos, True)
        # VALUE
        if ch == "]" and self._in_array:  # '[]', or a trailing comma
            return self._close(pos), None
        match = match_tag(text, pos, QUOTE, final)
        if match is Match.MORE:
            return pos, False
        if match is Match.NO and (ch == "<" or (ch in "{[" and len(self._closers) >= MAX_DEPTH)):
            return pos, True
        if self._in_array and self._num_items[-1]:
            self._pieces.append(", ")
        if match is Match.YES:
            self._pieces.append('"')
            self._state = _State.STRING
            self._mark_safe(in_string=True)
            return pos + len(QUOTE), None
        if ch in "{[":
            self._open(ch)
            return pos + 1, None
        if ch in ",}]":
            self._pieces.append('""')  # an empty bare value
            self._end_value()
        else:
            self._state = _State.BARE
        return pos, None

    def _string_piece(self, raw: str) -> None:
        if raw:
            self._pieces.append(json.dumps(raw, ensure_ascii=False)[1:-1])
            self._mark_safe(in_string=True)

    @property
    def _in_array(self) -> bool:
        return self._closers[0] == "]"

    def _member_key(self, key: str) -> None:
        separator = ", " if self._num_items[-1] else ""
        self._pieces.append(separator + json.dumps(key, ensure_ascii=False) + ": ")
        self._key.clear()
        self._state = _State.VALUE

    def _open(self, bracket: str) -> None:
        self._pieces.append(bracket)
        self._closers = ("}" if bracket == "{" else "]") + self._closers
        self._num_items.append(0)
        self._state = _State.FIRST_KEY if bracket == "{" else _State.VALUE
        self._mark_safe()

    def _close(self, pos: int) -> int:
        self._pieces.append(self._closers[0])
        self._closers = self._closers[1:]
        self._num_items.pop()
        self._end_value()
        return pos + 1

    def _end_value(self) -> None:
        if self._num_items:
            self._num_items[-1] += 1
        self._state = _State.AFTER_VALUE if self._closers else _State.DONE
        self._mark_safe()


class _BlockState(Enum):
    PREFIX = auto()  # before 'call:'
    NAME = auto()
    ARGUMENTS = auto()
    AFTER_CALL = auto()  # before '<tool_call|>'


class GemmaBlock(BlockReader):
    def __init__(self, sink: EventSink) -> None:
        self._sink = sink
        self._state = _BlockState.PREFIX
        self._arguments: GemmaArguments | None = None
        self.committed = False
        self.closed = False

    def read(self, text: str, pos: int, final: bool) -> tuple[int, bool]:
        while True:
            state = self._state
            if state is _BlockState.PREFIX:
                match = match_tag(text, pos, CALL_PREFIX, final)
                if match is not Match.YES:
                    return pos, match is Match.NO
                pos, self._state = pos + len(CALL_PREFIX), _BlockState.NAME
            elif state is _BlockState.NAME:
                status, name, at, _ = scan_name(text, pos, ("{",), final)
                if status is not NameScan.FOUND:
                    return pos, status is NameScan.INVALID
                self._sink.start_call(name)
                self.committed = True
                self._arguments = GemmaArguments(self._sink)
                pos, self._state = at + 1, _BlockState.ARGUMENTS
            elif state is _BlockState.ARGUMENTS:
                assert self._arguments is not None
                pos, ended = self._arguments.read(text, pos, final)
                if not ended:
                    return pos, False
                self._sink.end_call()
                self._state = _BlockState.AFTER_CALL
            else:
                match = match_tag(text, pos, CALL_CLOSE, final)
                if match is Match.YES:
                    self.closed = True
                    return pos + len(CALL_CLOSE), True
                return pos, match is Match.NO


@register_tool_parser("gemma4")
class Gemma4ToolParser(BlockParser):
    openers = (CALL_OPEN,)
    markers = (CALL_OPEN, CALL_CLOSE, QUOTE)
    call_end = CALL_CLOSE

    def open_block(self, opener: str) -> BlockReader:
        return GemmaBlock(self.sink)

    @classmethod
    def call_grammar(cls, tools: Sequence[ToolSpec], *, several: bool = False) -> str:
        grammar = GrammarBuilder()
        call = one_call_of(
            tools,
            lambda tool: f"{literal(checked_name(tool))} {_arguments_grammar(grammar, tool)}",
        )
        block = f"{literal(CALL_OPEN + CALL_PREFIX)} {call} {literal(CALL_CLOSE)}"
        return grammar.build(repeat_calls(grammar, block, several=several))


def _arguments_grammar(grammar: GrammarBuilder, tool: ToolSpec) -> str:
    # The template writes no whitespace, and a newline between a key and its colon would end
    # the mapping here.
    return grammar.schema_value(arguments_schema(tool), "gemma", whitespace=False)
