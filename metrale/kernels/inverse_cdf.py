"""One token per row by the inverse CDF in one launch (`runner/inverse_cdf.py` says what is drawn;
its torch formula `inverse_cdf_torch` is this kernel's reference, token for token).

One program per row streams the row twice, BLOCK tokens at a time: first for its fixed-point
total, then for the number of tokens whose running sum is at most the target, which is the
drawn token. The sums are int64, so the order the blocks add in cannot change the answer.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from metrale.runner.inverse_cdf import PROB_SCALE


@triton.jit
def _fixed_point(probs_ptr, offs, vocab_size, SCALE: tl.constexpr):
    p = tl.load(probs_ptr + offs, mask=offs < vocab_size, other=0.0)
    return (p * SCALE).to(tl.int64)


@triton.jit
def _inverse_cdf_kernel(
    probs_ptr,
    stride_row,
    draws_ptr,
    stride_draw,
    out_ptr,
    vocab_size,
    SCALE: tl.constexpr,
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0)
    probs_ptr += row.to(tl.int64) * stride_row
    total = tl.zeros([BLOCK], tl.int64)
    for start in range(0, vocab_size, BLOCK):
        total += _fixed_point(probs_ptr, start + tl.arange(0, BLOCK), vocab_size, SCALE)
    row_total = tl.sum(total, axis=0)
    draw = tl.load(draws_ptr + row * stride_draw)
    target = tl.minimum((draw * row_total.to(tl.float64)).to(tl.int64), row_total - 1)
    below = tl.zeros([BLOCK], tl.int32)
    carry = row_total * 0
    for start in range(0, vocab_size, BLOCK):
        counts = _fixed_point(probs_ptr, start + tl.arange(0, BLOCK), vocab_size, SCALE)
        running = carry + tl.cumsum(counts, axis=0)
        below += (running <= target).to(tl.int32)
        carry += tl.sum(counts, axis=0)
    token = tl.minimum(tl.sum(below, axis=0), vocab_size - 1)
    tl.store(out_ptr + row, token.to(tl.int64))


def inverse_cdf(probs: torch.Tensor, draws: torch.Tensor) -> torch.Tensor:
    """[num_rows] int64 token ids (`runner.inverse_cdf.inverse_cdf`'s contract)."""
    num_rows, vocab_size = probs.shape
    assert probs.dtype == torch.float32 and probs.stride(1) == 1, "fp32 rows, contiguous"
    assert draws.dtype == torch.float64 and draws.shape == (num_rows,)  # a column is fine
    out = torch.empty(num_rows, dtype=torch.int64, device=probs.device)
    if num_rows:
        _inverse_cdf_kernel[(num_rows,)](
            probs,
            probs.stride(0),
            draws,
            draws.stride(0),
            out,
            vocab_size,
            PROB_SCALE,
            BLOCK=2048,
        )
    return out
