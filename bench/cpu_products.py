"""Whether a CPU decode step's products are bound by the memory or by the arithmetic: the 33
products of a step of profile_cpu.py's 33.6M-parameter Llama (qkv, o, gate_up and down for 8
layers, then the head: 117 MB in float32, 59 MB in bfloat16), each weight its own so they come
from memory as in a step, at 1, 8, 16 and 128 rows, through Metrale's panel product (what it runs
on float32 weights, `kernels/cpu/panel_linear.cpp`; float32 only), oneDNN's prepacked weights
(what it runs on others) and F.linear. Beside them, the machine's two rates measured in the same
run:

- the read bandwidth (a sum over 256 MiB), which bounds a step at `bytes / bandwidth`;
- the product rate at each row count over one weight that stays in the caches (the qkv weight,
  1-2 MB, repeated), which bounds it at `2 * rows * parameters / rate`.

Prints a table; the step's products are at whichever floor is higher when their time is close
to it.

    python bench/cpu_products.py [--dtype float32|bfloat16]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn.functional as F

from metrale.kernels import cpu_extension

SHAPES = [(1024, 512), (512, 512), (3072, 512), (512, 1536)] * 8 + [(8192, 512)]
ONEDNN_LAYOUT_ROWS = 256  # as metrale/layers/linear.py lays weights out


def seconds(fn, rounds: int = 9, calls: int = 10) -> float:
    """Median seconds a call over `rounds` rounds of `calls`."""
    for _ in range(3):
        fn()
    times = []
    for _ in range(rounds):
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        times.append((time.perf_counter() - start) / calls)
    return statistics.median(times)


def onednn(x: torch.Tensor, packed: torch.Tensor) -> torch.Tensor:
    return torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], "")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 8, 16, 128])
    args = parser.parse_args()
    dtype = getattr(torch, args.dtype)
    torch.manual_seed(0)
    weights = [torch.randn(o, i, dtype=dtype) * 0.02 for o, i in SHAPES]
    packed = [torch.ops.mkldnn._reorder_linear_weight(w, ONEDNN_LAYOUT_ROWS) for w in weights]
    with_panels = dtype == torch.float32 and cpu_extension.available()
    panels = [cpu_extension.pack_panels(w) if with_panels else None for w in weights]
    params = sum(w.numel() for w in weights)
    nbytes = params * weights[0].element_size()
    big = torch.ones(64 * 2**20, dtype=torch.float32)
    bandwidth = big.numel() * 4 / seconds(big.sum, rounds=5, calls=3)
    print(
        f"{torch.get_num_threads()} threads, {args.dtype}: {len(weights)} products, "
        f"{params / 1e6:.1f}M parameters, {nbytes / 1e6:.0f} MB; read bandwidth "
        f"{bandwidth / 1e9:.1f} GB/s, so the memory floor is {1e3 * nbytes / bandwidth:.2f} ms"
    )
    print(
        "| rows | panels ms | oneDNN ms | F.linear ms | cached-weight rate (oneDNN), GFLOP/s | "
        "arithmetic floor ms | panels / max(floors) | oneDNN / max(floors) |\n"
        "|---|---|---|---|---|---|---|---|"
    )
    hot, hot_packed = weights[0], packed[0]
    for rows in args.rows:
        xs = {i: torch.randn(rows, i, dtype=dtype) for i in (512, 1536)}
        pairs = [(xs[w.shape[1]], w, p) for w, p in zip(weights, packed, strict=True)]
        step = seconds(lambda pairs=pairs: [onednn(x, p) for x, _, p in pairs])
        panel_step = float("nan")
        if with_panels:
            panel_step = seconds(
                lambda xs=xs: [
                    cpu_extension.panel_linear(xs[w.shape[1]], p, None, w.shape[0])
                    for w, p in zip(weights, panels, strict=True)
                ]
            )
        plain = seconds(lambda pairs=pairs: [F.linear(x, w) for x, w, _ in pairs])
        x = xs[512]
        hot_seconds = seconds(lambda x=x: [onednn(x, hot_packed) for _ in range(32)])
        rate = 2 * rows * hot.numel() * 32 / hot_seconds
        floor = 2 * rows * params / rate
        bound = max(floor, nbytes / bandwidth)
        print(
            f"| {rows} | {1e3 * panel_step:.2f} | {1e3 * step:.2f} | {1e3 * plain:.2f} | "
            f"{rate / 1e9:.0f} | {1e3 * floor:.2f} | {bound / panel_step:.0%} | "
            f"{bound / step:.0%} |"
        )


if __name__ == "__main__":
    main()
