"""`POST /v1/chat/completions` and `GET /v1/chat/completions/{id}`."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import time
from collections.abc import AsyncIterator
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, StreamingResponse

from metrale.frontend.chat_output import ChatDelta, ChatOutputParser, ToolCallDelta
from metrale.frontend.reasoning import (
    make_reasoning_parser,
    prompt_opens_reasoning,
    reasoning_format,
)
from metrale.frontend.tool_parsers import make_tool_parser, tool_specs
from metrale.sampling_params import SamplingParams, StructuredOutput, ThinkingBudget
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


# `reasoning_effort` as a thinking budget in tokens; "none" turns thinking off in the template.
EFFORT_BUDGETS = {"minimal": 256, "low": 1024, "medium": 4096, "high": 16384}


def template_kwargs(state: ServerState, body: ChatCompletionRequest) -> dict[str, Any]:
    kwargs = dict(body.chat_template_kwargs or {})
    if state.settings.disable_thinking or body.reasoning_effort == "none":
        kwargs["enable_thinking"] = False
    return kwargs


def thinking_budget(
    state: ServerState, requested_tokens: int | None, prompt_text: str
) -> ThinkingBudget | None:
    """The tokens a request may think for: the tighter of what it asked and the server's cap."""
    settings = state.settings
    limits = [b for b in (requested_tokens, settings.max_thinking_budget) if b is not None]
    if not limits or settings.reasoning_parser is None:
        return None
    fmt = reasoning_format(settings.reasoning_parser)
    start = state.tokenizer.token_to_id(fmt.start_tag)
    end = state.tokenizer.token_to_id(fmt.end_tag)
    if start is None or end is None:  # tags that are not single tokens cannot be forced
        return None
    return ThinkingBudget(
        min(limits), start, end, starts_inside=prompt_opens_reasoning(prompt_text, fmt)
    )


def build_prompt(state: ServerState, body: ChatCompletionRequest) -> tuple[str, list[int]]:
    try:
        text = state.tokenizer.apply_chat_template(
            render_messages(body.messages),
            tools=body.tools,
            add_generation_prompt=body.add_generation_prompt,
            continue_final_message=body.continue_final_message,
            **template_kwargs(state, body),
        )
    except ChatTemplateError as e:
        raise APIError(
            f"the chat template could not render these messages: {e}", param="messages"
        ) from None
    return text, state.tokenizer.encode(text, add_special_tokens=False)


def at_most_one_tool_call(
    state: ServerState, body: ChatCompletionRequest, params: SamplingParams
) -> SamplingParams:
    """`parallel_tool_calls: false`: end the reply right after its first call.

    Done with a stop string kept in the output, so the parser still sees the whole call; only
    the hermes format has a closing tag to stop on, and a request with stop strings of its own
    keeps them (including the tag would change how those are reported).
    """
    if (
        body.parallel_tool_calls is not False
        or not body.tools
        or params.stop
        or state.settings.tool_call_parser != "hermes"
    ):
        return params
    return dataclasses.replace(params, stop=("</tool_call>",), include_stop_str_in_output=True)


def structured_output(state: ServerState, body: ChatCompletionRequest) -> StructuredOutput | None:
    """The grammar the reply must follow: a forced tool call, `structured_outputs`, or
    `response_format`; None when it is free text."""
    choice = body.tool_choice
    if body.tools and choice not in (None, "auto", "none"):
        return _tool_call_grammar(state, body)
    if body.structured_outputs:
        spec = body.structured_outputs
        if "json" in spec:
            schema = spec["json"]
            return StructuredOutput(
                "json", schema if isinstance(schema, str) else json.dumps(schema)
            )
        for kind in ("regex", "grammar"):
            if isinstance(spec.get(kind), str):
                return StructuredOutput(kind, spec[kind])
        raise APIError(
            "structured_outputs: give one of json (a schema), regex or grammar",
            param="structured_outputs",
        )
    response_format = body.response_format or {}
    kind = response_format.get("type", "text")
    if kind == "text":
        return None
    if kind == "json_object":  # an object, as OpenAI defines it, not any JSON value
        return StructuredOutput("json", json.dumps({"type": "object"}))
    if kind == "json_schema":
        schema = (response_format.get("json_schema") or {}).get("schema")
        if not isinstance(schema, dict):
            raise APIError(
                "response_format.json_schema.schema: a JSON schema object is required",
                param="response_format",
            )
        return StructuredOutput("json", json.dumps(schema))
    raise APIError(
        f"response_format.type {kind!r}: use text, json_object or json_schema",
        param="response_format",
    )


