"""Tool calls written as JSON objects: ``{"name": "f", "arguments": {...}}``.

Hermes, Mistral and bare JSON output all spell a call this way. The rule, the same for a
stream and a whole text: an object is a call once its "name" member has been read completely
(a valid name string). From then on it stays a call: its arguments ("arguments" or
"parameters") are sent as they arrive, and if the object is cut short or broken by a stray
character the arguments are closed at their last valid point. An object that ends without a
name is not a call, and its text is left to the caller (as content).

A call counts as repaired when its object did not end at its closing brace, or its arguments
had to be closed, normalized (`JsonScanner`) or replaced by ``{}``; arguments written as a
string holding an object are a spelling some models use, and count as parsed.

`call_object_grammar` writes such an object for grammars that force a call, and
`call_array_grammar` an array of them.
"""

from __future__ import annotations

import json
from collections.abc import Collection
from enum import Enum, auto

from metrale.frontend.tool_parsers.block_parser import BlockReader
from metrale.frontend.tool_parsers.grammar import (
    GrammarBuilder,
    arguments_schema,
    literal,
    repeat_calls,
)
from metrale.frontend.tool_parsers.json_scanner import JsonScanner, Step
from metrale.frontend.tool_parsers.names import is_valid_name
from metrale.frontend.tool_parsers.schema import ToolSpec
from metrale.frontend.tool_parsers.sink import EventSink
from metrale.frontend.tool_parsers.tags import Match, match_tag, skip_space

ARGUMENT_KEYS = ("arguments", "parameters")
_WHITESPACE = " \t\n\r"


class ArgumentsStream:
    """The arguments value of one call, sent as far as it is known to stay valid JSON.

    An object streams. A string holding an object (double-encoded arguments) is decoded at
    the end; any other value, or a string that holds no object, becomes ``{}``.
    """

    def __init__(self) -> None:
        self._scanner = JsonScanner()
        self._is_object: bool | None = None

    def push(self, ch: str) -> Step:
        if self._is_object is None:
            self._is_object = ch == "{"
        return self._scanner.push(ch)

    @property
    def complete(self) -> bool:
        return self._scanner.complete

    def drain_ready(self) -> str:
        return self._scanner.drain_safe() if self._is_object else ""

    def send_final(self, sink: EventSink) -> None:
        """Send the rest of the value to the open call, noting a repair if it had to be
        closed, normalized or replaced."""
        if self._is_object:
            sink.arguments(self._scanner.drain_rest())
            repaired = not self._scanner.complete
        else:
            decoded = self._decoded_string()
            sink.arguments(decoded or "{}")
            repaired = decoded is None
        if repaired or self._scanner.normalized:
            sink.note_repair()

    def _decoded_string(self) -> str | None:
        """The object that a complete string value holds, as JSON; None if it holds none."""
        if not self._scanner.complete:
            return None
        value = json.loads(self._scanner.text())
        if not isinstance(value, str):
            return None
        try:
            inner = json.loads(value)
        except (ValueError, RecursionError):
            return None
        if not isinstance(inner, dict):
            return None
        try:
            return json.dumps(inner, ensure_ascii=False, allow_nan=False)
        except ValueError:
            return None


class _State(Enum):
    OPEN = auto()  # before '{'
    FIRST_KEY = auto()  # after '{': a key or '}'
    NEXT_KEY = auto()  # after ',': a key
    KEY = auto()
    COLON = auto()
    VALUE_START = auto()
    VALUE = auto()
    AFTER_MEMBER = auto()


class _Push(Enum):
    CONSUMED = auto()
    CLOSED = auto()  # consumed the object's closing brace
    STOPPED = auto()  # not consumed: the object is broken here


