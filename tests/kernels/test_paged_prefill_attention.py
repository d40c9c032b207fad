"""Varlen paged prefill attention against its torch reference, the reference against dense
causal SDPA, and the kernel against itself across chunkings and against the decode kernel.

Interpreter runs use small fp32/fp16 shapes (the interpreter's `tl.dot` does not support bf16);
`gpu` tests add bf16 and Llama-3-8B shapes.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from metrale.kernels.paged_decode_attention import paged_decode_attention
from metrale.kernels.paged_prefill_attention import (
    paged_prefill_attention,
    paged_prefill_attention_ref,
)
from tests.kernels.paged_cache import make_paged_cache

ON_GPU = torch.cuda.is_available()
needs_gpu = pytest.mark.skipif(not ON_GPU, reason="needs a CUDA device")
FP8 = [torch.float8_e4m3fn, torch.float8_e5m2]
TOLERANCE = {torch.float32: 1e-4, torch.float16: 2e-3, torch.bfloat16: 1e-2}

# (cached positions before the chunk, chunk length): a one-token chunk, a prefill from scratch,
# a chunk after an unaligned prefix, a prefix-cache hit on a block boundary, a chunk spanning
# two query tiles.
CHUNKS = [(0, 1), (0, 13), (5, 20), (16, 7), (3, 70)]


def flat_batch(
    chunks: list[tuple[int, int]], index_dtype: torch.dtype, device: torch.device
) -> tuple[list[int], torch.Tensor, torch.Tensor]:
    """seq_lens, query_start_loc [num_seqs + 1] and seq_lens [num_seqs] of (context, q_len)."""
    seq_lens = [context + q_len for context, q_len in chunks]
    starts = [0]
    for _, q_len in chunks:
        starts.append(starts[-1] + q_len)
    return (
        seq_lens,
        torch.tensor(starts, dtype=index_dtype, device=device),
        torch.tensor(seq_lens, dtype=index_dtype, device=device),
    )


def run_and_compare(
    chunks: list[tuple[int, int]],
    *,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    block_size: int,
    dtype: torch.dtype,
    device: torch.device,
    sliding_window: int | None = None,
    index_dtype: torch.dtype = torch.int64,
    cache_dtype: torch.dtype | None = None,
) -> None:
    torch.manual_seed(len(chunks) * 1000 + sum(c + n for c, n in chunks))
    seq_lens, query_start_loc, lens = flat_batch(chunks, index_dtype, device)
    k_cache, v_cache, block_tables = make_paged_cache(
        seq_lens, block_size, num_kv_heads, head_dim, dtype, device, index_dtype, cache_dtype
    )
    num_tokens = sum(q_len for _, q_len in chunks)
    q = torch.randn(num_tokens, num_heads, head_dim).to(dtype=dtype, device=device)
    max_query_len = max(q_len for _, q_len in chunks)
    scale = head_dim**-0.5
    out = torch.full_like(q, float("nan"))  # every element must be written
    paged_prefill_attention(
        q,
        k_cache,
        v_cache,
        block_tables,
        query_start_loc,
        lens,
        max_query_len,
        scale,
        sliding_window,
        out,
    )
    ref = paged_prefill_attention_ref(
        q, k_cache, v_cache, block_tables, query_start_loc, lens, scale, sliding_window
    )
    assert not out.isnan().any()
    tol = TOLERANCE[dtype]
    torch.testing.assert_close(
        out.float(), ref.float(), atol=tol * ref.abs().max().item(), rtol=tol
    )


@pytest.mark.parametrize("cache_dtype", [None, *FP8])
@pytest.mark.parametrize("sliding_window", [None, 6])
@pytest.mark.parametrize("num_heads,num_kv_heads", [(4, 4), (4, 2), (8, 2), (6, 2)])
def test_matches_reference(
    device: torch.device,
    num_heads: int,
    num_kv_heads: int,
    sliding_window: int | None,
    cache_dtype: torch.dtype | None,
) -> None:
    """Also over fp8 caches, whose keys and values are widened as they are read: the result is
    the reference's over the same fp8 values (q in fp32, so nothing else rounds)."""
    run_and_compare(
        CHUNKS,
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        head_dim=32,
        block_size=8,
        dtype=torch.float32,
        device=device,
        sliding_window=sliding_window,
        cache_dtype=cache_dtype,
    )


@pytest.mark.parametrize(
    "head_dim,block_size,index_dtype",
    [(16, 4, torch.int32), (64, 16, torch.int64), (32, 32, torch.int32)],
)
def test_head_dims_block_sizes_index_dtypes(
    device: torch.device, head_dim: int, block_size: int, index_dtype: torch.dtype
) -> None:
    run_and_compare(
        [(0, 9), (11, 6), (33, 1)],
        num_heads=4,
        num_kv_heads=1,
        head_dim=head_dim,
        block_size=block_size,
        dtype=torch.float32,
        device=device,
        index_dtype=index_dtype,
    )


@pytest.mark.parametrize("dtype", [torch.float16, pytest.param(torch.bfloat16, marks=needs_gpu)])
def test_half_precision(device: torch.device, dtype: torch.dtype) -> None:
    run_and_compare(
        CHUNKS,
        num_heads=8,
        num_kv_heads=2,
        head_dim=32,
        block_size=8,
        dtype=dtype,
        device=device,
        sliding_window=9,
    )


