"""`POST /v1/completions`: the legacy completions API (string, token-id and batched prompts)."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import StreamingResponse

from metrale.server import sse
from metrale.server.errors import APIError, parse_body
from metrale.server.generation import (
    Choice,
    PreparedPrompt,
    Usage,
    admit,
    check_token_ids,
    engine_error,
    new_id,
    prepare,
    stream_deltas,
    until_disconnected,
)
from metrale.server.json_body import JSONResponse
from metrale.server.openai.logprobs import completion_logprobs
from metrale.server.protocol import CompletionRequest
from metrale.server.security.guard import Admission
from metrale.server.state import ServerState

router = APIRouter()


def split_prompts(state: ServerState, prompt: Any, echo: bool) -> list[tuple[str, list[int]]]:
    """(prompt text, token ids) for each prompt of a string, id list, or batch of either; an id
    prompt's text is decoded only for `echo`, the one place it is shown."""
    if isinstance(prompt, str) or (prompt and isinstance(prompt[0], int)):
        prompt = [prompt]
    tokenizer = state.tokenizer
    out = []
    for p in prompt:
        if isinstance(p, str):
            out.append((p, tokenizer.encode(p)))
        else:  # checked before decoding: the tokenizer takes 32-bit ids only
            check_token_ids(p, state.config.model.vocab_size, "prompt")
            out.append((tokenizer.decode(p) if echo else "", list(p)))
    return out


@router.post("/v1/completions")
async def create_completion(request: Request) -> Any:
    state: ServerState = request.app.state.server
    body = await parse_body(request, CompletionRequest)
    state.check_model(body.model)
    state.check_alive()
    try:
        params = body.sampling_params(
            body.max_tokens,
            body.logprobs,
            state.config.generation.sampling_overrides(),
            state.settings.loop_watchdog,
        )
    except ValueError as e:
        raise APIError(str(e)) from None
    request_id = new_id("cmpl")
    texts, prompts = [], []
    for i, (text, token_ids) in enumerate(split_prompts(state, body.prompt, body.echo)):
        texts.append(text)
        prompts.append(
            prepare(state, f"{request_id}-{i}", token_ids, params, body.n, body.priority)
        )
    model = state.settings.served_model_name
    admission = admit(request, state, prompts)
    if body.stream:
        include_usage = state.settings.always_include_usage or bool(
            body.stream_options and body.stream_options.include_usage
        )
        return StreamingResponse(
            _stream(state, request_id, prompts, texts, body, model, include_usage, admission),
            media_type="text/event-stream",
        )
    try:
        result = await until_disconnected(
            request,
            _complete(state, request_id, prompts, texts, body, model, admission),
            state.settings.request_timeout_s,
        )
    except APIError:
        raise
    except Exception as e:
        raise engine_error(e) from e
    return JSONResponse(result)


def _logprobs(
    state: ServerState, choice: Choice, body: CompletionRequest, offset: int
) -> dict[str, Any] | None:
    if choice.logprobs is None or body.logprobs is None:
        return None
    return completion_logprobs(
        choice.token_ids, choice.logprobs, state.tokenizer, body.logprobs, offset
    )


async def _complete(
    state: ServerState,
    request_id: str,
    prompts: list[PreparedPrompt],
    texts: list[str],
    body: CompletionRequest,
    model: str,
    admission: Admission,
) -> dict[str, Any]:
    choices = [Choice(i) for i in range(len(prompts) * body.n)]
    usage = Usage(prompt_tokens=sum(len(p.prompt_token_ids) for p in prompts) * body.n)
    cached: dict[int, int] = {}
    async for index, delta in stream_deltas(state, prompts, admission):
        choices[index].add(delta)
        cached[index] = delta.num_cached_tokens
    usage.completion_tokens = sum(len(c.token_ids) for c in choices)
    usage.cached_tokens = sum(cached.values())
    body_choices = []
    for c in choices:
        prefix = texts[c.index // body.n] if body.echo else ""
        body_choices.append(
            {
                "index": c.index,
                "text": prefix + c.text,
                "logprobs": _logprobs(state, c, body, len(prefix)),
                "finish_reason": c.finish_reason,
                "stop_reason": c.stop_reason,
            }
        )
    return {
        "id": request_id,
        "object": "text_completion",
        "created": int(time.time()),
        "model": model,
        "choices": body_choices,
        "usage": usage.body(),
    }


async def _stream(
    state: ServerState,
    request_id: str,
    prompts: list[PreparedPrompt],
    texts: list[str],
    body: CompletionRequest,
    model: str,
    include_usage: bool,
    admission: Admission,
) -> AsyncIterator[bytes]:
    created = int(time.time())
    usage = Usage(prompt_tokens=sum(len(p.prompt_token_ids) for p in prompts) * body.n)
    offsets = [0] * (len(prompts) * body.n)
    cached: dict[int, int] = {}

    def chunk(choices: list[dict[str, Any]], **extra: Any) -> bytes:
        payload: dict[str, Any] = {
            "id": request_id,
            "object": "text_completion",
            "created": created,
            "model": model,
            "choices": choices,
        }
        if include_usage:
            payload["usage"] = None
        payload.update(extra)
        return sse.event(payload)

    if body.echo:
        for index in range(len(offsets)):
            text = texts[index // body.n]
            offsets[index] = len(text)
            yield chunk([{"index": index, "text": text, "logprobs": None, "finish_reason": None}])
    try:
        async for index, delta in stream_deltas(
            state, prompts, admission, state.settings.request_timeout_s
        ):
            usage.completion_tokens += len(delta.token_ids)
            cached[index] = delta.num_cached_tokens
            if not delta.text and not delta.finished and delta.logprobs is None:
                continue
            piece = Choice(index, token_ids=list(delta.token_ids), logprobs=delta.logprobs)
            choice = {
                "index": index,
                "text": delta.text,
                "logprobs": _logprobs(state, piece, body, offsets[index]),
                "finish_reason": delta.finish_reason,
            }
            if delta.finished:
                choice["stop_reason"] = delta.stop_reason
            offsets[index] += len(delta.text)
            yield chunk([choice])
    except Exception as e:
        yield sse.event(engine_error(e).body())
        yield sse.DONE
        return
    if include_usage:
        usage.cached_tokens = sum(cached.values())
        yield chunk([], usage=usage.body())
    yield sse.DONE
