"""Matrix-vector product for one-row steps (batch-1 decode): y = x @ W.T (+ b).

At one row cuBLAS runs split-K kernels plus a reduce for some of Llama's shapes, which read the
weight well below the memory bandwidth inside a decode step (B1 profile: qkv at 76%, o at 63%).
Here each program owns BLOCK_N whole rows of W and streams them once, BLOCK_K columns at a time,
so the product is a single read of W at full width with no reduce kernel after it.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


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
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    row_mask = rows < N
    acc = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        cols = k0 + tl.arange(0, BLOCK_K)
        col_mask = cols < K
        x = tl.load(x_ptr + cols, mask=col_mask, other=0.0)
        w = tl.load(
            w_ptr + rows[:, None].to(tl.int64) * stride_w + cols[None, :],
            mask=row_mask[:, None] & col_mask[None, :],
            other=0.0,
            eviction_policy="evict_first",  # read once per step: keep L2 for the activations
        )
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
    if triton.cdiv(n, _BLOCK_N) >= _MANY_PROGRAMS:
        return 256, 4
    return (1024 if k >= 8192 else 512), 8


def gemv(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    block_n: int = _BLOCK_N,
    block_k: int | None = None,
    num_warps: int | None = None,
) -> torch.Tensor:
    """x: [1, K]; weight: [N, K] with contiguous rows; bias: [N] or None. Returns [1, N] in x's
    dtype, accumulated in fp32. block_n, block_k, num_warps: launch overrides for bench/gemv.py."""
    n, k = weight.shape
    default_block_k, default_warps = _launch(n, k)
    block_k = block_k or default_block_k
    num_warps = num_warps or default_warps
    assert x.shape == (1, k), f"x must be [1, {k}], got {tuple(x.shape)}"
    assert x.stride(1) == 1 and weight.stride(1) == 1, "rows of x and weight must be contiguous"
    assert bias is None or bias.shape == (n,), f"bias must be [{n}]"
    y = torch.empty((1, n), dtype=x.dtype, device=x.device)
    _gemv_kernel[(triton.cdiv(n, block_n),)](
        x,
        weight,
        bias if bias is not None else weight,
        y,
        n,
        k,
        weight.stride(0),
        HAS_BIAS=bias is not None,
        BLOCK_N=block_n,
        BLOCK_K=block_k,
        num_warps=num_warps,
    )
    return y


def gemv_ref(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None):
    """Torch reference of `gemv`: the product in fp32, cast back."""
    y = x.float() @ weight.float().t()
    if bias is not None:
        y += bias.float()
    return y.to(x.dtype)
