"""Matrix-matrix product with a packed GGUF weight (prefill, batched decode):
y = x @ dequant(W).T (+ b).

Each program computes a BLOCK_M x BLOCK_N tile of y: it streams BLOCK_K columns of its rows of
x and of W, dequantizes W's tile in registers (`quant_format`), rounds it to x's dtype, as the
dequantized checkpoint would be, and multiplies on the tensor cores. The weight is read in its
quantized bytes, once per BLOCK_M rows of x.

Past `DEQUANTIZE_ROWS` rows of x (a prefill chunk) the product is compute-bound and re-reading
the weight for every BLOCK_M rows costs more than writing it out once: the weight is
dequantized (`quant_dequantize`) and cuBLAS multiplies.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from metrale.kernels.grid import cdiv
from metrale.kernels.quant_format import load_dequantized
from metrale.kernels.quant_layout import FORMAT_IDS, check_packed, matmul_ref

DEQUANTIZE_ROWS = 1024


@triton.jit
def _quant_gemm_kernel(
    x_ptr,
    q_ptr,
    s_ptr,
    m_ptr,
    b_ptr,
    y_ptr,
    M,
    N,
    K,
    stride_x,
    stride_y,
    stride_q,
    stride_s,
    HAS_BIAS: tl.constexpr,
    FORMAT: tl.constexpr,
    IEEE: tl.constexpr,  # float32 x: multiply in float32, not TF32
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    row_mask = rows < M
    col_mask = (cols < N)[:, None]
    wide = cols[:, None].to(tl.int64)
    q_rows = q_ptr + wide * stride_q
    s_rows = s_ptr + wide * stride_s
    m_rows = m_ptr + wide * stride_s
    x_rows = x_ptr + rows[:, None].to(tl.int64) * stride_x
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        x = tl.load(x_rows + ks[None, :], mask=row_mask[:, None] & (ks < K)[None, :], other=0.0)
        w = load_dequantized(q_rows, s_rows, m_rows, k0, K, col_mask, FORMAT, BLOCK_K)
        acc = _dot(x, w.to(x.dtype), acc, IEEE)
    if HAS_BIAS:
        acc += tl.load(b_ptr + cols, mask=cols < N, other=0.0).to(tl.float32)[None, :]
    out = y_ptr + rows[:, None].to(tl.int64) * stride_y + cols[None, :]
    tl.store(out, acc.to(y_ptr.dtype.element_ty), mask=row_mask[:, None] & (cols < N)[None, :])


@triton.jit
def _dot(x, w, acc, IEEE: tl.constexpr):
    """acc + x @ w.T"""
    if IEEE:
        return tl.dot(x, tl.trans(w), acc, input_precision="ieee")
    return tl.dot(x, tl.trans(w), acc)


def _launch(m: int) -> tuple[int, int, int, int, int]:
    """(block_m, block_n, block_k, num_warps, num_stages) for m rows of x."""
    if m <= 16:
        return 16, 64, 128, 4, 4
    if m <= 64:
        return 64, 64, 128, 4, 3
    return 128, 128, 64, 8, 3


def quant_gemm(
    x: torch.Tensor,
    fmt: str,
    qweight: torch.Tensor,
    scales: torch.Tensor,
    mins: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    blocks: tuple[int, int, int, int, int] | None = None,
    dequantize_rows: int = DEQUANTIZE_ROWS,
) -> torch.Tensor:
    """x: [M, K] with contiguous rows; the weight's packed parts of `fmt` (`quant_layout`) for
    N rows of K columns; bias: [N] or None. Returns [M, N] in x's dtype, accumulated in float32.
    blocks: (block_m, block_n, block_k, num_warps, num_stages), for bench/quant_gguf.py;
    dequantize_rows: from this many rows of x, dequantize then cuBLAS."""
    n, k = check_packed(fmt, qweight, scales, mins, bias)
    m = x.shape[0]
    assert x.dim() == 2 and x.shape[1] == k, f"x must be [M, {k}], got {tuple(x.shape)}"
    assert x.stride(1) == 1, "rows of x must be contiguous"
    if m >= dequantize_rows:
        from metrale.kernels.quant_dequantize import dequantize

        return F.linear(x, dequantize(fmt, qweight, scales, mins, x.dtype), bias)
    block_m, block_n, block_k, num_warps, num_stages = blocks or _launch(m)
    y = torch.empty((m, n), dtype=x.dtype, device=x.device)
    if m == 0:
        return y
    _quant_gemm_kernel[(cdiv(m, block_m), cdiv(n, block_n))](
        x,
        qweight,
        scales,
        mins if fmt == "Q4_1" else scales,
        bias if bias is not None else scales,
        y,
        m,
        n,
        k,
        x.stride(0),
        y.stride(0),
        qweight.stride(0),
        scales.stride(0),
        HAS_BIAS=bias is not None,
        FORMAT=FORMAT_IDS[fmt],
        IEEE=x.dtype == torch.float32,
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        BLOCK_K=block_k,
        num_warps=num_warps,
        num_stages=num_stages,
    )
    return y


def quant_gemm_ref(
    x: torch.Tensor,
    fmt: str,
    qweight: torch.Tensor,
    scales: torch.Tensor,
    mins: torch.Tensor,
    bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """Torch reference of `quant_gemm`: the weight dequantized to x's dtype, the product
    accumulated in float32."""
    return matmul_ref(x, fmt, qweight, scales, mins, bias, x.dtype)
