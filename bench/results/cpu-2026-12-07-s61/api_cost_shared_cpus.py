"""`bench/api_cost.py`'s streamed rounds with each server's API process left on the CPUs its
engine and the load use (api_cost.py gives it one of its own), so it competes for them as at B4
on a fast GPU: a baseline package and the tree alternating, medians printed.

    python bench/results/cpu-2026-12-07-s61/api_cost_shared_cpus.py BASELINE_DIR ROUNDS OUTPUT_LEN
"""

from __future__ import annotations

import multiprocessing
import os
import random
import statistics
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(REPO / "bench"))
from api_cost import TINY_QWEN3, _pin_load, drive, measure, start  # noqa: E402
from serve_telemetry import dummy_checkpoint, wait_healthy  # noqa: E402


def main() -> None:
    packages = {"baseline": Path(sys.argv[1]).resolve(), "candidate": REPO}
    rounds, output_len = int(sys.argv[2]), int(sys.argv[3])
    model = dummy_checkpoint(TINY_QWEN3)
    logs = Path(tempfile.mkdtemp(prefix="api-cost-shared-"))
    cpus = set(os.sched_getaffinity(0))
    servers = {
        name: start(package, model, 256, [], logs / f"{name}.log", cpus)
        for name, package in packages.items()
    }
    pool = multiprocessing.get_context("spawn").Pool(1, _pin_load, (cpus,))
    results: dict[str, list[dict]] = {name: [] for name in packages}
    try:
        for name, (process, port) in servers.items():
            wait_healthy(process, f"http://127.0.0.1:{port}", logs / f"{name}.log")
            pool.apply(drive, (port, str(model), [[5, 6, 7]] * 16, 16))  # warm up
        rng = random.Random(0)
        for i in range(rounds):
            prompts = [[rng.randrange(10, 4000) for _ in range(32)] for _ in range(256)]
            for name in list(servers) if i % 2 == 0 else list(reversed(servers)):
                process, port = servers[name]
                result = measure(pool, process.pid, port, str(model), prompts, output_len)
                results[name].append(result)
                print(i, name, {k: round(v, 3) for k, v in result.items()}, flush=True)
    finally:
        pool.terminate()
        for process, _ in servers.values():
            process.terminate()
            process.wait(60)
    for name, rows in results.items():
        medians = {k: round(statistics.median(r[k] for r in rows), 3) for k in rows[0]}
        print(name, "medians", medians)


if __name__ == "__main__":  # the load pool spawns: its workers import this file
    main()
