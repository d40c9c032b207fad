"""Timing of GPU work for the kernel benchmarks: CUDA events around each call, median kept."""

from __future__ import annotations

from collections.abc import Callable

import torch


def median_seconds(fn: Callable[[], object], repeats: int = 20) -> float:
    """Median seconds of `fn`, after one untimed call (which compiles what it launches)."""
    fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1000)
    return sorted(times)[len(times) // 2]
