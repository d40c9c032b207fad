"""Each sampled row's random numbers, drawn on the host before the step.

A row needs three uniform draws in [0, 1) a step, one per column: the token it samples (the
inverse CDF of its distribution, `kernels/inverse_cdf.py`), whether it keeps the draft it checks,
and whether XTC fires. They travel to the device with the row's other sampling parameters, so
sampling launches no random-number kernel, and a batch of seeded requests costs what one does.

A seeded request's draws are a function of its seed and the position of the token being sampled
alone: SplitMix64 keyed by the seed, counting over (position, column). So its tokens do not depend
on what shares its batch, on preemption or swap (no generator state to carry), or on the device.
A position sampled again (after a rejected draft, or a thinking block closed early) reuses its
draws on a context that they did not decide, which keeps it a fair draw. Other rows take theirs
from one host generator.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

TOKEN, DRAFT, XTC = 0, 1, 2  # the columns
NUM_DRAWS = 3

_GAMMA = np.uint64(0x9E3779B97F4A7C15)  # SplitMix64's increment (the golden ratio)
_MIX1 = np.uint64(0xBF58476D1CE4E5B9)
_MIX2 = np.uint64(0x94D049BB133111EB)


def _mix(z: np.ndarray) -> np.ndarray:
    """SplitMix64's finalizer: a bijection of uint64 that scatters every input bit."""
    z = (z ^ (z >> np.uint64(30))) * _MIX1
    z = (z ^ (z >> np.uint64(27))) * _MIX2
    return z ^ (z >> np.uint64(31))


def _keys(seeds: Sequence[int]) -> np.ndarray:
    return _mix(np.array([s % 2**64 for s in seeds], dtype=np.uint64))


def _keyed_draws(keys: np.ndarray, positions: np.ndarray) -> np.ndarray:
    counters = positions.astype(np.uint64)[:, None] * np.uint64(NUM_DRAWS)
    counters = counters + np.arange(NUM_DRAWS, dtype=np.uint64)
    bits = _mix(keys[:, None] + (counters + np.uint64(1)) * _GAMMA)
    return (bits >> np.uint64(11)).astype(np.float64) * 2.0**-53


def seeded_draws(seeds: Sequence[int], positions: Sequence[int]) -> np.ndarray:
    """[n, NUM_DRAWS] float64 in [0, 1): row i's draws for seed `seeds[i]` (any int64) at token
    position `positions[i]`."""
    return _keyed_draws(_keys(seeds), np.array(positions, dtype=np.uint64))


@dataclass(frozen=True)
class Seeds:
    """A batch's seeds (None: an unseeded row), keyed once for the steps that share them."""

    rows: np.ndarray  # int64, the seeded rows
    keys: np.ndarray  # uint64, their SplitMix64 keys

    @classmethod
    def of(cls, seeds: Sequence[int | None]) -> Seeds:
        rows = [i for i, seed in enumerate(seeds) if seed is not None]
        return cls(np.array(rows, dtype=np.int64), _keys([seeds[i] for i in rows]))


class RandomDraws:
    """Fills a step's draws: seeded rows from their seed and position, the others from one
    generator (`seed` None: fresh entropy)."""

    def __init__(self, seed: int | None = None) -> None:
        self._rng = np.random.default_rng(seed)

    def fill(self, out: np.ndarray, seeds: Seeds, positions: Sequence[int]) -> None:
        """`out[:n]` (a [rows, NUM_DRAWS] float64 array) for the n rows sampling the tokens at
        `positions`: the seeded rows of `seeds` from their seed, the others from the generator
        (drawn only when some row is unseeded)."""
        n = len(positions)
        if len(seeds.rows) < n:
            out[:n] = self._rng.random((n, NUM_DRAWS))
        if len(seeds.rows):
            at = np.array(positions, dtype=np.uint64)[seeds.rows]
            out[seeds.rows] = _keyed_draws(seeds.keys, at)
