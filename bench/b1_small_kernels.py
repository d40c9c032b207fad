"""The small kernels of a batch-1 decode step (B1, Llama-3.1-8B shape), replayed from CUDA
graphs: paged decode attention at each split count it could use, and the greedy argmax over the
128k-entry logits, torch's one-block reduction against two-stage ones.

B1's block tables are 2,048 tokens wide (its max_seq_len) and its contexts 128-640 tokens. An
attention graph chains 32 calls (a step's layers), so a call's figure includes the gap to the
next kernel as in a step; the default launch is the first row (8 splits of 256 tokens when
it ran on 2026-12-01, 16 of 128 since, after what it measured).

    python bench/b1_small_kernels.py [--out DIR]
"""

from __future__ import annotations

import argparse
import functools
import json
import os
from pathlib import Path

import torch
import torch.nn.functional as F
from cuda_timing import graph_seconds

from metrale.kernels.paged_decode_attention import paged_decode_attention

NUM_HEADS, NUM_KV_HEADS, HEAD_DIM, BLOCK_SIZE, TABLE_TOKENS = 32, 8, 128, 16, 2048
LAYERS = 32
VOCAB = 128256


def attention_variants(results: dict) -> None:
    num_blocks = TABLE_TOKENS // BLOCK_SIZE
    shape = (num_blocks + 1, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM)
    k_cache = torch.randn(shape, device="cuda", dtype=torch.bfloat16)
    v_cache = torch.randn_like(k_cache)
    block_tables = torch.randperm(num_blocks, device="cuda").view(1, num_blocks)
    q = torch.randn(1, NUM_HEADS, HEAD_DIM, device="cuda", dtype=torch.bfloat16)
    for context in (256, 512):
        seq_lens = torch.tensor([context], device="cuda")
        attend = functools.partial(
            paged_decode_attention, q, k_cache, v_cache, block_tables, seq_lens, HEAD_DIM**-0.5
        )
        expected = attend()
        for splits in (None, 4, 16, 32):
            for block_n in (64, 128):
                if splits is None and block_n == 64:
                    continue
                launch = functools.partial(attend, num_splits=splits, max_block_n=block_n)
                assert torch.allclose(launch(), expected, atol=2e-2, rtol=2e-2)
                us = graph_seconds(lambda launch=launch: [launch() for _ in range(LAYERS)]) * 1e6
                name = f"attention ctx={context} splits={splits or 'default'} block_n={block_n}"
                results[name] = {"us_per_layer": us / LAYERS}
                print(f"{name:50s} {us / LAYERS:7.2f} us per layer")


def two_stage_argmax(logits: torch.Tensor, chunk: int) -> torch.Tensor:
    """argmax over the last dim: each chunk's max in parallel, then the best chunk (first
    maximum wins at both stages, as argmax's does)."""
    rows, vocab = logits.shape
    pad = (-vocab) % chunk
    padded = F.pad(logits, (0, pad), value=float("-inf")) if pad else logits
    values, indices = padded.view(rows, -1, chunk).max(dim=-1)  # [rows, chunks]
    best = values.argmax(dim=-1, keepdim=True)  # [rows, 1]
    return (best * chunk + indices.gather(1, best)).squeeze(1)


def argmax_variants(results: dict) -> None:
    logits = torch.randn(1, VOCAB, device="cuda")
    expected = logits.argmax(dim=-1)
    variants = {"torch argmax": lambda: logits.argmax(dim=-1)}
    for chunk in (256, 1024, 4096):
        variants[f"two-stage chunk={chunk}"] = functools.partial(two_stage_argmax, logits, chunk)
    for name, fn in variants.items():
        assert torch.equal(fn(), expected), name
        us = graph_seconds(lambda fn=fn: [fn() for _ in range(8)]) * 1e6 / 8
        results[f"argmax {name}"] = {"us": us}
        print(f"argmax {name:30s} {us:7.2f} us")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", "bench/results")))
    args = parser.parse_args()
    torch.manual_seed(0)
    results: dict = {"device": torch.cuda.get_device_name()}
    attention_variants(results)
    argmax_variants(results)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "b1_small_kernels.json").write_text(json.dumps(results, indent=2) + "\n")


if __name__ == "__main__":
    main()
