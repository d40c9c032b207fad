"""What the packed-weight kernels share (layout: `quant_layout`): the format constants and the
load of a tile of weights, dequantized in registers."""

from __future__ import annotations

import triton
import triton.language as tl

Q8_0: tl.constexpr = tl.constexpr(0)
Q4_0: tl.constexpr = tl.constexpr(1)
Q4_1: tl.constexpr = tl.constexpr(2)


@triton.jit
def load_dequantized(
    q_rows,
    s_rows,
    m_rows,
    k0,
    K,
    row_mask,
    FORMAT: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    """Columns k0 .. k0 + BLOCK_K of the rows whose `qweight`, `scales` and `mins` start at
    q_rows, s_rows, m_rows ([R, 1] pointers; row_mask [R, 1]), dequantized: float32
    [R, BLOCK_K], 0 past K. BLOCK_K is a power of two, at least 64."""
    GROUPS: tl.constexpr = BLOCK_K // 32
    groups = k0 // 32 + tl.arange(0, GROUPS)
    group_mask = row_mask & (groups < K // 32)[None, :]
    scale = tl.load(s_rows + groups[None, :], mask=group_mask, other=0.0).to(tl.float32)
    # evict_first: the weight is read once per step; L2 is better kept for the activations.
    if FORMAT == Q8_0:
        cols = k0 + tl.arange(0, BLOCK_K)
        mask = row_mask & (cols < K)[None, :]
        q = tl.load(q_rows + cols[None, :], mask=mask, other=0, eviction_policy="evict_first")
        q = q.to(tl.float32)
    else:
        pairs = k0 // 2 + tl.arange(0, BLOCK_K // 2)
        mask = row_mask & (pairs < K // 2)[None, :]
        b = tl.load(q_rows + pairs[None, :], mask=mask, other=0, eviction_policy="evict_first")
        # Columns 2j, 2j + 1 of byte j. (Making the floats from the bits of 2^23 + q, an OR and
        # an add instead of a conversion, measured no faster on the H200: bench/quant_gguf.py.)
        q = tl.interleave(b & 15, b >> 4).to(tl.float32)
        if FORMAT == Q4_0:
            q = q - 8.0
    w = tl.reshape(q, [q.shape[0], GROUPS, 32]) * scale[:, :, None]
    if FORMAT == Q4_1:
        offset = tl.load(m_rows + groups[None, :], mask=group_mask, other=0.0).to(tl.float32)
        w = w + offset[:, :, None]
    return tl.reshape(w, [q.shape[0], BLOCK_K])