class JsonCallReader:
    """Reads one call object from its '{' (leading whitespace allowed).

    With ``known_names``, only a name among them makes the object a call.
    """

    def __init__(self, sink: EventSink, known_names: Collection[str] | None = None) -> None:
        self._sink = sink
        self._known_names = known_names
        self._state = _State.OPEN
        self._scanner = JsonScanner()  # the key or member value being read
        self._member = ""  # the key whose value is being read
        self._name: str | None = None
        self._arguments: ArgumentsStream | None = None
        self._in_arguments = False
        self.committed = False

    def read(self, text: str, pos: int, final: bool) -> tuple[int, bool]:
        """Like `BlockReader.read`; an ended uncommitted reader left no trace in the sink."""
        for at in range(pos, len(text)):
            push = self._push(text[at])
            if push is _Push.STOPPED:
                self._end(closed=False)
                return at, True
            if push is _Push.CLOSED:
                self._end(closed=True)
                return at + 1, True
        if final:
            self._end(closed=False)
            return len(text), True
        if self.committed and self._arguments is not None:
            self._sink.arguments(self._arguments.drain_ready())
        return len(text), False

    def _push(self, ch: str) -> _Push:
        state = self._state
        if state in (_State.KEY, _State.VALUE):
            return self._push_scanned(ch)
        if ch in _WHITESPACE:
            return _Push.CONSUMED
        if state is _State.OPEN:
            return self._go(_State.FIRST_KEY) if ch == "{" else _Push.STOPPED
        if state in (_State.FIRST_KEY, _State.NEXT_KEY):
            if ch == '"':
                self._scanner = JsonScanner()
                self._state = _State.KEY
                return self._push_scanned(ch)
            return _Push.CLOSED if ch == "}" and state is _State.FIRST_KEY else _Push.STOPPED
        if state is _State.COLON:
            return self._go(_State.VALUE_START) if ch == ":" else _Push.STOPPED
        if state is _State.VALUE_START:
            self._start_value()
            return self._push_scanned(ch)
        if ch == ",":  # AFTER_MEMBER
            return self._go(_State.NEXT_KEY)
        return _Push.CLOSED if ch == "}" else _Push.STOPPED

    def _go(self, state: _State) -> _Push:
        self._state = state
        return _Push.CONSUMED

    def _start_value(self) -> None:
        self._state = _State.VALUE
        self._in_arguments = self._member in ARGUMENT_KEYS and self._arguments is None
        if self._in_arguments:
            self._arguments = ArgumentsStream()
        else:
            self._scanner = JsonScanner()

    def _push_scanned(self, ch: str) -> _Push:
        stream = self._arguments if self._in_arguments else self._scanner
        assert stream is not None
        step = stream.push(ch)
        if step is Step.ACCEPTED:
            return _Push.CONSUMED
        if step is Step.COMPLETE:
            self._end_scanned()
            return _Push.CONSUMED
        if stream.complete:  # a number ended at this character, which belongs to the object
            self._end_scanned()
            return self._push(ch)
        return _Push.STOPPED

    def _end_scanned(self) -> None:
        if self._state is _State.KEY:
            self._member = json.loads(self._scanner.text())
            self._state = _State.COLON
            return
        self._state = _State.AFTER_MEMBER
        if self._in_arguments:
            self._in_arguments = False
        elif self._member == "name" and self._name is None:
            name = json.loads(self._scanner.text())
            if (
                isinstance(name, str)
                and is_valid_name(name)
                and (self._known_names is None or name in self._known_names)
            ):
                self._name = name
                self._sink.start_call(name)
                self.committed = True

    def _end(self, closed: bool) -> None:
        if not self.committed:
            return
        if self._arguments is not None:
            self._arguments.send_final(self._sink)
        if not closed:
            self._sink.note_repair()
        self._sink.end_call()


def call_object_grammar(grammar: GrammarBuilder, tool: ToolSpec) -> str:
    """EBNF of one call object, ``{"name": "f", "arguments": {...}}`` (or "parameters", which
    Llama writes), its arguments following the tool's schema."""
    name = literal(f'{{"name": {json.dumps(tool.name, ensure_ascii=False)}, ')
    keys = " | ".join(literal(f'"{key}": ') for key in ARGUMENT_KEYS)
    return f'{name} ({keys}) {grammar.json_value(arguments_schema(tool))} "}}"'


