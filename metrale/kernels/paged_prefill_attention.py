"""Prefill attention over the paged KV cache: a flat varlen batch of query chunks.

Sequence b's queries are rows query_start_loc[b]:query_start_loc[b + 1] of q, and its keys are
the first seq_lens[b] positions of its blocks, the chunk's own keys included (stored before the
call). Query i of the chunk sits at position seq_lens[b] - q_len + i, so one kernel covers
prefill from scratch, chunked prefill and prefix-cache hits: a chunk only differs by how many
cached positions come before it.

Flash-attention style: one program per (query tile, kv head, sequence) streams key tiles through
an online softmax with fp32 accumulation. A tile's rows are its tokens times the query heads of
the kv head's group (heads innermost, the group padded to a power of two), so a GQA group reads
each key tile once, and a tile of 128 rows spans 128 / group tokens: fewer straddle the causal
diagonal than in a tile of one head. Key tiles are gathered position by position through the
block table, so any block_size works and a key tile may span blocks. The grid is sized by the
host's `max_query_len`; tiles past a sequence's chunk exit at once.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from metrale.kernels.grid import cdiv
from metrale.kernels.paged_kv import LOG2_E, attend_keys, check_paged_inputs, dot_dtype


# The metadata arrive as slices past a mixed step's decode rows (`query_start_loc[n:]`), so their
# addresses' alignment changes with the number of decodes; they are read a scalar at a time, and
# specializing on it would compile a new variant (a second or more on the H200, stalling every
# stream) the first time a step has an unaligned count.
@triton.jit(
    do_not_specialize_on_alignment=["block_tables_ptr", "query_start_loc_ptr", "seq_lens_ptr"]
)
def _paged_prefill_kernel(
    q_ptr,
    k_cache_ptr,
    v_cache_ptr,
    out_ptr,
    block_tables_ptr,
    query_start_loc_ptr,
    seq_lens_ptr,
    scale,
    sliding_window,
    stride_q_token,
    stride_q_head,
    stride_out_token,
    stride_out_head,
    stride_cache_block,
    stride_cache_token,
    stride_cache_head,
    stride_bt_seq,
    GROUP_SIZE: tl.constexpr,
    GROUP_P2: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_Q: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    HAS_WINDOW: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    DOT_DTYPE: tl.constexpr,
    K_ROWS: tl.constexpr,
):
    q_tile = tl.program_id(0)
    kv_head = tl.program_id(1)
    seq = tl.program_id(2)

    q_start = tl.load(query_start_loc_ptr + seq).to(tl.int32)
    q_len = tl.load(query_start_loc_ptr + seq + 1).to(tl.int32) - q_start
    if q_tile * BLOCK_Q >= q_len:
        return
    seq_len = tl.load(seq_lens_ptr + seq).to(tl.int32)
    context_len = seq_len - q_len  # cached positions before this chunk

    # Row r: token r // GROUP_P2 of the tile, query head r % GROUP_P2 of the kv head's group.
    rows = tl.arange(0, BLOCK_Q * GROUP_P2)
    offs_m = q_tile * BLOCK_Q + rows // GROUP_P2  # the rows' tokens in the chunk
    heads = kv_head * GROUP_SIZE + rows % GROUP_P2
    offs_d = tl.arange(0, HEAD_DIM)
    m_mask = (offs_m < q_len) & (rows % GROUP_P2 < GROUP_SIZE)
    query_pos = context_len + offs_m
    q = tl.load(
        q_ptr
        + (q_start + offs_m)[:, None] * stride_q_token
        + heads[:, None] * stride_q_head
        + offs_d[None, :],
        mask=m_mask[:, None],
        other=0.0,
    ).to(DOT_DTYPE)  # [BLOCK_Q * GROUP_P2, HEAD_DIM]

    # Keys [lo, hi): up to the tile's last query (causal), from the first query's window.
    hi = context_len + tl.minimum((q_tile + 1) * BLOCK_Q, q_len)
    lo = 0
    if HAS_WINDOW:
        lo = tl.maximum(context_len + q_tile * BLOCK_Q - sliding_window + 1, 0)

    # Finite start for the running max: a row may see no key in a tile (causal or window), and
    # exp(-inf - m) must then be 0, never exp(-inf + inf) = nan.
    m_i = tl.full([BLOCK_Q * GROUP_P2], -1.0e30, dtype=tl.float32)
    l_i = tl.zeros([BLOCK_Q * GROUP_P2], dtype=tl.float32)
    acc = tl.zeros([BLOCK_Q * GROUP_P2, HEAD_DIM], dtype=tl.float32)
    # Key tiles wholly before the tile's first query are seen by every row: no mask to build.
    # The tiles from there to `hi` straddle the causal diagonal (or a sliding window's edge).
    unmasked_hi = lo
    if not HAS_WINDOW:
        unmasked_hi = (context_len + q_tile * BLOCK_Q) // BLOCK_N * BLOCK_N
    bt_row = block_tables_ptr + seq * stride_bt_seq
    scale_log2 = scale * LOG2_E
    m_i, l_i, acc = attend_keys(
        q,
        query_pos,
        k_cache_ptr,
        v_cache_ptr,
        bt_row,
        kv_head,
        lo,
        unmasked_hi,
        hi,
        sliding_window,
        scale_log2,
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
        MASKED=False,
        K_ROWS=K_ROWS,
    )
    m_i, l_i, acc = attend_keys(
        q,
        query_pos,
        k_cache_ptr,
        v_cache_ptr,
        bt_row,
        kv_head,
        unmasked_hi,
        hi,
        hi,
        sliding_window,
        scale_log2,
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
        K_ROWS=K_ROWS,
    )

    # Every real row sees at least its own key, so l_i > 0; padded rows are not stored.
    o = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
    tl.store(
        out_ptr
        + (q_start + offs_m)[:, None] * stride_out_token
        + heads[:, None] * stride_out_head
        + offs_d[None, :],
        o.to(out_ptr.dtype.element_ty),
        mask=m_mask[:, None],
    )


def paged_prefill_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    max_query_len: int,
    scale: float,
    sliding_window: int | None = None,
    out: torch.Tensor | None = None,
    *,
    tiles: tuple[int, int] | None = None,
    num_warps: int | None = None,
    num_stages: int | None = None,
    k_rows: bool | None = None,
    dot_dtype_override: torch.dtype | None = None,
) -> torch.Tensor:
    """Causal attention of each sequence's query chunk over its cached context.

    q: [num_tokens, num_heads, head_dim], the flat batch. Caches: [num_blocks, block_size,
    num_kv_heads, head_dim], contiguous. block_tables: [num_seqs, max_blocks] int32/int64.
    query_start_loc: [num_seqs + 1] int32/int64 row offsets into q. seq_lens: [num_seqs], each
    sequence's length including its chunk. max_query_len: a host int >= every chunk length; it
    sizes the grid. sliding_window: keys at positions <= pos - window are masked.
    Rows of q not covered by query_start_loc are left unwritten in out.
    Returns out: [num_tokens, num_heads, head_dim], dtype of q.
    """
    _, num_heads, head_dim = q.shape
    _, block_size, num_kv_heads, cache_head_dim = k_cache.shape
    num_seqs = seq_lens.shape[0]
    _check_inputs(q, k_cache, v_cache, block_tables, query_start_loc, seq_lens, sliding_window)
    assert cache_head_dim == head_dim, f"q head_dim {head_dim} != cache head_dim {cache_head_dim}"
    if out is None:
        out = torch.empty_like(q)
    assert out.shape == q.shape and out.dtype == q.dtype and out.stride(2) == 1, (
        f"out must be {tuple(q.shape)} {q.dtype} with contiguous head_dim"
    )
    if num_seqs == 0 or max_query_len == 0:
        return out

    group = num_heads // num_kv_heads
    group_p2 = triton.next_power_of_2(group)
    if q.dtype == torch.float32:
        # fp32 ("ieee") dots run on FMA units with both operands in registers: at 64x32 tiles
        # and head_dim 128 they spill, at 32x16 they fit (ptxas, sm_90).
        rows, block_n, warps, stages, rows_of_keys = 32, 16, 4, 3, False
    else:
        # 128 rows in 8 warps, keys loaded as they lie (bench/prefill_attention.py's sweep on
        # an H100: 1.11-1.28x the one-head 64 x 64 tiles). Narrower key tiles suited groups of
        # two (Qwen3-0.6B's heads), wider ones groups of four (Llama-3.1-8B's).
        rows, block_n, warps, stages, rows_of_keys = 128, 32 if group <= 2 else 64, 8, 2, True
    if tiles is not None:  # a launch override, for the sweep in bench/prefill_attention.py
        rows, block_n = tiles
    num_warps = num_warps or warps
    num_stages = num_stages or stages
    k_rows = rows_of_keys if k_rows is None else k_rows
    # One tile height whatever the chunk: a height per power of two below it would compile a
    # variant at the first short chunk of a run (tiles past a chunk's rows exit at once).
    block_q = max(rows // group_p2, 1)  # tokens a tile
    grid = (cdiv(max_query_len, block_q), num_kv_heads, num_seqs)
    _paged_prefill_kernel[grid](
        q,
        k_cache,
        v_cache,
        out,
        block_tables,
        query_start_loc,
        seq_lens,
        scale,
        sliding_window or 0,
        q.stride(0),
        q.stride(1),
        out.stride(0),
        out.stride(1),
        k_cache.stride(0),
        k_cache.stride(1),
        k_cache.stride(2),
        block_tables.stride(0),
        GROUP_SIZE=group,
        GROUP_P2=group_p2,
        HEAD_DIM=head_dim,
        BLOCK_Q=block_q,
        BLOCK_N=block_n,
        BLOCK_SIZE=block_size,
        HAS_WINDOW=sliding_window is not None,
        DOT_PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
        DOT_DTYPE=dot_dtype(q.dtype, k_cache.dtype, dot_dtype_override),
        K_ROWS=k_rows,
        num_warps=num_warps,
        num_stages=num_stages,
    )
    return out


def _check_inputs(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    sliding_window: int | None,
) -> None:
    check_paged_inputs(q, k_cache, v_cache, block_tables, seq_lens, sliding_window)
    num_seqs = seq_lens.shape[0]
    assert query_start_loc.shape == (num_seqs + 1,) and query_start_loc.is_contiguous(), (
        f"query_start_loc must be contiguous [{num_seqs + 1}], got {tuple(query_start_loc.shape)}"
    )
    assert query_start_loc.dtype in (torch.int32, torch.int64), "query_start_loc: int32/int64"
    assert query_start_loc.device == q.device, "query_start_loc on a different device"


def paged_prefill_attention_ref(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    sliding_window: int | None = None,
) -> torch.Tensor:
    """Torch reference of `paged_prefill_attention`: gather each context, softmax in fp32.

    Rows of q outside every chunk come back as zeros.
    """
    num_heads = q.shape[1]
    block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    group_size = num_heads // num_kv_heads
    out = torch.zeros_like(q)  # [num_tokens, num_heads, head_dim]
    starts = query_start_loc.tolist()
    for seq, seq_len in enumerate(seq_lens.tolist()):
        q_start, q_end = starts[seq], starts[seq + 1]
        if q_end == q_start:
            continue
        key_pos = torch.arange(seq_len, device=q.device)  # [seq_len]
        query_pos = torch.arange(seq_len - (q_end - q_start), seq_len, device=q.device)
        blocks = block_tables[seq, key_pos // block_size].long()
        keys = k_cache[blocks, key_pos % block_size].float()  # [seq_len, num_kv_heads, head_dim]
        values = v_cache[blocks, key_pos % block_size].float()
        keys = keys.repeat_interleave(group_size, dim=1)  # [seq_len, num_heads, head_dim]
        values = values.repeat_interleave(group_size, dim=1)
        queries = q[q_start:q_end].float()  # [q_len, num_heads, head_dim]
        scores = torch.einsum("qhd,khd->hqk", queries, keys) * scale
        visible = key_pos[None, :] <= query_pos[:, None]  # [q_len, seq_len]
        if sliding_window is not None:
            visible &= key_pos[None, :] > query_pos[:, None] - sliding_window
        scores.masked_fill_(~visible, float("-inf"))
        probs = scores.softmax(dim=-1)  # [num_heads, q_len, seq_len]
        out[q_start:q_end] = torch.einsum("hqk,khd->qhd", probs, values).to(q.dtype)
    return out
