"""Paged prefill attention on long prompts: TFLOP/s of each launch, beside torch SDPA.

Causal prefill in bf16, blocks of 16 tokens scattered over the pool, at two head layouts:
Qwen3-0.6B's (16 query heads, 8 kv) with 8 fresh prompts of 2048 tokens (B5's shape) and 16
chunks of 512 tokens after a cached prefix of 1536 (B5's 75%-shared suffixes), and
Llama-3.1-8B's (32 query heads, 8 kv) with 2 fresh prompts of 8192 tokens. The reference, for
fresh prompts, is torch's `scaled_dot_product_attention(is_causal=True)` over the same keys and
values laid out contiguously (its flash backend), in the same run. Then a sweep of launch
configurations (`--no-sweep`: the default launch only; run it under two packages'
PYTHONPATHs, alternating, for a before / after in one call).

    python bench/prefill_attention.py [--no-sweep] [--out DIR]
"""

from __future__ import annotations

import argparse
import functools
import itertools
import json
import os
from pathlib import Path

import torch
from cuda_timing import median_seconds

from metrale.kernels import paged_prefill_attention as ppa

HEAD_DIM, BLOCK_SIZE = 128, 16
SHAPES = {  # name: (num_heads, num_kv_heads, num_seqs, chunk_len, cached tokens before it)
    "qwen3_0.6b_8x2048": (16, 8, 8, 2048, 0),
    "qwen3_0.6b_16x512_after_1536": (16, 8, 16, 512, 1536),
    "llama_8b_2x8192": (32, 8, 2, 8192, 0),
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--no-sweep", action="store_true", help="the default launch only")
    parser.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", "bench/results")))
    args = parser.parse_args()
    torch.manual_seed(0)
    results: dict = {"device": torch.cuda.get_device_name()}
    # rows of a tile (tokens x the GQA group's heads), key tile, warps, stages, keys as they lie
    configs = list(itertools.product((64, 128), (32, 64), (4, 8), (2, 3), (True, False)))
    for name, (num_heads, num_kv_heads, num_seqs, chunk_len, cached) in SHAPES.items():
        seq_len = cached + chunk_len
        num_tokens = num_seqs * chunk_len
        blocks_per_seq = seq_len // BLOCK_SIZE
        num_blocks = num_seqs * blocks_per_seq
        cache_shape = (num_blocks, BLOCK_SIZE, num_kv_heads, HEAD_DIM)
        k_cache = torch.randn(cache_shape, dtype=torch.bfloat16, device="cuda")
        v_cache = torch.randn(cache_shape, dtype=torch.bfloat16, device="cuda")
        block_tables = torch.randperm(num_blocks, device="cuda").view(num_seqs, blocks_per_seq)
        q = torch.randn(num_tokens, num_heads, HEAD_DIM, dtype=torch.bfloat16, device="cuda")
        seq_lens = torch.full((num_seqs,), seq_len, device="cuda")
        query_start_loc = torch.arange(0, num_tokens + 1, chunk_len, device="cuda")
        # Query i of a chunk sees the cached keys and i + 1 of its own: 2 products, 2 FLOP each.
        keys_seen = chunk_len * cached + chunk_len * (chunk_len + 1) / 2
        flops = 4 * num_seqs * num_heads * keys_seen * HEAD_DIM
        row: dict = {}

        def report(label: str, seconds: float, row=row, flops=flops, name=name) -> None:
            row[label] = {"ms": seconds * 1e3, "tflops": flops / seconds / 1e12}
            print(
                f"{name} {label:32s} {seconds * 1e3:8.3f} ms {flops / seconds / 1e12:6.1f} TFLOP/s"
            )

        attention = functools.partial(
            ppa.paged_prefill_attention,
            q,
            k_cache,
            v_cache,
            block_tables,
            query_start_loc,
            seq_lens,
            chunk_len,
            HEAD_DIM**-0.5,
        )
        expected = attention()
        report("metrale (default launch)", median_seconds(attention, 30))
        for rows, block_n, warps, stages, k_rows in [] if args.no_sweep else configs:
            call = functools.partial(
                attention,
                tiles=(rows, block_n),
                num_warps=warps,
                num_stages=stages,
                k_rows=k_rows,
            )
            label = f"r{rows}_n{block_n}_w{warps}_s{stages}_{'krows' if k_rows else 'kcols'}"
            try:
                seconds = median_seconds(call, 5)
            except Exception as e:  # out of shared memory or registers for the bigger tiles
                print(f"{name} {label}: {type(e).__name__}")
                continue
            torch.testing.assert_close(call(), expected, atol=2e-2, rtol=2e-2)
            report(label, seconds)
        if cached == 0:  # the reference: flash SDPA over contiguous keys, GQA expanded by torch
            positions = torch.arange(seq_len, device="cuda")
            keys = k_cache[block_tables[:, positions // BLOCK_SIZE], positions % BLOCK_SIZE]
            values = v_cache[block_tables[:, positions // BLOCK_SIZE], positions % BLOCK_SIZE]
            qs = q.view(num_seqs, chunk_len, num_heads, HEAD_DIM).transpose(1, 2)
            ks, vs = keys.transpose(1, 2), values.transpose(1, 2)
            report(
                "torch sdpa (contiguous)",
                median_seconds(
                    lambda qs=qs, ks=ks, vs=vs: torch.nn.functional.scaled_dot_product_attention(
                        qs, ks, vs, is_causal=True, enable_gqa=True
                    ),
                    30,
                ),
            )
        results[name] = row
        del k_cache, v_cache, q
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "prefill_attention.json").write_text(json.dumps(results, indent=2) + "\n")


if __name__ == "__main__":
    main()