def call_array_grammar(grammar: GrammarBuilder, call: str, *, several: bool) -> str:
    """EBNF of a JSON array of ``call`` (the EBNF of one call object): one element, or with
    ``several`` one or more, comma-separated as ``json.dumps`` writes them."""
    elements = repeat_calls(grammar, call, several=several, separator='"," " "?')
    return f'"[" {elements} "]"'


class JsonCallBlock(BlockReader):
    """A block holding one call object, then its closing tag if the format has one."""

    def __init__(
        self, sink: EventSink, closer: str | None, known_names: Collection[str] | None = None
    ) -> None:
        self._call: JsonCallReader | None = JsonCallReader(sink, known_names)
        self._closer = closer
        self._committed = False
        self.closed = None if closer is None else False

    @property
    def committed(self) -> bool:  # type: ignore[override]
        return self._committed or (self._call is not None and self._call.committed)

    def read(self, text: str, pos: int, final: bool) -> tuple[int, bool]:
        if self._call is not None:
            pos, ended = self._call.read(text, pos, final)
            if not ended:
                return pos, False
            self._committed = self._call.committed
            self._call = None
            if not self._committed:
                return pos, True
        if self._closer is None:
            return pos, True
        after_space = skip_space(text, pos)
        match = match_tag(text, after_space, self._closer, final)
        if match is Match.YES:
            self.closed = True
            return after_space + len(self._closer), True
        return pos, match is Match.NO


class _ArrayState(Enum):
    OPEN = auto()  # before '['
    FIRST = auto()  # after '[': an element or ']'
    NEXT = auto()  # after ',': an element
    ELEMENT = auto()
    AFTER_ELEMENT = auto()


class JsonCallArray(BlockReader):
    """A JSON array of call objects. Elements that are not calls are skipped (and not
    counted); the array ends at its ']' (closed) or at the first character that does not fit.
    """

    def __init__(self, sink: EventSink, known_names: Collection[str] | None = None) -> None:
        self._sink = sink
        self._known_names = known_names
        self._state = _ArrayState.OPEN
        self._element: JsonCallReader | None = None
        self._committed = False
        self.closed = False

    @property
    def committed(self) -> bool:  # type: ignore[override]
        return self._committed or (self._element is not None and self._element.committed)

    def read(self, text: str, pos: int, final: bool) -> tuple[int, bool]:
        while True:
            if self._element is not None:
                pos, ended = self._element.read(text, pos, final)
                if not ended:
                    return pos, False
                self._committed = self.committed
                self._element = None
                self._state = _ArrayState.AFTER_ELEMENT
            pos = skip_space(text, pos)
            if pos == len(text):
                return pos, final
            ch, state = text[pos], self._state
            if state is _ArrayState.OPEN and ch == "[":
                self._state = _ArrayState.FIRST
                pos += 1
            elif state in (_ArrayState.FIRST, _ArrayState.NEXT) and ch == "{":
                self._element = JsonCallReader(self._sink, self._known_names)
            elif state in (_ArrayState.FIRST, _ArrayState.AFTER_ELEMENT) and ch == "]":
                self.closed = True
                return pos + 1, True
            elif state is _ArrayState.AFTER_ELEMENT and ch == ",":
                self._state = _ArrayState.NEXT
                pos += 1
            else:
                return pos, True


class JsonCallsBlock(BlockReader):
    """A call object, or an array of them, after optional whitespace."""

    def __init__(self, sink: EventSink, known_names: Collection[str] | None = None) -> None:
        self._sink = sink
        self._known_names = known_names
        self._inner: BlockReader | None = None

    @property
    def committed(self) -> bool:  # type: ignore[override]
        return self._inner is not None and self._inner.committed

    @property
    def closed(self) -> bool | None:  # type: ignore[override]
        return self._inner.closed if self._inner is not None else None

    def read(self, text: str, pos: int, final: bool) -> tuple[int, bool]:
        if self._inner is None:
            start = skip_space(text, pos)
            if start == len(text):
                return pos, final
            if text[start] == "[":
                self._inner = JsonCallArray(self._sink, self._known_names)
            else:
                self._inner = JsonCallBlock(self._sink, None, self._known_names)
            pos = start
        return self._inner.read(text, pos, final)
