"""Matrix-vector product with a packed GGUF weight (batch-1 decode): y = x @ dequant(W).T (+ b).

The weight is read in its quantized bytes (`quant_layout`: 1.06 bytes a value for Q8_0, 0.56
for Q4_0, 0.63 for Q4_1) and dequantized in registers, so a decode step reads 2-3.5x fewer bytes
than from bfloat16. As in `gemv`, each program owns BLOCK_N whole rows and streams them once,
and with programmatic dependent launch loads its first tile before waiting for the kernel that
writes x.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from metrale.kernels.grid import cdiv
from metrale.kernels.pdl import pdl_enabled, wait_for_previous_kernel
from metrale.kernels.quant_format import load_dequantized
from metrale.kernels.quant_layout import FORMAT_IDS, check_packed, matmul_ref


@triton.jit
def _quant_gemv_kernel(
    x_ptr,
    q_ptr,
    s_ptr,
    m_ptr,
    b_ptr,
    y_ptr,
    N,
    K,
    stride_q,
    stride_s,
    HAS_BIAS: tl.constexpr,
    FORMAT: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    PDL: tl.constexpr,
):
    rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    row_mask = (rows < N)[:, None]
    wide = rows[:, None].to(tl.int64)
    q_rows = q_ptr + wide * stride_q
    s_rows = s_ptr + wide * stride_s
    m_rows = m_ptr + wide * stride_s
    # The first tile: nothing earlier in the step writes W, so with PDL it streams in while the
    # previous kernel finishes.
    w = load_dequantized(q_rows, s_rows, m_rows, 0, K, row_mask, FORMAT, BLOCK_K)
    wait_for_previous_kernel(PDL)
    cols = tl.arange(0, BLOCK_K)
    x = tl.load(x_ptr + cols, mask=cols < K, other=0.0).to(tl.float32)
    acc = w * x[None, :]
    for k0 in range(BLOCK_K, K, BLOCK_K):
        w = load_dequantized(q_rows, s_rows, m_rows, k0, K, row_mask, FORMAT, BLOCK_K)
        cols = k0 + tl.arange(0, BLOCK_K)
        x = tl.load(x_ptr + cols, mask=cols < K, other=0.0).to(tl.float32)
        acc += w * x[None, :]
    y = tl.sum(acc, 1)
    out_mask = rows < N
    if HAS_BIAS:
        y += tl.load(b_ptr + rows, mask=out_mask, other=0.0).to(tl.float32)
    tl.store(y_ptr + rows, y.to(y_ptr.dtype.element_ty), mask=out_mask)


def _launch(n: int, k: int) -> tuple[int, int, int]:
    """(block_n, block_k, num_warps). From bench/quant_gguf.py's sweep on the H200 at
    Llama-3.1-8B's shapes: the gate_up and lm_head weights (n >= 16,384: thousands of
    programs) read fastest in short tiles on 4 warps, the others in long ones on 8."""
    if n >= 16384 or k < 512:
        return 8, 256 if k >= 256 else 64, 4
    return 8, 512, 8


def quant_gemv(
    x: torch.Tensor,
    fmt: str,
    qweight: torch.Tensor,
    scales: torch.Tensor,
    mins: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    block_n: int | None = None,
    block_k: int | None = None,
    num_warps: int | None = None,
) -> torch.Tensor:
    """x: [1, K]; the weight's packed parts of `fmt` (`quant_layout`) for N rows of K columns;
    bias: [N] or None. Returns [1, N] in x's dtype, accumulated in float32.
    block_n, block_k, num_warps: launch overrides for bench/quant_gguf.py."""
    n, k = check_packed(fmt, qweight, scales, mins, bias)
    assert x.shape == (1, k), f"x must be [1, {k}], got {tuple(x.shape)}"
    assert x.is_contiguous(), "x must be contiguous"
    default_n, default_k, default_warps = _launch(n, k)
    y = torch.empty((1, n), dtype=x.dtype, device=x.device)
    pdl = pdl_enabled(x.device)
    _quant_gemv_kernel[(cdiv(n, block_n or default_n),)](
        x,
        qweight,
        scales,
        mins if fmt == "Q4_1" else scales,
        bias if bias is not None else scales,
        y,
        n,
        k,
        qweight.stride(0),
        scales.stride(0),
        HAS_BIAS=bias is not None,
        FORMAT=FORMAT_IDS[fmt],
        BLOCK_N=block_n or default_n,
        BLOCK_K=block_k or default_k,
        PDL=pdl,
        num_warps=num_warps or default_warps,
        launch_pdl=pdl,
    )
    return y


def quant_gemv_ref(
    x: torch.Tensor,
    fmt: str,
    qweight: torch.Tensor,
    scales: torch.Tensor,
    mins: torch.Tensor,
    bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """Torch reference of `quant_gemv`: the float32 weight times x in float32, cast back."""
    return matmul_ref(x, fmt, qweight, scales, mins, bias, torch.float32)
