"""Cascade decode attention against plain split-K, one layer's call, replayed from CUDA graphs
(as the engine's decode steps run): `paged_decode_attention` over the same rows with and
without `shared_prefix` (its finding included in the timed graph), on shapes where the rows
share a prefix (B5's: 64 rows of 2,056 tokens, 1,536 shared; 16 samples of one 4,000-token
prompt) and where they share none (B3's: 512 rows of ~1,500 tokens), bf16, H200/H100.

    python bench/cascade_attention.py [--out DIR]
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

import torch
from provenance import git_sha

from metrale.kernels.paged_decode_attention import (
    paged_decode_attention,
    paged_decode_attention_ref,
    shared_prefix,
)

ROOT = Path(__file__).resolve().parent
CASES = {
    # name: (rows, context, shared tokens, heads, kv heads)
    "b5_qwen3_0.6b_64x2056_shared1536": (64, 2056, 1536, 16, 8),
    "n16_llama8b_16x4096_shared4000": (16, 4096, 4000, 32, 8),
    "b3_llama8b_512x1500_shared0": (512, 1500, 0, 32, 8),
}


def graph_us(fn, replays: int = 200) -> float:
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    for _ in range(10):
        graph.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(replays):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / replays * 1000


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", ROOT / "results")))
    args = parser.parse_args()
    device = torch.device("cuda")
    head_dim, block_size = 128, 16
    scale = head_dim**-0.5
    results = {"git_sha": git_sha(), "device": torch.cuda.get_device_name(), "cases": {}}
    for name, (rows, context, shared, heads, kv_heads) in CASES.items():
        torch.manual_seed(0)
        per_row = -(-context // block_size)
        common = shared // block_size
        num_blocks = common + rows * (per_row - common) + 1
        shape = (num_blocks, block_size, kv_heads, head_dim)
        k = torch.randn(shape, device=device, dtype=torch.bfloat16)
        v = torch.randn(shape, device=device, dtype=torch.bfloat16)
        own = torch.randperm(num_blocks - common, device=device)[: rows * (per_row - common)]
        tables = torch.cat(
            [
                torch.arange(common, device=device).expand(rows, common),
                common + own.view(rows, per_row - common),
            ],
            dim=1,
        )
        lens = torch.full((rows,), context, device=device)
        q = torch.randn(rows, heads, head_dim, device=device, dtype=torch.bfloat16)
        out = torch.empty_like(q)

        def plain(out=out, q=q, k=k, v=v, tables=tables, lens=lens) -> None:
            paged_decode_attention(q, k, v, tables, lens, scale, out=out)

        def cascade(out=out, q=q, k=k, v=v, tables=tables, lens=lens) -> None:
            found = shared_prefix(tables, lens, block_size)
            paged_decode_attention(q, k, v, tables, lens, scale, out=out, shared_prefix=found)

        found = shared_prefix(tables, lens, block_size)
        cascade()
        ref = paged_decode_attention_ref(q[:4], k, v, tables[:4], lens[:4], scale)
        error = (out[:4].float() - ref.float()).abs().max().item()
        timings = {"plain": [], "cascade": []}
        for _ in range(3):
            timings["plain"].append(graph_us(plain))
            timings["cascade"].append(graph_us(cascade))
        best = {kind: min(times) for kind, times in timings.items()}
        kv_bytes = rows * context * kv_heads * head_dim * 2 * 2
        results["cases"][name] = {
            "shared_found": found[0].item(),
            "max_error_vs_reference": error,
            "us": timings,
            "plain_us": best["plain"],
            "cascade_us": best["cascade"],
            "speedup": best["plain"] / best["cascade"],
            "plain_tb_per_s": kv_bytes / best["plain"] / 1e6,
        }
        print(
            f"{name}: shared {found[0].item()} tokens; plain {best['plain']:.1f} us "
            f"({kv_bytes / best['plain'] / 1e6:.2f} TB/s), cascade {best['cascade']:.1f} us, "
            f"{best['plain'] / best['cascade']:.2f}x; error {error:.2e}",
            flush=True,
        )
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "cascade_attention.json").write_text(json.dumps(results, indent=2) + "\n")


if __name__ == "__main__":
    main()
