"""Paged decode attention at B3's shapes: how close to the memory roofline, which launch wins.

Llama-3.1-8B heads (32 query, 8 kv, head_dim 128), bf16, blocks of 16 tokens scattered over the
pool, contexts uniform in [1000, 2000]. Reports the kernel's time and the bandwidth it reaches
reading the cached keys and values, for each launch configuration of the split kernel, next to
torch's `scaled_dot_product_attention` over the same keys and values laid out contiguously (the
in-run reference). `--shape b2`: B2's decode steps instead (Qwen3-0.6B's 16 query and 8 kv
heads, 256 sequences, contexts uniform in [200, 1100], a block table as wide as B2's 4,096-token
limit); `b2_48`, `b2_12`: its last steps, few sequences of long contexts. Every launch is timed
replayed from a CUDA graph, as the engine's decode steps run it: at B2's sizes the host's launch
(~0.1 ms) would otherwise be most of the figure.

    python bench/decode_attention.py [--shape b3|b2|b2_48|b2_12] [--batch N]
        [--kv-cache-dtype bf16|fp8] [--no-sweep] [--out DIR]
"""

from __future__ import annotations

import argparse
import functools
import itertools
import json
import os
from dataclasses import dataclass
from pathlib import Path

import torch
import triton
from cuda_timing import copy_bandwidth, graph_seconds
from provenance import metrale_tree

from metrale.kernels import paged_decode_attention as pda

HEAD_DIM, BLOCK_SIZE = 128, 16


@dataclass(frozen=True)
class Shape:
    num_heads: int
    num_kv_heads: int
    batch: int
    context: tuple[int, int]  # uniform in [lo, hi]
    max_len: int  # the block table's width, in tokens


SHAPES = {
    "b3": Shape(32, 8, 512, (1000, 2000), 2000),
    "b2": Shape(16, 8, 256, (200, 1100), 4096),
    # B2's last steps: its longest requests, fewer than 64 (then fewer than 16) of them left
    "b2_48": Shape(16, 8, 48, (1000, 2048), 4096),
    "b2_12": Shape(16, 8, 12, (1200, 2048), 4096),
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shape", choices=list(SHAPES), default="b3")
    parser.add_argument("--batch", type=int, help="sequences (default: the shape's)")
    parser.add_argument("--kv-cache-dtype", choices=["bf16", "fp8"], default="bf16")
    parser.add_argument("--no-sweep", action="store_true", help="the default launch alone")
    parser.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", "bench/results")))
    args = parser.parse_args()
    torch.manual_seed(0)
    shape_of = SHAPES[args.shape]
    batch = args.batch or shape_of.batch
    lo, hi = shape_of.context
    num_heads, num_kv_heads = shape_of.num_heads, shape_of.num_kv_heads
    seq_lens = torch.randint(lo, hi + 1, (batch,), device="cuda")
    max_blocks = triton.cdiv(shape_of.max_len, BLOCK_SIZE)
    num_blocks = batch * max_blocks + 1
    shape = (num_blocks, BLOCK_SIZE, num_kv_heads, HEAD_DIM)
    cache_dtype = torch.float8_e4m3fn if args.kv_cache_dtype == "fp8" else torch.bfloat16
    k_cache = torch.randn(shape, device="cuda").to(cache_dtype)
    v_cache = torch.randn(shape, device="cuda").to(cache_dtype)
    block_tables = torch.randperm(num_blocks - 1, device="cuda")[: batch * max_blocks]
    block_tables = block_tables.view(batch, max_blocks)
    q = torch.randn(batch, num_heads, HEAD_DIM, dtype=torch.bfloat16, device="cuda")
    scale = HEAD_DIM**-0.5
    kv_bytes = int(seq_lens.sum()) * num_kv_heads * HEAD_DIM * 2 * cache_dtype.itemsize

    results: dict = {
        "shape": args.shape,
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
    graph_seconds(attention)  # the device warm: the first timing of a call ran ~15% long
    report("metrale (default launch)", graph_seconds(attention))
    results["num_splits"] = pda.plan_decode_splits(
        batch,
        num_kv_heads,
        max_blocks * BLOCK_SIZE,
        torch.cuda.get_device_properties(0).multi_processor_count,
    )

    # Sweep the split kernel's launch: splits, key tile, warps, pipeline stages.
    sweep = itertools.product((1, 2, 4, 8, 16), (64, 128), (4, 8), (2, 3))
    for num_splits, block_n, warps, stages in () if args.no_sweep else sweep:
        launch = functools.partial(
            attention,
            num_splits=num_splits,
            max_block_n=block_n,
            num_warps=warps,
            num_stages=stages,
        )
        name = f"splits={num_splits} block_n={block_n} w={warps} s={stages}"
        try:
            seconds = graph_seconds(launch, 10)
        except Exception as e:  # out of shared memory for the bigger tiles
            print(f"{name}: {e}")
            continue
        assert torch.allclose(launch(), expected, atol=2e-2, rtol=2e-2)
        report(name, seconds)

    # The reference: torch SDPA over the same keys and values, contiguous and padded to `hi`.
    keys = torch.randn(batch, num_kv_heads, hi, HEAD_DIM, dtype=torch.bfloat16, device="cuda")
    values = torch.randn_like(keys)
    qs = q.view(batch, num_heads, 1, HEAD_DIM)
    padded_bytes = keys.numel() * 2 * 2
    seconds = graph_seconds(
        lambda: torch.nn.functional.scaled_dot_product_attention(qs, keys, values, enable_gqa=True)
    )
    results["torch_sdpa_padded"] = {"ms": seconds * 1e3, "tb_per_s": padded_bytes / seconds / 1e12}
    print(
        f"torch sdpa (contiguous, {hi} keys each) {seconds * 1e3:8.3f} ms  "
        f"{padded_bytes / seconds / 1e12:5.2f} TB/s"
    )
    args.out.mkdir(parents=True, exist_ok=True)
    results["metrale_tree"] = metrale_tree()
    (args.out / f"decode_attention-{args.shape}-{args.kv_cache_dtype}.json").write_text(
        json.dumps(results, indent=2) + "\n"
    )


if __name__ == "__main__":
    main()
