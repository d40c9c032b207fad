"""The token draw alone: the exponential race the sampler used until 2026-12-06 (noise for every
token, one `exponential_` per seeded row on its own generator, then argmax of p / noise) against
the inverse CDF that replaced it (`runner/inverse_cdf.py`: one uniform per row from the host).

On the GPU: the Triton kernels from probabilities, divide + softmax + those kernels from the
logits, the tempered kernels from the logits, and the torch formula; per variant and batch size
the host's time to issue a draw (median of 200, no sync) and the wall time per draw (CUDA events
around 200 back to back). On a CPU (`--device cpu`): from the logits, the torch formula against
the C++ op (`kernels/cpu/inverse_cdf.cpp`), wall time per draw (best of 3 x 10). Rows of Qwen3's
vocabulary (151,936).

    python bench/sampling_draw.py [--device cuda|cpu] [--out DIR]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path

import torch

from metrale.runner.inverse_cdf import inverse_cdf_torch, tempered_weights

VOCAB = 151_936


def race(probs: torch.Tensor, generators: list[torch.Generator | None]) -> torch.Tensor:
    noise = torch.empty_like(probs).exponential_()
    for row, generator in enumerate(generators):
        if generator is not None:
            noise[row].exponential_(generator=generator)
    return (probs / noise).argmax(dim=-1)


def timed_cuda(fn, repeats: int = 200) -> dict[str, float]:
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


def timed_cpu(fn) -> dict[str, float]:
    fn()
    best = float("inf")
    for _ in range(3):
        start = time.perf_counter()
        for _ in range(10):
            fn()
        best = min(best, (time.perf_counter() - start) / 10)
    return {"wall_us_per_draw": 1e6 * best}


def variants(rows: int, device: torch.device) -> dict:
    logits = torch.randn(rows, VOCAB, device=device) * 3
    temperature = torch.full((rows,), 0.6, device=device)
    probs = torch.softmax(logits / temperature.unsqueeze(1), dim=-1)
    draws = torch.rand(rows, dtype=torch.float64, device=device)
    seeded = [torch.Generator(device=device).manual_seed(i) for i in range(rows)]
    out = {
        "race_unseeded": lambda: race(probs, [None] * rows),
        "race_seeded": lambda: race(probs, seeded),
        "inverse_cdf_torch": lambda: inverse_cdf_torch(probs, draws),
        "tempered_torch": lambda: inverse_cdf_torch(tempered_weights(logits, temperature), draws),
    }
    if device.type == "cuda":
        from metrale.kernels.inverse_cdf import inverse_cdf, tempered_inverse_cdf

        out["inverse_cdf_kernel"] = lambda: inverse_cdf(probs, draws)
        # from the logits: what the sampler did before the tempered kernels, and them
        out["divide_softmax_kernel"] = lambda: inverse_cdf(
            torch.softmax(logits / temperature.unsqueeze(1), dim=-1), draws
        )
        out["tempered_kernel"] = lambda: tempered_inverse_cdf(logits, temperature, draws)
    else:
        from metrale.kernels import cpu_extension

        if cpu_extension.enabled():
            op = torch.ops.metrale_cpu.tempered_inverse_cdf
            out["tempered_op"] = lambda: op(logits, temperature, draws)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    parser.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", ".")))
    args = parser.parse_args()
    device = torch.device(args.device)
    on_gpu = device.type == "cuda"
    name = torch.cuda.get_device_name() if on_gpu else f"cpu, {torch.get_num_threads()} threads"
    results: dict = {"device": name, "vocab": VOCAB}
    for rows in (1, 64, 256) if on_gpu else (1, 16):
        for variant, fn in variants(rows, device).items():
            results[f"{rows}_rows_{variant}"] = (timed_cuda if on_gpu else timed_cpu)(fn)
            print(rows, variant, json.dumps(results[f"{rows}_rows_{variant}"]))
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / f"sampling_draw-{args.device}.json").write_text(
        json.dumps(results, indent=1) + "\n"
    )


if __name__ == "__main__":
    main()
