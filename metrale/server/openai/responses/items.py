"""One response's output items, in the Responses API's shape.

The parts of `reply_parts.py` become items: reasoning a `reasoning` item, text a `message` item
holding one `output_text` part, a tool call a `function_call` item. `feed` returns the stream
events they settle, in the order of OpenAI's streaming reference:

    response.output_item.added
      message:        response.content_part.added, response.output_text.delta...,
                      response.output_text.done, response.content_part.done
      reasoning:      response.content_part.added (a reasoning_text part),
                      response.reasoning_text.delta..., response.reasoning_text.done,
                      response.content_part.done
                      or, when the request asked for a summary (`reasoning.summary`):
                      response.reasoning_summary_part.added,
                      response.reasoning_summary_text.delta...,
                      response.reasoning_summary_text.done, response.reasoning_summary_part.done
      function_call:  response.function_call_arguments.delta...,
                      response.function_call_arguments.done
    response.output_item.done (carrying the whole item)

The model's thinking is the only summary there is, so with a summary asked for it is given as
the summary (what Codex shows) and not a second time as content. With
`include: ["reasoning.encrypted_content"]` a reasoning item also carries its text, encoded, in
`encrypted_content`, so clients that keep only that field (stateless clients do) give the model
its thinking back on the next turn (`translate.decode_reasoning`). The route numbers the events.
"""

from __future__ import annotations

import copy
import uuid
from typing import Any

from metrale.frontend.chat_output import ToolCallDelta
from metrale.server.openai.responses.translate import ToolSet, encode_reasoning
from metrale.server.reply_parts import Event, PartKind, ReplyParts


def item_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


class ResponseItems(ReplyParts):
    def __init__(self, tools: ToolSet, *, summary: bool, encrypted: bool) -> None:
        super().__init__()
        self.output: list[dict[str, Any]] = []  # the items so far, in the response's shape
        self._tools = tools
        self._summary = summary
        self._encrypted = encrypted

    @property
    def output_text(self) -> str:
        return "".join(
            part["text"]
            for item in self.output
            if item["type"] == "message"
            for part in item["content"]
        )

    def finish(self, status: str = "completed") -> list[Event]:
        """Close the open item with `status` (`incomplete` when the reply was cut short)."""
        if self.output and self._open is not None:
            self.output[-1]["status"] = status
        return super().finish()

    # -- the parts as items --------------------------------------------------------------------

    def opened(self, kind: PartKind, call: ToolCallDelta | None) -> list[Event]:
        if kind == "reasoning":
            item: dict[str, Any] = {"id": item_id("rs"), "type": "reasoning", "summary": []}
            if not self._summary:
                item["content"] = []
        elif kind == "text":
            item = {"id": item_id("msg"), "type": "message", "role": "assistant", "content": []}
        else:
            assert call is not None and call.name is not None and call.id is not None
            namespace, name = self._tools.call_name(call.name)
            item = {
                "id": item_id("fc"),
                "type": "function_call",
                "call_id": call.id,
                "name": name,
                "arguments": "",
            }
            if namespace is not None:
                item["namespace"] = namespace
        item["status"] = "in_progress"
        self.output.append(item)
        events = [self._event("response.output_item.added", item=_copy(item))]
        if kind == "reasoning" and self._summary:
            part = {"type": "summary_text", "text": ""}
            item["summary"].append(part)
            events.append(
                self._item_event(
                    "response.reasoning_summary_part.added", summary_index=0, part=dict(part)
                )
            )
        elif kind != "tool_call":
            part = {"type": "reasoning_text", "text": ""}
            if kind == "text":
                part = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
            item["content"].append(part)
            events.append(
                self._item_event("response.content_part.added", content_index=0, part=_copy(part))
            )
        return events

    def grown(self, kind: PartKind, text: str) -> list[Event]:
        item = self.output[-1]
        if kind == "tool_call":
            item["arguments"] += text
            return [self._item_event("response.function_call_arguments.delta", delta=text)]
        if kind == "reasoning" and self._summary:
            item["summary"][0]["text"] += text
            return [
                self._item_event(
                    "response.reasoning_summary_text.delta", summary_index=0, delta=text
                )
            ]
        item["content"][0]["text"] += text
        if kind == "reasoning":
            return [self._item_event("response.reasoning_text.delta", content_index=0, delta=text)]
        return [
            self._item_event("response.output_text.delta", content_index=0, delta=text, logprobs=[])
        ]

    def closed(self, kind: PartKind) -> list[Event]:
        item = self.output[-1]
        if item["status"] == "in_progress":
            item["status"] = "completed"
        if kind == "tool_call":
            events = [
                self._item_event(
                    "response.function_call_arguments.done",
                    name=item["name"],
                    arguments=item["arguments"],
                )
            ]
        elif kind == "reasoning" and self._summary:
            part = item["summary"][0]
            events = [
                self._item_event(
                    "response.reasoning_summary_text.done", summary_index=0, text=part["text"]
                ),
                self._item_event(
                    "response.reasoning_summary_part.done", summary_index=0, part=dict(part)
                ),
            ]
        else:
            part = item["content"][0]
            done = "response.output_text.done" if kind == "text" else "response.reasoning_text.done"
            extra = {"logprobs": []} if kind == "text" else {}
            events = [
                self._item_event(done, content_index=0, text=part["text"], **extra),
                self._item_event("response.content_part.done", content_index=0, part=_copy(part)),
            ]
        if kind == "reasoning" and self._encrypted:
            item["encrypted_content"] = encode_reasoning(_reasoning_of(item))
        events.append(self._event("response.output_item.done", item=_copy(item)))
        return events

    # -- events --------------------------------------------------------------------------------

    def _event(self, kind: str, **fields: Any) -> Event:
        return {"type": kind, "output_index": len(self.output) - 1, **fields}

    def _item_event(self, kind: str, **fields: Any) -> Event:
        return self._event(kind, item_id=self.output[-1]["id"], **fields)


def _reasoning_of(item: dict[str, Any]) -> str:
    parts = item.get("content") or item["summary"]
    return "".join(part["text"] for part in parts)


def _copy(value: dict[str, Any]) -> dict[str, Any]:
    """A snapshot for an event: the item goes on growing after it is sent."""
    return copy.deepcopy(value)
