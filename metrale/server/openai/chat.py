"""`POST /v1/chat/completions` and `GET /v1/chat/completions/{id}`."""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections.abc import AsyncIterator
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, StreamingResponse

from metrale.server import sse
from metrale.server.errors import APIError, parse_body
from metrale.server.generation import (
    Choice,
    PreparedPrompt,
    Usage,
    default_max_tokens,
    engine_error,
    new_id,
    prepare,
    stream_deltas,
    until_disconnected,
)
from metrale.server.openai.logprobs import chat_logprobs
from metrale.server.protocol import ChatCompletionRequest, ChatMessage
from metrale.server.state import ServerState
from metrale.tokenizer import ChatTemplateError

router = APIRouter()


def render_messages(messages: list[ChatMessage]) -> list[dict[str, Any]]:
    """Messages as the chat template expects them: text parts joined, tool calls as dicts."""
    rendered = []
    for i, message in enumerate(messages):
        item: dict[str, Any] = message.model_dump(exclude_none=True, exclude={"content"})
        content = message.content
        if isinstance(content, list):
            for part in content:
                if part.type != "text" or part.text is None:
                    raise APIError(
                        f"messages[{i}].content: parts of type {part.type!r} are not supported "
                        f"(this server serves text only)",
                        param=f"messages.{i}.content",
                    )
            content = "".join(part.text or "" for part in content)
        item["content"] = content
        for call in item.get("tool_calls", []):
            arguments = call["function"]["arguments"]
            if isinstance(arguments, str):
                # Templates index into arguments; a well-formed JSON string becomes a dict, a
                # malformed one (a model's past mistake) is passed on as given.
                with contextlib.suppress(json.JSONDecodeError):
                    call["function"]["arguments"] = json.loads(arguments)
        if item["role"] == "developer":
            # OpenAI's newer name for the system turn; chat templates know only "system".
            item["role"] = "system"
        if "reasoning" in item and "reasoning_content" not in item:
            item["reasoning_content"] = item.pop("reasoning")
        rendered.append(item)
    return rendered


def build_prompt(state: ServerState, body: ChatCompletionRequest) -> list[int]:
    try:
        text = state.tokenizer.apply_chat_template(
            render_messages(body.messages),
            tools=body.tools,
            add_generation_prompt=body.add_generation_prompt,
            continue_final_message=body.continue_final_message,
            **(body.chat_template_kwargs or {}),
        )
    except ChatTemplateError as e:
        raise APIError(
            f"the chat template could not render these messages: {e}", param="messages"
        ) from None
    return state.tokenizer.encode(text, add_special_tokens=False)


@router.post("/v1/chat/completions")
async def create_chat_completion(request: Request) -> Any:
    state: ServerState = request.app.state.server
    body = await parse_body(request, ChatCompletionRequest)
    state.check_model(body.model)
    state.check_alive()
    prompt_ids = build_prompt(state, body)
    max_tokens = body.max_completion_tokens or body.max_tokens
    logprobs = (body.top_logprobs or 0) if body.logprobs else None
    try:
        params = body.sampling_params(
            max_tokens or default_max_tokens(state, len(prompt_ids)),
            logprobs,
            state.config.generation.sampling_overrides(),
        )
    except ValueError as e:
        raise APIError(str(e)) from None
    prompt = prepare(state, new_id("chatcmpl"), prompt_ids, params, body.n)
    model = state.settings.served_model_name
    if body.stream:
        include_usage = state.settings.always_include_usage or bool(
            body.stream_options and body.stream_options.include_usage
        )
        return StreamingResponse(
            _stream(state, prompt, body, model, include_usage), media_type="text/event-stream"
        )
    try:
        result = await until_disconnected(
            request, _complete(state, prompt, body, model), state.settings.request_timeout_s
        )
    except APIError:
        raise
    except Exception as e:
        raise engine_error(e) from e
    if body.store:
        state.store_completion(prompt.request_id, result)
    return JSONResponse(result)


async def _complete(
    state: ServerState, prompt: PreparedPrompt, body: ChatCompletionRequest, model: str
) -> dict[str, Any]:
    choices = [Choice(i) for i in range(body.n)]
    usage = Usage(prompt_tokens=len(prompt.prompt_token_ids))
    async for index, delta in stream_deltas(state, [prompt]):
        choices[index].add(delta)
        usage.cached_tokens = delta.num_cached_tokens
    usage.completion_tokens = sum(len(c.token_ids) for c in choices)
    return {
        "id": prompt.request_id,
        "object": "chat.completion",
        "created": int(time.time()),
        "model": model,
        "choices": [
            {
                "index": c.index,
                "message": {"role": "assistant", "content": c.text},
                "logprobs": None
                if c.logprobs is None
                else {
                    "content": chat_logprobs(
                        c.token_ids, c.logprobs, state.tokenizer, body.top_logprobs or 0
                    )
                },
                "finish_reason": c.finish_reason,
                "stop_reason": c.stop_reason,
            }
            for c in choices
        ],
        "usage": usage.body(),
        "metadata": body.metadata,
    }


async def _stream(
    state: ServerState,
    prompt: PreparedPrompt,
    body: ChatCompletionRequest,
    model: str,
    include_usage: bool,
) -> AsyncIterator[str]:
    created = int(time.time())
    usage = Usage(prompt_tokens=len(prompt.prompt_token_ids))

    def chunk(choices: list[dict[str, Any]], **extra: Any) -> str:
        payload: dict[str, Any] = {
            "id": prompt.request_id,
            "object": "chat.completion.chunk",
            "created": created,
            "model": model,
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
        async with asyncio.timeout(state.settings.request_timeout_s):
            async for index, delta in stream_deltas(state, [prompt]):
                usage.completion_tokens += len(delta.token_ids)
                usage.cached_tokens = delta.num_cached_tokens
                if not delta.text and not delta.finished and delta.logprobs is None:
                    continue
                choice: dict[str, Any] = {
                    "index": index,
                    "delta": {"content": delta.text} if delta.text else {},
                    "logprobs": None
                    if delta.logprobs is None
                    else {
                        "content": chat_logprobs(
                            delta.token_ids, delta.logprobs, state.tokenizer, body.top_logprobs or 0
                        )
                    },
                    "finish_reason": delta.finish_reason,
                }
                if delta.finished:
                    choice["stop_reason"] = delta.stop_reason
                yield chunk([choice])
    except Exception as e:
        yield sse.event(engine_error(e).body())
        yield sse.DONE
        return
    if include_usage:
        yield chunk([], usage=usage.body())
    yield sse.DONE


@router.get("/v1/chat/completions/{completion_id}")
async def get_chat_completion(request: Request, completion_id: str) -> Any:
    state: ServerState = request.app.state.server
    stored = state.stored_completions.get(completion_id)
    if stored is None:
        raise APIError(
            f"no stored chat completion with id {completion_id!r} (only completions "
            f"created with store: true are kept)",
            404,
            param="completion_id",
        )
    return JSONResponse(stored)
