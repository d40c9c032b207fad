"""How a chat request becomes a prompt and sampling parameters, for every API family.

The chat template renders the messages; the request's thinking budget, grammar (a forced tool
call, `response_format`, `structured_outputs`) and tool-call limits become engine parameters;
and each choice gets the reasoning and tool-call parsers its text goes through. The OpenAI and
Anthropic routes share all of it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import json
from typing import Any

from metrale.frontend.chat_output import ChatOutputParser
from metrale.frontend.reasoning import (
    make_reasoning_parser,
    prompt_opens_reasoning,
    reasoning_format,
)
from metrale.frontend.tool_parsers import make_tool_parser, tool_parser_class, tool_specs
from metrale.sampling_params import SamplingParams, StructuredOutput, ThinkingBudget
from metrale.server import compaction
from metrale.server.errors import APIError
from metrale.server.generation import PreparedPrompt, prepare
from metrale.server.protocol import ChatCompletionRequest, ChatMessage
from metrale.server.state import ServerState
from metrale.tokenizer import ChatTemplateError


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


def build_prompt(
    state: ServerState, body: ChatCompletionRequest, *, compact: bool = True
) -> tuple[str, list[int]]:
    """The prompt's text and tokens. A template that refuses system turns past the first (Qwen3.5's
    "System message must be at the beginning.") gets them folded into the first one instead:
    agents (Claude Code, Codex) send such turns, and a refusal would leave them stuck."""
    messages = render_messages(body.messages)
    try:
        text = _render_folding(state, body, messages)
    except ChatTemplateError as e:
        raise APIError(
            f"the chat template could not render these messages: {e}", param="messages"
        ) from None
    ids = state.tokenizer.encode(text, add_special_tokens=False)
    if compact and state.settings.auto_compact:
        # the prompt must leave room for the output asked for, or one token
        wanted = body.max_completion_tokens or body.max_tokens or 1
        limit = state.config.scheduler.max_seq_len - wanted
        if len(ids) > limit:
            return _compacted(state, body, messages, len(ids), limit)
    return text, ids


def _render_folding(
    state: ServerState, body: ChatCompletionRequest, messages: list[dict[str, Any]]
) -> str:
    """The prompt's text; a template that refuses later system turns gets them folded (and
    when that fails too, the first refusal is the one reported)."""
    try:
        return _render(state, body, messages)
    except ChatTemplateError as first:
        folded = fold_system_messages(messages)
        if folded is None:
            raise
        try:
            return _render(state, body, folded)
        except ChatTemplateError:
            raise first from None


def _compacted(
    state: ServerState,
    body: ChatCompletionRequest,
    messages: list[dict[str, Any]],
    num_tokens: int,
    limit: int,
) -> tuple[str, list[int]]:
    """The prompt of `messages` shortened by --auto-compact until it is at most `limit` tokens;
    the request's record keeps what was done (the header, `usage.compacted`)."""
    fitted: dict[int, tuple[str, list[int]]] = {}  # by id() of a candidate that fits

    def fits(candidate: list[dict[str, Any]]) -> bool:
        try:
            text = _render_folding(state, body, candidate)
        except ChatTemplateError:
            return False  # a shape the template refuses: try the next step
        ids = state.tokenizer.encode(text, add_special_tokens=False)
        if len(ids) > limit:
            return False
        fitted[id(candidate)] = text, ids
        return True

    try:
        shorter, steps = compaction.compact(messages, fits)
    except ValueError as e:
        raise APIError(
            f"the prompt is {num_tokens} tokens, over the {limit} this request leaves for it, "
            f"and --auto-compact could not shorten it enough: {e}",
            param="messages",
        ) from None
    text, ids = fitted[id(shorter)]  # compact returns the very list that fitted
    compaction.record(
        compaction.Compaction(tuple(steps), num_tokens, len(ids), len(messages), len(shorter))
    )
    return text, ids


def _render(state: ServerState, body: ChatCompletionRequest, messages: list[dict[str, Any]]) -> str:
    return state.tokenizer.apply_chat_template(
        messages,
        tools=body.tools,
        add_generation_prompt=body.add_generation_prompt,
        continue_final_message=body.continue_final_message,
        **template_kwargs(state, body),
    )


