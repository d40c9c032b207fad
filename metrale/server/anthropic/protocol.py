"""The Anthropic Messages API request bodies, validated at the HTTP edge and nowhere else.

As for the OpenAI bodies: strict types, ranges checked with messages that name the field, and
unknown fields ignored (`cache_control`, `metadata`, `service_tier`, `citations`, ...), so newer
SDKs and Claude Code keep working. Content blocks are a union tagged by `type`, so an error
names the block at fault. `translate.py` turns these into the chat route's request at once.

A message's role may be `system` as well as `user` and `assistant`: Claude Code 2.1 sends one
inside `messages` (its mid-conversation tool-changes beta). Which blocks each role may hold is
`translate.py`'s check, so the error names the block and says where it belongs.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import Field, field_validator, model_validator

from metrale.server.protocol import MAX_STOP_SEQUENCES, MAX_TOOLS, ExtraSamplingFields, _Body

# The largest max_tokens accepted, whatever the context window: Anthropic's own ceiling (Claude
# Opus's 128k output tokens). Below it, a max_tokens past the window is no error (the reply runs
# to the window's end); above it, it is a mistake.
MAX_OUTPUT_TOKENS = 128_000


class TextBlock(_Body):
    type: Literal["text"]
    text: str


class MediaBlock(_Body):
    """An image or a document: accepted by the schema so the route can refuse it clearly."""

    type: Literal["image", "document"]


class ToolUseBlock(_Body):
    type: Literal["tool_use"]
    id: str
    name: str
    input: dict[str, Any]


class ToolResultBlock(_Body):
    type: Literal["tool_result"]
    tool_use_id: str
    content: str | list[Annotated[TextBlock | MediaBlock, Field(discriminator="type")]] = ""


class ThinkingBlock(_Body):
    type: Literal["thinking"]
    thinking: str


class RedactedThinkingBlock(_Body):
    """Thinking another server encrypted; opaque here, so it is dropped from the prompt."""

    type: Literal["redacted_thinking"]


ContentBlock = Annotated[
    TextBlock | MediaBlock | ToolUseBlock | ToolResultBlock | ThinkingBlock | RedactedThinkingBlock,
    Field(discriminator="type"),
]


class Message(_Body):
    role: Literal["user", "assistant", "system"]
    content: str | list[ContentBlock]


class Tool(_Body):
    type: str | None = None
    name: Annotated[str, Field(min_length=1)]
    description: str | None = None
    input_schema: dict[str, Any]

    @field_validator("type")
    @classmethod
    def _custom_only(cls, value: str | None) -> str | None:
        if value not in (None, "custom"):
            raise ValueError(
                f"{value!r} is one of Anthropic's server tools, which this server does not run; "
                f"give client tools (name, description, input_schema)"
            )
        return value


class ToolChoice(_Body):
    type: Literal["auto", "any", "tool", "none"]
    name: str | None = None  # with type "tool"
    disable_parallel_tool_use: bool | None = None

    @model_validator(mode="after")
    def _named(self) -> ToolChoice:
        if self.type == "tool" and not self.name:
            raise ValueError("tool_choice.name: required when tool_choice.type is 'tool'")
        return self


class ThinkingConfig(_Body):
    """`enabled` and `adaptive` render the prompt with thinking on, `disabled` with it off."""

    type: Literal["enabled", "adaptive", "disabled"]
    budget_tokens: Annotated[int, Field(ge=1024)] | None = None

    @model_validator(mode="after")
    def _budget_given(self) -> ThinkingConfig:
        if self.type == "enabled" and self.budget_tokens is None:
            raise ValueError("thinking.budget_tokens: required when thinking.type is 'enabled'")
        return self


class CountTokensRequest(_Body):
    """What decides the prompt; `POST /v1/messages/count_tokens` takes exactly this."""

    model: str
    messages: Annotated[list[Message], Field(min_length=1)]
    system: str | list[TextBlock] | None = None
    tools: Annotated[list[Tool], Field(max_length=MAX_TOOLS)] | None = None
    tool_choice: ToolChoice | None = None
    thinking: ThinkingConfig | None = None


class Metadata(_Body):
    user_id: Annotated[str, Field(max_length=256)] | None = None


class MessagesRequest(CountTokensRequest, ExtraSamplingFields):
    max_tokens: Annotated[int, Field(ge=1)]
    stop_sequences: (
        Annotated[list[Annotated[str, Field(min_length=1)]], Field(max_length=MAX_STOP_SEQUENCES)]
        | None
    ) = None
    metadata: Metadata | None = None
    temperature: Annotated[float, Field(ge=0, le=1)] | None = None
    top_p: Annotated[float, Field(gt=0, le=1)] | None = None
    top_k: Annotated[int, Field(ge=0)] | None = None
    stream: bool = False

    @field_validator("max_tokens")
    @classmethod
    def _max_tokens_ceiling(cls, value: int) -> int:
        if value > MAX_OUTPUT_TOKENS:
            raise ValueError(
                f"{value} > {MAX_OUTPUT_TOKENS}, which is the maximum allowed number of output "
                f"tokens"
            )
        return value
