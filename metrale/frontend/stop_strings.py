"""Stop strings, matched on streamed text without ever leaking a partial match.

Text that could still turn out to be the start of a stop string is held back until the next
delta settles it, so a client never sees characters that a later match would have cut.
"""

from __future__ import annotations


class StopStringMatcher:
    def __init__(self, stop: tuple[str, ...], include_in_output: bool = False) -> None:
        self.stop = stop
        self.include_in_output = include_in_output
        self._held = ""

    def feed(self, text: str, final: bool = False) -> tuple[str, str | None]:
        """(the text now safe to emit, the stop string that matched, if one did)."""
        if not self.stop:
            return text, None
        buffer = self._held + text
        match_at, matched = len(buffer), None
        for stop in self.stop:
            at = buffer.find(stop)
            if at != -1 and at < match_at:
                match_at, matched = at, stop
        if matched is not None:
            self._held = ""
            end = match_at + len(matched) if self.include_in_output else match_at
            return buffer[:end], matched
        if final:
            self._held = ""
            return buffer, None
        hold = self._partial_match_len(buffer)
        self._held = buffer[len(buffer) - hold :]
        return buffer[: len(buffer) - hold], None

    def _partial_match_len(self, text: str) -> int:
        """Length of the longest suffix of `text` that begins some stop string."""
        longest = 0
        for stop in self.stop:
            for n in range(min(len(stop) - 1, len(text)), longest, -1):
                if stop.startswith(text[-n:]):
                    longest = n
                    break
        return longest
