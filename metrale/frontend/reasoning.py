"""Reasoning (``<think>...</think>``) split from content, incrementally.

Qwen3 and DeepSeek-R1 write their reasoning between ``<think>`` and ``</think>``. One state
machine serves streaming and non-streaming, as for tool parsers: ``feed`` each delta (or the
whole text once), then ``finish``; the collected reasoning and content are the same however
the text was split. Nothing is retracted: a tail that may be the start of a tag is held back.

Layout follows the Qwen3 template, which renders ``'<think>\\n' + reasoning.strip('\\n') +
'\\n</think>\\n\\n' + content.lstrip('\\n')``: newlines at either end of a block are layout and
dropped, as are newlines at the start of the content after a block. So the empty block that a
non-thinking turn writes, ``<think>\\n\\n</think>\\n\\n``, leaves no trace. Several blocks
concatenate their reasoning. A ``</think>`` with no open block is dropped.

Where the block opens matters: a template may write ``<think>`` into the prompt (DeepSeek-R1,
Qwen3 thinking models), so the output starts inside the block and only closes it. Such a
template-seeded block is told from one the model opens itself by looking at the prompt
(`prompt_opens_reasoning`); a model that repeats the seeded ``<think>`` is not taken to open a
second block, and reasoning left open when generation stops is still reasoning.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from metrale.frontend.tool_parsers.base import ContentDelta
from metrale.frontend.tool_parsers.tags import Match, find_first, match_tag, partial_tail_len


@dataclass(frozen=True, slots=True)
class ReasoningDelta:
    """Text for the assistant message's ``reasoning_content``."""

    text: str


ReasoningEvent = ReasoningDelta | ContentDelta


@dataclass(frozen=True)
class ReasoningFormat:
    start_tag: str
    end_tag: str
    # Whether the family's chat template writes the start tag into the generation prompt;
    # used when the prompt itself is not at hand.
    starts_in_reasoning: bool


_FORMATS: dict[str, ReasoningFormat] = {}


def register_reasoning_format(name: str, fmt: ReasoningFormat) -> None:
    if name in _FORMATS:
        raise ValueError(f"reasoning parser name {name!r} is already taken")
    _FORMATS[name] = fmt


def reasoning_format(name: str) -> ReasoningFormat:
    fmt = _FORMATS.get(name)
    if fmt is None:
        raise ValueError(
            f"unknown reasoning parser {name!r}; known: {', '.join(reasoning_parser_names())}"
        )
    return fmt


def reasoning_parser_names() -> list[str]:
    return sorted(_FORMATS)


register_reasoning_format("qwen3", ReasoningFormat("<think>", "</think>", False))
register_reasoning_format("deepseek_r1", ReasoningFormat("<think>", "</think>", True))


def prompt_opens_reasoning(prompt: str, fmt: ReasoningFormat) -> bool:
    """Whether the rendered prompt ends inside an open block: the model continues in it."""
    return prompt.rstrip().endswith(fmt.start_tag)


def make_reasoning_parser(name: str, *, prompt: str | None = None) -> ReasoningParser:
    """A fresh parser for one generation; pass the rendered ``prompt`` when there is one."""
    fmt = _FORMATS.get(name)
    if fmt is None:
        raise ValueError(
            f"unknown reasoning parser {name!r}; known: {', '.join(reasoning_parser_names())}"
        )
    seeded = fmt.starts_in_reasoning if prompt is None else prompt_opens_reasoning(prompt, fmt)
    return ReasoningParser(fmt, starts_in_reasoning=seeded)


