"""What the attention kernels that read the paged KV cache share: the launch checks, and the
body of their key loop (find a tile of keys through the block table, fold it into an online
softmax), so decode and prefill address the cache and accumulate in exactly one way.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from metrale.config import is_fp8

# Scores are kept in base 2: the softmax scale is multiplied by log2(e) once, and every
# exponential is an exp2 (one instruction) instead of an exp.
LOG2_E = tl.constexpr(1.4426950408889634)
_TL_DTYPES = {torch.float32: tl.float32, torch.float16: tl.float16, torch.bfloat16: tl.bfloat16}


def dot_dtype(q_dtype: torch.dtype, cache_dtype: torch.dtype, override: torch.dtype | None):
    """The dtype of both operands of the score and value products (accumulation is fp32):
    q's own, except that 16-bit queries over an fp8 cache compute in fp16, to which fp8 widens
    faster than to bf16 (bench/decode_attention.py: 0.76 against 0.84 ms at B3's shapes)."""
    if override is None:
        override = torch.float16 if is_fp8(cache_dtype) and q_dtype != torch.float32 else q_dtype
    return _TL_DTYPES[override]


@triton.jit
def attend_keys(
    q,
    query_pos,
    k_cache_ptr,
    v_cache_ptr,
    block_table_row,
    kv_head,
    start,
    stop,
    hi,
    sliding_window,
    scale_log2,
    m_i,
    l_i,
    acc,
    stride_cache_block,
    stride_cache_token,
    stride_cache_head,
    HEAD_DIM: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    HAS_WINDOW: tl.constexpr,
    MASKED: tl.constexpr,
    K_ROWS: tl.constexpr,
):
    """Fold the keys at positions [start, stop) of one kv head into the running max `m_i`, sum
    `l_i` and output `acc` of the query rows `q` [ROWS, HEAD_DIM] at positions `query_pos`
    [ROWS], one tile of BLOCK_N keys at a time, in base 2 (`scale_log2` = scale * log2(e)).
    Keys and values are widened to q's dtype (`dot_dtype`) as they are loaded.

    Keys are found through the sequence's block table, so a tile may span blocks. With MASKED,
    a row sees the keys before `hi` up to its own position (and inside the sliding window);
    without, every key of every tile exists and every row sees it (tiles wholly before the
    causal diagonal), and no mask is built. K_ROWS loads a key tile as it lies in the cache
    (key by key) and transposes it for the product; else it is loaded transposed.
    """
    offs_d = tl.arange(0, HEAD_DIM)
    for tile in range(start, stop, BLOCK_N):
        offs_n = tile + tl.arange(0, BLOCK_N)  # [BLOCK_N] key positions
        n_mask = offs_n < hi
        block_ids = tl.load(block_table_row + offs_n // BLOCK_SIZE, mask=n_mask, other=0)
        kv_off = (
            block_ids.to(tl.int64) * stride_cache_block
            + (offs_n % BLOCK_SIZE) * stride_cache_token
            + kv_head * stride_cache_head
        )  # [BLOCK_N]
        v_ptrs = v_cache_ptr + kv_off[:, None] + offs_d[None, :]  # [BLOCK_N, HEAD_DIM]
        if K_ROWS:
            k_rows = k_cache_ptr + kv_off[:, None] + offs_d[None, :]  # [BLOCK_N, HEAD_DIM]
            if MASKED:  # noqa: SIM108  (a constexpr branch, as Triton compiles it)
                k = tl.load(k_rows, mask=n_mask[:, None], other=0.0)
            else:
                k = tl.load(k_rows)
            k = tl.trans(k.to(q.dtype))
        else:
            k_ptrs = k_cache_ptr + kv_off[None, :] + offs_d[:, None]  # [HEAD_DIM, BLOCK_N]
            if MASKED:  # noqa: SIM108
                k = tl.load(k_ptrs, mask=n_mask[None, :], other=0.0)
            else:
                k = tl.load(k_ptrs)
            k = k.to(q.dtype)
        s = tl.dot(q, k, input_precision=DOT_PRECISION) * scale_log2  # [ROWS, BLOCK_N]
        if MASKED:
            visible = (offs_n[None, :] <= query_pos[:, None]) & n_mask[None, :]
            if HAS_WINDOW:
                visible = visible & (offs_n[None, :] > query_pos[:, None] - sliding_window)
            s = tl.where(visible, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        if MASKED:  # noqa: SIM108
            v = tl.load(v_ptrs, mask=n_mask[:, None], other=0.0)
        else:
            v = tl.load(v_ptrs)
        v = v.to(q.dtype)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
        m_i = m_new
    return m_i, l_i, acc


def check_paged_inputs(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    sliding_window: int | None,
) -> None:
    """q: [num_rows, num_heads, head_dim]; caches: [num_blocks, block_size, num_kv_heads,
    head_dim]; block_tables: [num_seqs, max_blocks]; seq_lens: [num_seqs]."""
    _, num_heads, head_dim = q.shape
    num_seqs = seq_lens.shape[0]
    assert k_cache.dim() == 4 and k_cache.shape == v_cache.shape, (
        f"caches must both be [num_blocks, block_size, num_kv_heads, head_dim], got "
        f"{tuple(k_cache.shape)} and {tuple(v_cache.shape)}"
    )
    assert k_cache.is_contiguous() and v_cache.is_contiguous(), "caches must be contiguous"
    assert k_cache.dtype == v_cache.dtype and (k_cache.dtype == q.dtype or is_fp8(k_cache.dtype)), (
        f"caches {k_cache.dtype}/{v_cache.dtype} must hold q's dtype {q.dtype} or fp8"
    )
    assert q.dtype in (torch.float16, torch.bfloat16, torch.float32), f"unsupported {q.dtype}"
    assert q.stride(2) == 1, "q's head_dim must be contiguous"
    num_kv_heads = k_cache.shape[2]
    assert num_heads % num_kv_heads == 0, (
        f"num_heads {num_heads} is not a multiple of num_kv_heads {num_kv_heads}"
    )
    assert head_dim >= 16 and head_dim & (head_dim - 1) == 0, (
        f"head_dim {head_dim} must be a power of two >= 16"
    )
    assert block_tables.dim() == 2 and block_tables.shape[0] == num_seqs, (
        f"block_tables must be [{num_seqs}, max_blocks], got {tuple(block_tables.shape)}"
    )
    assert block_tables.dtype in (torch.int32, torch.int64) and block_tables.stride(1) == 1, (
        "block_tables must be int32/int64 with contiguous rows"
    )
    assert seq_lens.dim() == 1 and seq_lens.dtype in (torch.int32, torch.int64), (
        f"seq_lens must be [num_seqs] int32/int64, got {tuple(seq_lens.shape)} {seq_lens.dtype}"
    )
    assert seq_lens.is_contiguous(), "seq_lens must be contiguous"
    assert sliding_window is None or sliding_window > 0, (
        f"sliding_window {sliding_window} must be positive or None"
    )
    assert q.device == k_cache.device == block_tables.device == seq_lens.device, (
        "tensors on different devices"
    )
