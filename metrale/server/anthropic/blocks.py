"""One reply's content blocks, in Anthropic's shape.

The parts of `reply_parts.py` become blocks: reasoning a `thinking` block, text a `text` block,
a tool call a `tool_use` block. `feed` returns the stream events they settle:
`content_block_start`, `content_block_delta` (`thinking_delta`, `text_delta`, `input_json_delta`,
and a `signature_delta` as a thinking block closes) and `content_block_stop`. The streaming
route sends them; the non-streaming route reads `content`. Indices count blocks from 0.
"""

from __future__ import annotations

import json
import uuid
from typing import Any

from metrale.frontend.chat_output import ToolCallDelta
from metrale.server.reply_parts import Event, PartKind, ReplyParts


class ReplyBlocks(ReplyParts):
    def __init__(self) -> None:
        super().__init__()
        self.content: list[dict[str, Any]] = []  # the blocks so far, in the response's shape
        self._arguments_text: list[str] = []  # the open tool call's JSON pieces

    def opened(self, kind: PartKind, call: ToolCallDelta | None) -> list[Event]:
        if kind == "reasoning":
            block: dict[str, Any] = {"type": "thinking", "thinking": "", "signature": ""}
            start = dict(block)
        elif kind == "text":
            block = {"type": "text", "text": ""}
            start = dict(block)
        else:
            # The parser's ids are OpenAI-style (call_...); Anthropic clients expect toolu_ ones.
            assert call is not None
            block = {"type": "tool_use", "id": f"toolu_{uuid.uuid4().hex[:24]}", "name": call.name}
            start = {**block, "input": {}}
            self._arguments_text = []
        self.content.append(block)
        return [
            {"type": "content_block_start", "index": len(self.content) - 1, "content_block": start}
        ]

    def grown(self, kind: PartKind, text: str) -> list[Event]:
        block = self.content[-1]
        if kind == "reasoning":
            block["thinking"] += text
            return [self._delta({"type": "thinking_delta", "thinking": text})]
        if kind == "text":
            block["text"] += text
            return [self._delta({"type": "text_delta", "text": text})]
        self._arguments_text.append(text)
        return [self._delta({"type": "input_json_delta", "partial_json": text})]

    def closed(self, kind: PartKind) -> list[Event]:
        events = []
        if kind == "reasoning":
            # Anthropic ends every thinking block with its signature; there is nothing to sign
            # here, and an empty one keeps the stream in the shape clients know.
            events.append(self._delta({"type": "signature_delta", "signature": ""}))
        elif kind == "tool_call":
            self.content[-1]["input"] = json.loads("".join(self._arguments_text) or "{}")
        return [*events, {"type": "content_block_stop", "index": len(self.content) - 1}]

    def _delta(self, delta: dict[str, Any]) -> Event:
        return {"type": "content_block_delta", "index": len(self.content) - 1, "delta": delta}
