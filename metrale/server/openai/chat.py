"""`POST /v1/chat/completions` and `GET /v1/chat/completions/{id}`."""

from __future__ import annotations

import dataclasses
import time
from collections.abc import AsyncIterator
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import StreamingResponse

from metrale.frontend.chat_output import ChatDelta, ChatOutputParser, ToolCallDelta
from metrale.frontend.output_processor import CompletionDelta
from metrale.server import sse
from metrale.server.chat_request import build_prompt, plan_generation, report_output
from metrale.server.errors import APIError, parse_body
from metrale.server.generation import (
    Choice,
    PreparedPrompt,
    Usage,
    admit,
    default_max_tokens,
    engine_error,
    new_id,
    stream_deltas,
    until_disconnected,
)
from metrale.server.json_body import JSONResponse
from metrale.server.openai.logprobs import chat_logprobs
from metrale.server.openai.stored_completions import store_completion
from metrale.server.protocol import ChatCompletionRequest
from metrale.server.security.guard import Admission
from metrale.server.state import ServerState

router = APIRouter()


def message_fields(state: ServerState, delta: ChatDelta) -> dict[str, Any]:
    """A message (or a streamed delta) in OpenAI's shape, reasoning under the chosen name."""
    fields: dict[str, Any] = {}
    if delta.reasoning:
        field_choice = state.settings.reasoning_field
        for name in ("reasoning_content", "reasoning"):
            if field_choice in (name, "both"):
                fields[name] = delta.reasoning
    if delta.content:
        fields["content"] = delta.content
    if delta.tool_calls:
        fields["tool_calls"] = [_tool_call_fields(call) for call in delta.tool_calls]
    return fields


def _tool_call_fields(call: ToolCallDelta) -> dict[str, Any]:
    if call.name is None:
        return {"index": call.index, "function": {"arguments": call.arguments}}
    return {
        "index": call.index,
        "id": call.id,
        "type": "function",
        "function": {"name": call.name, "arguments": call.arguments},
    }


def merge(into: ChatDelta, more: ChatDelta) -> None:
    into.reasoning += more.reasoning
    into.content += more.content
    for call in more.tool_calls:
        last = into.tool_calls[-1] if into.tool_calls else None
        if last is not None and last.index == call.index and call.name is None:
            last.arguments += call.arguments
        else:
            into.tool_calls.append(call)


def finish_reason(reason: str | None, parser: ChatOutputParser) -> str | None:
    return "tool_calls" if reason == "stop" and parser.num_tool_calls else reason


@router.post("/v1/chat/completions")
async def create_chat_completion(request: Request) -> Any:
    state: ServerState = request.app.state.server
    body = await parse_body(request, ChatCompletionRequest)
    state.check_model(body.model)
    state.check_alive()
    prompt_text, prompt_ids = build_prompt(state, body)
    max_tokens = body.max_completion_tokens or body.max_tokens
    prompt, parsers = plan_generation(
        state,
        body,
        prompt_text,
        prompt_ids,
        new_id("chatcmpl"),
        max_tokens=max_tokens or default_max_tokens(state, len(prompt_ids)),
        logprobs=(body.top_logprobs or 0) if body.logprobs else None,
    )
    model = state.settings.served_model_name
    admission = admit(request, state, [prompt])
    if body.stream:
        include_usage = state.settings.always_include_usage or bool(
            body.stream_options and body.stream_options.include_usage
        )
        return StreamingResponse(
            _stream(_Completion(state, prompt, body, model, parsers), include_usage, admission),
            media_type="text/event-stream",
        )
    try:
        result = await until_disconnected(
            request,
            _complete(_Completion(state, prompt, body, model, parsers), admission),
            state.settings.request_timeout_s,
        )
    except APIError:
        raise
    except Exception as e:
        raise engine_error(e) from e
    if body.store:
        store_completion(state, result, body.messages)
    return JSONResponse(result)


