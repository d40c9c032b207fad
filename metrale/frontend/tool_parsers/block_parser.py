"""The shared frame of every format: content, with tool calls in blocks that an opener starts.

`BlockParser` scans content for the format's openers (``<tool_call>``, ``[TOOL_CALLS]``...),
holding back a tail that may be the start of one. At an opener it hands the text to the
format's `BlockReader` until the block ends. A block that started no call was not a tool call
after all: its raw text, opener included, is content. Whitespace between a call and the next
opener, or the end of output, is layout and dropped; before content it is kept.

What stays true: ``_buffer`` holds exactly the text not yet attributed to content or to a
call. An open block's raw text stays there until the block commits to a call, so an
uncommitted block can still fall back to content; after that it is trimmed as it is read.

Outcomes: a block that started no call counts as text. A block's calls count as parsed
unless its reader noted a repair, or the block ended other than as the format closes one (cut
short, or broken off by text that does not fit): that counts its last call as repaired.

A fault inside a parser (a bug, never a property of the model output) is contained: the open
call is closed with valid arguments (repaired), and the rest of the output passes through as
content.
"""

from __future__ import annotations

import logging
from abc import ABC, abstractmethod
from collections.abc import Sequence
from typing import ClassVar

from metrale.frontend.tool_parsers.base import CallOutcome, Event, ToolParser, ToolParserOptions
from metrale.frontend.tool_parsers.sink import EventSink
from metrale.frontend.tool_parsers.tags import find_first, match_any, partial_tail_len, skip_space

logger = logging.getLogger(__name__)


class BlockReader(ABC):
    """Reads one block from just after its opener. Keeps no positions across `read` calls:
    the parser may trim the text it already consumed."""

    committed = False  # a call has started: the block's text belongs to calls, not content
    # Whether the block ended as the format closes one (at its closing tag); None for formats
    # with no closing marker. A committed block that ends with False had its last call
    # repaired.
    closed: bool | None = None

    @abstractmethod
    def read(self, text: str, pos: int, final: bool) -> tuple[int, bool]:
        """Consume ``text`` from ``pos``: (position reached, whether the block ended there).

        Text from the returned position on is offered again, with more, on the next call. An
        ended block leaves no call open. With ``final`` (no more text) the block must end.
        """


class BlockParser(ToolParser):
    openers: ClassVar[tuple[str, ...]] = ()

    def __init__(self, options: ToolParserOptions) -> None:
        self.options = options
        self.sink = EventSink(options.id_prefix)
        self._buffer = ""
        self._pos = 0  # how far the open block has read into _buffer
        self._block: BlockReader | None = None
        self._after_call = False  # the last thing read was a call: whitespace is layout
        self._faulted = False
        self._finished = False

    @abstractmethod
    def open_block(self, opener: str) -> BlockReader:
        """The reader for a block that ``opener`` starts."""

    def locate_block(self, text: str, final: bool) -> tuple[int, str | None]:
        """(where content surely ends, the opener of the block that starts there or None).

        Text after the returned end is held: it may be the start of an opener.
        """
        hit = find_first(text, 0, self.openers)
        if hit is not None:
            return hit
        hold = 0 if final else partial_tail_len(text, 0, self.openers)
        return len(text) - hold, None

    def feed(self, text: str) -> list[Event]:
        if self._finished:
            raise RuntimeError("ToolParser.feed after finish: use one parser per generation")
        if self._faulted:
            self.sink.content(text)
        else:
            self._buffer += text
            self._run_guarded(final=False)
        return self.sink.take()

    @property
    def call_outcomes(self) -> Sequence[CallOutcome]:
        return self.sink.call_outcomes

    @property
    def in_block(self) -> bool:
        return self._block is not None

    @property
    def num_text_outcomes(self) -> int:
        return self.sink.num_text_outcomes

    def finish(self) -> list[Event]:
        if self._finished:
            raise RuntimeError("ToolParser.finish called twice")
        self._finished = True
        if not self._faulted:
            self._run_guarded(final=True)
        return self.sink.take()

    def _run_guarded(self, final: bool) -> None:
        try:
            self._run(final)
        except Exception:
            logger.exception(
                "%s failed on model output; passing the rest through as content",
                type(self).__name__,
            )
            self._faulted = True
            block = self._block
            self.sink.close_open_call()
            if block is None:
                self.sink.content(self._buffer)
            elif block.committed:  # broken off: its last call counts as repaired
                self.sink.settle(repaired=True)
                self.sink.content(self._buffer[self._pos :])
            else:
                self.sink.left_as_text(self._buffer)
            self._buffer, self._pos, self._block = "", 0, None

    def _run(self, final: bool) -> None:
        while True:
            block = self._block
            if block is None:
                if not self._read_content(final):
                    return
                continue
            self._pos, ended = block.read(self._buffer, self._pos, final)
            if ended:
                self._end_block(block)
                continue
            if final:
                raise RuntimeError(f"{type(block).__name__} did not end with the output")
            if block.committed:
                self._buffer, self._pos = self._buffer[self._pos :], 0
            return

    def _end_block(self, block: BlockReader) -> None:
        if self.sink.call_open:
            raise RuntimeError(f"{type(block).__name__} ended with a call open")
        if not block.committed and self._pos == 0:  # it would be opened again, forever
            raise RuntimeError(f"{type(block).__name__} ended without reading its opener")
        if block.committed:
            self.sink.settle(repaired=block.closed is False)
            self._after_call = True
        else:
            self.sink.left_as_text(self._buffer[: self._pos])
        self._buffer, self._pos, self._block = self._buffer[self._pos :], 0, None

    def _read_content(self, final: bool) -> bool:
        """Emit the content in the buffer; True if a block opened."""
        text = self._buffer
        if self._after_call:
            start = skip_space(text, 0)
            if start == len(text):
                if final:
                    self._buffer, self._after_call = "", False
                return False
            opener, more = match_any(text, start, self.openers, final)
            if more:
                return False
            self._after_call = False
            if opener is not None:
                text = text[start:]
        content_end, opener = self.locate_block(text, final)
        self.sink.content(text[:content_end])
        self._buffer = text[content_end:]
        if opener is None:
            return False
        self._pos = len(opener)
        self._block = self.open_block(opener)
        return True
