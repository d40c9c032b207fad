"""Host time by phase, with no profiler: methods wrapped in `perf_counter` pairs (~1 us a call).

torch's profiler and cProfile slow a host-bound step several times over; a wrapper around each
phase of interest keeps the host at its own speed. Used by `step_host.py` (GPU) and
`host_step_cpu.py`.
"""

from __future__ import annotations

import collections
import functools
import time
from collections.abc import Callable

import torch


class PhaseClock:
    """Seconds and calls per phase since the last `take()`; a phase nested in itself (a
    subclass's forward calling its base's) counts once."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = collections.Counter()
        self.calls: dict[str, int] = collections.Counter()
        self._open: set[str] = set()

    def wrap(self, owner, attr: str, phase: str | Callable[[tuple], str]) -> None:
        """Time `owner.attr` (a class's method or an object's attribute) as `phase`, or as the
        name `phase(args)` gives a call (one phase per kernel of a launcher's calls, say)."""
        inner = getattr(owner, attr)
        clock = self

        @functools.wraps(inner)
        def timed(*args, **kwargs):
            name = phase if isinstance(phase, str) else phase(args)
            if name in clock._open or torch.compiler.is_compiling():
                return inner(*args, **kwargs)
            clock._open.add(name)
            start = time.perf_counter()
            try:
                return inner(*args, **kwargs)
            finally:
                clock.seconds[name] += time.perf_counter() - start
                clock.calls[name] += 1
                clock._open.discard(name)

        setattr(owner, attr, timed)

    def take(self) -> tuple[dict[str, float], dict[str, int]]:
        taken = dict(self.seconds), dict(self.calls)
        self.seconds.clear()
        self.calls.clear()
        return taken
