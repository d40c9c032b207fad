"""CUDA graphs of the decode step: the whole forward replayed as one launch.

A decode step (every request computes one token) launches hundreds of small kernels; replaying
them from a graph removes the launch gaps between them. One graph is captured per padded batch
size (1, 2, 4, 8, then multiples of 8 up to `--max-cuda-graph-batch`), largest first so that
all share one memory pool. A speculative verify is a decode of several rows (the runner lays a
decode with K drafts out as K + 1 one-row sequences), so it replays the graph of its row count.
The graphs read the runner's persistent input buffers, whose addresses never change: a replay
is "fill the buffers, replay". Rows past the real batch are padding that stores nothing (slot
-1) and attends to one token of block 0.
"""

from __future__ import annotations

import gc
import logging
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING, TypeVar

import torch

from metrale.engine.step import ScheduledChunk

if TYPE_CHECKING:
    from metrale.runner.model_runner import ModelRunner

logger = logging.getLogger(__name__)


def graph_batch_sizes(max_batch: int) -> list[int]:
    sizes = [s for s in (1, 2, 4) if s < max_batch]
    sizes += range(8, max_batch + 1, 8)
    if not sizes or sizes[-1] != max_batch:
        sizes.append(max_batch)
    return sorted(set(sizes))


@contextmanager
def no_garbage_collection() -> Iterator[None]:
    """Python's collector held off while graphs are captured, as SGLang and vLLM do: a
    collection inside a capture can run the finalizers of unrelated objects, and a finalizer's
    CUDA call that is illegal in a capture (an event's query, a pinned buffer's release)
    invalidates it (`cudaErrorStreamCaptureInvalidated`: one run of the GPU tests on an H100 failed
    with it on 2026-12-05, the runs since have not). Whatever is garbage is collected first."""
    gc.collect()
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()


def padded_size(sizes: list[int], n: int) -> int | None:
    """The smallest of the captured `sizes` (ascending) that holds `n`; None past the largest."""
    return next((s for s in sizes if s >= n), None)


G = TypeVar("G")


def capture_largest_first(
    sizes: list[int], capture: Callable[[int], G]
) -> tuple[dict[int, G], float]:
    """A graph per size, the largest first so that all share the memory the largest needs, with
    the collector held off; the graphs and the seconds the captures took."""
    start = time.perf_counter()
    with no_garbage_collection():
        graphs = {size: capture(size) for size in reversed(sizes)}
    return graphs, time.perf_counter() - start


@dataclass
class DecodeGraph:
    num_seqs: int
    graph: torch.cuda.CUDAGraph
    logits: torch.Tensor  # [num_seqs, vocab_size], written by each replay

    def replay(self) -> torch.Tensor:
        self.graph.replay()
        return self.logits


class DecodeGraphs:
    def __init__(self, runner: ModelRunner, max_batch: int) -> None:
        self.runner = runner
        self.sizes = graph_batch_sizes(max_batch)
        self.graphs: dict[int, DecodeGraph] = {}
        # Their memory pool, once the first is captured; the graphs of steps with prompt tokens
        # capture into it too (they all replay one at a time, on one stream).
        self.pool: tuple[int, int] | None = None

    def graph_for(self, chunks: list[ScheduledChunk]) -> DecodeGraph | None:
        """The graph that runs this step, if it is a decode step (drafts included) small enough
        for one."""
        num_rows = 0
        for c in chunks:
            if not c.samples or not c.is_decode:
                return None
            num_rows += c.num_tokens
        size = padded_size(self.sizes, num_rows)
        return None if size is None else self.graphs[size]

    @torch.inference_mode()
    def capture(self) -> None:
        self.graphs, seconds = capture_largest_first(self.sizes, self._capture)
        logger.info(
            "captured %d decode CUDA graphs (batch sizes %s) in %.1f s",
            len(self.sizes),
            self.sizes,
            seconds,
        )

    def _capture(self, num_seqs: int) -> DecodeGraph:
        runner = self.runner
        batch = runner._fill_inputs([], padded_num_seqs=num_seqs)
        meta = runner.build_metadata(batch)
        input_ids = runner.buffers.input_ids.device[:num_seqs]
        positions = runner.buffers.positions.device[:num_seqs]

        def forward() -> torch.Tensor:
            return runner.model.compute_logits(runner.model(input_ids, positions, meta))

        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            # Once, outside the capture: kernels compile or load, cuBLAS and the allocator
            # settle, whatever is lazy happens.
            forward()
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            logits = forward()
        self.pool = graph.pool()
        return DecodeGraph(num_seqs, graph, logits)
