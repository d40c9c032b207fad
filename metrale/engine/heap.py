"""The process's startup heap, kept out of the garbage collector's sweeps.

What a process builds before it serves (torch and the other modules, the model, the block pool's
tens of thousands of blocks, the tokenizer, the app) lives as long as the process. Left in the
collector's oldest generation it makes each full collection, which the allocations of serving
trigger every few rounds of requests, walk all of it: about 0.45 ms of an API process's CPU per
request at 256 concurrent streams (`bench/api_cost.py`), and ~0.3 s in one pause of an offline
`LLM.generate` on a CPU (550k objects). Frozen, a sweep walks only what serving allocated. vLLM's
engine core and API server freeze their startup heaps the same way.
"""

from __future__ import annotations

import gc
import logging

from metrale import envs

logger = logging.getLogger(__name__)


def freeze_startup_heap() -> bool:
    """Move every object alive now out of the collector's reach, garbage collected first so
    nothing dead is kept for good; whether it did (not with METRALE_FREEZE_HEAP=0)."""
    if not envs.freeze_heap():
        return False
    gc.collect()
    gc.freeze()
    logger.debug("%d objects of the startup heap frozen", gc.get_freeze_count())
    return True
