"""The tool-call event model and the parser interface.

A tool parser reads the text a model generates and splits it into content and tool calls. The
same incremental state machine serves streaming and non-streaming: streaming calls `feed` with
each text delta, non-streaming calls `feed(whole_text)` once, and both end with `finish`.
Because only the delta boundaries differ, the collected content and calls are identical.

What stays true of every event stream a parser returns:
  * events are final: nothing is retracted, so text that may still turn into a tool-call
    opener (a partial ``<tool_call``) is held back rather than emitted as content;
  * `ToolCallStart` carries the complete name and comes before any of that call's arguments;
  * the `ToolCallArguments` pieces of one call concatenate to one JSON object (``{}`` at least),
    and a call's pieces all arrive before the next call starts;
  * model output never raises: malformed text becomes content or a repaired call.

A parser also says how it settled each would-be call (`CallOutcome`): every `ToolCallStart`
it emits is counted once as parsed or repaired, at the latest when `finish` returns, and every
opener it left as content once as text. The counts, like the events, do not depend on where
the deltas were cut.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from enum import StrEnum
from typing import ClassVar

from metrale.frontend.tool_parsers.schema import ToolSpec


@dataclass(frozen=True, slots=True)
class ContentDelta:
    """Text for the assistant message's ``content``."""

    text: str


@dataclass(frozen=True, slots=True)
class ToolCallStart:
    """A tool call begins; ``index`` counts calls from 0 in the order they start."""

    index: int
    id: str
    name: str


@dataclass(frozen=True, slots=True)
class ToolCallArguments:
    """The next piece of the JSON ``arguments`` string of call ``index``."""

    index: int
    text: str


Event = ContentDelta | ToolCallStart | ToolCallArguments


@dataclass(frozen=True, slots=True)
class ToolCall:
    id: str
    name: str
    arguments: str  # a JSON object, as text


def collect(events: Iterable[Event]) -> tuple[str, list[ToolCall]]:
    """Fold an event stream into (content, calls), as a non-streaming response reports them."""
    content: list[str] = []
    starts: list[ToolCallStart] = []
    arguments: list[list[str]] = []
    for event in events:
        if isinstance(event, ContentDelta):
            content.append(event.text)
        elif isinstance(event, ToolCallStart):
            starts.append(event)
            arguments.append([])
        else:
            arguments[event.index].append(event.text)
    calls = [
        ToolCall(start.id, start.name, "".join(pieces))
        for start, pieces in zip(starts, arguments, strict=True)
    ]
    return "".join(content), calls


class CallOutcome(StrEnum):
    """How a parser settled one would-be call: the ``outcome`` label of tool-call metrics."""

    PARSED = "parsed"  # a call the model wrote well-formed
    REPAIRED = "repaired"  # a call, once the parser closed or fixed it (cut short, broken...)
    TEXT = "text"  # it opened like a call, but could not be read as one: left as content


def count_outcomes(call_outcomes: Iterable[CallOutcome], num_text: int) -> dict[str, int]:
    """Outcome name -> count, every outcome present: ``call_outcomes`` of calls, plus
    ``num_text`` would-be calls left as text."""
    counts = {outcome.value: 0 for outcome in CallOutcome}
    for outcome in call_outcomes:
        counts[outcome.value] += 1
    counts[CallOutcome.TEXT.value] += num_text
    return counts


@dataclass(frozen=True)
class ToolParserOptions:
    """What a parser knows about the request.

    ``tools`` maps function names to their schemas; formats that write argument values as
    untyped text (the XML ones) use it to give each value its JSON type. Call ids are
    ``id_prefix`` followed by the call index, so a stream and a whole-text parse agree on them.
    """

    tools: Mapping[str, ToolSpec] = field(default_factory=dict)
    id_prefix: str = "call_"


class ToolParser(ABC):
    """One request's tool-call parser: feed text deltas, then finish once.

    The class also describes its format to the request that uses it: the marker strings the
    text must keep, the end of one call, and the grammar that forces a call.
    """

    # The fixed strings that frame calls (openers, closers, separators). Where a tokenizer has
    # one as a special token, detokenization must keep it, or this parser never sees it.
    markers: ClassVar[tuple[str, ...]] = ()
    # The text that ends one call, after which the reply may stop (`parallel_tool_calls:
    # false`); None when the format has no such marker.
    call_end: ClassVar[str | None] = None

    @classmethod
    def call_grammar(cls, tools: Sequence[ToolSpec], *, several: bool = False) -> str | None:
        """An EBNF grammar (xgrammar's dialect) for a reply that is one call to one of ``tools``;
        with ``several``, one or more such calls, laid out as the format writes parallel
        calls. None if the format has none.

        Whatever the grammar accepts, this parser reads back as exactly those calls (one
        without ``several``), each with arguments the tool's JSON schema accepts as far as the
        format can write them. Raises ValueError when a tool cannot be written in the format.
        """
        return None

    @abstractmethod
    def feed(self, text: str) -> list[Event]:
        """Take the next text delta; return the events it settles (possibly none)."""

    @abstractmethod
    def finish(self) -> list[Event]:
        """The generation ended: flush held-back text and close or repair an open call."""

    @property
    @abstractmethod
    def call_outcomes(self) -> Sequence[CallOutcome]:
        """PARSED or REPAIRED for each call started so far whose outcome is settled, by call
        index. A call is settled once nothing read after it can change its outcome (the next
        call starts, or its block ends); when `finish` has returned, every call is."""

    @property
    @abstractmethod
    def num_text_outcomes(self) -> int:
        """How many would-be calls were left as content (TEXT)."""

    @property
    def in_block(self) -> bool:
        """Whether the parser is inside a block that is or may become a call (its text is not
        content, or not yet): what `ChatOutputParser` does not count as prose."""
        return False

    @property
    def outcomes(self) -> dict[str, int]:
        """``{"parsed": n, "repaired": n, "text": n}`` so far; final once `finish` returned."""
        return count_outcomes(self.call_outcomes, self.num_text_outcomes)
