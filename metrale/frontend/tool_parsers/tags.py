"""Matching fixed tags in text that may stop in the middle of one.

A streaming parser must not decide on ``<tool_ca`` until the next delta shows whether it is
``<tool_call>``; these helpers answer "yes", "no" or "need more text" for that.
"""

from __future__ import annotations

from collections.abc import Sequence
from enum import Enum


class Match(Enum):
    YES = "yes"
    NO = "no"
    MORE = "more"  # the text so far is a proper prefix of the tag


def match_tag(text: str, pos: int, tag: str, final: bool) -> Match:
    if text.startswith(tag, pos):
        return Match.YES
    if not final and tag.startswith(text[pos:]):
        return Match.MORE
    return Match.NO


def match_any(text: str, pos: int, tags: Sequence[str], final: bool) -> tuple[str | None, bool]:
    """(the tag at ``pos``, or None; whether more text could still make one match)."""
    more = False
    for tag in tags:
        match = match_tag(text, pos, tag, final)
        if match is Match.YES:
            return tag, False
        more = more or match is Match.MORE
    return None, more


def find_first(text: str, start: int, tags: Sequence[str]) -> tuple[int, str] | None:
    """The earliest (index, tag) at or after ``start``; the longer tag wins a tie."""
    best: tuple[int, str] | None = None
    for tag in tags:
        at = text.find(tag, start)
        if at != -1 and (
            best is None or at < best[0] or (at == best[0] and len(tag) > len(best[1]))
        ):
            best = (at, tag)
    return best


def partial_tail_len(text: str, start: int, tags: Sequence[str]) -> int:
    """Length of the longest tail of ``text[start:]`` that is a proper prefix of some tag."""
    longest = 0
    for tag in tags:
        for n in range(min(len(tag) - 1, len(text) - start), longest, -1):
            if text.endswith(tag[:n]):
                longest = n
                break
    return longest


def skip_space(text: str, pos: int) -> int:
    while pos < len(text) and text[pos].isspace():
        pos += 1
    return pos
