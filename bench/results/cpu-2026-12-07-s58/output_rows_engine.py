"""The engine alone on peer_cpu.py's 32 requests, 16 at a time (128-token prompts, 128 tokens
each, the server's 256-token prompt chunks), the last layer past its attention on the sampled
rows only (`rows`) or on every row then gathered (the forward before), alternating round by
round in one process (README.md)."""

import statistics
import sys

import offline_streams
from forwards import engine_and_forwards

prompts, llm, model, forwards = engine_and_forwards()
every_row, kept_rows = forwards["every row"], forwards["rows"]


offline_streams.run(llm, prompts[:4], 4, 16)
rounds = int(sys.argv[1]) if len(sys.argv) > 1 else 4
results = {"every row": [], "rows": []}
for r in range(rounds):
    order = (("every row", every_row), ("rows", kept_rows))
    for name, fn in order if r % 2 == 0 else order[::-1]:
        model.forward = fn
        results[name].append(offline_streams.run(llm, prompts, 16, 128))
        print(f"round {r} {name:9s} {results[name][-1]:8.1f} tok/s", flush=True)
for name, xs in results.items():
    rounds_ = ", ".join(f"{x:.1f}" for x in xs)
    print(f"{name:9s} median {statistics.median(xs):8.1f} tok/s  ({rounds_})")
ratio = statistics.median(results["rows"]) / statistics.median(results["every row"])
print("ratio of medians", ratio)
