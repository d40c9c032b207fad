"""The CPU decode attention (`metrale_cpu::paged_decode_attention`) over a warm pool and a cold
one: a 16-row decode step of profile_cpu.py's 33.6M Llama (8 query heads over 4 KV heads of 64,
blocks of 16 slots scattered over the pool), one call a layer. Warm: the same layer's cache eight
times, so its keys and values stay in the caches; cold: eight layers' caches in turn, as a step
reads them (each layer's 6.3 MB at 192 slots in float32, eight of them past this VM's L3). Beside
them, the machine's read bandwidth measured in the same run, which bounds the cold call at
`bytes / bandwidth`.

Which package runs is PYTHONPATH's choice: run two alternately for an A/B.

    python bench/cpu_decode_attention.py [--dtype float32|bfloat16] [--context 192] [--rows 16]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch
from cpu_products import seconds

import metrale
from metrale.kernels import cpu_extension

HEADS, KV_HEADS, HEAD_DIM, BLOCK_SIZE, LAYERS = 8, 4, 64, 16, 8


def read_bandwidth() -> float:
    """Bytes a second summing 256 MiB of float32 (torch's threads)."""
    x = torch.ones(64 * 2**20)
    return x.numel() * 4 / seconds(lambda: x.sum(), rounds=5, calls=3)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--context", type=int, default=192, help="slots each row sees")
    parser.add_argument("--rows", type=int, default=16)
    parser.add_argument("--pool-blocks", type=int, default=2048)
    args = parser.parse_args()
    if not cpu_extension.available():
        raise SystemExit("the CPU extension could not be built here")
    dtype = getattr(torch, args.dtype)
    torch.manual_seed(0)
    shape = (args.pool_blocks, BLOCK_SIZE, KV_HEADS, HEAD_DIM)
    caches = [(torch.randn(shape).to(dtype), torch.randn(shape).to(dtype)) for _ in range(LAYERS)]
    blocks_per_row = -(-args.context // BLOCK_SIZE)
    tables = torch.randperm(args.pool_blocks)[: args.rows * blocks_per_row]
    tables = tables.view(args.rows, blocks_per_row).contiguous()
    lens = torch.full((args.rows,), args.context, dtype=torch.int64)
    q = torch.randn(args.rows, HEADS, HEAD_DIM).to(dtype)
    attend = torch.ops.metrale_cpu.paged_decode_attention

    def step(layers: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        for k, v in layers:
            attend(q, k, v, tables, lens, HEAD_DIM**-0.5, 0)

    bytes_a_call = 2 * args.rows * args.context * KV_HEADS * HEAD_DIM * dtype.itemsize
    bandwidth = read_bandwidth()
    result = {
        "package": metrale.__file__.rsplit("/", 2)[0],
        "dtype": args.dtype,
        "rows": args.rows,
        "context": args.context,
        "threads": torch.get_num_threads(),
        "read_gb_per_s": round(bandwidth / 1e9, 1),
        "bytes_a_call": bytes_a_call,
        "floor_us": round(bytes_a_call / bandwidth * 1e6, 1),
    }
    for name, layers in (("warm", [caches[0]] * LAYERS), ("cold", caches)):
        times = []
        for _ in range(5):
            step(layers)
        for _ in range(50):
            start = time.perf_counter()
            step(layers)
            times.append((time.perf_counter() - start) / LAYERS)
        result[f"{name}_us"] = round(statistics.median(times) * 1e6, 1)
    print(json.dumps(result))


if __name__ == "__main__":
    main()
