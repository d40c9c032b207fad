"""A reply's parts (reasoning, text, tool calls), opened and closed as the chat output parser
splits the text; each API names them its own way.

`feed` takes each parsed delta and returns the stream events it settles; `finish` closes the
open part. Anthropic's content blocks (`anthropic/blocks.py`) and the Responses API's output
items (`openai/responses/items.py`) are subclasses that say what opening, growing and closing a
part sends, so both APIs split a reply the same way, streamed or whole.

What stays true: at most one part is open, the last one; a part opens only when it has something
to hold, and a text part only once non-whitespace text arrives (Anthropic refuses
whitespace-only text blocks when a client sends the history back, and an empty message item
helps no one); a tool call's argument pieces go to the call they continue.
"""

from __future__ import annotations

import abc
from typing import Any, Literal

from metrale.frontend.chat_output import ChatDelta, ToolCallDelta

Event = dict[str, Any]
PartKind = Literal["reasoning", "text", "tool_call"]


class ReplyParts(abc.ABC):
    def __init__(self) -> None:
        self.num_tool_calls = 0
        self._open: PartKind | None = None  # the open part's kind
        self._open_call: int | None = None  # the parser's index of the open tool call
        self._pending_space = ""  # whitespace that opens no text part on its own

    def feed(self, delta: ChatDelta) -> list[Event]:
        # A delta's parts lose their relative order; this order is the one text is written
        # in: a call already open continues first (nothing can come before its end), then
        # reasoning, then the content before any new call, then the new calls.
        events: list[Event] = []
        calls = list(delta.tool_calls)
        while calls and calls[0].name is None and calls[0].index == self._open_call:
            events += self._arguments(calls.pop(0).arguments)
        if delta.reasoning:
            if self._open != "reasoning":
                events += self._switch("reasoning")
            events += self.grown("reasoning", delta.reasoning)
        if delta.content:
            events += self._text(delta.content)
        for call in calls:
            if call.name is not None:
                self.num_tool_calls += 1
                events += self._switch("tool_call", call)
                self._open_call = call.index
            events += self._arguments(call.arguments)
        return events

    def finish(self) -> list[Event]:
        """Close the open part; the reply is complete."""
        return self._close()

    # -- what each API sends -------------------------------------------------------------------

    @abc.abstractmethod
    def opened(self, kind: PartKind, call: ToolCallDelta | None) -> list[Event]:
        """A part of `kind` begins (`call`: the tool call's id and name, for a tool call)."""

    @abc.abstractmethod
    def grown(self, kind: PartKind, text: str) -> list[Event]:
        """The open part gains `text` (for a tool call, a piece of its JSON arguments)."""

    @abc.abstractmethod
    def closed(self, kind: PartKind) -> list[Event]:
        """The open part ends."""

    # -- the state machine ---------------------------------------------------------------------

    def _text(self, text: str) -> list[Event]:
        events = []
        if self._open != "text":
            self._pending_space += text
            if not self._pending_space.strip():
                return []
            text, self._pending_space = self._pending_space, ""
            events = self._switch("text")
        return [*events, *self.grown("text", text)]

    def _arguments(self, text: str) -> list[Event]:
        if not text or self._open != "tool_call":  # the parser starts every call it continues
            return []
        return self.grown("tool_call", text)

    def _switch(self, kind: PartKind, call: ToolCallDelta | None = None) -> list[Event]:
        events = self._close()
        self._open = kind
        return [*events, *self.opened(kind, call)]

    def _close(self) -> list[Event]:
        self._pending_space = ""
        kind, self._open, self._open_call = self._open, None, None
        return [] if kind is None else self.closed(kind)