def fold_system_messages(messages: list[dict[str, Any]]) -> list[dict[str, Any]] | None:
    """`messages` with every system turn after the first position joined (a blank line apart,
    in order) into a leading one; None when there is none to fold."""
    later = [m for m in messages[1:] if m["role"] == "system"]
    if not later:
        return None
    first = messages[0] if messages[0]["role"] == "system" else None
    texts = [m["content"] or "" for m in ([first] if first else []) + later]
    rest = [m for m in messages[1 if first else 0 :] if m["role"] != "system"]
    return [{"role": "system", "content": "\n\n".join(texts)}, *rest]


def plan_generation(
    state: ServerState,
    body: ChatCompletionRequest,
    prompt_text: str,
    prompt_ids: list[int],
    request_id: str,
    *,
    max_tokens: int,
    logprobs: int | None = None,
    thinking_tokens: int | None = None,
    max_tool_calls: int | None = None,
) -> tuple[PreparedPrompt, list[ChatOutputParser]]:
    """The engine requests of a rendered chat prompt, and the parser of each choice's text.

    Every route that chats goes through here: the request's sampling knobs, the tool-call
    format's needs, the grammar (checked before anything is queued, so a bad one is a 400), and
    the thinking budget: `thinking_tokens` as the route asked, else `reasoning_effort`'s, and
    with a grammar, as long as the context (the grammar starts where thinking ends, so the
    engine must track the thinking block). Calls past `max_tool_calls` are dropped.
    """
    structured = structured_output(state, body)
    if structured is not None:
        state.check_structured_output(structured)
    try:
        thinks = state.settings.reasoning_parser is not None and (
            template_kwargs(state, body).get("enable_thinking") is not False
        )
        params = body.sampling_params(
            max_tokens,
            logprobs,
            state.settings.sampling_defaults(state.config.generation.sampling_overrides(), thinks),
            state.settings.loop_watchdog,
        )
    except ValueError as e:
        raise APIError(str(e)) from None
    params = tool_call_params(state, body, params)
    if thinking_tokens is None:
        thinking_tokens = EFFORT_BUDGETS.get(body.reasoning_effort or "")
    if structured is not None:
        params = dataclasses.replace(params, structured=structured)
        thinking_tokens = thinking_tokens or state.config.scheduler.max_seq_len
    if params.content_loop_min_repeats and thinking_tokens is None:
        # the engine tracks the thinking block, for the watchdog to close one that loops
        thinking_tokens = state.config.scheduler.max_seq_len
    if (budget := thinking_budget(state, thinking_tokens, prompt_text)) is not None:
        params = dataclasses.replace(params, thinking=budget)
    prompt = prepare(state, request_id, prompt_ids, params, body.n, body.priority)
    parsers = [
        output_parser(state, body, prompt_text, request_id, max_tool_calls) for _ in range(body.n)
    ]
    if any(parser.counts_per_delta for parser in parsers):
        prompt = dataclasses.replace(prompt, coalesce=False)
    return prompt, parsers


def tool_call_params(
    state: ServerState, body: ChatCompletionRequest, params: SamplingParams
) -> SamplingParams:
    """What the tool-call format needs of the engine's parameters, when its parser reads the
    reply: its markers kept in the text, and with `parallel_tool_calls: false`, a stop after the
    first call.

    Markers that are special tokens (Mistral's ``[TOOL_CALLS]``, Gemma's ``<|tool_call>``) would
    be dropped with the other special tokens; they are kept, and only they. The stop is a stop
    string kept in the output, so the parser still sees the whole call; it needs a format with
    a marker that ends one call, and a request with stop strings of its own keeps them
    (including the marker would change how those are reported).
    """
    name = state.settings.tool_call_parser
    if not body.tools or body.tool_choice == "none" or name is None:
        return params
    parser_class = tool_parser_class(name)
    special_ids = set(state.tokenizer.all_special_ids)
    marker_ids = [state.tokenizer.token_to_id(marker) for marker in parser_class.markers]
    kept = tuple(sorted({i for i in marker_ids if i is not None and i in special_ids}))
    if kept and params.skip_special_tokens:
        params = dataclasses.replace(params, kept_special_token_ids=kept)
    if body.parallel_tool_calls is False and parser_class.call_end is not None and not params.stop:
        params = dataclasses.replace(
            params, stop=(parser_class.call_end,), include_stop_str_in_output=True
        )
    return params


