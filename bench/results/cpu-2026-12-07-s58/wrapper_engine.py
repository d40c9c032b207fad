"""Inductor's C++ wrapper for the compiled CPU decode steps, measured inside one engine: the
engine's own `CompiledDecode` and a second one over the same model and pool, one compiled with
`cpp_wrapper` and the other without, swapped round by round (README.md). A round runs
peer_cpu.py's 32 requests 16 at a time, then 4 of them one at a time; every compiled step's
forward is timed, by its row count. `python wrapper_engine.py ROUNDS first|second`: whether the
wrapper's graphs are compiled first (the engine's own) or second."""

import collections
import statistics
import sys
import time

import torch._inductor.config as inductor_config

sys.path.insert(0, "/work/main/bench")
sys.path.insert(0, "/work/main/bench/results/cpu-2026-12-07-s57")
import offline_streams
from requests16 import chunked_engine, token_prompts

from metrale.runner.compiled_decode import CompiledDecode

rounds = int(sys.argv[1]) if len(sys.argv) > 1 else 4
wrapper_first = (sys.argv[2] if len(sys.argv) > 2 else "second") == "first"
prompts = token_prompts()
inductor_config.cpp_wrapper = wrapper_first
start = time.perf_counter()
llm = chunked_engine()
print(f"engine built in {time.perf_counter() - start:.1f} s (cpp_wrapper={wrapper_first})")
runner = llm.engine.runner
own = runner.compiled
inductor_config.cpp_wrapper = not wrapper_first
other = CompiledDecode(runner)
start = time.perf_counter()
assert other.warm_up()
print(f"second graphs in {time.perf_counter() - start:.1f} s (cpp_wrapper={not wrapper_first})")
graphs = {"c++": own, "python": other} if wrapper_first else {"python": own, "c++": other}
tok_s = collections.defaultdict(list)  # (name, streams) -> tok/s a round
step_ms = collections.defaultdict(list)  # (name, rows) -> wall ms of each compiled forward


def timed(name, compiled):
    run = compiled.run

    def timed_run(batch):
        start = time.perf_counter()
        logits = run(batch)
        step_ms[name, batch.seq_lens.shape[0]].append(1e3 * (time.perf_counter() - start))
        return logits

    compiled.run = timed_run


for name, compiled in graphs.items():
    runner.compiled = compiled
    offline_streams.run(llm, prompts[:4], 4, 16)
    timed(name, compiled)
step_ms.clear()
for r in range(rounds):
    for name in ("python", "c++") if r % 2 == 0 else ("c++", "python"):
        runner.compiled = graphs[name]
        tok_s[name, 16].append(offline_streams.run(llm, prompts, 16, 128))
        tok_s[name, 1].append(offline_streams.run(llm, prompts[:4], 1, 128))
        print(f"round {r} {name:7s} {tok_s[name, 16][-1]:7.1f} / {tok_s[name, 1][-1]:6.1f} tok/s")
for rows in (16, 1):
    for name in graphs:
        xs = step_ms[name, rows]
        q, median = statistics.quantiles(xs, n=10), statistics.median(xs)
        print(
            f"{name:7s} {rows:2d}-row forward median {median:.3f} ms  p10 {q[0]:.3f}  n={len(xs)}"
        )
for (name, streams), xs in sorted(tok_s.items()):
    rounds_ = ", ".join(f"{x:.1f}" for x in xs)
    print(f"{name:7s} {streams:2d} streams median {statistics.median(xs):7.1f} tok/s ({rounds_})")
