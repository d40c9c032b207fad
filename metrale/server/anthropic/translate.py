"""An Anthropic request as the chat route's request, so both share one prompt and one parser.

The chat route already renders messages through the chat template, tokenizes, builds sampling
parameters and parses reasoning and tool calls; an Anthropic request becomes a
`ChatCompletionRequest` here and goes through the same functions. What changes on the way:

  * `system` (a string or text blocks) becomes the first message, with Claude Code's volatile
    billing header removed (see `normalize_system`);
  * a `system` message inside `messages` (Claude Code 2.1 sends one on a process's first
    request, for its mid-conversation tool changes) stays a system message where it stands,
    normalized as `system` is, and dropped when that leaves it empty; only text blocks belong in
    it. The demo template, as Qwen3's, renders a system message past the first as a system turn
    in place, so nothing is moved: moving its text into the leading system message would change
    the prompt's start, and with it the prefix cache of the whole conversation. A template that
    refuses a system message past the first (Qwen3.5's "System message must be at the
    beginning.") answers a 400 naming the template's complaint; folding the text into the
    leading system message for such a template is the fallback to add where the prompt is
    rendered, since only there is the template known;
  * an assistant turn's `thinking` blocks become `reasoning_content`, its `tool_use` blocks
    `tool_calls` (arguments as the input object), and `redacted_thinking` is dropped;
  * a user turn's `tool_result` blocks become `tool` messages, in order with its text;
  * text blocks of one turn join with a newline, as vLLM joins text parts;
  * a final assistant turn is a prefill: the reply continues it (a final system message is not);
  * `thinking` maps to the template's `enable_thinking`, when the request says.
"""

from __future__ import annotations

import re
from typing import Any

import pydantic

from metrale.server.anthropic.protocol import (
    CountTokensRequest,
    MediaBlock,
    Message,
    TextBlock,
    ThinkingBlock,
    ToolChoice,
    ToolResultBlock,
    ToolUseBlock,
)
from metrale.server.errors import APIError, validation_error
from metrale.server.protocol import ChatCompletionRequest, ChatMessage, FunctionCall, ToolCall

# Claude Code opens its system prompt with a line like `x-anthropic-billing-header:
# cc_version=2.1.117.48f; cc_entrypoint=cli; cch=71fea;` whose hashes change on every request.
# It means nothing to the model, and left in, it would make every prompt differ from the
# previous turn's a few tokens in, so the prefix cache could never serve a turn.
BILLING_HEADER = re.compile(r"\Ax-anthropic-billing-header:[^\n]*\n?")


def normalize_system(system: str | list[TextBlock] | None) -> str:
    """The system prompt's text, without a leading billing-header line in any block."""
    if system is None:
        return ""
    texts = [system] if isinstance(system, str) else [block.text for block in system]
    return "\n".join(t for t in (BILLING_HEADER.sub("", text) for text in texts) if t)


def chat_request(body: CountTokensRequest, **sampling: Any) -> ChatCompletionRequest:
    """The chat route's request for `body`; `sampling` adds its knobs (stop, temperature, ...)."""
    messages = []
    system = normalize_system(body.system)
    if system:
        messages.append(ChatMessage(role="system", content=system))
    for i, message in enumerate(body.messages):
        messages.extend(_chat_messages(i, message))
    prefill = body.messages[-1].role == "assistant"
    template_kwargs = None
    if body.thinking is not None:
        template_kwargs = {"enable_thinking": body.thinking.type != "disabled"}
    tools = [
        {
            "type": "function",
            "function": {
                "name": tool.name,
                "description": tool.description or "",
                "parameters": tool.input_schema,
            },
        }
        for tool in body.tools or []
    ]
    try:
        return ChatCompletionRequest(
            messages=messages,
            tools=tools or None,
            tool_choice=_tool_choice(body.tool_choice),
            parallel_tool_calls=False
            if body.tool_choice is not None and body.tool_choice.disable_parallel_tool_use
            else None,
            chat_template_kwargs=template_kwargs,
            add_generation_prompt=not prefill,
            continue_final_message=prefill,
            **sampling,
        )
    except pydantic.ValidationError as e:
        raise validation_error(e) from None