def test_empty_chunk_in_batch(device: torch.device) -> None:
    """A sequence with no new tokens (equal query_start_loc entries) writes nothing."""
    run_and_compare(
        [(4, 5), (10, 0), (0, 3)],
        num_heads=4,
        num_kv_heads=2,
        head_dim=16,
        block_size=4,
        dtype=torch.float32,
        device=device,
    )


@pytest.mark.parametrize("sliding_window", [None, 7])
def test_chunked_equals_whole(device: torch.device, sliding_window: int | None) -> None:
    """Prefilling in chunks gives the rows that one whole prefill gives."""
    torch.manual_seed(4)
    seq_len, block_size, num_heads, num_kv_heads, head_dim = 45, 4, 4, 2, 16
    k_cache, v_cache, block_tables = make_paged_cache(
        [seq_len], block_size, num_kv_heads, head_dim, torch.float32, device
    )
    q = torch.randn(seq_len, num_heads, head_dim, device=device)

    def prefill(start: int, end: int) -> torch.Tensor:
        return paged_prefill_attention(
            q[start:end],
            k_cache,
            v_cache,
            block_tables,
            torch.tensor([0, end - start], device=device),
            torch.tensor([end], device=device),
            end - start,
            0.25,
            sliding_window,
        )

    whole = prefill(0, seq_len)
    pieces = torch.cat([prefill(0, 16), prefill(16, 17), prefill(17, 45)])
    torch.testing.assert_close(pieces, whole, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("sliding_window", [None, 5])
def test_one_token_chunks_match_decode(device: torch.device, sliding_window: int | None) -> None:
    torch.manual_seed(5)
    seq_lens = [1, 8, 23, 40]
    k_cache, v_cache, block_tables = make_paged_cache(seq_lens, 8, 2, 32, torch.float32, device)
    q = torch.randn(len(seq_lens), 8, 32, device=device)
    lens = torch.tensor(seq_lens, device=device)
    query_start_loc = torch.arange(len(seq_lens) + 1, device=device)
    prefill = paged_prefill_attention(
        q, k_cache, v_cache, block_tables, query_start_loc, lens, 1, 0.2, sliding_window
    )
    decode = paged_decode_attention(
        q, k_cache, v_cache, block_tables, lens, 0.2, sliding_window, num_splits=2
    )
    torch.testing.assert_close(prefill, decode, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("sliding_window", [None, 5])
def test_reference_matches_dense_sdpa(sliding_window: int | None) -> None:
    """The reference itself: paged gather + mask equals causal SDPA on a whole prefill."""
    torch.manual_seed(6)
    chunks, block_size, num_heads, num_kv_heads, head_dim = [(0, 1), (0, 11)], 4, 4, 2, 16
    seq_lens, query_start_loc, lens = flat_batch(chunks, torch.int64, torch.device("cpu"))
    k_cache, v_cache, block_tables = make_paged_cache(
        seq_lens, block_size, num_kv_heads, head_dim, torch.float32, torch.device("cpu")
    )
    q = torch.randn(sum(seq_lens), num_heads, head_dim)
    ref = paged_prefill_attention_ref(
        q, k_cache, v_cache, block_tables, query_start_loc, lens, 0.3, sliding_window
    )
    for seq, n in enumerate(seq_lens):
        flat = (
            block_tables[seq].repeat_interleave(block_size) * block_size
            + torch.arange(block_tables.shape[1] * block_size) % block_size
        )
        keys = k_cache.view(-1, num_kv_heads, head_dim)[flat[:n]]  # [n, num_kv_heads, head_dim]
        values = v_cache.view(-1, num_kv_heads, head_dim)[flat[:n]]
        pos = torch.arange(n)
        visible = pos[None, :] <= pos[:, None]
        if sliding_window is not None:
            visible &= pos[None, :] > pos[:, None] - sliding_window
        rows = slice(int(query_start_loc[seq]), int(query_start_loc[seq + 1]))
        dense = F.scaled_dot_product_attention(
            q[rows].transpose(0, 1),  # [num_heads, n, head_dim]
            keys.transpose(0, 1),
            values.transpose(0, 1),
            attn_mask=visible[None],
            scale=0.3,
            enable_gqa=True,
        ).transpose(0, 1)
        torch.testing.assert_close(ref[rows], dense, atol=1e-5, rtol=1e-5)


LLAMA3_8B = dict(num_heads=32, num_kv_heads=8, head_dim=128, block_size=16)


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("sliding_window", [None, 1000])
@pytest.mark.parametrize(
    "chunks",
    [
        [(0, 4096)],
        [(0, 1), (0, 1000), (2048, 512), (4000, 96), (3071, 1), (16, 2000), (0, 17)],
    ],
)
@pytest.mark.parametrize("cache_dtype", [None, torch.float8_e4m3fn])
def test_llama3_8b_shapes_bf16(
    device: torch.device,
    chunks: list[tuple[int, int]],
    sliding_window: int | None,
    cache_dtype: torch.dtype | None,
) -> None:
    run_and_compare(
        chunks,
        **LLAMA3_8B,
        dtype=torch.bfloat16,
        device=device,
        sliding_window=sliding_window,
        cache_dtype=cache_dtype,
    )


@pytest.mark.gpu
@needs_gpu
def test_llama3_8b_shapes_fp32(device: torch.device) -> None:
    run_and_compare(
        [(0, 300), (1500, 700), (4095, 1)], **LLAMA3_8B, dtype=torch.float32, device=device
    )
