"""A packed GGUF weight dequantized into a dense one, [N, K] in the activations' dtype: what
`quant_gemm` hands cuBLAS for a prefill chunk. One program a tile of BLOCK_N rows and BLOCK_K
columns; reference: `quant_layout.dequantize_ref`."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from metrale.kernels.grid import cdiv
from metrale.kernels.quant_format import load_dequantized
from metrale.kernels.quant_layout import FORMAT_IDS, check_packed


@triton.jit
def _dequantize_kernel(
    q_ptr,
    s_ptr,
    m_ptr,
    w_ptr,
    N,
    K,
    stride_q,
    stride_s,
    stride_w,
    FORMAT: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    k0 = tl.program_id(1) * BLOCK_K
    row_mask = (rows < N)[:, None]
    wide = rows[:, None].to(tl.int64)
    w = load_dequantized(
        q_ptr + wide * stride_q,
        s_ptr + wide * stride_s,
        m_ptr + wide * stride_s,
        k0,
        K,
        row_mask,
        FORMAT,
        BLOCK_K,
    )
    cols = k0 + tl.arange(0, BLOCK_K)
    out = w_ptr + wide * stride_w + cols[None, :]
    tl.store(out, w.to(w_ptr.dtype.element_ty), mask=row_mask & (cols < K)[None, :])


def dequantize(
    fmt: str,
    qweight: torch.Tensor,
    scales: torch.Tensor,
    mins: torch.Tensor,
    dtype: torch.dtype,
    block_n: int = 16,
    block_k: int = 256,
) -> torch.Tensor:
    """The [N, K] weight in `dtype` (computed in float32, then rounded)."""
    n, k = check_packed(fmt, qweight, scales, mins)
    w = torch.empty((n, k), dtype=dtype, device=qweight.device)
    _dequantize_kernel[(cdiv(n, block_n), cdiv(k, block_k))](
        qweight,
        scales,
        mins if fmt == "Q4_1" else scales,
        w,
        n,
        k,
        qweight.stride(0),
        scales.stride(0),
        w.stride(0),
        FORMAT=FORMAT_IDS[fmt],
        BLOCK_N=block_n,
        BLOCK_K=block_k,
    )
    return w
