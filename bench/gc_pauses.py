"""Time a benchmark's process spends in Python's garbage collector."""

from __future__ import annotations

import gc
import time


class GcPauses:
    """Seconds this process has spent in the garbage collector since `seconds` was last reset
    (every collection, of any generation, from its start to its end)."""

    def __init__(self) -> None:
        self.seconds = 0.0
        self._start = 0.0
        gc.callbacks.append(self._on_collection)

    def _on_collection(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._start = time.perf_counter()
        else:
            self.seconds += time.perf_counter() - self._start

    def close(self) -> None:
        gc.callbacks.remove(self._on_collection)
