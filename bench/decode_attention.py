"""Paged decode attention at B3's shapes: how close to the memory roofline, which launch wins.

Llama-3.1-8B heads (32 query, 8 kv, head_dim 128), bf16, blocks of 16 tokens scattered over the
pool, contexts uniform in [1000, 2000]. Reports the kernel's time and the bandwidth it reaches
reading the cached keys and values, for each launch configuration of the split kernel, next to
torch's `scaled_dot_product_attention` over the same keys and values laid out contiguously (the
in-run reference).

    python bench/decode_attention.py [--batch 512] [--kv-cache-dtype bf16|fp8] [--out DIR]
"""

from __future__ import annotations

import argparse
import functools
import itertools
import json
import os
from pathlib import Path

import torch
import triton
from cuda_timing import copy_bandwidth, median_seconds

from metrale.kernels import paged_decode_attention as pda

NUM_HEADS, NUM_KV_HEADS, HEAD_DIM, BLOCK_SIZE = 32, 8, 128, 16


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batch", type=int, default=512)
    parser.add_argument("--kv-cache-dtype", choices=["bf16", "fp8"], default="bf16")
    parser.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", "bench/results")))
    args = parser.parse_args()
    torch.manual_seed(0)
    batch = args.batch
    seq_lens = torch.randint(1000, 2001, (batch,), device="cuda")
    max_blocks = triton.cdiv(2000, BLOCK_SIZE)
    num_blocks = batch * max_blocks + 1
    shape = (num_blocks, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM)
    cache_dtype = torch.float8_e4m3fn if args.kv_cache_dtype == "fp8" else torch.bfloat16
    k_cache = torch.randn(shape, device="cuda").to(cache_dtype)
    v_cache = torch.randn(shape, device="cuda").to(cache_dtype)
    block_tables = torch.randperm(num_blocks - 1, device="cuda")[: batch * max_blocks]
    block_tables = block_tables.view(batch, max_blocks)
    q = torch.randn(batch, NUM_HEADS, HEAD_DIM, dtype=torch.bfloat16, device="cuda")
    scale = HEAD_DIM**-0.5
    kv_bytes = int(seq_lens.sum()) * NUM_KV_HEADS * HEAD_DIM * 2 * cache_dtype.itemsize

    results: dict = {
        "batch": batch,
        "kv_cache_dtype": args.kv_cache_dtype,
        "kv_bytes": kv_bytes,
        "device": torch.cuda.get_device_name(),
    }

    def report(name: str, seconds: float) -> None:
        results[name] = {"ms": seconds * 1e3, "tb_per_s": kv_bytes / seconds / 1e12}
        print(f"{name:40s} {seconds * 1e3:8.3f} ms  {kv_bytes / seconds / 1e12:5.2f} TB/s")

    results["copy_tb_per_s"] = copy_bandwidth() / 1e12
    print(f"copy bandwidth {results['copy_tb_per_s']:.2f} TB/s (read + write)")

    attention = functools.partial(
        pda.paged_decode_attention, q, k_cache, v_cache, block_tables, seq_lens, scale
    )
    expected = attention()
    report("metrale (default launch)", median_seconds(attention))

    # Sweep the split kernel's launch: splits, key tile, warps, pipeline stages.
    for num_splits, block_n, warps, stages in itertools.product(
        (1, 2), (64, 128), (2, 4, 8), (2, 3)
    ):
        launch = functools.partial(
            attention,
            num_splits=num_splits,
            max_block_n=block_n,
            num_warps=warps,
            num_stages=stages,
        )
        name = f"splits={num_splits} block_n={block_n} w={warps} s={stages}"
        try:
            seconds = median_seconds(launch, 5)
        except Exception as e:  # out of shared memory for the bigger tiles
            print(f"{name}: {e}")
            continue
        assert torch.allclose(launch(), expected, atol=2e-2, rtol=2e-2)
        report(name, seconds)

    # The reference: torch SDPA over the same keys and values, contiguous and padded to 2000.
    keys = torch.randn(batch, NUM_KV_HEADS, 2000, HEAD_DIM, dtype=torch.bfloat16, device="cuda")
    values = torch.randn_like(keys)
    qs = q.view(batch, NUM_HEADS, 1, HEAD_DIM)
    padded_bytes = keys.numel() * 2 * 2
    seconds = median_seconds(
        lambda: torch.nn.functional.scaled_dot_product_attention(qs, keys, values, enable_gqa=True)
    )
    results["torch_sdpa_padded"] = {"ms": seconds * 1e3, "tb_per_s": padded_bytes / seconds / 1e12}
    print(
        f"torch sdpa (contiguous, 2000 keys each) {seconds * 1e3:8.3f} ms  "
        f"{padded_bytes / seconds / 1e12:5.2f} TB/s"
    )
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / f"decode_attention-{args.kv_cache_dtype}.json").write_text(
        json.dumps(results, indent=2) + "\n"
    )


if __name__ == "__main__":
    main()
