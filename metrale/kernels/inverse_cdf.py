"""One token per row by the inverse CDF (`runner/inverse_cdf.py` says what is drawn; its torch
formula `inverse_cdf_torch` is this kernel's reference, token for token).

Two launches, each over every (row, chunk of CHUNK tokens), so one row is spread over the GPU
as widely as a batch is: the first writes each chunk's fixed-point total; in the second each
program sums the totals before its chunk, and only the chunk where the row's running sum passes
the target reads its tokens again, to find the token. The sums are int64, so the order they add
in cannot change the answer.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from metrale.kernels.grid import cdiv, next_power_of_2
from metrale.runner.inverse_cdf import PROB_SCALE

CHUNK = 4096  # tokens per program: Qwen3's vocabulary is 38 chunks


@triton.jit
def _fixed_point(probs_ptr, offs, vocab_size, SCALE: tl.constexpr):
    p = tl.load(probs_ptr + offs, mask=offs < vocab_size, other=0.0)
    return (p * SCALE).to(tl.int64)


@triton.jit
def _chunk_totals_kernel(
    probs_ptr, stride_row, totals_ptr, out_ptr, vocab_size, SCALE: tl.constexpr, CHUNK: tl.constexpr
):
    row = tl.program_id(0)
    chunk = tl.program_id(1)
    offs = chunk * CHUNK + tl.arange(0, CHUNK)
    counts = _fixed_point(probs_ptr + row.to(tl.int64) * stride_row, offs, vocab_size, SCALE)
    tl.store(totals_ptr + row * tl.num_programs(1) + chunk, tl.sum(counts, axis=0))
    if chunk == 0:  # what a row keeps if no chunk claims it (garbage probabilities: NaN)
        tl.store(out_ptr + row, 0)


@triton.jit
def _find_kernel(
    probs_ptr,
    stride_row,
    draws_ptr,
    stride_draw,
    totals_ptr,
    out_ptr,
    vocab_size,
    SCALE: tl.constexpr,
    CHUNK: tl.constexpr,
    NUM_CHUNKS_P2: tl.constexpr,
):
    row = tl.program_id(0)
    chunk = tl.program_id(1)
    num_chunks = tl.num_programs(1)
    ids = tl.arange(0, NUM_CHUNKS_P2)
    totals = tl.load(totals_ptr + row * num_chunks + ids, mask=ids < num_chunks, other=0)
    row_total = tl.sum(totals, axis=0)
    before = tl.sum(tl.where(ids < chunk, totals, 0), axis=0)
    mine = tl.sum(tl.where(ids == chunk, totals, 0), axis=0)
    draw = tl.load(draws_ptr + row * stride_draw)
    target = tl.minimum((draw * row_total.to(tl.float64)).to(tl.int64), row_total - 1)
    if before <= target and target < before + mine:  # one chunk of the row (none if all zero)
        offs = chunk * CHUNK + tl.arange(0, CHUNK)
        counts = _fixed_point(probs_ptr + row.to(tl.int64) * stride_row, offs, vocab_size, SCALE)
        below = tl.sum((before + tl.cumsum(counts, axis=0) <= target).to(tl.int32), axis=0)
        tl.store(out_ptr + row, tl.minimum(chunk * CHUNK + below, vocab_size - 1).to(tl.int64))


def inverse_cdf(probs: torch.Tensor, draws: torch.Tensor) -> torch.Tensor:
    """[num_rows] int64 token ids (`runner.inverse_cdf.inverse_cdf`'s contract)."""
    num_rows, vocab_size = probs.shape
    assert probs.dtype == torch.float32 and probs.stride(1) == 1, "fp32 rows, contiguous"
    assert draws.dtype == torch.float64 and draws.shape == (num_rows,)  # a column is fine
    out = torch.empty(num_rows, dtype=torch.int64, device=probs.device)
    if num_rows == 0:
        return out
    num_chunks = cdiv(vocab_size, CHUNK)
    totals = torch.empty(num_rows, num_chunks, dtype=torch.int64, device=probs.device)
    grid = (num_rows, num_chunks)
    _chunk_totals_kernel[grid](
        probs, probs.stride(0), totals, out, vocab_size, PROB_SCALE, CHUNK=CHUNK
    )
    _find_kernel[grid](
        probs,
        probs.stride(0),
        draws,
        draws.stride(0),
        totals,
        out,
        vocab_size,
        PROB_SCALE,
        CHUNK=CHUNK,
        NUM_CHUNKS_P2=next_power_of_2(num_chunks),
    )
    return out
