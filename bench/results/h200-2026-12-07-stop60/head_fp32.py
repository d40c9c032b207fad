"""The head's product then `.float()` (what the sampler got before 6db7f22) against the product
writing float32 itself (`torch.mm(..., out_dtype=torch.float32)`, `gemv(out_dtype=...)` at one
row), each replayed from a CUDA graph; also the float32 result's largest error against the
product of the weights in float32. Run from the repository root on a GPU, `OUT` set:

    PYTHONPATH=.:bench python bench/results/h200-2026-12-07-stop60/head_fp32.py
"""

from __future__ import annotations

import json
import os

import torch
import torch.nn.functional as F
from cuda_timing import graph_seconds

from metrale.kernels.gemv import gemv

HEADS = [("qwen3_0.6b", 1024, 151936), ("llama_8b", 4096, 128256)]


def variants(x: torch.Tensor, w: torch.Tensor):
    if x.shape[0] == 1:
        return (lambda: gemv(x, w).float()), (lambda: gemv(x, w, out_dtype=torch.float32))
    return (lambda: F.linear(x, w).float()), (lambda: torch.mm(x, w.t(), out_dtype=torch.float32))


def main() -> None:
    out = []
    for name, hidden, vocab in HEADS:
        w = torch.randn(vocab, hidden, device="cuda", dtype=torch.bfloat16) * 0.02
        for rows in (1, 64, 256, 512):
            x = torch.randn(rows, hidden, device="cuda", dtype=torch.bfloat16)
            then_float, fp32_out = variants(x, w)
            ta = sorted(graph_seconds(then_float, 50) for _ in range(3))
            tb = sorted(graph_seconds(fp32_out, 50) for _ in range(3))
            err = (fp32_out() - x.float() @ w.float().t()).abs().max().item()
            row = {
                "model": name,
                "rows": rows,
                "then_float_us": ta[1] * 1e6,
                "fp32_out_us": tb[1] * 1e6,
                "max_err_fp32": err,
            }
            print(json.dumps(row))
            out.append(row)
    result = {"gpu": torch.cuda.get_device_name(), "rows": out}
    with open(os.environ["OUT"] + "/head_fp32.json", "w") as f:
        json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
