"""`met serve` under the 16-stream load with and without the engine's threads and the API process
pinned to cores, alternating (README.md, section 3)."""

import asyncio
import os

import psutil
from common import cpu_seconds, serve_command
from peer_cpu import load, server

cmd, port, prompts = serve_command([])


def threads(p):
    return {t.id: t.user_time + t.system_time for t in p.threads()}


with server(cmd, port, {}) as base:
    me = psutil.Process()
    api = next(
        p
        for p in psutil.process_iter(["cmdline"])
        if p.info["cmdline"] and str(port) in " ".join(p.info["cmdline"])
    )
    engine = max(api.children(recursive=True), key=cpu_seconds)
    asyncio.run(load(base, prompts[:2], 2, "metrale"))
    t0 = threads(engine)
    asyncio.run(load(base, prompts[:16], 16, "metrale"))
    t1 = threads(engine)
    busy = sorted(((t1[t] - t0.get(t, 0), t) for t in t1), reverse=True)
    print(
        "engine threads cpu during a load:",
        [(round(c, 2), t) for c, t in busy[:5]],
        "main pid",
        engine.pid,
    )
    main_tid = engine.pid
    worker = next(t for c, t in busy if t != main_tid)
    all_cpus = set(range(os.cpu_count()))

    def pin(variant):
        for t in t1:
            os.sched_setaffinity(t, all_cpus)
        os.sched_setaffinity(api.pid, all_cpus)
        os.sched_setaffinity(0, all_cpus)
        if variant >= 1:
            os.sched_setaffinity(main_tid, {0})
            os.sched_setaffinity(worker, {1})
            for t in psutil.Process(api.pid).threads():
                os.sched_setaffinity(t.id, {1})
        if variant >= 2:
            for t in me.threads():
                os.sched_setaffinity(t.id, {1})

    VARIANTS = [int(x) for x in os.environ.get("VARIANTS", "0,1,2").split(",")]
    res = {v: [] for v in VARIANTS}
    for rep in range(int(os.environ.get("REPS", "3"))):
        for v in VARIANTS:
            pin(v)
            row = asyncio.run(load(base, prompts, 16, "metrale"))
            res[v].append(round(row["tokens_per_s"], 1))
            print(v, rep, row, flush=True)
    print(res)
