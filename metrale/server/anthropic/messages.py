"""`POST /v1/messages` and `POST /v1/messages/count_tokens`: Anthropic's Messages API.

A request is translated into the chat route's request (`translate.py`) and served by the same
prompt rendering, sampling parameters, engine fan-in and output parser; only the reply's shape
is Anthropic's. A stream is the event sequence of Anthropic's streaming reference:

    message_start, ping,
    per block: content_block_start, content_block_delta..., content_block_stop,
    message_delta (stop_reason, stop_sequence, cumulative usage), message_stop

or, if generation fails once the stream has begun, an `error` event in place of the end.

The stop reason is `max_tokens` (`model_context_window_exceeded` when the context window, not
max_tokens, cut the reply short), else `tool_use` when the reply holds a tool call, else
`stop_sequence` for one of the request's stop strings, else `end_turn`.

Usage follows Anthropic's accounting, where a prompt's tokens are
`input_tokens + cache_read_input_tokens + cache_creation_input_tokens`: prefix-cache hits are
`cache_read_input_tokens`, the rest of the prompt `input_tokens`, and nothing is billed as cache
creation. `message_start` is sent before the engine has looked up the cache, so it counts the
whole prompt as input; `message_delta` carries the split.
"""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import StreamingResponse

from metrale.frontend.chat_output import ChatOutputParser
from metrale.frontend.output_processor import CompletionDelta
from metrale.server import compaction, sse
from metrale.server.anthropic.blocks import ReplyBlocks
from metrale.server.anthropic.errors import error_body
from metrale.server.anthropic.protocol import CountTokensRequest, MessagesRequest
from metrale.server.anthropic.translate import chat_request
from metrale.server.chat_request import build_prompt, plan_generation, report_output
from metrale.server.errors import APIError, parse_body
from metrale.server.generation import (
    PreparedPrompt,
    Usage,
    admit,
    engine_error,
    stream_deltas,
    until_disconnected,
)
from metrale.server.json_body import JSONResponse
from metrale.server.security.guard import Admission
from metrale.server.state import ServerState

router = APIRouter()


@router.post("/v1/messages")
async def create_message(request: Request) -> Any:
    state: ServerState = request.app.state.server
    body = await parse_body(request, MessagesRequest)
    state.check_model(body.model)
    state.check_alive()
    chat = chat_request(
        body,
        stop=body.stop_sequences,
        temperature=body.temperature,
        top_p=body.top_p,
        top_k=body.top_k,
        **body.extra_sampling_fields(),
    )
    prompt_text, prompt_ids = build_prompt(state, chat)
    # As in Anthropic's API since Sonnet 4.5, a max_tokens past the context window is no error:
    # the reply may run to the window's end and then says so. Clients such as Claude Code ask
    # for tens of thousands of tokens whatever the model's window.
    max_seq_len = state.config.scheduler.max_seq_len
    if len(prompt_ids) >= max_seq_len:
        # Anthropic's wording, which Claude Code watches for to compact its history.
        raise APIError(
            f"prompt is too long: {len(prompt_ids)} tokens > {max_seq_len - 1} maximum; shorten "
            f"the messages or raise --max-seq-len",
            param="messages",
        )
    max_tokens = min(body.max_tokens, max_seq_len - len(prompt_ids))
    prompt, (parser,) = plan_generation(
        state,
        chat,
        prompt_text,
        prompt_ids,
        f"msg_{uuid.uuid4().hex}",
        max_tokens=max_tokens,
        thinking_tokens=body.thinking.budget_tokens if body.thinking is not None else None,
    )
    reply = _Reply(prompt, state.settings.served_model_name, parser, max_tokens < body.max_tokens)
    reply.admission = admit(request, state, [prompt])
    if body.stream:
        return StreamingResponse(_stream(state, reply), media_type="text/event-stream")
    try:
        await until_disconnected(request, _complete(state, reply), state.settings.request_timeout_s)
    except APIError:
        raise
    except Exception as e:
        raise engine_error(e) from e
    return JSONResponse(reply.message())