def structured_output(state: ServerState, body: ChatCompletionRequest) -> StructuredOutput | None:
    """The grammar the reply must follow: a forced tool call, `structured_outputs`, or
    `response_format`; None when it is free text. When the model may think first, the grammar
    starts after the block and the blank line that follows it."""
    structured = _requested_grammar(state, body)
    may_think = (
        state.settings.reasoning_parser is not None
        and template_kwargs(state, body).get("enable_thinking") is not False
    )
    if structured is None or not may_think:
        return structured
    return dataclasses.replace(structured, max_leading_newlines=2)


def _requested_grammar(state: ServerState, body: ChatCompletionRequest) -> StructuredOutput | None:
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
    """`tool_choice` required or named: the reply must be calls in the parser's format. Named,
    one call to that function; required, one or more calls to any of the tools, as OpenAI and
    vLLM allow, or exactly one with `parallel_tool_calls: false`."""
    tools = body.tools or []
    choice = body.tool_choice
    if isinstance(choice, dict):
        name = (choice.get("function") or {}).get("name")
        tools = [tool for tool in tools if (tool.get("function") or {}).get("name") == name]
        if not tools:
            raise APIError(
                f"tool_choice names {name!r}, which is not among the tools", param="tool_choice"
            )
    elif choice != "required":
        raise APIError(
            f"tool_choice={choice!r}: use auto, none, required or a named function",
            param="tool_choice",
        )
    format_name = state.settings.tool_call_parser
    if format_name is None:
        raise APIError(
            f"tool_choice {choice!r} needs a tool-call format, and this server reads none "
            f"(--tool-call-parser none); use 'auto', or serve with --tool-call-parser",
            param="tool_choice",
        )
    try:
        several = choice == "required" and body.parallel_tool_calls is not False
        grammar = _call_grammar(format_name, json.dumps(tools), several)
    except Exception as e:  # a tool the format cannot write, or a schema xgrammar refuses
        raise APIError(
            f"tool_choice {choice!r}: cannot force a {format_name} tool call for these tools ({e})",
            param="tools",
        ) from None
    if grammar is None:
        raise APIError(
            f"tool_choice {choice!r} cannot be enforced for the {format_name} tool-call format; "
            f"use 'auto'",
            param="tool_choice",
        )
    return StructuredOutput("grammar", grammar)


@functools.lru_cache(maxsize=64)
def _call_grammar(format_name: str, tools_json: str, several: bool) -> str | None:
    """Cached by the tools' text: agents send the same tools with every turn."""
    specs = tool_specs(json.loads(tools_json))
    return tool_parser_class(format_name).call_grammar(specs, several=several)


def output_parser(
    state: ServerState,
    body: ChatCompletionRequest,
    prompt_text: str,
    request_id: str,
    max_tool_calls: int | None = None,
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
    limits = [n for n in (max_tool_calls, 1 if body.parallel_tool_calls is False else None) if n]
    prose = body.max_inter_tool_prose
    return ChatOutputParser(
        reasoning,
        tools,
        max_tool_calls=min(limits, default=None),
        max_inter_tool_prose=settings.max_inter_tool_prose if prose is None else prose,
    )


def report_output(
    state: ServerState, parsers: list[ChatOutputParser], reasoning_tokens: int | None = None
) -> None:
    """Count what the choices' parsers found: reasoning tokens (counted here from the parsers'
    text unless the route counted them already) and tool-call outcomes by parser."""
    telemetry = state.llm.telemetry
    if reasoning_tokens is None:
        reasoning_tokens = sum(
            len(state.tokenizer.encode(text, add_special_tokens=False))
            for parser in parsers
            if (text := parser.reasoning_text)
        )
    telemetry.reasoning_tokens(reasoning_tokens)
    if (name := state.settings.tool_call_parser) is not None:
        for parser in parsers:
            telemetry.tool_calls(name, parser.tool_call_outcomes)
