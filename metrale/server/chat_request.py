"""How a chat request becomes a prompt and sampling parameters, for every API family.

The chat template renders the messages; the request's thinking budget, grammar (a forced tool
call, `response_format`, `structured_outputs`) and tool-call limits become engine parameters;
and each choice gets the reasoning and tool-call parsers its text goes through. The OpenAI and
Anthropic routes share all of it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
from typing import Any

from metrale.frontend.chat_output import ChatOutputParser
from metrale.frontend.reasoning import (
    make_reasoning_parser,
    prompt_opens_reasoning,
    reasoning_format,
)
from metrale.frontend.tool_parsers import make_tool_parser, tool_specs
from metrale.sampling_params import SamplingParams, StructuredOutput, ThinkingBudget
from metrale.server.errors import APIError
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
