"""A JSON value, validated one character at a time, with the closers that would end it.

Streaming JSON arguments means sending a prefix before the value is complete. `JsonScanner`
tracks the last *safe point*: a prefix that becomes valid JSON by appending closing characters
only (a quote, then brackets and braces). Text is released only up to safe points, so a value
cut short by the end of generation, or broken by a stray character, is repaired by appending
those closers: never by retracting what was sent.

The scanner also normalizes: raw control characters inside strings are escaped, and an invalid
escape such as ``\\U`` (a Windows path) is read as a literal backslash. Its output is therefore
always valid for a strict JSON parser, and identical however the input was split;
``normalized`` says whether it differs from the input (the model wrote invalid JSON).
"""

from __future__ import annotations

from enum import Enum, auto

# Deeper nesting is treated as malformed: no real arguments nest this far.
MAX_DEPTH = 64

_WHITESPACE = " \t\n\r"
_HEX = "0123456789abcdefABCDEF"
_SIMPLE_ESCAPES = '"\\/bfnrt'
_CONTROL_ESCAPES = {"\b": "\\b", "\f": "\\f", "\n": "\\n", "\r": "\\r", "\t": "\\t"}
_LITERALS = {"t": "true", "f": "false", "n": "null"}


class Step(Enum):
    ACCEPTED = auto()
    COMPLETE = auto()  # the character was consumed and finished the value
    REJECTED = auto()  # not consumed: the value ended before it (a number) or it is invalid


class _State(Enum):
    VALUE = auto()  # a value must start
    OBJECT_FIRST = auto()  # after '{': a key or '}'
    OBJECT_KEY = auto()  # after ',' in an object: a key
    COLON = auto()
    AFTER_VALUE = auto()  # inside a container: ',' or its closer
    ARRAY_FIRST = auto()  # after '[': a value or ']'
    STRING = auto()
    ESCAPE = auto()
    UNICODE = auto()
    NUMBER = auto()
    LITERAL = auto()
    DONE = auto()


class _Num(Enum):
    MINUS = auto()
    ZERO = auto()
    INT = auto()
    DOT = auto()
    FRACTION = auto()
    EXP_MARK = auto()
    EXP_SIGN = auto()
    EXPONENT = auto()


_NUMBER_ENDS = frozenset({_Num.ZERO, _Num.INT, _Num.FRACTION, _Num.EXPONENT})


