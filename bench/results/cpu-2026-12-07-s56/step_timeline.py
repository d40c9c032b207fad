"""The engine alone on peer_cpu.py's 32 requests, 16 at a time: each step's composition and wall
time (README.md, section 3)."""

import collections
import sys
import time

sys.path.insert(0, "/work/main/bench")
from pathlib import Path

import offline_streams
from peer_cpu import text_prompts
from profile_cpu import checkpoint

from metrale import LLM
from metrale.tokenizer import Tokenizer

model = checkpoint(Path("/work/main/bench/.cache/llama-34m"))
tok = Tokenizer.from_dir(model)
prompts = [tok.encode(p, add_special_tokens=False) for p in text_prompts(model, 32)]
llm = LLM(str(model), dtype="float32", max_seq_len=2048, enable_prefix_caching=False)
core = llm.engine
sched = core.scheduler
log = []
orig = sched.schedule


def schedule():
    out = orig()
    pre = sum(c.num_tokens for c in out.chunks if c.num_tokens > 1)
    dec = sum(1 for c in out.chunks if c.num_tokens == 1)
    log.append([time.perf_counter(), pre, dec])
    return out


sched.schedule = schedule


def run(ps, streams):
    start = time.perf_counter()
    return offline_streams.run(llm, ps, streams, 128), start


run(prompts[:2], 2)
for rep in range(2):
    log.clear()
    tps, start = run(prompts, 16)
    end = time.perf_counter()
    times = [t for t, _, _ in log] + [end]
    kinds = collections.defaultdict(lambda: [0, 0.0])
    for (t, pre, dec), t2 in zip(log, times[1:], strict=False):
        k = ("prefill-only" if dec == 0 else "mixed") if pre else f"decode{dec}"
        kinds[k][0] += 1
        kinds[k][1] += t2 - t
    print(f"tok/s {tps:.1f} total {end - start:.3f}s steps {len(log)}")
    for k, (n, s) in sorted(kinds.items(), key=lambda kv: -kv[1][1]):
        print(f"  {k:14s} n={n:4d} total={s * 1000:8.1f} ms  per={s / n * 1000:6.2f} ms")
    if rep == 1:
        for (t, pre, dec), t2 in list(zip(log, times[1:], strict=False))[:30]:
            print(f"    pre={pre:4d} dec={dec:3d} {1000 * (t2 - t):7.2f} ms")