def _tool_call_grammar(state: ServerState, body: ChatCompletionRequest) -> StructuredOutput:
    """`tool_choice` required or named: the reply must be one call in the parser's format."""
    functions = {t.get("function", {}).get("name"): t.get("function", {}) for t in body.tools or []}
    choice = body.tool_choice
    if isinstance(choice, dict):
        name = (choice.get("function") or {}).get("name")
        if name not in functions:
            raise APIError(
                f"tool_choice names {name!r}, which is not among the tools", param="tool_choice"
            )
        functions = {name: functions[name]}
    elif choice != "required":
        raise APIError(
            f"tool_choice={choice!r}: use auto, none, required or a named function",
            param="tool_choice",
        )
    if state.settings.tool_call_parser != "hermes":
        raise APIError(
            f"tool_choice {choice!r} is enforced by a grammar only for the hermes tool-call "
            f"format so far (this model uses {state.settings.tool_call_parser}); use 'auto'",
            param="tool_choice",
        )
    calls = [
        {
            "type": "object",
            "properties": {
                "name": {"const": name},
                "arguments": function.get("parameters") or {"type": "object"},
            },
            "required": ["name", "arguments"],
            "additionalProperties": False,
        }
        for name, function in functions.items()
    ]
    schema = calls[0] if len(calls) == 1 else {"anyOf": calls}
    return StructuredOutput(
        "json", json.dumps(schema), prefix="<tool_call>\n", suffix="\n</tool_call>"
    )


def output_parser(
    state: ServerState, body: ChatCompletionRequest, prompt_text: str, request_id: str
) -> ChatOutputParser:
    """The reasoning and tool-call parsing one choice's text goes through."""
    settings = state.settings
    reasoning = None
    if settings.reasoning_parser is not None:
        reasoning = make_reasoning_parser(settings.reasoning_parser, prompt=prompt_text)
    tools = None
    if body.tools and body.tool_choice != "none" and settings.tool_call_parser is not None:
        tools = make_tool_parser(
            settings.tool_call_parser,
            tools=tool_specs(body.tools),
            id_prefix=f"call_{request_id[-8:]}_",
        )
    return ChatOutputParser(reasoning, tools)


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
    structured = structured_output(state, body)
    if structured is not None:
        state.check_structured_output(structured)
    prompt_text, prompt_ids = build_prompt(state, body)
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
    params = at_most_one_tool_call(state, body, params)
    requested = EFFORT_BUDGETS.get(body.reasoning_effort or "")
    if structured is not None:
        # The grammar starts where thinking ends, so the engine must track the thinking block.
        params = dataclasses.replace(params, structured=structured)
        requested = requested or state.config.scheduler.max_seq_len
    if (budget := thinking_budget(state, requested, prompt_text)) is not None:
        params = dataclasses.replace(params, thinking=budget)
    prompt = prepare(state, new_id("chatcmpl"), prompt_ids, params, body.n)
    model = state.settings.served_model_name
    parsers = [output_parser(state, body, prompt_text, prompt.request_id) for _ in range(body.n)]
    if body.stream:
        include_usage = state.settings.always_include_usage or bool(
            body.stream_options and body.stream_options.include_usage
        )
        return StreamingResponse(
            _stream(state, prompt, body, model, include_usage, parsers),
            media_type="text/event-stream",
        )
    try:
        result = await until_disconnected(
            request,
            _complete(state, prompt, body, model, parsers),
            state.settings.request_timeout_s,
        )
    except APIError:
        raise
    except Exception as e:
        raise engine_error(e) from e
    if body.store:
        state.store_completion(prompt.request_id, result)
    return JSONResponse(result)


async def _complete(
    state: ServerState,
    prompt: PreparedPrompt,
    body: ChatCompletionRequest,
    model: str,
    parsers: list[ChatOutputParser],
) -> dict[str, Any]:
    choices = [Choice(i) for i in range(body.n)]
    messages = [ChatDelta() for _ in range(body.n)]
    usage = Usage(prompt_tokens=len(prompt.prompt_token_ids))
    async for index, delta in stream_deltas(state, [prompt]):
        choices[index].add(delta)
        merge(messages[index], parsers[index].feed(delta.text))
        if delta.finished:
            merge(messages[index], parsers[index].finish())
        usage.cached_tokens = delta.num_cached_tokens
    usage.completion_tokens = sum(len(c.token_ids) for c in choices)
    usage.reasoning_tokens = sum(
        len(state.tokenizer.encode(m.reasoning, add_special_tokens=False)) for m in messages
    )
    return {
        "id": prompt.request_id,
        "object": "chat.completion",
        "created": int(time.time()),
        "model": model,
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
                        c.token_ids, c.logprobs, state.tokenizer, body.top_logprobs or 0
                    )
                },
                "finish_reason": finish_reason(c.finish_reason, parser),
                "stop_reason": c.stop_reason,
            }
            for c, m, parser in zip(choices, messages, parsers, strict=True)
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
    parsers: list[ChatOutputParser],
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
                parsed = parsers[index].feed(delta.text)
                if delta.finished:
                    merge(parsed, parsers[index].finish())
                if parsed.reasoning:
                    usage.reasoning_tokens += len(
                        state.tokenizer.encode(parsed.reasoning, add_special_tokens=False)
                    )
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
                    "finish_reason": finish_reason(delta.finish_reason, parsers[index]),
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
