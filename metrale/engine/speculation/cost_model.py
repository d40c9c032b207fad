"""When drafts pay: what a verified draft token costs at each batch size, measured at startup.

A step of `b` decodes takes `plain_s(b)` without drafts and `verify_s(b)` with K drafts each (the
runner times both, once warm, before any request arrives: `ModelRunner.measure_decode_s`). A
draft token then costs `(verify_s(b) - plain_s(b)) / (b K)` seconds, while the step brings
`b / plain_s(b)` tokens a second; drafting a request pays when its drafts bring, per draft token,
at least

    (verify_s(b) - plain_s(b)) / (b K) * b / plain_s(b) = (verify_s(b) / plain_s(b) - 1) / K

accepted tokens (`min_acceptance`). At batch 1 on a GPU a decode is bound by reading the
weights and a few more tokens are nearly free, so nearly any draft pays; at large batches the
step is bound by compute and a draft must be accepted most of the time. The speculator compares
each request's measured acceptance with this bar at the step's batch size (`speculator.py`);
batch sizes between those measured are interpolated, larger ones take the largest measured's.
"""

from __future__ import annotations

import bisect
import time
from collections.abc import Callable
from dataclasses import dataclass


@dataclass(frozen=True)
class VerifyCosts:
    """Seconds of a decode step of `batch_sizes[i]` sequences: `plain_s[i]` with no drafts,
    `verify_s[i]` with `num_drafts` drafts each."""

    num_drafts: int
    batch_sizes: tuple[int, ...]
    plain_s: tuple[float, ...]
    verify_s: tuple[float, ...]

    @classmethod
    def measure(
        cls,
        num_drafts: int,
        max_batch_size: int,
        step_s: Callable[[int, int], float],
        budget_s: float = 2.0,
    ) -> VerifyCosts:
        """Time `step_s(num_seqs, num_drafts)` (seconds of a decode step of `num_seqs`
        sequences with `num_drafts` drafts each) at powers of two up to `max_batch_size`, until
        about `budget_s` of startup is spent (a CPU's large steps are slow: larger batches then
        take the largest measured's bar)."""
        sizes = sorted({*(1 << i for i in range(max_batch_size.bit_length())), max_batch_size})
        measured, plain, verify = [], [], []
        start = time.perf_counter()
        for b in sizes:
            if measured and time.perf_counter() - start > budget_s:
                break
            measured.append(b)
            plain.append(step_s(b, 0))
            verify.append(step_s(b, num_drafts))
        return cls(num_drafts, tuple(measured), tuple(plain), tuple(verify))

    def min_acceptance(self, num_seqs: int) -> float:
        """Accepted tokens a draft token must bring, on average, for drafts to pay in a step of
        `num_seqs` decodes (0: they are free)."""
        num_seqs = min(max(num_seqs, 1), self.batch_sizes[-1])
        plain, verify = self._at(num_seqs)
        return max(verify / plain - 1.0, 0.0) / self.num_drafts

    def _at(self, num_seqs: int) -> tuple[float, float]:
        """(plain, verify) seconds at `num_seqs`, linear between the batch sizes measured."""
        sizes = self.batch_sizes
        i = bisect.bisect_left(sizes, num_seqs)
        if sizes[i] == num_seqs:
            return self.plain_s[i], self.verify_s[i]
        w = (num_seqs - sizes[i - 1]) / (sizes[i] - sizes[i - 1])
        return (
            self.plain_s[i - 1] * (1 - w) + self.plain_s[i] * w,
            self.verify_s[i - 1] * (1 - w) + self.verify_s[i] * w,
        )

    def describe(self) -> str:
        """One line for the startup log: the bar at each measured batch size."""
        return ", ".join(f"b={b}: {self.min_acceptance(b):.2f}" for b in self.batch_sizes)