class ReasoningParser:
    """Splits one generation into reasoning and content.

    ``_buffer`` holds the text not yet emitted: at most a partial tag, newlines whose role
    (layout or text) the next characters decide, or a model-written start tag that may repeat
    the seeded one.
    """

    def __init__(self, fmt: ReasoningFormat, *, starts_in_reasoning: bool) -> None:
        self._fmt = fmt
        self._in_reasoning = starts_in_reasoning
        self._seeded = starts_in_reasoning  # until the output shows something else
        self._at_edge = starts_in_reasoning  # just inside a block, or just after one
        self._buffer = ""
        self._held_newlines = ""  # reasoning's trailing newlines: layout if the block ends
        self._events: list[ReasoningEvent] = []
        self._finished = False

    def feed(self, text: str) -> list[ReasoningEvent]:
        if self._finished:
            raise RuntimeError("ReasoningParser.feed after finish: use one parser per generation")
        self._buffer += text
        self._run(final=False)
        return self._take()

    def finish(self) -> list[ReasoningEvent]:
        if self._finished:
            raise RuntimeError("ReasoningParser.finish called twice")
        self._finished = True
        self._run(final=True)
        return self._take()

    def _run(self, final: bool) -> None:
        while self._buffer:
            if self._at_edge and not self._skip_edge(final):
                return
            if self._in_reasoning:
                progressed = self._read_reasoning(final)
            else:
                progressed = self._read_content(final)
            if not progressed:
                return

    def _skip_edge(self, final: bool) -> bool:
        """Drop layout newlines at a block edge (and a repeated seeded start tag); False while
        the buffer cannot tell yet."""
        text = self._buffer.lstrip("\n")
        if self._seeded:
            match = match_tag(text, 0, self._fmt.start_tag, final)
            if match is Match.MORE:
                self._buffer = text
                return False
            if match is Match.YES:
                text = text[len(self._fmt.start_tag) :].lstrip("\n")
                self._seeded = False
        self._buffer = text
        if not text:
            return False
        self._at_edge = self._seeded = False
        return True

    def _read_reasoning(self, final: bool) -> bool:
        end_tag = self._fmt.end_tag
        at = self._buffer.find(end_tag)
        if at != -1:
            self._reasoning(self._buffer[:at], block_ends=True)
            self._buffer = self._buffer[at + len(end_tag) :]
            self._in_reasoning = False
            self._at_edge = True
            return True
        held = 0 if final else partial_tail_len(self._buffer, 0, (end_tag,))
        self._reasoning(self._buffer[: len(self._buffer) - held], block_ends=final)
        self._buffer = self._buffer[len(self._buffer) - held :]
        return False

    def _read_content(self, final: bool) -> bool:
        tags = (self._fmt.start_tag, self._fmt.end_tag)
        hit = find_first(self._buffer, 0, tags)
        if hit is not None:
            at, tag = hit
            self._content(self._buffer[:at])
            self._buffer = self._buffer[at + len(tag) :]
            self._in_reasoning = tag == self._fmt.start_tag
            self._at_edge = True  # a stray end tag is dropped, with the layout after it
            return True
        held = 0 if final else partial_tail_len(self._buffer, 0, tags)
        self._content(self._buffer[: len(self._buffer) - held])
        self._buffer = self._buffer[len(self._buffer) - held :]
        return False

    def _reasoning(self, text: str, *, block_ends: bool) -> None:
        text = self._held_newlines + text
        body = text.rstrip("\n")
        self._held_newlines = "" if block_ends else text[len(body) :]
        if body:
            self._emit(ReasoningDelta(body))

    def _content(self, text: str) -> None:
        if text:
            self._emit(ContentDelta(text))

    def _emit(self, event: ReasoningEvent) -> None:
        last = self._events[-1] if self._events else None
        if type(last) is type(event):
            self._events[-1] = type(event)(last.text + event.text)  # type: ignore[union-attr]
        else:
            self._events.append(event)

    def _take(self) -> list[ReasoningEvent]:
        events, self._events = self._events, []
        return events


def collect_reasoning(events: Iterable[ReasoningEvent]) -> tuple[str, str]:
    """Fold an event stream into (reasoning, content)."""
    reasoning: list[str] = []
    content: list[str] = []
    for event in events:
        (reasoning if isinstance(event, ReasoningDelta) else content).append(event.text)
    return "".join(reasoning), "".join(content)
