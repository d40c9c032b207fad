"""The Responses API request body (`POST /v1/responses`), validated at the HTTP edge.

As for chat (`server/protocol.py`): strict types, ranges named in the error, unknown fields
ignored so newer SDKs and clients keep working. Input items are told apart by `type` (a message
may leave it out, as the SDK's "easy" messages do); item kinds and content parts this server
cannot serve are refused by the route with the item's path, not here, so the message can say why.
Tools are kept as the dicts the client sent: hosted tools (`web_search`, ...) are legal input
that the route leaves out of the prompt with a warning.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import ConfigDict, Discriminator, Field, Tag, model_validator

from metrale.server.protocol import MAX_TOOLS, ContentPart, ExtraSamplingFields, _Body, _Open

MAX_INPUT_ITEMS = 10_000
MAX_METADATA_KEYS = 16


class MessageItem(_Body):
    type: Literal["message"] = "message"
    id: str | None = None
    role: Literal["user", "system", "developer", "assistant"]
    content: str | list[ContentPart]
    status: str | None = None


class FunctionCallItem(_Body):
    type: Literal["function_call"]
    id: str | None = None
    call_id: Annotated[str, Field(min_length=1)]
    name: Annotated[str, Field(min_length=1)]
    arguments: str
    namespace: str | None = None
    status: str | None = None


class FunctionCallOutputItem(_Body):
    type: Literal["function_call_output"]
    id: str | None = None
    call_id: Annotated[str, Field(min_length=1)]
    output: str | list[ContentPart]
    status: str | None = None


class ReasoningItem(_Body):
    type: Literal["reasoning"]
    id: str | None = None
    summary: list[ContentPart] = Field(default_factory=list)
    content: list[ContentPart] | None = None
    encrypted_content: str | None = None
    status: str | None = None


class OtherItem(_Body):
    """An item of a kind the route refuses by name (`item_reference`, `web_search_call`, ...)."""

    model_config = ConfigDict(strict=True, extra="allow")
    type: str


def _item_kind(value: Any) -> str:
    kind = value.get("type", "message") if isinstance(value, dict) else getattr(value, "type", "")
    return kind if isinstance(kind, str) and kind in _ITEM_KINDS else "other"


_ITEM_KINDS = {"message", "function_call", "function_call_output", "reasoning"}

InputItem = Annotated[
    Annotated[MessageItem, Tag("message")]
    | Annotated[FunctionCallItem, Tag("function_call")]
    | Annotated[FunctionCallOutputItem, Tag("function_call_output")]
    | Annotated[ReasoningItem, Tag("reasoning")]
    | Annotated[OtherItem, Tag("other")],
    Discriminator(_item_kind),
]


class Reasoning(_Body):
    effort: Literal["none", "minimal", "low", "medium", "high", "xhigh"] | None = None
    summary: Literal["auto", "concise", "detailed"] | None = None
    generate_summary: Literal["auto", "concise", "detailed"] | None = None  # the old name


class TextFormat(_Open):
    type: Literal["text", "json_object", "json_schema"]
    name: str | None = None
    schema_: Annotated[dict[str, Any] | None, Field(alias="schema")] = None
    strict: bool | None = None

    model_config = ConfigDict(strict=True, extra="allow", populate_by_name=True)


class TextConfig(_Body):
    format: TextFormat | None = None
    verbosity: Literal["low", "medium", "high"] | None = None


class ConversationRef(_Body):
    id: Annotated[str, Field(min_length=1)]


class ResponsesRequest(ExtraSamplingFields):
    model: str | None = None
    input: str | Annotated[list[InputItem], Field(max_length=MAX_INPUT_ITEMS)] | None = None
    instructions: str | None = None
    max_output_tokens: Annotated[int, Field(ge=1)] | None = None
    temperature: Annotated[float, Field(ge=0, le=2)] | None = None
    top_p: Annotated[float, Field(gt=0, le=1)] | None = None
    # vLLM's extras, as on chat.
    top_k: Annotated[int, Field(ge=-1)] | None = None
    min_p: Annotated[float, Field(ge=0, le=1)] | None = None
    seed: int | None = None
    tools: Annotated[list[dict[str, Any]], Field(max_length=MAX_TOOLS)] | None = None
    tool_choice: Literal["none", "auto", "required"] | dict[str, Any] | None = None
    parallel_tool_calls: bool = True
    max_tool_calls: Annotated[int, Field(ge=1)] | None = None
    reasoning: Reasoning | None = None
    text: TextConfig | None = None
    store: bool = True
    background: bool = False
    stream: bool = False
    metadata: Annotated[dict[str, str], Field(max_length=MAX_METADATA_KEYS)] | None = None
    user: str | None = None
    safety_identifier: str | None = None
    include: list[str] | None = None
    truncation: Literal["auto", "disabled"] = "disabled"
    previous_response_id: Annotated[str, Field(min_length=1)] | None = None
    conversation: Annotated[str, Field(min_length=1)] | ConversationRef | None = None
    prompt_cache_key: str | None = None
    client_metadata: dict[str, Any] | None = None
    service_tier: str | None = None
    top_logprobs: Annotated[int, Field(ge=0, le=20)] | None = None

    @model_validator(mode="after")
    def _consistent(self) -> ResponsesRequest:
        if self.previous_response_id is not None and self.conversation is not None:
            raise ValueError("previous_response_id and conversation cannot both be given")
        if self.background and not self.store:
            raise ValueError("background responses must be stored: set store to true")
        return self

    @property
    def conversation_id(self) -> str | None:
        if isinstance(self.conversation, ConversationRef):
            return self.conversation.id
        return self.conversation

    def input_items(self) -> list[Any]:
        if self.input is None:
            return []
        if isinstance(self.input, str):
            return [MessageItem(role="user", content=self.input)]
        return list(self.input)


__all__ = [
    "MAX_TOOLS",
    "FunctionCallItem",
    "FunctionCallOutputItem",
    "InputItem",
    "MessageItem",
    "OtherItem",
    "ReasoningItem",
    "ResponsesRequest",
]
