"""The token draw alone, on the GPU: the exponential race the sampler used until 2026-12-06
(noise for every token, one `exponential_` launch per seeded row on its own generator, then
argmax of p / noise) against the inverse CDF that replaced it (`runner/inverse_cdf.py`: one
uniform per row from the host; the Triton kernels, and the torch formula for comparison); and
from the logits, temperature and softmax then the kernel against the tempered kernels.

Per variant and batch size: the host's time to issue a draw (median of 200, no sync) and the
device's (CUDA events around 200 draws), on softmax rows of Qwen3's vocabulary (151,936).

    python bench/sampling_draw.py [--out DIR]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path

import torch

from metrale.kernels.inverse_cdf import inverse_cdf, tempered_inverse_cdf
from metrale.runner.inverse_cdf import inverse_cdf_torch

VOCAB = 151_936


def race(probs: torch.Tensor, generators: list[torch.Generator | None]) -> torch.Tensor:
    noise = torch.empty_like(probs).exponential_()
    for row, generator in enumerate(generators):
        if generator is not None:
            noise[row].exponential_(generator=generator)
    return (probs / noise).argmax(dim=-1)


def timed(fn, repeats: int = 200) -> dict[str, float]:
    for _ in range(10):
        fn()
    torch.cuda.synchronize()
    host = []
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        host.append(time.perf_counter() - t)
    end.record()
    torch.cuda.synchronize()
    return {
        "host_us_median": 1e6 * statistics.median(host),
        "wall_us_per_draw": 1e3 * start.elapsed_time(end) / repeats,
    }


def variants(rows: int) -> dict:
    logits = torch.randn(rows, VOCAB, device="cuda") * 3
    temperature = torch.full((rows,), 0.6, device="cuda")
    probs = torch.softmax(logits, dim=-1)
    draws = torch.rand(rows, dtype=torch.float64, device="cuda")
    seeded = [torch.Generator(device="cuda").manual_seed(i) for i in range(rows)]
    return {
        "race_unseeded": lambda: race(probs, [None] * rows),
        "race_seeded": lambda: race(probs, seeded),
        "inverse_cdf_kernel": lambda: inverse_cdf(probs, draws),
        "inverse_cdf_torch": lambda: inverse_cdf_torch(probs, draws),
        # from the fp32 logits: what the sampler did before the tempered kernels, and them
        "divide_softmax_kernel": lambda: inverse_cdf(
            torch.softmax(logits / temperature.unsqueeze(1), dim=-1), draws
        ),
        "tempered_kernel": lambda: tempered_inverse_cdf(logits, temperature, draws),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", ".")))
    args = parser.parse_args()
    results: dict = {"device": torch.cuda.get_device_name(), "vocab": VOCAB}
    for rows in (1, 64, 256):
        for name, fn in variants(rows).items():
            results[f"{rows}_rows_{name}"] = timed(fn)
            print(rows, name, json.dumps(results[f"{rows}_rows_{name}"]))
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "sampling_draw.json").write_text(json.dumps(results, indent=1) + "\n")


if __name__ == "__main__":
    main()
