"""The garbage collector's CPU time in each process after its startup heap is frozen: put this
directory on PYTHONPATH (as `sitecustomize`) and every Python process started under it writes
/tmp/prof/gc-PID.txt (seconds and counts per generation) every 20 collections and at exit.

    PYTHONPATH=bench/results/cpu-2026-12-07-s61 python bench/api_cost.py --baseline /tmp/base
"""

import atexit
import gc
import os
import sys
import time

_start = [0.0]
_seconds = [0.0, 0.0, 0.0]
_counts = [0, 0, 0]
_longest = [0.0, 0.0, 0.0]
_frozen = [0, 0.0]  # objects frozen (once seen), when last asked (get_freeze_count walks them)


def _dump() -> None:
    with open(f"/tmp/prof/gc-{os.getpid()}.txt", "w") as f:
        f.write(
            f"{' '.join(sys.argv)[:60]} gc_s={[round(s, 3) for s in _seconds]} n={_counts} "
            f"longest_ms={[round(s * 1e3, 1) for s in _longest]} "
            f"thr={gc.get_threshold()} frozen={_frozen[0]} cpu={time.process_time():.2f}\n"
        )


def _callback(phase: str, info: dict) -> None:
    if not _frozen[0]:
        now = time.monotonic()
        if now - _frozen[1] >= 1:
            _frozen[1] = now
            _frozen[0] = gc.get_freeze_count()
        return
    if phase == "start":
        _start[0] = time.thread_time()
        return
    if not _start[0]:
        return
    generation = info["generation"]
    seconds = time.thread_time() - _start[0]
    _seconds[generation] += seconds
    _longest[generation] = max(_longest[generation], seconds)
    _counts[generation] += 1
    if sum(_counts) % 20 == 0:
        _dump()


os.makedirs("/tmp/prof", exist_ok=True)
gc.callbacks.append(_callback)
atexit.register(_dump)
