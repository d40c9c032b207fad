"""One token per row by the inverse CDF (`runner/inverse_cdf.py` says what is drawn; its torch
formulas are these kernels' reference).

Every launch runs over each (row, chunk of CHUNK tokens), so one row is spread over the GPU as
widely as a batch is. `inverse_cdf` takes the weights, in one launch: each program writes its
chunk's fixed-point total, and the row's last program to finish (an atomic count) finds the
chunk where the row's running sum passes the target and reads that chunk again for the token.
`tempered_inverse_cdf` takes the logits and the rows' temperatures and computes the weights
`exp(l - max l)` of the tempered logits `l` where it reads them, after a first launch for each
chunk's maximum: two launches (each ~17 us of host time: they dominate a small batch's draw),
the logits read twice and a chunk again, nothing of their size written (the torch formula
divides, reduces, subtracts and exponentiates in four passes that each write). The sums are
int64, so the order they add in cannot change the answer.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from metrale.kernels.grid import cdiv, next_power_of_2
from metrale.runner.inverse_cdf import PROB_SCALE

CHUNK = 4096  # tokens per program: Qwen3's vocabulary is 38 chunks


@triton.jit
def _tempered(logits_ptr, offs, vocab_size, temperature):
    x = tl.load(logits_ptr + offs, mask=offs < vocab_size, other=float("-inf"))
    return tl.math.div_rn(x.to(tl.float32), temperature)


@triton.jit
def _counts(weights_ptr, offs, vocab_size, temperature, row_max, SCALE, TEMPERED: tl.constexpr):
    """The fixed-point weights of tokens `offs` (0 past the vocabulary)."""
    if TEMPERED:
        w = tl.exp(_tempered(weights_ptr, offs, vocab_size, temperature) - row_max)
    else:
        w = tl.load(weights_ptr + offs, mask=offs < vocab_size, other=0.0)
    return (w * SCALE).to(tl.int64)


@triton.jit
def _row_max(maxes_ptr, row, num_chunks, NUM_CHUNKS_P2: tl.constexpr):
    ids = tl.arange(0, NUM_CHUNKS_P2)
    maxes = tl.load(maxes_ptr + row * num_chunks + ids, mask=ids < num_chunks, other=-1e38)
    return tl.max(maxes, axis=0)


@triton.jit
def _chunk_max_kernel(
    logits_ptr,
    stride_row,
    temperature_ptr,
    stride_temperature,
    maxes_ptr,
    arrived_ptr,
    vocab_size,
    CHUNK: tl.constexpr,
):
    row = tl.program_id(0)
    chunk = tl.program_id(1)
    offs = chunk * CHUNK + tl.arange(0, CHUNK)
    t = tl.load(temperature_ptr + row * stride_temperature)
    scaled = _tempered(logits_ptr + row.to(tl.int64) * stride_row, offs, vocab_size, t)
    tl.store(maxes_ptr + row * tl.num_programs(1) + chunk, tl.max(scaled, axis=0))
    if chunk == 0:  # the draw kernel's count of the row's chunks done, from zero
        tl.store(arrived_ptr + row, 0)


@triton.jit
def _draw_kernel(
    weights_ptr,
    stride_row,
    temperature_ptr,
    stride_temperature,
    maxes_ptr,
    draws_ptr,
    stride_draw,
    totals_ptr,
    arrived_ptr,
    out_ptr,
    vocab_size,
    SCALE: tl.constexpr,
    CHUNK: tl.constexpr,
    NUM_CHUNKS_P2: tl.constexpr,
    TEMPERED: tl.constexpr,
):
    row = tl.program_id(0)
    chunk = tl.program_id(1)
    num_chunks = tl.num_programs(1)
    t, row_max = 1.0, 0.0
    if TEMPERED:
        t = tl.load(temperature_ptr + row * stride_temperature)
        row_max = _row_max(maxes_ptr, row, num_chunks, NUM_CHUNKS_P2)
    ptr = weights_ptr + row.to(tl.int64) * stride_row
    counts = _counts(
        ptr, chunk * CHUNK + tl.arange(0, CHUNK), vocab_size, t, row_max, SCALE, TEMPERED
    )
    tl.store(totals_ptr + row * num_chunks + chunk, tl.sum(counts, axis=0))
    # The row's last chunk to finish draws its token: the atomic orders every chunk's total
    # before it (release by each, acquire by the last), and the last reads them past L1.
    if tl.atomic_add(arrived_ptr + row, 1) == num_chunks - 1:
        ids = tl.arange(0, NUM_CHUNKS_P2)
        totals = tl.load(
            totals_ptr + row * num_chunks + ids, mask=ids < num_chunks, other=0, volatile=True
        )
        row_total = tl.sum(totals, axis=0)
        draw = tl.load(draws_ptr + row * stride_draw)
        target = tl.minimum((draw * row_total.to(tl.float64)).to(tl.int64), row_total - 1)
        # The chunk that holds the target: the number of chunks whose running sum is at most it.
        found = tl.sum((tl.cumsum(totals, axis=0) <= target).to(tl.int32), axis=0)
        before = tl.sum(tl.where(ids < found, totals, 0), axis=0)
        offs = found * CHUNK + tl.arange(0, CHUNK)
        counts = _counts(ptr, offs, vocab_size, t, row_max, SCALE, TEMPERED)
        below = tl.sum((before + tl.cumsum(counts, axis=0) <= target).to(tl.int32), axis=0)
        tl.store(out_ptr + row, tl.minimum(found * CHUNK + below, vocab_size - 1).to(tl.int64))


def inverse_cdf(weights: torch.Tensor, draws: torch.Tensor) -> torch.Tensor:
    """[num_rows] int64 token ids (`runner.inverse_cdf.inverse_cdf`'s contract)."""
    assert weights.dtype == torch.float32, "fp32 weights"
    return _launch(weights, None, draws)


def tempered_inverse_cdf(
    logits: torch.Tensor, temperature: torch.Tensor, draws: torch.Tensor
) -> torch.Tensor:
    """[num_rows] int64 token ids (`runner.inverse_cdf.tempered_inverse_cdf`'s contract);
    logits of any float dtype, the temperatures a strided column if need be."""
    assert temperature.dtype == torch.float32 and temperature.shape == logits.shape[:1]
    return _launch(logits, temperature, draws)


def _launch(
    values: torch.Tensor, temperature: torch.Tensor | None, draws: torch.Tensor
) -> torch.Tensor:
    num_rows, vocab_size = values.shape
    assert values.stride(1) == 1, "contiguous rows"
    assert draws.dtype == torch.float64 and draws.shape == (num_rows,)  # a column is fine
    device = values.device
    out = torch.empty(num_rows, dtype=torch.int64, device=device)
    if num_rows == 0:
        return out
    num_chunks = cdiv(vocab_size, CHUNK)
    grid = (num_rows, num_chunks)
    totals = torch.empty(num_rows, num_chunks, dtype=torch.int64, device=device)
    tempered = temperature is not None
    if not tempered:
        arrived = torch.zeros(num_rows, dtype=torch.int32, device=device)
        maxes, temperature = totals, draws  # pointers the kernel does not read untempered
    else:
        arrived = torch.empty(num_rows, dtype=torch.int32, device=device)
        maxes = torch.empty(num_rows, num_chunks, dtype=torch.float32, device=device)
        _chunk_max_kernel[grid](
            values,
            values.stride(0),
            temperature,
            temperature.stride(0),
            maxes,
            arrived,
            vocab_size,
            CHUNK,
        )
    _draw_kernel[grid](
        values,
        values.stride(0),
        temperature,
        temperature.stride(0),
        maxes,
        draws,
        draws.stride(0),
        totals,
        arrived,
        out,
        vocab_size,
        PROB_SCALE,
        CHUNK=CHUNK,
        NUM_CHUNKS_P2=next_power_of_2(num_chunks),
        TEMPERED=tempered,
    )
    return out
