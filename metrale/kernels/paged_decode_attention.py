"""Decode attention over the paged KV cache: one query token per sequence, split-K.

A decode step has few query rows (one per sequence) and long contexts, so one program per
(sequence, kv head) would leave most of the GPU idle on small batches. Flash-decoding splits
each context into `num_splits` partitions: pass one computes, per split, the running max, sum
and unnormalised output; pass two (a small reduce kernel) rescales and combines them.

The split count comes from tensor shapes (batch size, kv heads, block-table width), never from
`seq_lens` values, so the launch needs no host sync and a CUDA graph captured at one batch shape
replays correctly for any lengths. Splits past a sequence's end run no iterations and write a
neutral partial (max -1e30, sum 0). The split count and partition length reach the kernels as
runtime ints, not constexprs, so a block table of a new width does not compile a new kernel.

One program serves all query heads that share a kv head (GQA), so each K/V tile is read once
per group: the group is padded to 16 rows for `tl.dot`, cheap since decode is bound by memory.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from metrale.config import is_fp8
from metrale.kernels.grid import cdiv, next_power_of_2
from metrale.kernels.paged_kv import LOG2_E, attend_keys, check_paged_inputs, dot_dtype
from metrale.kernels.pdl import pdl_enabled, wait_for_previous_kernel

# A split this short spends more on its partial (write + reduce) than on its keys. At B1's
# shapes on the H200 (one sequence, 2,048-token table, contexts 256-512; bench/b1_small_kernels.py)
# 16 splits of 128 tokens took 6.2 us a layer, 8 of 256 7.2-8.1 us, 32 of 64 6.9 us.
_MIN_PARTITION_TOKENS = 128
# Keeps the reduce kernel's [num_splits, head_dim] tile in registers.
_MAX_SPLITS = 64
# Aim for this many programs per SM in pass one, in a power of two of splits. They run one at a
# time per SM (a bf16 program's three stages of 128-key K and V tiles take ~192 KB of shared
# memory), and the splits are cut from the block table's width, the engine's longest context, so
# where the live contexts are shorter the splits past them launch, find no keys and exit: the
# programs that read anything are fewer than the target. At B2's last steps on an H100
# (bench/decode_attention.py --shape b2_12: 12 sequences of 1,200-2,048 tokens in a 4,096-token
# table, graph-timed) 3 splits (the target of 2) took 50 us a layer, 11 splits 47, 8-16 splits
# 40-41; at 48 sequences 1 split 120 us, 3 splits 129, 2-8 splits 115-117; at 256 sequences 1
# split stays the fastest (245 us, 2 splits 249). A split count that does not divide the table
# into whole halves of the contexts leaves one split of each sequence with most of its keys. So
# 8 splits at 12 sequences, 2 at 48, 1 from 66 on.
_PROGRAMS_PER_SM = 4
_NUM_SMS_WITHOUT_GPU = 132


@triton.jit
def _paged_decode_split_kernel(
    q_ptr,
    k_cache_ptr,
    v_cache_ptr,
    block_tables_ptr,
    seq_lens_ptr,
    part_max_ptr,
    part_sum_ptr,
    part_acc_ptr,
    scale,
    sliding_window,
    stride_q_seq,
    stride_q_head,
    stride_cache_block,
    stride_cache_token,
    stride_cache_head,
    stride_bt_seq,
    num_splits,
    partition_size,
    NUM_HEADS: tl.constexpr,
    GROUP_SIZE: tl.constexpr,
    BLOCK_G: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    HAS_WINDOW: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    DOT_DTYPE: tl.constexpr,
    PDL: tl.constexpr,
):
    wait_for_previous_kernel(PDL)
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)

    seq_len = tl.load(seq_lens_ptr + seq).to(tl.int32)
    query_pos = seq_len - 1
    offs_g = tl.arange(0, BLOCK_G)
    offs_d = tl.arange(0, HEAD_DIM)
    g_mask = offs_g < GROUP_SIZE
    heads = kv_head * GROUP_SIZE + offs_g  # [BLOCK_G]

    q = tl.load(
        q_ptr + seq * stride_q_seq + heads[:, None] * stride_q_head + offs_d[None, :],
        mask=g_mask[:, None],
        other=0.0,
    ).to(DOT_DTYPE)  # [BLOCK_G, HEAD_DIM]

    # Keys [lo, hi) of this split that the query sees: causal end is seq_len itself.
    lo = split * partition_size
    hi = tl.minimum(lo + partition_size, seq_len)
    if HAS_WINDOW:
        lo = tl.maximum(lo, query_pos - sliding_window + 1)

    # A finite start for the running max: masked scores are -inf, and exp(-inf - m) must be 0,
    # never exp(-inf + inf) = nan, while the split has seen no key.
    m_i = tl.full([BLOCK_G], -1.0e30, dtype=tl.float32)
    l_i = tl.zeros([BLOCK_G], dtype=tl.float32)
    acc = tl.zeros([BLOCK_G, HEAD_DIM], dtype=tl.float32)
    m_i, l_i, acc = attend_keys(
        q,
        tl.full([BLOCK_G], query_pos, tl.int32),
        k_cache_ptr,
        v_cache_ptr,
        block_tables_ptr + seq * stride_bt_seq,
        kv_head,
        lo,
        hi,
        hi,
        sliding_window,
        scale * LOG2_E,
        m_i,
        l_i,
        acc,
        stride_cache_block,
        stride_cache_token,
        stride_cache_head,
        HEAD_DIM,
        BLOCK_N,
        BLOCK_SIZE,
        DOT_PRECISION,
        HAS_WINDOW,
        MASKED=True,
        K_ROWS=False,
    )

    # Partials: [num_seqs, num_heads, num_splits] and [num_seqs, num_heads, num_splits, HEAD_DIM].
    part = (seq * NUM_HEADS + heads) * num_splits + split  # [BLOCK_G]
    tl.store(part_max_ptr + part, m_i, mask=g_mask)
    tl.store(part_sum_ptr + part, l_i, mask=g_mask)
    tl.store(part_acc_ptr + part[:, None] * HEAD_DIM + offs_d[None, :], acc, mask=g_mask[:, None])


@triton.jit
def _paged_decode_reduce_kernel(
    part_max_ptr,
    part_sum_ptr,
    part_acc_ptr,
    out_ptr,
    stride_out_seq,
    stride_out_head,
    num_splits,
    NUM_HEADS: tl.constexpr,
    BLOCK_S: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    PDL: tl.constexpr,
):
    wait_for_previous_kernel(PDL)
    seq = tl.program_id(0)
    head = tl.program_id(1)
    offs_s = tl.arange(0, BLOCK_S)
    offs_d = tl.arange(0, HEAD_DIM)
    s_mask = offs_s < num_splits
    part = (seq * NUM_HEADS + head) * num_splits + offs_s  # [BLOCK_S]

    m = tl.load(part_max_ptr + part, mask=s_mask, other=float("-inf"))  # [BLOCK_S]
    l_s = tl.load(part_sum_ptr + part, mask=s_mask, other=0.0)
    acc = tl.load(
        part_acc_ptr + part[:, None] * HEAD_DIM + offs_d[None, :], mask=s_mask[:, None], other=0.0
    )  # [BLOCK_S, HEAD_DIM]
    m_max = tl.max(m, 0)
    w = tl.exp2(m - m_max)  # [BLOCK_S]; the maxima are in base 2
    total = tl.sum(w * l_s, 0)
    o = tl.sum(w[:, None] * acc, 0)  # [HEAD_DIM]
    # total is 0 only for an empty context (a padding row): write zeros, not nan.
    o = tl.where(total > 0, o / tl.where(total > 0, total, 1.0), 0.0)
    tl.store(
        out_ptr + seq * stride_out_seq + head * stride_out_head + offs_d,
        o.to(out_ptr.dtype.element_ty),
    )


@functools.lru_cache
def _num_sms(device: torch.device) -> int:
    if device.type != "cuda":
        return _NUM_SMS_WITHOUT_GPU
    return torch.cuda.get_device_properties(device).multi_processor_count


def plan_decode_splits(num_seqs: int, num_kv_heads: int, max_context_len: int, num_sms: int) -> int:
    """How many splits fill the GPU: enough programs, but no split under the minimum length.

    From shapes only (`max_context_len` is the block-table width times block_size).
    """
    wanted = next_power_of_2(cdiv(_PROGRAMS_PER_SM * num_sms, max(1, num_seqs * num_kv_heads)))
    by_length = cdiv(max_context_len, _MIN_PARTITION_TOKENS)
    return max(1, min(wanted, by_length, _MAX_SPLITS))


def paged_decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    sliding_window: int | None = None,
    out: torch.Tensor | None = None,
    *,
    num_splits: int | None = None,
    max_block_n: int | None = None,
    num_warps: int | None = None,
    num_stages: int | None = None,
    dot_dtype_override: torch.dtype | None = None,
) -> torch.Tensor:
    """Attention of each sequence's last token over its cached context.

    q: [num_seqs, num_heads, head_dim], the query at position seq_lens[b] - 1 (its own k/v
    already stored). Caches: [num_blocks, block_size, num_kv_heads, head_dim], contiguous.
    block_tables: [num_seqs, max_blocks] int32/int64. seq_lens: [num_seqs] int32/int64; 0 gives
    a zero output row. sliding_window: keys at positions <= pos - window are masked.
    num_splits: None picks it from shapes; tests force it to cover multi-split paths.
    max_block_n, num_warps, num_stages, dot_dtype_override: launch overrides for the sweep in
    bench/decode_attention.py.
    Returns out: [num_seqs, num_heads, head_dim], dtype of q.
    """
    num_seqs, num_heads, head_dim = q.shape
    _, block_size, num_kv_heads, cache_head_dim = k_cache.shape
    check_paged_inputs(q, k_cache, v_cache, block_tables, seq_lens, sliding_window)
    assert q.shape[0] == seq_lens.shape[0], "decode takes one query row per sequence"
    assert cache_head_dim == head_dim, f"q head_dim {head_dim} != cache head_dim {cache_head_dim}"
    if out is None:
        out = torch.empty_like(q)
    assert out.shape == q.shape and out.dtype == q.dtype and out.stride(2) == 1, (
        f"out must be {tuple(q.shape)} {q.dtype} with contiguous head_dim"
    )
    if num_seqs == 0:
        return out

    max_context_len = block_tables.shape[1] * block_size
    if num_splits is None:
        num_splits = plan_decode_splits(num_seqs, num_kv_heads, max_context_len, _num_sms(q.device))
    partition_size = cdiv(max_context_len, num_splits)
    # 128-key tiles read the cache at 95% of the copy bandwidth on the H200 at B3's shapes
    # (64: 86%; bench/decode_attention.py). fp32 tiles are twice the bytes: a quarter of the
    # keys keeps the pipelined K/V buffers in shared memory.
    # An fp8 cache: 64-key tiles, 2 warps and 2 stages (0.71 against 0.77 ms at B3's shapes).
    # It reads half the bytes of bf16 in nearly bf16's time: widening the keys and values in
    # registers, not reading them, bounds its loop.
    fp8_cache = is_fp8(k_cache.dtype)
    if max_block_n is None:
        max_block_n = 32 if q.dtype == torch.float32 else 64 if fp8_cache else 128
    num_warps = num_warps or (2 if fp8_cache else 4)
    num_stages = num_stages or (2 if fp8_cache else 3)
    block_n = min(max_block_n, max(16, next_power_of_2(partition_size)))
    partition_size = cdiv(partition_size, block_n) * block_n
    num_splits = cdiv(max_context_len, partition_size)
    group_size = num_heads // num_kv_heads
    pdl = pdl_enabled(q.device)

    part_max = torch.empty((num_seqs, num_heads, num_splits), dtype=torch.float32, device=q.device)
    part_sum = torch.empty_like(part_max)
    part_acc = torch.empty(
        (num_seqs, num_heads, num_splits, head_dim), dtype=torch.float32, device=q.device
    )
    _paged_decode_split_kernel[(num_seqs, num_kv_heads, num_splits)](
        q,
        k_cache,
        v_cache,
        block_tables,
        seq_lens,
        part_max,
        part_sum,
        part_acc,
        scale,
        sliding_window or 0,
        q.stride(0),
        q.stride(1),
        k_cache.stride(0),
        k_cache.stride(1),
        k_cache.stride(2),
        block_tables.stride(0),
        num_splits,
        partition_size,
        NUM_HEADS=num_heads,
        GROUP_SIZE=group_size,
        BLOCK_G=max(16, next_power_of_2(group_size)),
        HEAD_DIM=head_dim,
        BLOCK_N=block_n,
        BLOCK_SIZE=block_size,
        HAS_WINDOW=sliding_window is not None,
        DOT_PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
        DOT_DTYPE=dot_dtype(q.dtype, k_cache.dtype, dot_dtype_override),
        PDL=pdl,
        num_warps=num_warps,
        num_stages=num_stages,
        launch_pdl=pdl,
    )
    _paged_decode_reduce_kernel[(num_seqs, num_heads)](
        part_max,
        part_sum,
        part_acc,
        out,
        out.stride(0),
        out.stride(1),
        num_splits,
        NUM_HEADS=num_heads,
        BLOCK_S=next_power_of_2(num_splits),
        HEAD_DIM=head_dim,
        PDL=pdl,
        launch_pdl=pdl,
    )
    return out


def paged_decode_attention_ref(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    sliding_window: int | None = None,
) -> torch.Tensor:
    """Torch reference of `paged_decode_attention`: gather each context, softmax in fp32."""
    num_heads = q.shape[1]
    block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    group_size = num_heads // num_kv_heads
    out = torch.zeros_like(q)  # [num_seqs, num_heads, head_dim]
    for seq, seq_len in enumerate(seq_lens.tolist()):
        if seq_len == 0:
            continue
        pos = torch.arange(seq_len, device=q.device)  # [seq_len]
        blocks = block_tables[seq, pos // block_size].long()
        keys = k_cache[blocks, pos % block_size].float()  # [seq_len, num_kv_heads, head_dim]
        values = v_cache[blocks, pos % block_size].float()
        keys = keys.repeat_interleave(group_size, dim=1)  # [seq_len, num_heads, head_dim]
        values = values.repeat_interleave(group_size, dim=1)
        scores = torch.einsum("hd,thd->ht", q[seq].float(), keys) * scale
        if sliding_window is not None:
            scores[:, pos <= seq_len - 1 - sliding_window] = float("-inf")
        probs = scores.softmax(dim=-1)  # [num_heads, seq_len]
        out[seq] = torch.einsum("ht,thd->hd", probs, values).to(q.dtype)
    return out
