"""`--auto-compact`: a conversation too long for the context is shortened before it is
tokenized for good, step by step, each step only if the one before did not make it fit:

1. `truncate_tool_results`: the middle tool results keep their head and tail;
2. `omit_tool_results`: they become a one-line pointer;
3. `drop_oldest_turns`: the oldest middle turns go, a user message and what answers it
   together (an assistant's tool calls stay with their results), as few as make it fit;
4. `trim_system`: the system prompt keeps its head;
5. `last_messages`: only the system prompt and the last user turn (and what follows it) stay.

"Middle" is everything between the leading system messages and the last user turn, which are
never touched before step 4. The response says what happened: the `x-metrale-compacted` header
names the steps taken and `usage.compacted` carries them with the prompt's tokens before and
after (both filled from the request's record, `access_log`).
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from metrale.server import access_log

HEADER = access_log.COMPACTED_HEADER.decode()
TOOL_RESULT_KEEP_CHARS = 256  # of a truncated tool result's head, and as many of its tail
SYSTEM_KEEP_CHARS = 2000
OMITTED = "[tool result omitted by auto-compact: {n} characters]"
TRUNCATED = "\n[... {n} characters truncated by auto-compact ...]\n"

Messages = list[dict[str, Any]]


@dataclass(frozen=True)
class Compaction:
    steps: tuple[str, ...]
    prompt_tokens_before: int
    prompt_tokens_after: int
    messages_before: int
    messages_after: int

    def usage_field(self) -> dict[str, Any]:
        return {
            "compacted": {
                "steps": list(self.steps),
                "prompt_tokens_before": self.prompt_tokens_before,
                "prompt_tokens_after": self.prompt_tokens_after,
                "messages_before": self.messages_before,
                "messages_after": self.messages_after,
            }
        }


def compact(messages: Messages, fits: Callable[[Messages], bool]) -> tuple[Messages, list[str]]:
    """The first of the ever shorter versions of `messages` that fits (the very list `fits`
    accepted), and the steps taken to it; ValueError if not even the last step's does."""
    head, original, tail = _split(messages)
    steps: list[str] = []

    def attempt(name: str, candidate: Messages) -> Messages | None:
        steps.append(name)
        return candidate if fits(candidate) else None

    middle = [_truncated(m) for m in original]
    if (done := attempt("truncate_tool_results", head + middle + tail)) is not None:
        return done, steps
    middle = [_omitted(m) for m in original]
    if (done := attempt("omit_tool_results", head + middle + tail)) is not None:
        return done, steps
    groups = _turns(middle)
    if len(groups) > 1:
        steps.append("drop_oldest_turns")
        # the fewest of the oldest turns to drop (fitting only gets easier with more dropped),
        # keeping the latest middle turn: the last step drops that too
        fitted = None
        low, high = 1, len(groups)
        while low < high:
            mid = (low + high) // 2
            candidate = head + _flatten(groups[mid:]) + tail
            if fits(candidate):
                high, fitted = mid, candidate
            else:
                low = mid + 1
        if fitted is not None:
            return fitted, steps
        middle = _flatten(groups[-1:])
    head = [_trimmed_system(m) for m in head]
    if (done := attempt("trim_system", head + middle + tail)) is not None:
        return done, steps
    if (done := attempt("last_messages", head + tail)) is not None:
        return done, steps
    raise ValueError("even the system prompt's head and the last user turn alone do not fit")


def record(report: Compaction) -> None:
    """Keep the report on the request's record, for the header and the usage."""
    if (rec := access_log.current_record()) is not None:
        rec.compaction = report


def usage_field() -> dict[str, Any]:
    """`{"compacted": ...}` for the usage of a request that was compacted, else nothing."""
    rec = access_log.current_record()
    return {} if rec is None or rec.compaction is None else rec.compaction.usage_field()


def _split(messages: Messages) -> tuple[Messages, Messages, Messages]:
    """(leading system messages, the middle, the last user turn onwards)."""
    start = 0
    while start < len(messages) and messages[start]["role"] == "system":
        start += 1
    last_user = max(
        (i for i in range(start, len(messages)) if messages[i]["role"] == "user"), default=None
    )
    end = len(messages) if last_user is None else last_user
    end = max(end, start)
    return messages[:start], messages[start:end], messages[end:]


def _turns(middle: Messages) -> list[Messages]:
    """The middle cut before each user message: a turn holds a user message and everything
    that answers it, so tool calls and their results are never parted."""
    groups: list[Messages] = []
    for message in middle:
        if message["role"] == "user" or not groups:
            groups.append([])
        groups[-1].append(message)
    return groups


def _flatten(groups: list[Messages]) -> Messages:
    return [m for group in groups for m in group]


def _truncated(message: dict[str, Any]) -> dict[str, Any]:
    text = message.get("content")
    keep = TOOL_RESULT_KEEP_CHARS
    if message["role"] != "tool" or not isinstance(text, str) or len(text) <= 2 * keep + 64:
        return message
    out = copy.copy(message)
    out["content"] = text[:keep] + TRUNCATED.format(n=len(text) - 2 * keep) + text[-keep:]
    return out


def _omitted(message: dict[str, Any]) -> dict[str, Any]:
    if message["role"] != "tool":
        return message
    out = copy.copy(message)
    out["content"] = OMITTED.format(n=len(message.get("content") or ""))
    return out


def _trimmed_system(message: dict[str, Any]) -> dict[str, Any]:
    text = message.get("content")
    if not isinstance(text, str) or len(text) <= SYSTEM_KEEP_CHARS:
        return message
    out = copy.copy(message)
    out["content"] = text[:SYSTEM_KEEP_CHARS] + TRUNCATED.format(n=len(text) - SYSTEM_KEEP_CHARS)
    return out
