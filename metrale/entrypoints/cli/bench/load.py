"""Send a fixed list of requests at a request rate, at most so many at once, within a deadline.

Arrivals follow `vllm bench serve`: at rate `inf` every request is sent at once (the concurrency
cap still holds them back); otherwise the gaps between sends are drawn from a gamma distribution
of mean 1/rate whose shape is the burstiness (1: a Poisson process; lower: burstier), or are all
1/rate for `constant` arrivals. A request still running at the deadline is cancelled and counts
as failed; the run's duration ends at the deadline then.
"""

from __future__ import annotations

import asyncio
import math
import random
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass

from metrale.entrypoints.cli.bench.datasets import Sample
from metrale.entrypoints.cli.bench.metrics import RequestResult

ARRIVALS = ("poisson", "constant")


@dataclass(frozen=True)
class LoadShape:
    request_rate: float = math.inf  # requests per second
    max_concurrency: int | None = None  # None: no cap
    arrival: str = "poisson"
    burstiness: float = 1.0
    deadline_s: float = 600.0
    seed: int = 0

    def check(self) -> None:
        if not self.request_rate > 0:
            raise ValueError("--request-rate must be > 0 (or inf)")
        if self.max_concurrency is not None and self.max_concurrency < 1:
            raise ValueError("--max-concurrency must be at least 1")
        if self.arrival not in ARRIVALS:
            raise ValueError(f"--arrival {self.arrival!r}: use one of {', '.join(ARRIVALS)}")
        if not self.burstiness > 0:
            raise ValueError("--burstiness must be > 0")
        if not self.deadline_s > 0:
            raise ValueError("--deadline must be > 0 seconds")


def send_delays(n: int, shape: LoadShape) -> list[float]:
    """Seconds to wait before each of `n` sends (the first is sent at once)."""
    if math.isinf(shape.request_rate):
        return [0.0] * n
    if shape.arrival == "constant":
        return [0.0] + [1.0 / shape.request_rate] * (n - 1)
    rng = random.Random(shape.seed)
    scale = 1.0 / (shape.request_rate * shape.burstiness)
    return [0.0] + [rng.gammavariate(shape.burstiness, scale) for _ in range(n - 1)]


async def run_load(
    samples: Sequence[Sample],
    send: Callable[[Sample], Awaitable[RequestResult]],
    shape: LoadShape,
    on_done: Callable[[RequestResult], None] | None = None,
) -> tuple[list[RequestResult], float]:
    """Every sample's result, in order, and the run's wall time in seconds."""
    shape.check()
    gate = asyncio.Semaphore(shape.max_concurrency) if shape.max_concurrency else None
    results: list[RequestResult | None] = [None] * len(samples)
    start = time.perf_counter()

    async def one(i: int, sample: Sample) -> None:
        if gate is None:
            results[i] = await send(sample)
        else:
            async with gate:
                results[i] = await send(sample)
        if on_done is not None:
            on_done(results[i])

    tasks: list[asyncio.Task] = []

    async def dispatch() -> None:
        for i, (sample, delay) in enumerate(
            zip(samples, send_delays(len(samples), shape), strict=True)
        ):
            if delay > 0:
                await asyncio.sleep(delay)
            tasks.append(asyncio.create_task(one(i, sample)))

    dispatcher = asyncio.create_task(dispatch())
    done, _ = await asyncio.wait([dispatcher], timeout=shape.deadline_s)
    if not done:
        dispatcher.cancel()
    remaining = shape.deadline_s - (time.perf_counter() - start)
    if tasks and remaining > 0:
        await asyncio.wait(tasks, timeout=remaining)
    late = [t for t in tasks if not t.done()]
    for task in late:
        task.cancel()
    await asyncio.gather(*late, dispatcher, return_exceptions=True)
    duration = time.perf_counter() - start
    for task in tasks:
        if task.done() and not task.cancelled() and task.exception() is not None:
            raise task.exception()  # a bug in `send`: it returns failures, never raises
    missed = f"not finished within the {shape.deadline_s:g} s deadline"
    return [
        r if r is not None else RequestResult(prompt_len=s.prompt_len, error=missed)
        for r, s in zip(results, samples, strict=True)
    ], duration
