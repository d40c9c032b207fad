"""One response as it is generated: its items, its token counts, its status, and the
`response` object that reports them.

The status is `queued` (a background response not started), `in_progress`, then one of
`completed`; `incomplete` (`incomplete_details.reason` `max_output_tokens`: the token limit or
the context window cut the reply short); `failed` (an `error` with a code: the engine's failure,
a timeout, `context_length_exceeded`); or `cancelled` (a background response cancelled, or a
stream whose client left).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from typing import Any

from metrale.frontend.chat_output import ChatOutputParser
from metrale.frontend.output_processor import CompletionDelta
from metrale.server.errors import APIError
from metrale.server.generation import PreparedPrompt, Usage
from metrale.server.openai.responses.items import ResponseItems
from metrale.server.openai.responses.protocol import ResponsesRequest
from metrale.server.openai.responses.translate import ToolSet
from metrale.server.reply_parts import Event
from metrale.server.security.guard import Admission

FINAL_EVENTS = {
    "completed": "response.completed",
    "incomplete": "response.incomplete",
    "failed": "response.failed",
    "cancelled": "response.failed",
}
ENCRYPTED_REASONING = "reasoning.encrypted_content"


class ResponseRun:
    def __init__(
        self,
        response_id: str,
        body: ResponsesRequest,
        model: str,
        tools: ToolSet,
        prompt: PreparedPrompt | None = None,
        parser: ChatOutputParser | None = None,
    ) -> None:
        self.id, self.body, self.model, self.tools = response_id, body, model, tools
        self.prompt, self.parser = prompt, parser
        reasoning = body.reasoning
        self.items = ResponseItems(
            tools,
            summary=reasoning is not None
            and (reasoning.summary or reasoning.generate_summary) is not None,
            encrypted=ENCRYPTED_REASONING in (body.include or []),
        )
        self.usage = Usage(prompt_tokens=len(prompt.prompt_token_ids) if prompt else 0)
        self.compacted: dict[str, Any] = {}  # usage.compacted, once the prompt is planned
        self.created_at = int(time.time())
        self.completed_at: int | None = None
        self.status = "queued" if body.background else "in_progress"
        self.error: dict[str, Any] | None = None
        self.finish_reason: str | None = None
        self.admission: Admission | None = None  # refunded the tokens not generated
        # A background response's stream events, numbered, for the clients that follow it.
        self.events: list[Event] = []
        self._changed = asyncio.Event()
        self._sequence = 0

    @property
    def done(self) -> bool:
        return self.status not in ("queued", "in_progress")

    def numbered(self, event: Event) -> Event:
        event["sequence_number"] = self._sequence
        self._sequence += 1
        return event

    def log(self, event: Event) -> None:
        """Keep a background response's event for its followers, and wake them."""
        self.events.append(self.numbered(event))
        self._changed.set()
        self._changed = asyncio.Event()

    async def follow(self, after: int = -1) -> AsyncIterator[Event]:
        """The logged events after sequence number `after`, as they come, to the last."""
        i = after + 1
        while True:
            changed = self._changed
            while i < len(self.events):
                yield self.events[i]
                i += 1
            if self.done and i >= len(self.events):
                return
            await changed.wait()

    def add(self, delta: CompletionDelta) -> list[Event]:
        """Take an engine delta; return the item events it settles."""
        assert self.parser is not None
        self.usage.completion_tokens += len(delta.token_ids)
        self.usage.cached_tokens = delta.num_cached_tokens
        events = self.items.feed(self.parser.take(delta))  # which may end the response here
        if delta.finished:
            self.finish_reason = delta.finish_reason
            events += self.items.feed(self.parser.finish())
            cut = delta.finish_reason == "length"
            events += self.items.finish("incomplete" if cut else "completed")
            self.end("incomplete" if cut else "completed")
        return events

    def count_reasoning(self, count: int) -> None:
        self.usage.reasoning_tokens = count

    def end(self, status: str, error: APIError | None = None) -> None:
        self.status = status
        self.completed_at = int(time.time())
        if error is not None:
            self.error = {"code": error.code or _error_code(error), "message": error.message}

    @property
    def final_event(self) -> str:
        return FINAL_EVENTS[self.status]

    def body_dict(self) -> dict[str, Any]:
        """The `response` object, as it stands."""
        body = self.body
        reasoning = body.reasoning
        text_format = body.text.format if body.text is not None else None
        usage = self.usage
        conversation = body.conversation_id
        out: dict[str, Any] = {
            "id": self.id,
            "object": "response",
            "created_at": self.created_at,
            "status": self.status,
            "background": body.background,
            "completed_at": self.completed_at,
            "error": self.error,
            "incomplete_details": {"reason": "max_output_tokens"}
            if self.status == "incomplete"
            else None,
            "instructions": body.instructions,
            "max_output_tokens": body.max_output_tokens,
            "max_tool_calls": body.max_tool_calls,
            "model": self.model,
            "output": self.items.output,
            "parallel_tool_calls": body.parallel_tool_calls,
            "previous_response_id": body.previous_response_id,
            "conversation": {"id": conversation} if conversation else None,
            "reasoning": {
                "effort": reasoning.effort if reasoning else None,
                "summary": (reasoning.summary or reasoning.generate_summary) if reasoning else None,
            },
            "store": body.store,
            "temperature": body.temperature,
            "text": {
                "format": text_format.model_dump(exclude_none=True, by_alias=True)
                if text_format is not None
                else {"type": "text"}
            },
            "tool_choice": body.tool_choice if body.tool_choice is not None else "auto",
            "tools": body.tools or [],
            "top_p": body.top_p,
            "truncation": body.truncation,
            "usage": None
            if self.status in ("queued", "in_progress")
            else {
                "input_tokens": usage.prompt_tokens,
                "input_tokens_details": {
                    "cached_tokens": usage.cached_tokens,
                    "cache_write_tokens": 0,
                },
                "output_tokens": usage.completion_tokens,
                "output_tokens_details": {"reasoning_tokens": usage.reasoning_tokens},
                "total_tokens": usage.prompt_tokens + usage.completion_tokens,
                **self.compacted,
            },
            "user": body.user,
            "metadata": body.metadata or {},
            "prompt_cache_key": body.prompt_cache_key,
        }
        if self.tools.warnings:
            out["warnings"] = list(self.tools.warnings)
        return out


def _error_code(error: APIError) -> str:
    if error.status == 408:
        return "timeout"
    return "server_error" if error.status >= 500 else "invalid_request"
