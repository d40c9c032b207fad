"""A Responses request as the chat route's request, so both share one prompt and one parser.

The conversation is a list of items (the stored history, then this request's input); they
become chat messages:

  * `instructions` is the first system message (it is not carried over from a previous
    response: each request gives its own, as OpenAI's API has it);
  * a `message` item is a message of its role (`developer` stays developer: the chat renderer
    makes it the template's system turn); its text parts (`input_text`, `output_text`, `text`,
    `refusal`) join; image, file and audio parts are refused, as this server serves text;
  * `function_call` items join the assistant message before them (a reply's text and its calls
    are one turn) or open one; `function_call_output` items are `tool` messages;
  * a `reasoning` item becomes the next assistant turn's `reasoning_content`: its text is the
    item's content, else its summary, else this server's own `encrypted_content` (see
    `items.py`: the reasoning text, so clients that keep only the opaque field, as Codex does,
    give the model its thinking back); another server's encrypted content cannot be read and
    is dropped.

Tools come in the Responses shape (`name`, `parameters` at the top level). `namespace` tools
are flattened: each nested tool is offered as `namespace.name`, and a call to it comes back with
`namespace` and `name` apart, as the client named them. Hosted tools (`web_search`,
`file_search`, `code_interpreter`, ...) run on OpenAI's side; they are left out of the prompt and
named in the response's warnings, since clients such as Codex send them on every request.
"""

from __future__ import annotations

import base64
import binascii
from dataclasses import dataclass, field
from typing import Any

import pydantic

from metrale.server.errors import APIError, validation_error
from metrale.server.openai.responses.protocol import (
    FunctionCallItem,
    FunctionCallOutputItem,
    MessageItem,
    ReasoningItem,
    ResponsesRequest,
)
from metrale.server.protocol import (
    ChatCompletionRequest,
    ChatMessage,
    ContentPart,
    FunctionCall,
    ToolCall,
)

TEXT_PARTS = {"input_text", "output_text", "text", "refusal", "summary_text", "reasoning_text"}
# What this server writes in `encrypted_content`: the reasoning text, base64-encoded.
ENCRYPTED_PREFIX = "metrale.v1."
EFFORTS = {"xhigh": "high"}  # efforts past chat's scale, onto its nearest


@dataclass
class ToolSet:
    """The request's function tools in the chat route's shape, and how to name calls back."""

    tools: list[dict[str, Any]] = field(default_factory=list)
    namespaces: dict[str, tuple[str, str]] = field(default_factory=dict)  # flat -> (ns, name)
    warnings: list[str] = field(default_factory=list)

    def call_name(self, flat: str) -> tuple[str | None, str]:
        """A call's (namespace, name) as the client named its tool."""
        namespace, name = self.namespaces.get(flat, (None, flat))
        return namespace, name

    def flat_name(self, namespace: str | None, name: str) -> str:
        return name if not namespace else f"{namespace}.{name}"


def tool_set(tools: list[dict[str, Any]] | None) -> ToolSet:
    out = ToolSet()
    for i, tool in enumerate(tools or []):
        kind = tool.get("type")
        if kind == "function":
            out.tools.append(_function_tool(tool, f"tools.{i}", None))
        elif kind == "namespace":
            namespace = tool.get("name")
            nested = tool.get("tools")
            if not isinstance(namespace, str) or not namespace or not isinstance(nested, list):
                raise APIError(
                    f"tools.{i}: a namespace tool needs a name and a list of tools",
                    param=f"tools.{i}",
                )
            for j, inner in enumerate(nested):
                param = f"tools.{i}.tools.{j}"
                if not isinstance(inner, dict) or inner.get("type", "function") != "function":
                    raise APIError(f"{param}: a namespace holds function tools", param=param)
                chat_tool = _function_tool(inner, param, namespace)
                out.namespaces[chat_tool["function"]["name"]] = (namespace, inner["name"])
                out.tools.append(chat_tool)
        elif isinstance(kind, str):
            out.warnings.append(
                f"tools.{i}: {kind!r} is a tool OpenAI hosts; this server cannot run it, so it "
                f"was left out"
            )
        else:
            raise APIError(f"tools.{i}: a tool needs a type", param=f"tools.{i}")
    names = [t["function"]["name"] for t in out.tools]
    if len(set(names)) != len(names):
        twice = sorted({n for n in names if names.count(n) > 1})
        raise APIError(f"tools: names must be unique; given twice: {twice}", param="tools")
    return out


def _function_tool(tool: dict[str, Any], param: str, namespace: str | None) -> dict[str, Any]:
    name = tool.get("name")
    if not isinstance(name, str) or not name:
        raise APIError(f"{param}.name: a function tool needs a name", param=f"{param}.name")
    parameters = tool.get("parameters")
    if parameters is not None and not isinstance(parameters, dict):
        raise APIError(f"{param}.parameters: a JSON schema object", param=f"{param}.parameters")
    function: dict[str, Any] = {"name": name if namespace is None else f"{namespace}.{name}"}
    if isinstance(tool.get("description"), str):
        function["description"] = tool["description"]
    function["parameters"] = parameters or {"type": "object", "properties": {}}
    if isinstance(tool.get("strict"), bool):
        function["strict"] = tool["strict"]
    return {"type": "function", "function": function}


