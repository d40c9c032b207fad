"""Prompt-lookup (n-gram) drafts: the tokens that followed the latest earlier occurrence of the
sequence's end.

A request's `NgramIndex` maps each n-gram of its tokens (`ngram_min <= n <= ngram_max`) to where
its latest occurrence ended, among the positions before the last: the end itself never matches
itself. Appending a token registers the n-grams ending one position earlier, so each token costs
`ngram_max - ngram_min + 1` dictionary writes and nothing rescans the history. A proposal tries
the longest n first: the end's n-gram, looked up, gives the position it last ended at, and the
tokens after that position are the draft.

`may_match_after_one_more` tells, before the next token is known, whether any next token could
end in a match: the `ngram_min - 1` tokens before it must have ended earlier too (so those
shorter n-grams are registered as well). A scheduler that would wait for a pending token only to
look its drafts up asks it first.

Memory: one entry per distinct n-gram per length, at most `(ngram_max - ngram_min + 2)` per
token of the request (prompt and output), freed with the request.
"""

from __future__ import annotations

from collections.abc import Iterable


class NgramIndex:
    """One request's tokens and where each of their n-grams last ended."""

    def __init__(self, ngram_min: int, ngram_max: int) -> None:
        if not 1 <= ngram_min <= ngram_max:
            raise ValueError(
                f"ngram_min={ngram_min}, ngram_max={ngram_max}: need 1 <= ngram_min <= ngram_max"
            )
        self.ngram_min, self.ngram_max = ngram_min, ngram_max
        self._shortest = max(1, ngram_min - 1)  # registered: what a match needs before its end
        self.tokens: list[int] = []
        self._last_end: dict[tuple[int, ...], int] = {}

    def __len__(self) -> int:
        return len(self.tokens)

    def extend(self, token_ids: Iterable[int]) -> None:
        tokens = self.tokens
        for token_id in token_ids:
            end = len(tokens) - 1  # the end so far becomes an earlier position
            if end >= 0:
                for n in range(self._shortest, min(self.ngram_max, end + 1) + 1):
                    self._last_end[tuple(tokens[end - n + 1 : end + 1])] = end
            tokens.append(token_id)

    def match(self) -> tuple[int, int] | None:
        """(n, position) of the longest n-gram ending the tokens that also ended earlier, at its
        latest earlier occurrence; None when none does."""
        tokens = self.tokens
        for n in range(min(self.ngram_max, len(tokens)), self.ngram_min - 1, -1):
            end = self._last_end.get(tuple(tokens[len(tokens) - n :]))
            if end is not None:
                return n, end
        return None

    def propose(self, num_tokens: int) -> list[int]:
        """Up to `num_tokens` draft tokens (none without a match)."""
        found = self.match()
        if found is None:
            return []
        _, end = found
        return self.tokens[end + 1 : end + 1 + num_tokens]

    def may_match_after_one_more(self) -> bool:
        """Whether the tokens with some token appended could end in an n-gram that ended
        earlier: exactly when their last `ngram_min - 1` tokens ended earlier (a longer match
        holds a shorter one); for `ngram_min == 1`, when there is any token to repeat."""
        n = self.ngram_min - 1
        if n == 0:
            return bool(self.tokens)
        return (
            len(self.tokens) >= n and tuple(self.tokens[len(self.tokens) - n :]) in self._last_end
        )
