"""Matrix-vector product for one-row steps (batch-1 decode): y = x @ W.T (+ b).

At one row cuBLAS runs split-K kernels plus a reduce for some of Llama's shapes, which read the
weight well below the memory bandwidth inside a decode step (B1 profile: qkv at 76%, o at 63%).
Here each program owns BLOCK_N whole rows of W and streams them once, BLOCK_K columns at a time,
so the product is a single read of W at full width with no reduce kernel after it.

Two things a decode step gains from here: the MLP's SiLU-and-mul runs inside the down
projection's loads (`silu_and_mul=True`), and with programmatic dependent launch
(`metrale.kernels.pdl`) each program loads its first weight tile before waiting for the kernel
that writes x, so the weight stream does not stop at the kernel boundary.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from metrale.kernels.grid import cdiv
from metrale.kernels.pdl import pdl_enabled, wait_for_previous_kernel
from metrale.kernels.silu_and_mul import silu_and_mul_ref


@triton.jit
def _load_x(x_ptr, cols, col_mask, K, SILU_AND_MUL: tl.constexpr):
    """Columns `cols` of the input row; with SILU_AND_MUL, of silu(gate) * up from a [1, 2K]
    gate_up row, rounded to its dtype as `silu_and_mul` rounds its output."""
    if SILU_AND_MUL:
        gate = tl.load(x_ptr + cols, mask=col_mask, other=0.0)
        up = tl.load(x_ptr + K + cols, mask=col_mask, other=0.0).to(tl.float32)
        gate_f = gate.to(tl.float32)
        return (gate_f / (1.0 + tl.exp(-gate_f)) * up).to(gate.dtype)
    return tl.load(x_ptr + cols, mask=col_mask, other=0.0)


@triton.jit
def _load_w(w_rows, cols, row_mask, col_mask):
    # evict_first: W is read once per step; L2 is better kept for the activations.
    mask = row_mask[:, None] & col_mask[None, :]
    return tl.load(w_rows + cols[None, :], mask=mask, other=0.0, eviction_policy="evict_first")


@triton.jit
def _gemv_kernel(
    x_ptr,
    w_ptr,
    b_ptr,
    y_ptr,
    N,
    K,
    stride_w,
    HAS_BIAS: tl.constexpr,
    SILU_AND_MUL: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    PDL: tl.constexpr,
):
    rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    row_mask = rows < N
    w_rows = w_ptr + rows[:, None].to(tl.int64) * stride_w
    # The first weight tile: nothing earlier in the step writes W, so with PDL it streams in
    # while the previous kernel finishes.
    cols = tl.arange(0, BLOCK_K)
    col_mask = cols < K
    w = _load_w(w_rows, cols, row_mask, col_mask)
    wait_for_previous_kernel(PDL)
    x = _load_x(x_ptr, cols, col_mask, K, SILU_AND_MUL)
    acc = w.to(tl.float32) * x[None, :].to(tl.float32)
    for k0 in range(BLOCK_K, K, BLOCK_K):
        cols = k0 + tl.arange(0, BLOCK_K)
        col_mask = cols < K
        x = _load_x(x_ptr, cols, col_mask, K, SILU_AND_MUL)
        w = _load_w(w_rows, cols, row_mask, col_mask)
        acc += w.to(tl.float32) * x[None, :].to(tl.float32)
    y = tl.sum(acc, 1)
    if HAS_BIAS:
        y += tl.load(b_ptr + rows, mask=row_mask, other=0.0).to(tl.float32)
    tl.store(y_ptr + rows, y.to(y_ptr.dtype.element_ty), mask=row_mask)


# Programs of BLOCK_N rows from which the GPU holds enough of them at once to fill its bandwidth
# with small column tiles (bench/gemv.py on the H200: gate_up and lm_head, 1,792 and 8,016
# programs, read fastest at 256 columns and 4 warps; qkv, o and down, 256 to 512 programs, at
# 512-1024 columns and 8 warps).
_MANY_PROGRAMS = 1024
_BLOCK_N = 16


def _launch(n: int, k: int) -> tuple[int, int]:
    """(block_k, num_warps) for a weight of n rows of k columns."""
    if cdiv(n, _BLOCK_N) >= _MANY_PROGRAMS:
        return 256, 4
    return (1024 if k >= 8192 else 512), 8


def gemv(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    silu_and_mul: bool = False,
    out_dtype: torch.dtype | None = None,
    block_n: int = _BLOCK_N,
    block_k: int | None = None,
    num_warps: int | None = None,
) -> torch.Tensor:
    """x: [1, K]; weight: [N, K] with contiguous rows; bias: [N] or None. Returns [1, N] in
    `out_dtype` (default x's dtype), accumulated in fp32.

    silu_and_mul: x is a [1, 2K] gate_up row and the product is of silu(gate) * up, computed as
    the columns load (one kernel fewer than `silu_and_mul` then `gemv`, same rounding).
    block_n, block_k, num_warps: launch overrides for bench/gemv.py."""
    n, k = weight.shape
    default_block_k, default_warps = _launch(n, k)
    block_k = block_k or default_block_k
    num_warps = num_warps or default_warps
    x_width = 2 * k if silu_and_mul else k
    assert x.shape == (1, x_width), f"x must be [1, {x_width}], got {tuple(x.shape)}"
    assert x.stride(1) == 1 and weight.stride(1) == 1, "rows of x and weight must be contiguous"
    assert bias is None or bias.shape == (n,), f"bias must be [{n}]"
    y = torch.empty((1, n), dtype=out_dtype or x.dtype, device=x.device)
    pdl = pdl_enabled(x.device)
    _gemv_kernel[(cdiv(n, block_n),)](
        x,
        weight,
        bias if bias is not None else weight,
        y,
        n,
        k,
        weight.stride(0),
        HAS_BIAS=bias is not None,
        SILU_AND_MUL=silu_and_mul,
        BLOCK_N=block_n,
        BLOCK_K=block_k,
        PDL=pdl,
        num_warps=num_warps,
        launch_pdl=pdl,
    )
    return y


def gemv_ref(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    silu_and_mul: bool = False,
) -> torch.Tensor:
    """Torch reference of `gemv`: the product in fp32, cast back."""
    if silu_and_mul:
        x = silu_and_mul_ref(x)
    y = x.float() @ weight.float().t()
    if bias is not None:
        y += bias.float()
    return y.to(x.dtype)
