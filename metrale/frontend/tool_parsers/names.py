"""What counts as a function or parameter name in model output.

Names delimit structure in the tag formats (``<function=NAME>``, ``call:NAME{``), so a name
is refused as soon as it holds a character no name has: that keeps prose such as
``<tool_call> is a tag`` from being read as a call, and a missing delimiter from holding
text back for long.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from enum import Enum

from metrale.frontend.tool_parsers.tags import find_first, partial_tail_len

MAX_NAME_CHARS = 256
_FORBIDDEN = frozenset("<>{}[]\"'`=,;")


def may_start_name(text: str) -> bool:
    """Whether ``text`` could still be (the beginning of) a name."""
    return len(text) <= MAX_NAME_CHARS and not any(
        ch.isspace() or ch in _FORBIDDEN or not ch.isprintable() for ch in text
    )


def is_valid_name(text: str) -> bool:
    return bool(text) and may_start_name(text)


class NameScan(Enum):
    FOUND = "found"
    INVALID = "invalid"
    MORE = "more"  # no delimiter yet, and what there is could still be a name


def scan_name(
    text: str,
    pos: int,
    delimiters: Sequence[str],
    final: bool,
    clean: Callable[[str], str] = str.strip,
) -> tuple[NameScan, str, int, str]:
    """Read a name that runs from ``pos`` to the first delimiter.

    Returns (status, the cleaned name, where the delimiter is, which delimiter); the last three
    are meaningful only for FOUND.
    """
    hit = find_first(text, pos, delimiters)
    if hit is not None:
        name = clean(text[pos : hit[0]])
        return (NameScan.FOUND if is_valid_name(name) else NameScan.INVALID), name, *hit
    held = partial_tail_len(text, pos, delimiters)
    if final or not may_start_name(clean(text[pos : len(text) - held])):
        return NameScan.INVALID, "", pos, ""
    return NameScan.MORE, "", pos, ""
