"""One choice's generated text, split into reasoning, content and tool calls as it streams.

The reasoning parser sees the text first (a model may write `<tool_call>` while it thinks); its
content goes on to the tool-call parser. Both are incremental state machines that serve the
streaming and the non-streaming path alike, so the two can never disagree.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from metrale.frontend.reasoning import ReasoningDelta, ReasoningEvent, ReasoningParser
from metrale.frontend.tool_parsers import (
    ContentDelta,
    ToolCallArguments,
    ToolCallStart,
    ToolParser,
    count_outcomes,
)


@dataclass
class ToolCallDelta:
    """A new call (`id` and `name` set, first) or a piece of a call's JSON arguments."""

    index: int
    id: str | None = None
    name: str | None = None
    arguments: str = ""


@dataclass
class ChatDelta:
    reasoning: str = ""
    content: str = ""
    tool_calls: list[ToolCallDelta] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.reasoning or self.content or self.tool_calls)


class ChatOutputParser:
    """`max_tool_calls`: calls past this many are dropped (`parallel_tool_calls: false`). The
    engine stops after the first call where the format marks a call's end; this holds the line
    for the formats that do not, on the streaming and the non-streaming path alike. Dropped
    calls are not counted in `tool_call_outcomes` either."""

    def __init__(
        self,
        reasoning: ReasoningParser | None,
        tools: ToolParser | None,
        max_tool_calls: int | None = None,
    ) -> None:
        self._reasoning = reasoning
        self._tools = tools
        self._max_tool_calls = max_tool_calls
        self.num_tool_calls = 0
        self._reasoning_pieces: list[str] = []

    @property
    def reasoning_text(self) -> str:
        """All the reasoning split off so far."""
        return "".join(self._reasoning_pieces)

    @property
    def tool_call_outcomes(self) -> dict[str, int]:
        """The tool parser's `ToolParser.outcomes` for the calls delivered: calls dropped by
        ``max_tool_calls`` are left out, not counted under any outcome. Empty without a tool
        parser; final once `finish` has returned."""
        if self._tools is None:
            return {}
        delivered = self._tools.call_outcomes[: self._max_tool_calls]
        return count_outcomes(delivered, self._tools.num_text_outcomes)

    def feed(self, text: str) -> ChatDelta:
        if self._reasoning is None:
            return self._route(text, ChatDelta())
        return self._split(self._reasoning.feed(text))

    def finish(self) -> ChatDelta:
        delta = ChatDelta()
        if self._reasoning is not None:
            delta = self._split(self._reasoning.finish())
        if self._tools is not None:
            self._apply_tool_events(self._tools.finish(), delta)
        return delta

    def _split(self, events: list[ReasoningEvent]) -> ChatDelta:
        delta = ChatDelta()
        for event in events:
            if isinstance(event, ReasoningDelta):
                delta.reasoning += event.text
                self._reasoning_pieces.append(event.text)
            elif isinstance(event, ContentDelta):
                self._route(event.text, delta)
        return delta

    def _route(self, content: str, delta: ChatDelta) -> ChatDelta:
        if self._tools is None:
            delta.content += content
        else:
            self._apply_tool_events(self._tools.feed(content), delta)
        return delta

    def _apply_tool_events(self, events: list, delta: ChatDelta) -> None:
        for event in events:
            if isinstance(event, ContentDelta):
                delta.content += event.text
            elif self._max_tool_calls is not None and event.index >= self._max_tool_calls:
                continue
            elif isinstance(event, ToolCallStart):
                self.num_tool_calls += 1
                delta.tool_calls.append(ToolCallDelta(event.index, event.id, event.name))
            elif isinstance(event, ToolCallArguments):
                last = delta.tool_calls[-1] if delta.tool_calls else None
                if last is not None and last.index == event.index:
                    last.arguments += event.text
                else:
                    delta.tool_calls.append(ToolCallDelta(event.index, arguments=event.text))
