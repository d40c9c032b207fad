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


def graph_seconds(fn: Callable[[], object], repeats: int = 20) -> float:
    """Median seconds of the GPU work `fn` launches, replayed from one CUDA graph (as a decode
    step runs): no launch overhead of the host in the figure."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # compile kernels and let libraries allocate before capture
        for _ in range(2):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return median_seconds(graph.replay, repeats)


def copy_bandwidth(num_bytes: int = 2**31) -> float:
    """Bytes per second of a device-to-device copy of `num_bytes`, read and write counted."""
    src = torch.empty(num_bytes, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    return 2 * num_bytes / median_seconds(lambda: dst.copy_(src), 10)