def chat_request(
    body: ResponsesRequest, items: list[Any], tools: ToolSet, *, prefill: bool = False
) -> ChatCompletionRequest:
    """The chat route's request for the conversation `items` (history, then input)."""
    messages = []
    if body.instructions:
        messages.append(ChatMessage(role="system", content=body.instructions))
    messages += chat_messages(items, tools)
    if not messages:
        raise APIError("input: give at least one input item (or instructions)", param="input")
    reasoning = body.reasoning
    effort = reasoning.effort if reasoning is not None else None
    try:
        return ChatCompletionRequest(
            messages=messages,
            max_completion_tokens=body.max_output_tokens,
            temperature=body.temperature,
            top_p=body.top_p,
            top_k=body.top_k,
            min_p=body.min_p,
            **body.extra_sampling_fields(),
            seed=body.seed,
            tools=tools.tools or None,
            tool_choice=_tool_choice(body.tool_choice, tools),
            parallel_tool_calls=body.parallel_tool_calls,
            reasoning_effort=EFFORTS.get(effort, effort) if effort else None,
            response_format=_response_format(body),
            add_generation_prompt=not prefill,
            continue_final_message=prefill,
        )
    except pydantic.ValidationError as e:
        raise validation_error(e) from None


def chat_messages(items: list[Any], tools: ToolSet) -> list[ChatMessage]:
    messages: list[ChatMessage] = []
    reasoning: list[str] = []  # reasoning items waiting for their assistant turn
    for i, item in enumerate(items):
        if isinstance(item, MessageItem):
            text = _text(item.content, f"input.{i}.content")
            if item.role == "assistant":
                messages.append(_assistant(text, reasoning))
            else:
                messages.append(ChatMessage(role=item.role, content=text))
        elif isinstance(item, FunctionCallItem):
            name = tools.flat_name(item.namespace, item.name)
            call = ToolCall(
                id=item.call_id, function=FunctionCall(name=name, arguments=item.arguments)
            )
            last = messages[-1] if messages else None
            if last is None or last.role != "assistant" or reasoning:
                last = _assistant(None, reasoning)
                messages.append(last)
            last.tool_calls = [*(last.tool_calls or []), call]
        elif isinstance(item, FunctionCallOutputItem):
            output = _text(item.output, f"input.{i}.output")
            messages.append(ChatMessage(role="tool", content=output, tool_call_id=item.call_id))
        elif isinstance(item, ReasoningItem):
            if (text := reasoning_text(item)) is not None:
                reasoning.append(text)
        else:
            raise APIError(
                f"input.{i}: items of type {item.type!r} are not supported here (use message, "
                f"function_call, function_call_output or reasoning items)",
                param=f"input.{i}",
            )
    return messages


def _assistant(text: str | None, reasoning: list[str]) -> ChatMessage:
    message = ChatMessage(
        role="assistant", content=text, reasoning_content="\n\n".join(reasoning) or None
    )
    reasoning.clear()
    return message


def reasoning_text(item: ReasoningItem) -> str | None:
    for parts in (item.content, item.summary):
        if parts:
            return "\n\n".join(part.text or "" for part in parts)
    return decode_reasoning(item.encrypted_content)


def encode_reasoning(text: str) -> str:
    return ENCRYPTED_PREFIX + base64.b64encode(text.encode()).decode()


def decode_reasoning(encrypted: str | None) -> str | None:
    if not encrypted or not encrypted.startswith(ENCRYPTED_PREFIX):
        return None
    try:
        return base64.b64decode(encrypted.removeprefix(ENCRYPTED_PREFIX), validate=True).decode()
    except (binascii.Error, UnicodeDecodeError):
        return None


def _text(content: str | list[ContentPart], param: str) -> str:
    if isinstance(content, str):
        return content
    texts = []
    for j, part in enumerate(content):
        if part.type not in TEXT_PARTS:
            raise APIError(
                f"{param}.{j}: parts of type {part.type!r} are not supported (this server "
                f"serves text only)",
                param=f"{param}.{j}",
            )
        texts.append(part.text if part.text is not None else getattr(part, "refusal", "") or "")
    return "".join(texts)


def _tool_choice(choice: str | dict[str, Any] | None, tools: ToolSet) -> Any:
    if choice is None or isinstance(choice, str):
        return choice
    kind = choice.get("type")
    if kind == "function":
        name = choice.get("name")
        if not isinstance(name, str):
            raise APIError("tool_choice: a function choice needs a name", param="tool_choice")
        flat = tools.flat_name(choice.get("namespace"), name)
        return {"type": "function", "function": {"name": flat}}
    if kind == "allowed_tools":
        mode = choice.get("mode", "auto")
        allowed = {t.get("name") for t in choice.get("tools") or [] if isinstance(t, dict)}
        tools.tools = [t for t in tools.tools if t["function"]["name"] in allowed]
        if mode not in ("auto", "required"):
            raise APIError("tool_choice.mode: auto or required", param="tool_choice.mode")
        return mode
    raise APIError(
        f"tool_choice: {kind!r} names a tool this server cannot run; use auto, none, required "
        f"or a function",
        param="tool_choice",
    )


def _response_format(body: ResponsesRequest) -> Any:
    fmt = body.text.format if body.text is not None else None
    if fmt is None or fmt.type == "text":
        return None
    if fmt.type == "json_object":
        return {"type": "json_object"}
    if fmt.schema_ is None:
        raise APIError(
            "text.format.schema: a json_schema format needs a schema", param="text.format.schema"
        )
    spec = {"name": fmt.name or "response", "schema": fmt.schema_}
    if fmt.strict is not None:
        spec["strict"] = fmt.strict
    return {"type": "json_schema", "json_schema": spec}
