"""One reply's content blocks, opened and closed as the chat output parser splits the text.

`feed` takes each parsed delta (reasoning, content, tool calls) and returns the Anthropic
stream events it settles: `content_block_start`, `content_block_delta` (`thinking_delta`,
`text_delta`, `input_json_delta`, and a `signature_delta` as a thinking block closes) and
`content_block_stop`. The streaming route sends them; the non-streaming route reads `content`.
One state machine serves both, so a streamed reply and a whole one have the same blocks.

What stays true: at most one block is open, the last one; indices count blocks from 0; a block
opens only when it has something to hold, and a text block only once non-whitespace text
arrives (Anthropic refuses whitespace-only text blocks when a client sends the history back).
"""

from __future__ import annotations

import json
import uuid
from typing import Any

from metrale.frontend.chat_output import ChatDelta, ToolCallDelta

Event = dict[str, Any]


class ReplyBlocks:
    def __init__(self) -> None:
        self.content: list[dict[str, Any]] = []  # the blocks so far, in the response's shape
        self.num_tool_calls = 0
        self._open: str | None = None  # the open block's type
        self._open_call: int | None = None  # the parser's index of the open tool call
        self._arguments: list[str] = []  # the open tool call's JSON pieces
        self._pending_space = ""  # whitespace that opens no text block on its own

    def feed(self, delta: ChatDelta) -> list[Event]:
        # A delta's parts lose their relative order; this order is the one text is written
        # in: a call already open continues first (nothing can come before its end), then
        # reasoning, then the content before any new call, then the new calls.
        events: list[Event] = []
        calls = list(delta.tool_calls)
        while calls and calls[0].name is None and calls[0].index == self._open_call:
            events += self._arguments_delta(calls.pop(0).arguments)
        if delta.reasoning:
            events += self._thinking(delta.reasoning)
        if delta.content:
            events += self._text(delta.content)
        for call in calls:
            if call.name is not None:
                events += self._open_tool_use(call)
            events += self._arguments_delta(call.arguments)
        return events

    def finish(self) -> list[Event]:
        """Close the open block; the reply is complete."""
        return self._close()

    def _thinking(self, text: str) -> list[Event]:
        events = []
        if self._open != "thinking":
            events = self._open_block({"type": "thinking", "thinking": "", "signature": ""})
        self.content[-1]["thinking"] += text
        return [*events, self._delta({"type": "thinking_delta", "thinking": text})]

    def _text(self, text: str) -> list[Event]:
        events = []
        if self._open != "text":
            self._pending_space += text
            if not self._pending_space.strip():
                return []
            text, self._pending_space = self._pending_space, ""
            events = self._open_block({"type": "text", "text": ""})
        self.content[-1]["text"] += text
        return [*events, self._delta({"type": "text_delta", "text": text})]

    def _open_tool_use(self, call: ToolCallDelta) -> list[Event]:
        # The parser's ids are OpenAI-style (call_...); Anthropic clients expect toolu_ ones.
        self.num_tool_calls += 1
        events = self._open_block(
            {"type": "tool_use", "id": f"toolu_{uuid.uuid4().hex[:24]}", "name": call.name}
        )
        self._open_call, self._arguments = call.index, []
        return events

    def _arguments_delta(self, text: str) -> list[Event]:
        if not text or self._open != "tool_use":  # the parser starts every call it continues
            return []
        self._arguments.append(text)
        return [self._delta({"type": "input_json_delta", "partial_json": text})]

    def _open_block(self, block: dict[str, Any]) -> list[Event]:
        events = self._close()
        self._open = block["type"]
        self.content.append(block)
        start = {**block, "input": {}} if block["type"] == "tool_use" else dict(block)
        return [
            *events,
            {"type": "content_block_start", "index": len(self.content) - 1, "content_block": start},
        ]

    def _close(self) -> list[Event]:
        self._pending_space = ""
        if self._open is None:
            return []
        events = []
        block = self.content[-1]
        if self._open == "thinking":
            # Anthropic ends every thinking block with its signature; there is nothing to sign
            # here, and an empty one keeps the stream in the shape clients know.
            events.append(self._delta({"type": "signature_delta", "signature": ""}))
        elif self._open == "tool_use":
            block["input"] = json.loads("".join(self._arguments) or "{}")
            self._open_call = None
        self._open = None
        return [*events, {"type": "content_block_stop", "index": len(self.content) - 1}]

    def _delta(self, delta: dict[str, Any]) -> Event:
        return {"type": "content_block_delta", "index": len(self.content) - 1, "delta": delta}
