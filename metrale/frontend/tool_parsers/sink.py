"""Where a parser's readers put their events; it numbers the calls and guards the invariants.

Readers only say "content", "a call named X starts", "these argument characters", "the call
ended". The sink assigns indexes and ids, merges adjacent pieces, and makes sure every call
ends with a JSON object: ``{}`` if no arguments were written.

It also keeps the outcome tally. A call counts as parsed unless a reader notes a repair; the
last call started stays unsettled, open to such a note, until the next call starts or the
parser settles it at the end of its block. So at any moment every call started is either in
``call_outcomes`` (by index) or the one unsettled call.
"""

from __future__ import annotations

from metrale.frontend.tool_parsers.base import (
    CallOutcome,
    ContentDelta,
    Event,
    ToolCallArguments,
    ToolCallStart,
)
from metrale.frontend.tool_parsers.json_scanner import JsonScanner, Step


class EventSink:
    def __init__(self, id_prefix: str) -> None:
        self._id_prefix = id_prefix
        self._events: list[Event] = []
        self._num_calls = 0
        # The open call's argument pieces so far; None while no call is open.
        self._open_arguments: list[str] | None = None
        self.call_outcomes: list[CallOutcome] = []  # of the settled calls, by index
        self._unsettled: CallOutcome | None = None  # the last call's outcome, until settled
        self.num_text_outcomes = 0

    @property
    def call_open(self) -> bool:
        return self._open_arguments is not None

    def content(self, text: str) -> None:
        if not text:
            return
        if self._events and isinstance(self._events[-1], ContentDelta):
            text = self._events.pop().text + text
        self._events.append(ContentDelta(text))

    def left_as_text(self, text: str) -> None:
        """The raw text of a block that started no call: content, and one TEXT outcome."""
        self.content(text)
        self.num_text_outcomes += 1

    def start_call(self, name: str) -> None:
        if self._open_arguments is not None:
            raise RuntimeError("a tool call started while another is open")
        self.settle()
        self._unsettled = CallOutcome.PARSED
        index = self._num_calls
        self._events.append(ToolCallStart(index, f"{self._id_prefix}{index}", name))
        self._open_arguments = []

    def arguments(self, text: str) -> None:
        if self._open_arguments is None:
            raise RuntimeError("tool-call arguments with no open call")
        if not text:
            return
        self._open_arguments.append(text)
        last = self._events[-1] if self._events else None
        if isinstance(last, ToolCallArguments):
            self._events[-1] = ToolCallArguments(last.index, last.text + text)
        else:
            self._events.append(ToolCallArguments(self._num_calls, text))

    def end_call(self) -> None:
        if self._open_arguments is None:
            raise RuntimeError("end of a tool call with no open call")
        if not self._open_arguments:
            self.arguments("{}")
        self._open_arguments = None
        self._num_calls += 1

    def note_repair(self) -> None:
        """The open call, or the last one ended while it is unsettled, needed repair."""
        if self._unsettled is None:
            raise RuntimeError("a tool-call repair with no unsettled call")
        self._unsettled = CallOutcome.REPAIRED

    def settle(self, *, repaired: bool = False) -> None:
        """Count the last call's outcome, if it is unsettled (as REPAIRED with ``repaired``):
        nothing read from now on can change it."""
        if self._open_arguments is not None:
            raise RuntimeError("a tool call settled while it is open")
        if self._unsettled is not None:
            self.call_outcomes.append(CallOutcome.REPAIRED if repaired else self._unsettled)
            self._unsettled = None

    def close_open_call(self) -> None:
        """End the open call, if any, after a parser fault: append closers to its arguments.

        Readers send arguments only up to safe points, so closers always suffice.
        """
        if self._open_arguments is None:
            return
        self.note_repair()
        scanner = JsonScanner()
        for ch in "".join(self._open_arguments):
            if scanner.push(ch) is Step.REJECTED:
                break
        if not scanner.complete:
            self.arguments(scanner.drain_rest()[len("".join(self._open_arguments)) :])
        self.end_call()

    def take(self) -> list[Event]:
        events, self._events = self._events, []
        return events
