"""The engine alone on peer_cpu.py's 32 requests, 16 at a time (128-token prompts, 128 tokens
each, the server's 256-token prompt chunks), the prompt chunks' attention through
`paged_prefill_attention` or through the gathers and SDPA before it, alternating round by round in
one process (README.md)."""

import statistics
import sys

sys.path.insert(0, "/work/main/bench")
import offline_streams
from requests16 import chunked_engine, token_prompts

from metrale.layers.attention import torch_backend

in_place = torch_backend.PromptChunks.attend


def apart(self, layer, q, out):
    """The path before: each chunk gathered and through SDPA."""
    for p in self.chunks:
        out[p.start : p.end] = torch_backend._attend(
            layer, q[p.start : p.end].unsqueeze(0), p.block_ids, 1, p.mask
        ).squeeze(0)


prompts = token_prompts()
llm = chunked_engine()
offline_streams.run(llm, prompts[:4], 4, 16)
rounds = int(sys.argv[1]) if len(sys.argv) > 1 else 4
results = {"sdpa": [], "in place": []}
outputs = {}
for r in range(rounds):
    for name, fn in (("sdpa", apart), ("in place", in_place)):
        torch_backend.PromptChunks.attend = fn
        results[name].append(offline_streams.run(llm, prompts, 16, 128))
        print(f"round {r} {name:9s} {results[name][-1]:8.1f} tok/s", flush=True)
for name, xs in results.items():
    rounds_ = ", ".join(f"{x:.1f}" for x in xs)
    print(f"{name:9s} median {statistics.median(xs):8.1f} tok/s  ({rounds_})")
ratio = statistics.median(results["in place"]) / statistics.median(results["sdpa"])
print("ratio of medians", ratio)
