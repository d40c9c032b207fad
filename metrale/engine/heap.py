"""The process's heap as the garbage collector sees it while the process serves.

What a process builds before it serves (torch and the other modules, the model, the block pool's
tens of thousands of blocks, the tokenizer, the app) lives as long as the process. Left in the
collector's oldest generation it makes each full collection, which the allocations of serving
trigger every few rounds of requests, walk all of it: about 0.45 ms of an API process's CPU per
request at 256 concurrent streams (`bench/api_cost.py`), and ~0.3 s in one pause of an offline
`LLM.generate` on a CPU (550k objects). Frozen, a sweep walks only what serving allocated. vLLM's
engine core and API server freeze their startup heaps the same way.

What serving allocates is mostly short-lived: each engine step's outputs (a struct and two lists
a request), a stream's events and their frames. At CPython's default the young generation is
collected every 700 net allocations, nearly once per step's outputs, each time walking objects
still in use and promoting them to be walked again a generation up. Collected every
`YOUNG_THRESHOLD` allocations instead, most of them are freed by their reference counts before
a collection sees them. In `bench/api_cost.py`'s API process (256 streams on this project's
2-core VM, 4 rounds, 2026-12-07) the collector's CPU went from 0.342 s (662 young, 61 middle
and 6 full collections, the longest 37.5 ms; 2.3% of the process's CPU) to 0.123 s (41 young, 3
middle, the longest 22.6 ms); at 50,000 the young collections took ~16 ms each.
"""

from __future__ import annotations

import gc
import logging

from metrale import envs

logger = logging.getLogger(__name__)

YOUNG_THRESHOLD = 10_000  # net allocations between collections of the young generation
_default_thresholds: tuple[int, ...] | None = None  # set while frozen


def freeze_startup_heap() -> bool:
    """Move every object alive now out of the collector's reach, garbage collected first so
    nothing dead is kept for good, and collect the young generation every `YOUNG_THRESHOLD`
    allocations; whether it did (not with METRALE_FREEZE_HEAP=0)."""
    global _default_thresholds
    if not envs.freeze_heap():
        return False
    gc.collect()
    gc.freeze()
    if _default_thresholds is None:
        _default_thresholds = gc.get_threshold()
    gc.set_threshold(YOUNG_THRESHOLD, *_default_thresholds[1:])
    logger.debug("%d objects of the startup heap frozen", gc.get_freeze_count())
    return True


def thaw_heap() -> None:
    """Undo `freeze_startup_heap`: the frozen objects back in the collector's oldest generation,
    its thresholds as they were."""
    global _default_thresholds
    gc.unfreeze()
    if _default_thresholds is not None:
        gc.set_threshold(*_default_thresholds)
        _default_thresholds = None
