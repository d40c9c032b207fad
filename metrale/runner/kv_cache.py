"""The paged KV pool's memory on the device, and the host pool its blocks are swapped out to.

Every layer's keys and values live in one tensor, `[num_layers, 2, num_blocks, block_size,
num_kv_heads, head_dim]` (under tensor parallelism, this rank's KV heads); each layer's
attention binds its two contiguous slices. So a block's bytes in every layer are gathered by one
indexing op, and the host pool keeps a block's bytes for all layers together,
`[num_host_blocks, num_layers, 2, block_size, ...]`: a run of consecutive host blocks is one
copy. Copies go through raw bytes, so any cache dtype moves the same way (fp8 has no indexing
kernels of its own).

Copies are queued on the device's current stream, where the steps run: a swap-out reads blocks
after the steps before it have written them, and a block freed by it may be written by the very
step it precedes. Next to a GPU the host pool is pinned, so the copies are DMA transfers that do
not block the host; on a CPU both pools are plain memory and copies are done when they return.
"""

from __future__ import annotations

import math
import time
from collections.abc import Iterator

import torch
from torch import nn

from metrale.config import CacheConfig, ModelConfig

# Blocks gathered in one staging tensor: bounds the device memory a swap borrows (64 blocks of
# an 8B model's bf16 cache: 128 MiB).
MAX_STAGED_BLOCKS = 64


class PagedKVCache:
    def __init__(
        self,
        model: nn.Module,
        config: ModelConfig,
        cache: CacheConfig,
        device: torch.device,
    ) -> None:
        layers = list(model.attention_layers())
        shape = (
            len(layers),
            2,
            cache.num_blocks,
            cache.block_size,
            config.num_kv_heads_per_rank,  # this rank's under tensor parallelism
            config.head_dim,
        )
        # Zeros, not empty: masked-out slots are still multiplied by zero weights, and
        # uninitialized memory may hold NaN, which zero does not cancel.
        self.kv = torch.zeros(shape, dtype=cache.dtype, device=device)
        for i, layer in enumerate(layers):
            layer.bind_cache(self.kv[i, 0], self.kv[i, 1], i)
        self.device = device
        self._bytes = self.kv.view(torch.uint8)  # the same memory, a byte per element
        self.host: torch.Tensor | None = None
        if cache.num_host_blocks:
            # Every block copied in was copied out whole first: no slot is read uninitialized.
            self.host = torch.empty(
                (cache.num_host_blocks, *self._bytes[:, :, 0].shape),
                dtype=torch.uint8,
                pin_memory=device.type == "cuda",
            )

    @property
    def layers(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        return [(self.kv[i, 0], self.kv[i, 1]) for i in range(self.kv.shape[0])]

    @property
    def num_host_blocks(self) -> int:
        return 0 if self.host is None else self.host.shape[0]

    def swap_out(self, pairs: list[tuple[int, int]]) -> None:
        """Copy each (device, host) block pair's bytes to the host pool."""
        assert self.host is not None
        for device_ids, host_runs in self._staged(pairs):
            staged = self._bytes.index_select(2, device_ids).movedim(2, 0).contiguous()
            for start, end, offset in host_runs:
                self.host[start:end].copy_(staged[offset : offset + end - start], non_blocking=True)

    def swap_in(self, pairs: list[tuple[int, int]]) -> None:
        """Copy each (host, device) block pair's bytes back into the device pool."""
        assert self.host is not None
        device_first = [(d, h) for h, d in pairs]
        for device_ids, host_runs in self._staged(device_first):
            staged = torch.empty(
                (len(device_ids), *self.host.shape[1:]), dtype=torch.uint8, device=self.device
            )
            for start, end, offset in host_runs:
                staged[offset : offset + end - start].copy_(self.host[start:end], non_blocking=True)
            self._bytes.index_copy_(2, device_ids, staged.movedim(0, 2))

    def _staged(
        self, pairs: list[tuple[int, int]]
    ) -> Iterator[tuple[torch.Tensor, list[tuple[int, int, int]]]]:
        """The pairs in host order, a staging group at a time: the group's device block ids
        (a device tensor) and its runs of consecutive host blocks as (start, end, offset into
        the group)."""
        pairs = sorted(pairs, key=lambda p: p[1])
        for first in range(0, len(pairs), MAX_STAGED_BLOCKS):
            group = pairs[first : first + MAX_STAGED_BLOCKS]
            runs: list[tuple[int, int, int]] = []
            for offset, (_, host) in enumerate(group):
                if runs and runs[-1][1] == host:
                    start, _, run_offset = runs[-1]
                    runs[-1] = (start, host + 1, run_offset)
                else:
                    runs.append((host, host + 1, offset))
            device_ids = torch.tensor([d for d, _ in group], dtype=torch.int64)
            yield device_ids.to(self.device, non_blocking=True), runs

    def measure_copy_bandwidth(
        self, num_blocks: int = MAX_STAGED_BLOCKS, repeats: int = 5
    ) -> float:
        """Bytes a second of a swap out and back of `num_blocks` blocks (each way), the best of
        `repeats` once warm. Uses the pools' first blocks: call it before any request holds
        them."""
        n = min(num_blocks, self.num_host_blocks, self.kv.shape[2])
        pairs = [(i, i) for i in range(n)]
        best = math.inf
        for _ in range(repeats + 1):  # the first warms up
            start = time.perf_counter()
            self.swap_out(pairs)
            self.swap_in(pairs)
            self._synchronize()
            best = min(best, time.perf_counter() - start)
        return 2 * n * self.bytes_per_block / max(best, 1e-9)

    @property
    def bytes_per_block(self) -> int:
        return self._bytes[:, :, 0].numel()

    def _synchronize(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)


class SwapTiming:
    """How long a step's swap copies take: two events around them on a GPU, a clock on a CPU
    (where they are done when they return)."""

    def __init__(self, device: torch.device) -> None:
        self._events = None
        self._wall_s = 0.0
        if device.type == "cuda":
            self._events = (
                torch.cuda.Event(enable_timing=True),
                torch.cuda.Event(enable_timing=True),
            )

    @classmethod
    def start(cls, device: torch.device) -> SwapTiming:
        timing = cls(device)
        if timing._events is not None:
            timing._events[0].record()
        else:
            timing._wall_s = -time.perf_counter()
        return timing

    def stop(self) -> None:
        if self._events is not None:
            self._events[1].record()
        else:
            self._wall_s += time.perf_counter()

    def seconds(self) -> float:
        """The copies' time; on a GPU this waits for them (they precede the step's samples)."""
        if self._events is None:
            return self._wall_s
        self._events[1].synchronize()
        return self._events[0].elapsed_time(self._events[1]) / 1e3
