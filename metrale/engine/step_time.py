"""How long a step takes for the prompt tokens it prefills, learned from the steps run.

A step that prefills, as a decoding request sees it (the time between its tokens), is modelled
as `base_s + s_per_token * P + s_per_pair * A`: P the prompt tokens it prefills, A the
attention pairs they make (a chunk of n tokens from position s attends to `n * (s + (n + 1) /
2)` positions, counted in units of PAIRS_UNIT), so a late chunk of a long prompt costs more
than an early one. The three are fit by least squares over the recent steps that prefilled,
each step's weight decaying by DECAY per step after it, so the fit follows the batch as it
grows and shrinks. The base is not a decode-only step's time: on a GPU decode-only steps
replay a CUDA graph while a step that prefills launches its kernels one by one, which costs the
H200 tens of milliseconds at the 8B shape whatever the chunk. Where the steps seen cannot tell
the terms apart, fewer are fit: without the pairs term, then (all steps of one size) a line
from the decode-only steps' mean time to theirs.

The slai policy asks it how many tokens of a prompt a step can take and still end within the
deadline (`PrefillBudget` in `scheduling_policy.py`).
"""

from __future__ import annotations

import math
from collections.abc import Iterable

import numpy as np

DECAY = 0.98  # per step: a step 35 steps ago counts half
PAIRS_UNIT = 1024.0  # attention pairs are counted in units of this many (a token at 1K context)
# The steps that prefilled must spread this much (the standard deviation of their sizes, as a
# share of their mean) for a fit of their own; below it the decode-only steps anchor the line.
MIN_SPREAD = 0.1


def chunk_pairs(start_pos: int, num_tokens: int) -> float:
    """The attention pairs of a prompt chunk, in PAIRS_UNIT: token i attends to start + i + 1."""
    return num_tokens * (start_pos + (num_tokens + 1) / 2) / PAIRS_UNIT


def prefill_work(chunks: Iterable[tuple[int, int]]) -> tuple[int, float]:
    """(prompt tokens, attention pairs) of a step's prompt chunks, given as (start, tokens)."""
    tokens, pairs = 0, 0.0
    for start, n in chunks:
        tokens += n
        pairs += chunk_pairs(start, n)
    return tokens, pairs


class StepTimeModel:
    def __init__(self) -> None:
        # decayed normal equations of the steps that prefilled: X^T X and X^T t, X = (1, P, A)
        self._xx = np.zeros((3, 3))
        self._xt = np.zeros(3)
        self._decode_w = self._decode_t = 0.0  # decayed weight and time sum of decode-only steps
        self.coefficients: tuple[float, float, float] | None = None  # (base, per token, per pair)

    def observe(self, tokens: int, pairs: float, seconds: float) -> None:
        """A step that prefilled `tokens` prompt tokens making `pairs` attention pairs (0 and
        0.0: a decode-only step) took `seconds`."""
        self._xx *= DECAY
        self._xt *= DECAY
        self._decode_w *= DECAY
        self._decode_t *= DECAY
        if tokens:
            x = np.array([1.0, tokens, pairs])
            self._xx += np.outer(x, x)
            self._xt += x * seconds
        else:
            self._decode_w += 1.0
            self._decode_t += seconds
        self.coefficients = self._fit()

    def _fit(self) -> tuple[float, float, float] | None:
        w, sum_p = self._xx[0, 0], self._xx[0, 1]
        if w == 0:
            return None
        mean_p, mean_t = sum_p / w, self._xt[0] / w
        if self._xx[1, 1] / w - mean_p * mean_p > (MIN_SPREAD * mean_p) ** 2:
            for terms in ([0, 1, 2], [0, 1]):
                fit = self._solve(terms)
                if fit is not None and all(c >= 0 for c in fit[1:]) and fit[1] + fit[2] > 0:
                    return fit
        if self._decode_w > 0 and mean_p > 0:  # one size: a line from the decode-only steps
            slope = (mean_t - self._decode_t / self._decode_w) / mean_p
            if slope > 0:
                return mean_t - slope * mean_p, slope, 0.0
        return None

    def _solve(self, terms: list[int]) -> tuple[float, float, float] | None:
        xx, xt = self._xx[np.ix_(terms, terms)], self._xt[terms]
        if np.linalg.cond(xx) > 1e12:
            return None
        solved = np.linalg.solve(xx, xt)
        full = [0.0, 0.0, 0.0]
        for term, value in zip(terms, solved, strict=True):
            full[term] = float(value)
        return full[0], full[1], full[2]

    def seconds(self, start_pos: int, num_tokens: int) -> float:
        """What a chunk adds to a step (the fit's per-token and per-pair terms)."""
        assert self.coefficients is not None
        _, per_token, per_pair = self.coefficients
        return per_token * num_tokens + per_pair * chunk_pairs(start_pos, num_tokens)

    def tokens_within(self, seconds: float, start_pos: int) -> int:
        """The most tokens of a prompt, from `start_pos`, a chunk may take and add at most
        `seconds` to its step (0 if none). Needs a fit."""
        assert self.coefficients is not None
        if seconds <= 0:
            return 0
        _, b, c = self.coefficients
        # b n + c n (s + (n + 1) / 2) / U <= seconds:  (c / 2U) n^2 + (b + c (s + 1/2) / U) n
        quad, lin = c / (2 * PAIRS_UNIT), b + c * (start_pos + 0.5) / PAIRS_UNIT
        if quad == 0:
            return int(seconds / lin)
        return int((-lin + math.sqrt(lin * lin + 4 * quad * seconds)) / (2 * quad))
