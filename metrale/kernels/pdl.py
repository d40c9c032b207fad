"""Programmatic dependent launch (PDL): a kernel starts while the one before it drains.

Without PDL the GPU launches a grid only once the kernel before it has finished and flushed its
writes. Launched with `launch_pdl=True` (Hopper and later), a kernel may launch as the blocks of
the previous one exit, and then blocks in `gdc_wait` until that kernel has finished and its
writes are visible: `gemv` loads its first weight tile before the wait, since nothing earlier in
the step writes the weights.

The contract of a kernel launched this way, kept by `wait_for_previous_kernel`: every program
waits before it reads anything an earlier kernel wrote and before it writes anything. Since each
kernel waits for the one before it, which waited for the one before that, stream order holds
transitively; a kernel launched without PDL (a torch op) simply waits as usual.

No kernel here calls `gdc_launch_dependents`, which would let the next kernel launch as soon as
this one's blocks have all started: on the H200 that made B1 (batch-1 decode, 8B shape) 193
tok/s, against 211 without PDL and 213.7 with the implicit trigger at block exit, in one device
call (BENCHMARKS.md, 2026-12-01).
"""

from __future__ import annotations

import functools
import os

import torch
import triton
import triton.language as tl

from metrale import envs

try:  # Triton >= 3.3; the interpreter has no grid dependency control either
    from triton.language.extra.cuda import gdc_wait
except ImportError:  # pragma: no cover - older Triton
    gdc_wait = None


@functools.lru_cache
def _device_supports(index: int) -> bool:
    return torch.cuda.get_device_capability(index)[0] >= 9


def pdl_enabled(device: torch.device) -> bool:
    """Whether kernels on `device` launch with PDL: a Hopper-or-later GPU, a Triton that has it,
    not the interpreter, and not turned off with METRALE_PDL=0."""
    return (
        device.type == "cuda"
        and gdc_wait is not None
        and os.environ.get("TRITON_INTERPRET") != "1"
        and envs.pdl()
        and _device_supports(device.index if device.index is not None else 0)
    )


@triton.jit
def wait_for_previous_kernel(PDL: tl.constexpr):
    """With PDL, wait until the previous kernel has finished and its writes are visible."""
    if PDL:
        gdc_wait()
