"""Two engines of the same tree in one process, built one after the other and stepped
alternately (one step each, the order swapped every step) over the same requests, as
`cpu-2026-12-07-s56/engine_pair.py` and 76bc71b's comparison did, with each one's minor page
faults a step (README.md, section 2). STREAMS=16 (default) or 1; argv 1: cycles. Run it under
glibc's malloc and under tcmalloc (LD_PRELOAD=libtcmalloc_minimal.so.4, as `met serve`'s engine)."""

import os
import resource
import statistics
import sys
import time

sys.path.insert(0, "/work/main/bench")
sys.path.insert(0, "/work/main/bench/results/cpu-2026-12-07-s56")
from common import engine
from profile_cpu import add

STREAMS = int(os.environ.get("STREAMS", "16"))
llms = []
for _ in range(2):
    llm = engine()
    add(llm, 16, "warm")
    for _ in range(140):
        llm.engine.step()  # compile
    llms.append(llm)
res, faults = [[], []], [0, 0]
cycles = int(sys.argv[1]) if len(sys.argv) > 1 else 5
for c in range(cycles):
    for llm in llms:
        add(llm, STREAMS, f"c{c}")
        llm.engine.step()
        llm.engine.step()
    for n in range(120):
        for j in (0, 1) if n % 2 == 0 else (1, 0):
            f0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
            t = time.perf_counter()
            llms[j].engine.step()
            res[j].append((time.perf_counter() - t) * 1e3)
            faults[j] += resource.getrusage(resource.RUSAGE_SELF).ru_minflt - f0
    for llm in llms:
        for _ in range(10):
            llm.engine.step()
allocator = os.path.basename(os.environ.get("LD_PRELOAD", "")) or "glibc"
for name, v, f in zip(("built first", "built second"), res, faults, strict=True):
    v.sort()
    print(
        f"{allocator}, {STREAMS} streams, {name}: n={len(v)} median {statistics.median(v):.3f} ms",
        f"p10 {v[len(v) // 10]:.3f}, {f / len(v):.0f} page faults a step",
    )
