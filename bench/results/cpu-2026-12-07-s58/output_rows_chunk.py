"""One 256-token prompt step (two of peer_cpu.py's 128-token prompts, one token each) through the
engine, the last layer on the sampled rows only (`rows`) or on every row then gathered (the
forward before), alternating call by call in one process; medians of wall ms a call."""

import statistics
import sys
import time

from forwards import engine_and_forwards

from metrale import SamplingParams

prompts, llm, model, forwards = engine_and_forwards()
every_row, kept_rows = forwards["every row"], forwards["rows"]


one = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
calls = int(sys.argv[1]) if len(sys.argv) > 1 else 40
ms = {"every row": [], "rows": []}
for i in range(calls + 4):
    pair = prompts[(2 * i) % 32 : (2 * i) % 32 + 2]
    order = (("every row", every_row), ("rows", kept_rows))
    for name, fn in order if i % 2 == 0 else order[::-1]:
        model.forward = fn
        start = time.perf_counter()
        llm.generate(pair, one, use_tqdm=False)
        if i >= 4:
            ms[name].append(1e3 * (time.perf_counter() - start))
for name, xs in ms.items():
    q = statistics.quantiles(xs, n=10)
    print(f"{name:9s} median {statistics.median(xs):6.2f} ms  p10 {q[0]:6.2f}  p90 {q[-1]:6.2f}")
pairs = sum(r < e for r, e in zip(ms["rows"], ms["every row"], strict=True))
print(f"rows faster in {pairs} of {calls} pairs")
print("ratio of medians", statistics.median(ms["rows"]) / statistics.median(ms["every row"]))