class _Completion:
    """A completion as its deltas arrive: each choice's tokens and parsed message, and usage;
    `body()` is the `chat.completion` object (the reply, or what `store: true` keeps of a
    stream)."""

    def __init__(
        self,
        state: ServerState,
        prompt: PreparedPrompt,
        body: ChatCompletionRequest,
        model: str,
        parsers: list[ChatOutputParser],
    ) -> None:
        self.state, self.prompt, self.request, self.model = state, prompt, body, model
        self.parsers = parsers
        self.choices = [Choice(i) for i in range(body.n)]
        self.messages = [ChatDelta() for _ in range(body.n)]
        self.usage = Usage(prompt_tokens=len(prompt.prompt_token_ids))
        self.created = int(time.time())

    def add(self, index: int, delta: CompletionDelta) -> ChatDelta:
        """Take a choice's delta; return what its parser made of it."""
        parsed = self.parsers[index].take(delta)  # which may end the choice here
        self.choices[index].add(delta)
        if delta.finished:
            merge(parsed, self.parsers[index].finish())
        # A copy: merging grows the calls it keeps, and `parsed` is still to be sent.
        calls = [dataclasses.replace(call) for call in parsed.tool_calls]
        merge(self.messages[index], dataclasses.replace(parsed, tool_calls=calls))
        self.usage.completion_tokens += len(delta.token_ids)
        self.usage.cached_tokens = delta.num_cached_tokens
        return parsed

    def finish(self) -> None:
        self.usage.reasoning_tokens = sum(
            len(self.state.tokenizer.encode(m.reasoning, add_special_tokens=False))
            for m in self.messages
        )
        report_output(self.state, self.parsers, self.usage.reasoning_tokens)

    def body(self) -> dict[str, Any]:
        state, request = self.state, self.request
        return {
            "id": self.prompt.request_id,
            "object": "chat.completion",
            "created": self.created,
            "model": self.model,
            "choices": [
                {
                    "index": c.index,
                    "message": {
                        "role": "assistant",
                        "content": None if m.tool_calls and not m.content else m.content,
                        **message_fields(state, m),
                    },
                    "logprobs": None
                    if c.logprobs is None
                    else {
                        "content": chat_logprobs(
                            c.token_ids, c.logprobs, state.tokenizer, request.top_logprobs or 0
                        )
                    },
                    "finish_reason": finish_reason(c.finish_reason, parser),
                    "stop_reason": c.stop_reason,
                }
                for c, m, parser in zip(self.choices, self.messages, self.parsers, strict=True)
            ],
            "usage": self.usage.body(),
            "metadata": request.metadata,
        }


async def _complete(completion: _Completion, admission: Admission) -> dict[str, Any]:
    async for index, delta in stream_deltas(completion.state, [completion.prompt], admission):
        completion.add(index, delta)
    completion.finish()
    return completion.body()


async def _stream(
    completion: _Completion, include_usage: bool, admission: Admission
) -> AsyncIterator[bytes]:
    state, prompt, body = completion.state, completion.prompt, completion.request

    def chunk(choices: list[dict[str, Any]], **extra: Any) -> bytes:
        payload: dict[str, Any] = {
            "id": prompt.request_id,
            "object": "chat.completion.chunk",
            "created": completion.created,
            "model": completion.model,
            "choices": choices,
        }
        if include_usage:
            payload["usage"] = None
        payload.update(extra)
        return sse.event(payload)

    for i in range(body.n):
        yield chunk(
            [
                {
                    "index": i,
                    "delta": {"role": "assistant", "content": ""},
                    "logprobs": None,
                    "finish_reason": None,
                }
            ]
        )
    try:
        async for index, delta in stream_deltas(
            state, [prompt], admission, state.settings.request_timeout_s
        ):
            parsed = completion.add(index, delta)
            if not parsed and not delta.finished and delta.logprobs is None:
                continue
            choice: dict[str, Any] = {
                "index": index,
                "delta": message_fields(state, parsed),
                "logprobs": None
                if delta.logprobs is None
                else {
                    "content": chat_logprobs(
                        delta.token_ids, delta.logprobs, state.tokenizer, body.top_logprobs or 0
                    )
                },
                "finish_reason": finish_reason(delta.finish_reason, completion.parsers[index]),
            }
            if delta.finished:
                choice["stop_reason"] = delta.stop_reason
            yield chunk([choice])
    except Exception as e:
        yield sse.event(engine_error(e).body())
        yield sse.DONE
        return
    completion.finish()
    if body.store:
        store_completion(state, completion.body(), body.messages)
    if include_usage:
        yield chunk([], usage=completion.usage.body())
    yield sse.DONE
