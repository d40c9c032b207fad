"""The host's time to build a step's sampler inputs (`SamplingInputs.prepare`) for a batch of
decodes, step after step with the same rows (as a batch of decodes runs), on a CPU: 256 rows at
temperature 0.6 seeded (B2's sampling), unseeded, and greedy. Prints one JSON line of median
microseconds a step. Which package runs is PYTHONPATH's choice: run two alternately for an A/B.

    python bench/sampling_inputs.py [--rows 256]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

import metrale
from metrale.engine.step import ScheduledChunk
from metrale.runner.input_buffers import InputBuffers
from metrale.runner.sampling_inputs import SamplingInputs
from metrale.sampling_params import SamplingParams

VOCAB = 151_936  # Qwen3's


def median_us(rows: int, params: list[SamplingParams], steps: int = 300) -> float:
    cpu = torch.device("cpu")
    sampling = SamplingInputs(InputBuffers(8192, rows, 256, cpu), VOCAB, 4096, cpu)
    block_ids = list(range(70))
    times = []
    for step in range(steps + 20):
        chunks = [
            ScheduledChunk(f"r{i}", [5], 1000 + step, block_ids, True, p)
            for i, p in enumerate(params)
        ]
        start = time.perf_counter()
        sampling.prepare(chunks, False)
        times.append(time.perf_counter() - start)
    return statistics.median(times[20:]) * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, default=256)
    args = parser.parse_args()
    n = args.rows
    batches = {
        "seeded": [SamplingParams(temperature=0.6, seed=i) for i in range(n)],
        "sampled": [SamplingParams(temperature=0.6)] * n,
        "greedy": [SamplingParams(temperature=0.0)] * n,
    }
    result = {"package": metrale.__file__.rsplit("/", 2)[0], "rows": n}
    for name, params in batches.items():
        result[f"{name}_us"] = round(median_us(n, params), 1)
    print(json.dumps(result))


if __name__ == "__main__":
    main()