class JsonScanner:
    """Reads one JSON value; knows at every step whether and how it could be closed.

    The normalized text is kept as pieces; `drain_safe` hands out the text up to the last
    safe point and `drain_rest` everything, so a long value is never copied twice.
    """

    def __init__(self) -> None:
        self._pieces: list[str] = []
        self._num_drained = 0  # pieces handed out by drain_*; they are dropped
        self._state = _State.VALUE
        self._closers = ""  # the closing brackets for the open containers, innermost first
        self._in_key = False
        self._number = _Num.MINUS
        self._literal_rest = ""
        self._unicode_digits = ""
        self.complete = False
        self.normalized = False  # a raw control character or a bad escape was rewritten
        self._safe_count = 0  # pieces (drained included) at the last safe point
        self._safe_suffix: str | None = None  # what closes the text at the last safe point

    def push(self, ch: str) -> Step:
        step = self._step(ch)
        if step is not Step.REJECTED:
            self._note_safe_point()
        return step

    def text(self) -> str:
        """All normalized text; only for scanners that were never drained."""
        return "".join(self._pieces)

    def drain_safe(self) -> str:
        """Text up to the last safe point not handed out yet."""
        return self._drain(self._safe_count)

    def drain_rest(self) -> str:
        """What is left: all of it if the value is complete, else up to the last safe point
        followed by the closers that make it valid. Empty if it never reached a safe point."""
        if self.complete:
            return self._drain(self._num_drained + len(self._pieces))
        if self._safe_suffix is None:
            return ""
        return self._drain(self._safe_count) + self._safe_suffix

    def _drain(self, upto: int) -> str:
        num_new = upto - self._num_drained
        if num_new <= 0:
            return ""
        text = "".join(self._pieces[:num_new])
        del self._pieces[:num_new]
        self._num_drained = upto
        return text

    def _emit(self, piece: str) -> None:
        self._pieces.append(piece)

    def _note_safe_point(self) -> None:
        state = self._state
        if state in (_State.OBJECT_FIRST, _State.ARRAY_FIRST, _State.AFTER_VALUE, _State.DONE):
            suffix = self._closers
        elif state is _State.STRING and not self._in_key:
            suffix = '"' + self._closers
        elif state is _State.NUMBER and self._number in _NUMBER_ENDS:
            suffix = self._closers
        else:
            return
        self._safe_count = self._num_drained + len(self._pieces)
        self._safe_suffix = suffix

    def _step(self, ch: str) -> Step:
        state = self._state
        if state is _State.STRING:
            return self._string_char(ch)
        if state is _State.ESCAPE:
            return self._escape_char(ch)
        if state is _State.UNICODE:
            return self._unicode_char(ch)
        if state is _State.NUMBER:
            return self._number_char(ch)
        if state is _State.LITERAL:
            if ch != self._literal_rest[0]:
                return Step.REJECTED
            self._emit(ch)
            self._literal_rest = self._literal_rest[1:]
            return self._end_value() if not self._literal_rest else Step.ACCEPTED
        if state is _State.DONE:
            return Step.REJECTED
        if ch in _WHITESPACE:
            self._emit(ch)
            return Step.ACCEPTED
        if state is _State.VALUE:
            return self._value_start(ch)
        if state is _State.ARRAY_FIRST:
            return self._close(ch) if ch == "]" else self._value_start(ch)
        if state in (_State.OBJECT_FIRST, _State.OBJECT_KEY):
            if ch == '"':
                self._emit(ch)
                self._in_key = True
                self._state = _State.STRING
                return Step.ACCEPTED
            return self._close(ch) if ch == "}" and state is _State.OBJECT_FIRST else Step.REJECTED
        if state is _State.COLON:
            if ch != ":":
                return Step.REJECTED
            self._emit(ch)
            self._state = _State.VALUE
            return Step.ACCEPTED
        # AFTER_VALUE
        if ch == ",":
            self._emit(ch)
            self._state = _State.OBJECT_KEY if self._closers[0] == "}" else _State.VALUE
            return Step.ACCEPTED
        return self._close(ch)

    def _value_start(self, ch: str) -> Step:
        if ch in "{[":
            if len(self._closers) >= MAX_DEPTH:
                return Step.REJECTED
            self._emit(ch)
            self._closers = ("}" if ch == "{" else "]") + self._closers
            self._state = _State.OBJECT_FIRST if ch == "{" else _State.ARRAY_FIRST
            return Step.ACCEPTED
        if ch == '"':
            self._emit(ch)
            self._in_key = False
            self._state = _State.STRING
            return Step.ACCEPTED
        if ch == "-" or "0" <= ch <= "9":
            self._emit(ch)
            self._number = _Num.MINUS if ch == "-" else _Num.ZERO if ch == "0" else _Num.INT
            self._state = _State.NUMBER
            return Step.ACCEPTED
        if ch in _LITERALS:
            self._emit(ch)
            self._literal_rest = _LITERALS[ch][1:]
            self._state = _State.LITERAL
            return Step.ACCEPTED
        return Step.REJECTED

    def _close(self, ch: str) -> Step:
        if not self._closers or ch != self._closers[0]:
            return Step.REJECTED
        self._emit(ch)
        self._closers = self._closers[1:]
        return self._end_value()

    def _end_value(self) -> Step:
        if self._closers:
            self._state = _State.AFTER_VALUE
            return Step.ACCEPTED
        self._state = _State.DONE
        self.complete = True
        return Step.COMPLETE

    def _string_char(self, ch: str) -> Step:
        if ch == '"':
            self._emit(ch)
            if self._in_key:
                self._in_key = False
                self._state = _State.COLON
                return Step.ACCEPTED
            return self._end_value()
        if ch == "\\":
            self._state = _State.ESCAPE
        elif ch < " ":
            self._emit(_CONTROL_ESCAPES.get(ch) or f"\\u{ord(ch):04x}")
            self.normalized = True
        else:
            self._emit(ch)
        return Step.ACCEPTED

    def _escape_char(self, ch: str) -> Step:
        if ch in _SIMPLE_ESCAPES:
            self._emit("\\" + ch)
            self._state = _State.STRING
            return Step.ACCEPTED
        if ch == "u":
            self._unicode_digits = ""
            self._state = _State.UNICODE
            return Step.ACCEPTED
        self._emit("\\\\")  # not a JSON escape: the backslash was meant literally
        self.normalized = True
        self._state = _State.STRING
        return self._string_char(ch)

    def _unicode_char(self, ch: str) -> Step:
        if ch in _HEX:
            self._unicode_digits += ch
            if len(self._unicode_digits) == 4:
                self._emit("\\u" + self._unicode_digits)
                self._state = _State.STRING
            return Step.ACCEPTED
        self._emit("\\\\u" + self._unicode_digits)  # a broken \u escape, kept as text
        self.normalized = True
        self._state = _State.STRING
        return self._string_char(ch)

    def _number_char(self, ch: str) -> Step:
        digit = "0" <= ch <= "9"
        num = self._number
        nxt: _Num | None = None
        if num is _Num.MINUS:
            nxt = _Num.ZERO if ch == "0" else _Num.INT if digit else None
        elif num in (_Num.ZERO, _Num.INT):
            if digit and num is _Num.INT:
                nxt = _Num.INT
            elif ch == ".":
                nxt = _Num.DOT
            elif ch in "eE":
                nxt = _Num.EXP_MARK
        elif num in (_Num.DOT, _Num.FRACTION):
            if digit:
                nxt = _Num.FRACTION
            elif ch in "eE" and num is _Num.FRACTION:
                nxt = _Num.EXP_MARK
        elif num is _Num.EXP_MARK:
            nxt = _Num.EXP_SIGN if ch in "+-" else _Num.EXPONENT if digit else None
        else:  # EXP_SIGN, EXPONENT
            nxt = _Num.EXPONENT if digit else None
        if nxt is not None:
            self._emit(ch)
            self._number = nxt
            return Step.ACCEPTED
        if num not in _NUMBER_ENDS:
            return Step.REJECTED
        if self._closers:  # the number ended; the character belongs to the container
            self._state = _State.AFTER_VALUE
            return self._step(ch)
        self._state = _State.DONE
        self.complete = True
        return Step.REJECTED
