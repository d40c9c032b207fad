"""Where a parser's readers put their events; it numbers the calls and guards the invariants.

Readers only say "content", "a call named X starts", "these argument characters", "the call
ended". The sink assigns indexes and ids, merges adjacent pieces, and makes sure every call
ends with a JSON object: ``{}`` if no arguments were written.
"""

from __future__ import annotations

from metrale.frontend.tool_parsers.base import (
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

    @property
    def call_open(self) -> bool:
        return self._open_arguments is not None

    def content(self, text: str) -> None:
        if not text:
            return
        if self._events and isinstance(self._events[-1], ContentDelta):
            text = self._events.pop().text + text
        self._events.append(ContentDelta(text))

    def start_call(self, name: str) -> None:
        if self._open_arguments is not None:
            raise RuntimeError("a tool call started while another is open")
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

    def close_open_call(self) -> None:
        """End the open call, if any, after a parser fault: append closers to its arguments.

        Readers send arguments only up to safe points, so closers always suffice.
        """
        if self._open_arguments is None:
            return
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
