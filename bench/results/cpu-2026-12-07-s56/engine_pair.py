"""Two engines in one process, each compiled under its own environment (argv 1 and 2:
VAR=VALUE,...), stepped alternately over the same requests (README.md, section 2)."""

import os
import statistics
import sys
import time

from common import engine
from profile_cpu import add

STREAMS = int(os.environ.get("STREAMS", "16"))
envs = [dict(kv.split("=") for kv in e.split(",") if kv) for e in sys.argv[1:3]]
llms = []
for e in envs:
    os.environ.update(e)
    llm = engine()
    add(llm, 16, "warm")
    for _ in range(140):
        llm.engine.step()  # compile under its env
    llms.append(llm)
res = [[], []]
cycles = int(sys.argv[3]) if len(sys.argv) > 3 else 5
for c in range(cycles):
    for _i, llm in enumerate(llms):
        add(llm, STREAMS, f"c{c}")
        llm.engine.step()
        llm.engine.step()
    for n in range(120):
        for j in (0, 1) if n % 2 == 0 else (1, 0):
            os.environ.update(envs[j])
            t = time.perf_counter()
            llms[j].engine.step()
            res[j].append((time.perf_counter() - t) * 1e3)
    for llm in llms:
        for _ in range(10):
            llm.engine.step()
for e, v in zip(sys.argv[1:3], res, strict=False):
    v.sort()
    print(
        f"{e or 'default'}: n={len(v)} median {statistics.median(v):.3f} ms",
        f"p10 {v[len(v) // 10]:.3f} p25 {v[len(v) // 4]:.3f}",
    )
