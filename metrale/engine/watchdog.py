"""The content-loop watchdog: a generation whose last tokens are one block repeated ends.

A block of `p` tokens (1 <= p <= MAX_PERIOD) counts as looping once it has repeated
`max(min_repeats, ceil(MIN_SPAN / p))` times back to back at the end of the output, so a short
block must cover MIN_SPAN tokens (a rule of `-` or a run of newlines is not a loop; sixteen of
them twice over is). Each token is checked in constant numpy work: for every lag `p`, `runs[p]`
counts the consecutive tokens so far equal to the token `p` before them; the tail of length
`p * r` is `r` copies of one block exactly when `runs[p] >= p * (r - 1)`.
"""

from __future__ import annotations

import math

import numpy as np

DEFAULT_MIN_REPEATS = 4  # copies of a block that make a loop, unless told otherwise
MAX_PERIOD = 64  # tokens in the longest block watched
MIN_SPAN = 32  # tokens a loop must cover at least
STOP_REASON = "content_loop"  # the stop_reason of a generation the watchdog ended


class LoopDetector:
    def __init__(self, min_repeats: int, max_period: int = MAX_PERIOD, min_span: int = MIN_SPAN):
        if min_repeats < 2:
            raise ValueError(f"content_loop_min_repeats must be >= 2, got {min_repeats}")
        periods = np.arange(1, max_period + 1)
        repeats = np.maximum(min_repeats, np.ceil(min_span / periods)).astype(np.int64)
        self._needed = periods * (repeats - 1)  # runs[p] this long: the tail loops
        self._lags = periods
        self._ring = np.full(max_period, -1, dtype=np.int64)  # the last tokens, by position
        self._runs = np.zeros(max_period, dtype=np.int64)
        self._count = 0

    def push(self, token_id: int) -> int | None:
        """Take the next output token; the period of the loop it completes, if it does."""
        seen = np.minimum(self._lags, self._count)  # lags past the start compare to nothing
        before = self._ring[(self._count - self._lags) % len(self._ring)]
        same = (before == token_id) & (seen == self._lags)
        self._runs = np.where(same, self._runs + 1, 0)
        self._ring[self._count % len(self._ring)] = token_id
        self._count += 1
        looping = np.flatnonzero(self._runs >= self._needed)
        return int(looping[0]) + 1 if looping.size else None


def repeats_needed(period: int, min_repeats: int) -> int:
    """How many copies of a block of `period` tokens end a generation."""
    return max(min_repeats, math.ceil(MIN_SPAN / period))
