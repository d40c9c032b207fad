"""B4's offline side alone, several rounds: tok/s and time in the collector by generation.

python gc_offline.py ROUNDS   (from the repository's root; as run: .devrun/gc_offline.py)
"""

import gc
import json
import random
import sys
import time

sys.path.insert(0, "bench")
from serve_telemetry import QWEN3_06B_BODY, dummy_checkpoint

import metrale
from metrale import LLM, SamplingParams

events = []
t0 = [0.0]


def cb(phase, info):
    if phase == "start":
        t0[0] = time.perf_counter()
    else:
        events.append((info["generation"], time.perf_counter() - t0[0]))


gc.callbacks.append(cb)
model = dummy_checkpoint(QWEN3_06B_BODY)
rng = random.Random(0)
prompts = [[rng.randrange(10, 4000) for _ in range(128)] for _ in range(256)]
llm = LLM(
    str(model),
    load_format="dummy",
    dtype="bfloat16",
    max_seq_len=2048,
    enable_prefix_caching=False,
    max_num_seqs=256,
    num_kv_blocks=8192,
)
params = SamplingParams(temperature=0, max_tokens=256, ignore_eos=True)
llm.generate(prompts[:16], SamplingParams(max_tokens=16, ignore_eos=True), use_tqdm=False)
print(metrale.__file__, "frozen", gc.get_freeze_count(), "tracked", len(gc.get_objects()))
for _ in range(int(sys.argv[1])):
    events.clear()
    t = time.perf_counter()
    out = llm.generate(prompts, params, use_tqdm=False)
    s = time.perf_counter() - t
    n = sum(len(o.outputs[0].token_ids) for o in out)
    ms = [round(1e3 * sum(d for g, d in events if g == k), 1) for k in range(3)]
    cnt = [sum(1 for g, _ in events if g == k) for k in range(3)]
    row = {"tok_s": round(n / s), "gc_ms_by_gen": ms, "gc_count_by_gen": cnt}
    print(json.dumps(row), flush=True)
