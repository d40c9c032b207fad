"""One choice's generated text, split into reasoning, content and tool calls as it streams.

The reasoning parser sees the text first (a model may write `<tool_call>` while it thinks); its
content goes on to the tool-call parser. Both are incremental state machines that serve the
streaming and the non-streaming path alike, so the two can never disagree.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from metrale.frontend.output_processor import CompletionDelta
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


# The stop_reason (and watchdog label) of a choice ended by `max_inter_tool_prose`.
INTER_TOOL_PROSE = "inter_tool_prose"


class ChatOutputParser:
    """`max_tool_calls`: calls past this many are dropped (`parallel_tool_calls: false`). The
    engine stops after the first call where the format marks a call's end; this holds the line
    for the formats that do not, on the streaming and the non-streaming path alike. Dropped
    calls are not counted in `tool_call_outcomes` either.

    `max_inter_tool_prose`: once a call has started, the content tokens since the last call
    started (prose; not reasoning, not the text of a block that is or may become a call) are
    counted, and the delta that brings them to this many ends the choice (`take`): a
    tool-calling turn that drifts into prose between its calls ends there, as the turn's
    calls are what the client acts on. Tokens are counted per delta: a delta's tokens are
    prose when it left the parser outside a block and carried no reasoning.
    """

    def __init__(
        self,
        reasoning: ReasoningParser | None,
        tools: ToolParser | None,
        max_tool_calls: int | None = None,
        max_inter_tool_prose: int | None = None,
    ) -> None:
        self._reasoning = reasoning
        self._tools = tools
        self._max_tool_calls = max_tool_calls
        self._max_prose = max_inter_tool_prose or None
        self.num_tool_calls = 0
        self.prose_tokens = 0  # since the last call started; counted after the first
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

    @property
    def counts_per_delta(self) -> bool:
        """Whether what it does depends on how the tokens are split into deltas (the prose
        bound ends a choice at a delta's end): such a choice's deltas must not be merged."""
        return self._max_prose is not None and self._tools is not None

    @property
    def prose_overrun(self) -> bool:
        """The prose since the last call reached `max_inter_tool_prose`."""
        return self._max_prose is not None and self.prose_tokens >= self._max_prose

    def take(self, delta: CompletionDelta) -> ChatDelta:
        """`feed` an engine delta's text, its tokens counted; when that brings the prose since
        the last call to `max_inter_tool_prose`, `delta` becomes the choice's last: finished
        (`stop`, which a route reports as tool calls), `stop_reason` and `watchdog`
        INTER_TOOL_PROSE. The stream that yielded it then ends its engine request
        (`stream_deltas`). The caller still calls `finish` for a finished delta."""
        parsed = self.feed(delta.text, len(delta.token_ids))
        if self.prose_overrun and not delta.finished:
            delta.finish_reason = "stop"
            delta.stop_reason = delta.watchdog = INTER_TOOL_PROSE
        return parsed

    def feed(self, text: str, num_tokens: int = 0) -> ChatDelta:
        """The next piece of text, which `num_tokens` tokens made (for the prose count)."""
        if self._reasoning is None:
            delta = self._route(text, ChatDelta())
        else:
            delta = self._split(self._reasoning.feed(text))
        if self.counts_per_delta:
            if any(call.name is not None for call in delta.tool_calls):
                self.prose_tokens = 0
            elif self.num_tool_calls and not delta.reasoning and not self._tools.in_block:
                self.prose_tokens += num_tokens
        return delta

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
