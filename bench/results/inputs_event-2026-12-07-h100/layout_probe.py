"""Decode attention at B3's shape over a token-major paged cache (the pool's layout) against
a head-major one ([blocks, kv_heads, block_size, head_dim], each block's head a contiguous 4 KB),
read by the same kernel through its strides (the contiguity check skipped). From the repo root."""

import functools
import json
import os
import sys

sys.path.insert(0, "bench")
import torch
import triton
from cuda_timing import copy_bandwidth, median_seconds

from metrale.kernels import paged_decode_attention as pda

pda.check_paged_inputs = lambda *a, **k: None
H, KVH, D = 32, 8, 128
out = {}
print(f"copy {copy_bandwidth() / 1e12:.2f} TB/s")
for bs in (16, 32):
    torch.manual_seed(0)
    batch = 512
    seq_lens = torch.randint(1000, 2001, (batch,), device="cuda")
    max_blocks = triton.cdiv(2000, bs)
    nb = batch * max_blocks + 1
    tables = torch.randperm(nb - 1, device="cuda")[: batch * max_blocks].view(batch, max_blocks)
    q = torch.randn(batch, H, D, dtype=torch.bfloat16, device="cuda")
    kv_bytes = int(seq_lens.sum()) * KVH * D * 2 * 2
    token_major = [torch.randn(nb, bs, KVH, D, device="cuda").bfloat16() for _ in range(2)]
    head_major = [t.permute(0, 2, 1, 3).contiguous().permute(0, 2, 1, 3) for t in token_major]
    ref = pda.paged_decode_attention(q, *token_major, tables, seq_lens, D**-0.5)
    for name, (k, v) in (("token-major", token_major), ("head-major", head_major)):
        for bn, w, s in ((128, 4, 3), (128, 4, 2), (64, 4, 3), (64, 2, 3), (128, 8, 3)):
            f = functools.partial(
                pda.paged_decode_attention,
                q,
                k,
                v,
                tables,
                seq_lens,
                D**-0.5,
                max_block_n=bn,
                num_warps=w,
                num_stages=s,
            )
            assert torch.allclose(f(), ref, atol=2e-2, rtol=2e-2)
            sec = median_seconds(f)
            key = f"bs{bs} {name} bn{bn} w{w} s{s}"
            out[key] = sec * 1e3
            print(f"{key:34s} {sec * 1e3:7.3f} ms {kv_bytes / sec / 1e12:5.2f} TB/s", flush=True)
    del token_major, head_major
with open(os.path.join(os.environ.get("OUT", "."), "layout_probe.json"), "w") as f:
    json.dump(out, f, indent=1)