@router.post("/v1/messages/count_tokens")
async def count_tokens(request: Request) -> Any:
    state: ServerState = request.app.state.server
    body = await parse_body(request, CountTokensRequest)
    state.check_model(body.model)
    # the conversation as sent, never compacted: a client counts to decide when to compact
    _, prompt_ids = build_prompt(state, chat_request(body), compact=False)
    return JSONResponse({"input_tokens": len(prompt_ids)})


class _Reply:
    """One reply as it is generated: its blocks, its token counts and how it ended."""

    def __init__(
        self, prompt: PreparedPrompt, model: str, parser: ChatOutputParser, window_bound: bool
    ) -> None:
        self.prompt, self.model, self.parser = prompt, model, parser
        self.window_bound = window_bound  # the context window, not max_tokens, limits the reply
        self.blocks = ReplyBlocks()
        self.usage = Usage(prompt_tokens=len(prompt.prompt_token_ids))
        self.finish_reason: str | None = None
        self.stop_reason: str | int | None = None
        self.admission: Admission | None = None  # refunded the tokens not generated

    def add(self, delta: CompletionDelta) -> list[dict[str, Any]]:
        """Take an engine delta; return the block events it settles."""
        self.usage.completion_tokens += len(delta.token_ids)
        self.usage.cached_tokens = delta.num_cached_tokens
        events = self.blocks.feed(self.parser.take(delta))  # which may end the reply here
        if delta.finished:
            self.finish_reason, self.stop_reason = delta.finish_reason, delta.stop_reason
            events += self.blocks.feed(self.parser.finish()) + self.blocks.finish()
        return events

    def stop(self) -> dict[str, str | None]:
        if self.finish_reason == "length":
            reason = "model_context_window_exceeded" if self.window_bound else "max_tokens"
            return {"stop_reason": reason, "stop_sequence": None}
        if self.blocks.num_tool_calls:
            return {"stop_reason": "tool_use", "stop_sequence": None}
        if isinstance(self.stop_reason, str):  # a stop string; token ids are the template's
            return {"stop_reason": "stop_sequence", "stop_sequence": self.stop_reason}
        return {"stop_reason": "end_turn", "stop_sequence": None}

    def usage_body(self) -> dict[str, int]:
        cached = self.usage.cached_tokens
        return {
            "input_tokens": self.usage.prompt_tokens - cached,
            "cache_creation_input_tokens": 0,
            "cache_read_input_tokens": cached,
            "output_tokens": self.usage.completion_tokens,
            **compaction.usage_field(),
        }

    def message(self) -> dict[str, Any]:
        return {
            "id": self.prompt.request_id,
            "type": "message",
            "role": "assistant",
            "model": self.model,
            "content": self.blocks.content,
            **self.stop(),
            "usage": self.usage_body(),
        }


async def _complete(state: ServerState, reply: _Reply) -> None:
    async for _, delta in stream_deltas(state, [reply.prompt], reply.admission):
        reply.add(delta)
    report_output(state, [reply.parser])


def _event(payload: dict[str, Any]) -> bytes:
    """An SSE frame named, as Anthropic's are, by its payload's type."""
    return sse.event(payload, payload["type"])


async def _stream(state: ServerState, reply: _Reply) -> AsyncIterator[bytes]:
    start = {**reply.message(), "content": [], "stop_reason": None, "stop_sequence": None}
    yield _event({"type": "message_start", "message": start})
    yield _event({"type": "ping"})
    try:
        async for _, delta in stream_deltas(
            state, [reply.prompt], reply.admission, state.settings.request_timeout_s
        ):
            for event in reply.add(delta):
                yield _event(event)
    except Exception as e:
        yield _event(error_body(engine_error(e)))
        return
    report_output(state, [reply.parser])
    yield _event({"type": "message_delta", "delta": reply.stop(), "usage": reply.usage_body()})
    yield _event({"type": "message_stop"})