def _tool_choice(choice: ToolChoice | None) -> str | dict[str, Any] | None:
    """Anthropic's tool_choice in OpenAI's terms: any = required, tool = a named function."""
    if choice is None:
        return None
    if choice.type == "tool":
        return {"type": "function", "function": {"name": choice.name}}
    return {"any": "required"}.get(choice.type, choice.type)


def _chat_messages(i: int, message: Message) -> list[ChatMessage]:
    if message.role == "system":
        return _system_messages(i, message)
    if isinstance(message.content, str):
        return [ChatMessage(role=message.role, content=message.content)]
    if message.role == "assistant":
        return [_assistant_message(i, message)]
    out: list[ChatMessage] = []
    texts: list[str] = []
    for j, block in enumerate(message.content):
        if isinstance(block, TextBlock):
            texts.append(block.text)
        elif isinstance(block, ToolResultBlock):
            if texts:
                out.append(ChatMessage(role="user", content="\n".join(texts)))
                texts = []
            out.append(
                ChatMessage(
                    role="tool",
                    content=_tool_result_text(f"messages.{i}.content.{j}.content", block),
                    tool_call_id=block.tool_use_id,
                )
            )
        elif isinstance(block, MediaBlock):
            raise _media_error(f"messages.{i}.content.{j}", block)
        else:
            raise APIError(
                f"messages.{i}.content.{j}: a {block.type!r} block belongs in an assistant "
                f"message, not a user message",
                param=f"messages.{i}.content.{j}",
            )
    if texts or not out:
        out.append(ChatMessage(role="user", content="\n".join(texts)))
    return out


def _system_messages(i: int, message: Message) -> list[ChatMessage]:
    """A system message inside `messages`: its text, or nothing when there is none."""
    if isinstance(message.content, str):
        text = normalize_system(message.content)
    else:
        texts = []
        for j, block in enumerate(message.content):
            if not isinstance(block, TextBlock):
                raise APIError(
                    f"messages.{i}.content.{j}: a system message holds text blocks only, not "
                    f"{block.type!r} blocks; send this one in a user or assistant message",
                    param=f"messages.{i}.content.{j}",
                )
            texts.append(block)
        text = normalize_system(texts)
    return [ChatMessage(role="system", content=text)] if text else []


def _assistant_message(i: int, message: Message) -> ChatMessage:
    texts, thoughts, calls = [], [], []
    for j, block in enumerate(message.content):
        if isinstance(block, TextBlock):
            texts.append(block.text)
        elif isinstance(block, ThinkingBlock):
            thoughts.append(block.thinking)
        elif isinstance(block, ToolUseBlock):
            calls.append(
                ToolCall(id=block.id, function=FunctionCall(name=block.name, arguments=block.input))
            )
        elif isinstance(block, MediaBlock):
            raise _media_error(f"messages.{i}.content.{j}", block)
        elif isinstance(block, ToolResultBlock):
            raise APIError(
                f"messages.{i}.content.{j}: a 'tool_result' block belongs in a user message, "
                f"after the assistant message with its tool_use",
                param=f"messages.{i}.content.{j}",
            )
    return ChatMessage(
        role="assistant",
        content="\n".join(texts),
        reasoning_content="\n".join(thoughts) if thoughts else None,
        tool_calls=calls or None,
    )


def _tool_result_text(param: str, block: ToolResultBlock) -> str:
    if isinstance(block.content, str):
        return block.content
    for k, part in enumerate(block.content):
        if isinstance(part, MediaBlock):
            raise _media_error(f"{param}.{k}", part)
    return "\n".join(part.text for part in block.content if isinstance(part, TextBlock))


def _media_error(param: str, block: MediaBlock) -> APIError:
    return APIError(
        f"{param}: {block.type} blocks are not supported until we serve vision; send text",
        param=param,
    )
