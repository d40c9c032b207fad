"""`met serve` under peer_cpu.py's 16-stream load: each process's CPU over the run (README.md,
section 3)."""

import asyncio
import json
import sys
import time

import psutil
from common import cpu_seconds, serve_command
from peer_cpu import load, server

cmd, port, prompts = serve_command(sys.argv[1:])


with server(cmd, port, {}) as base:
    me = psutil.Process()
    srv = [
        p
        for p in psutil.process_iter(["cmdline"])
        if p.info["cmdline"]
        and "serve" in " ".join(p.info["cmdline"])
        and str(port) in " ".join(p.info["cmdline"])
    ]
    api = srv[0]
    kids = api.children(recursive=True)
    asyncio.run(load(base, prompts[:2], 2, "metrale"))
    for _rep in range(3):
        procs = {
            "api": api,
            **{f"child{i}:{' '.join(k.cmdline()[:3])[:40]}": k for i, k in enumerate(kids)},
            "client": me,
        }
        before = {n: cpu_seconds(p) for n, p in procs.items()}
        t = time.perf_counter()
        row = asyncio.run(load(base, prompts, 16, "metrale"))
        wall = time.perf_counter() - t
        after = {n: cpu_seconds(p) for n, p in procs.items()}
        print(
            json.dumps(row),
            f"wall {wall:.2f}s",
            {n: round((after[n] - before[n]) / wall, 3) for n in procs},
        )
