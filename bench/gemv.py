"""Batch-1 matrix-vector products at Llama-3.1-8B's weight shapes: cuBLAS against the Triton
`gemv` kernel and its launch sweep, each replayed from a CUDA graph (as in a decode step).

Reports the read bandwidth of each (weight bytes / time) next to the copy bandwidth measured in
the same run, and the five products of a layer back to back (+ the head), as a decode step
chains them.

    python bench/gemv.py [--out DIR]
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
from pathlib import Path

import torch
from cuda_timing import copy_bandwidth, graph_seconds

from metrale.kernels.gemv import gemv

SHAPES = {  # name -> (N, K) of W
    "qkv": (6144, 4096),
    "o": (4096, 4096),
    "gate_up": (28672, 4096),
    "down": (4096, 14336),
    "lm_head": (128256, 4096),
}
REPEATS = 8  # distinct weights per graph, so L2 holds none of them between replays


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", "bench/results")))
    args = parser.parse_args()
    copy = copy_bandwidth()
    results: dict = {"copy_tb_per_s": copy / 1e12, "device": torch.cuda.get_device_name()}
    print(f"copy bandwidth {copy / 1e12:.2f} TB/s (read + write)")
    x = torch.randn(1, 14336, device="cuda", dtype=torch.bfloat16)
    best = {}
    for name, (n, k) in SHAPES.items():
        repeats = 2 if name == "lm_head" else REPEATS
        weights = [
            torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02 for _ in range(repeats)
        ]
        xk = x[:, :k]
        nbytes = n * k * 2 * repeats

        def report(label: str, seconds: float, name=name, nbytes=nbytes, repeats=repeats) -> float:
            tb = nbytes / seconds / 1e12
            results.setdefault(name, {})[label] = {"us": seconds / repeats * 1e6, "tb_per_s": tb}
            print(f"{name:8s} {label:32s} {seconds / repeats * 1e6:8.1f} us  {tb:5.2f} TB/s")
            return seconds

        cublas = report("cublas", graph_seconds(lambda ws=weights, xk=xk: [xk @ w.t() for w in ws]))
        expected = xk @ weights[0].t()
        options = []
        for block_n, block_k, warps in itertools.product((4, 8, 16, 32), (256, 512, 1024), (4, 8)):
            if block_n * block_k > 16384:
                continue

            def launch(ws=weights, xk=xk, bn=block_n, bk=block_k, w=warps):
                return [gemv(xk, wt, block_n=bn, block_k=bk, num_warps=w) for wt in ws]

            torch.testing.assert_close(launch()[0], expected, atol=2e-2, rtol=2e-2)
            label = f"gemv n={block_n} k={block_k} w={warps}"
            options.append((report(label, graph_seconds(launch)), label))
        seconds, label = min(options)
        best[name] = {"label": label, "speedup_over_cublas": cublas / seconds}
        print(f"{name:8s} best {label}: {cublas / seconds:.2f}x cuBLAS")
        del weights
        torch.cuda.empty_cache()
    results["best"] = best
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "gemv.json").write_text(json.dumps(results, indent=2) + "\n")


if __name__ == "__main__":
    main()
