"""Ask the GPU's copy engine to bring a weight into L2 ahead of the product that reads it.

In a batch-1 decode step the memory streams weights during the products and idles during the
small kernels between them (rotary, attention and its reduce, norms). `prefetch_to_l2` launches
a kernel whose threads each issue one `cp.async.bulk.prefetch.L2` (Hopper) for a chunk of the
weight and exit: the copies go on while the kernels after it run, with no SM waiting on them,
so the product that follows finds its weight in L2.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from metrale.kernels.grid import cdiv

CHUNK_BYTES = 65536  # what one thread asks for
_THREADS = 128
_ASM = (
    "{ .reg .pred p; setp.ne.b32 p, $2, 0; "
    f"@p cp.async.bulk.prefetch.L2.global [$1], {CHUNK_BYTES}; mov.u32 $0, 0; }}"
)


@triton.jit
def _prefetch_kernel(ptr, num_chunks, CHUNK_ELEMENTS: tl.constexpr, THREADS: tl.constexpr):
    chunk = tl.program_id(0) * THREADS + tl.arange(0, THREADS)
    wanted = (chunk < num_chunks).to(tl.int32)
    addresses = ptr + chunk.to(tl.int64) * CHUNK_ELEMENTS
    tl.inline_asm_elementwise(
        _ASM, "=r,l,r", [addresses, wanted], dtype=tl.int32, is_pure=False, pack=1
    )


@functools.lru_cache
def _hopper(index: int) -> bool:
    return torch.cuda.get_device_capability(index)[0] >= 9


def can_prefetch(weight: torch.Tensor | None) -> bool:
    """A dense contiguous weight on a Hopper-or-later GPU."""
    if weight is None:
        return False
    device = weight.device
    return (
        device.type == "cuda"
        and weight.is_contiguous()
        and _hopper(device.index if device.index is not None else 0)
    )


def prefetch_to_l2(weight: torch.Tensor | None) -> None:
    """Queue the copy of `weight`'s whole chunks into L2 and return (the kernel does not wait
    for them); nothing where it `can_prefetch` not (METRALE_L2_PREFETCH turns the engine's
    calls on: `metrale.envs.l2_prefetch`)."""
    if not can_prefetch(weight):
        return
    assert weight is not None
    num_chunks = weight.numel() * weight.element_size() // CHUNK_BYTES
    if num_chunks == 0:
        return
    chunk_elements = CHUNK_BYTES // weight.element_size()
    grid = (cdiv(num_chunks, _THREADS),)
    _prefetch_kernel[grid](weight, num_chunks, chunk_elements, _THREADS, num_warps=_THREADS // 32)
