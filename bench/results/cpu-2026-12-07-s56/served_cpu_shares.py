"""`met serve` under peer_cpu.py's 16-stream load: each process's CPU over the run (README.md,
section 3)."""

import asyncio
import json
import sys
import time

import psutil

sys.path.insert(0, "/work/main/bench")
from pathlib import Path

from peer_cpu import commands, free_port, load, server, text_prompts
from profile_cpu import checkpoint

model = checkpoint(Path("/work/main/bench/.cache/llama-34m"))
prompts = text_prompts(model, 32)


class A:
    dtype = "float32"
    vllm_python = None
    llamacpp_python = None


extra = sys.argv[1:]
port = free_port()
cmd = commands(model, None, port, A)["metrale"] + extra


def cpu(p):
    t = p.cpu_times()
    return t.user + t.system


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
        before = {n: cpu(p) for n, p in procs.items()}
        t = time.perf_counter()
        row = asyncio.run(load(base, prompts, 16, "metrale"))
        wall = time.perf_counter() - t
        after = {n: cpu(p) for n, p in procs.items()}
        print(
            json.dumps(row),
            f"wall {wall:.2f}s",
            {n: round((after[n] - before[n]) / wall, 3) for n in procs},
        )
