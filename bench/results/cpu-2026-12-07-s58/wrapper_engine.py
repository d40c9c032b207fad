"""Inductor's C++ wrapper for the compiled CPU decode steps, measured inside one engine: the
engine's own `CompiledDecode` and a second one over the same model and pool, one compiled with
`cpp_wrapper` and the other without, swapped round by round on peer_cpu.py's 32 requests, 16 at
a time (README.md). `python wrapper_engine.py ROUNDS first|second`: whether the wrapper's graphs
are compiled first (the engine's own) or second."""

import statistics
import sys
import time

import torch
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
results = {"python": [], "c++": []}
for compiled in graphs.values():
    runner.compiled = compiled
    offline_streams.run(llm, prompts[:4], 4, 16)
for r in range(rounds):
    order = ("python", "c++") if r % 2 == 0 else ("c++", "python")
    for name in order:
        runner.compiled = graphs[name]
        steps = runner.num_compiled_steps
        results[name].append(offline_streams.run(llm, prompts, 16, 128))
        assert runner.num_compiled_steps > steps
        print(f"round {r} {name:7s} {results[name][-1]:8.1f} tok/s", flush=True)
for name, xs in results.items():
    rounds_ = ", ".join(f"{x:.1f}" for x in xs)
    print(f"{name:7s} median {statistics.median(xs):8.1f} tok/s  ({rounds_})")
print("c++ / python", statistics.median(results["c++"]) / statistics.median(results["python"]))
torch._dynamo.reset()
