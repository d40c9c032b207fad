"""One engine's 16-row decode steps with a temporary PANEL_OFF switch flipped every 8 steps
(README.md, section 1)."""

import os
import statistics
import sys
import time

from common import engine
from profile_cpu import add

llm = engine()
core = llm.engine
res = {"0": [], "1": []}
for cycle in range(int(sys.argv[1]) if len(sys.argv) > 1 else 6):
    add(llm, 16, f"c{cycle}")
    core.step()
    core.step()  # prefill
    n = 0
    while True:
        mode = "01"[(n // 8) % 2]
        os.environ["PANEL_OFF"] = mode
        t = time.perf_counter()
        outs = core.step()
        dt = time.perf_counter() - t
        n += 1
        if n > 2 and n % 8 not in (0, 1):
            res[mode].append(dt * 1e3)  # skip the first of a block (async)
        if (
            not core.scheduler.has_unfinished_requests()
            if hasattr(core.scheduler, "has_unfinished_requests")
            else n >= 120
        ):
            break
        if n >= 120:
            break
    while (
        core.step() or core.scheduler.get_num_unfinished_requests()
        if hasattr(core.scheduler, "get_num_unfinished_requests")
        else False
    ):
        pass
for m, v in res.items():
    v.sort()
    print(
        f"PANEL_OFF={m}: n={len(v)} median {statistics.median(v):.3f} ms",
        f"p10 {v[len(v) // 10]:.3f} p25 {v[len(v) // 4]:.3f}",
    )
