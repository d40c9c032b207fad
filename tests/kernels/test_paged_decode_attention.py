"""Split-K decode attention against its torch reference, and the reference against dense SDPA.

Interpreter runs use small fp32/fp16 shapes (the interpreter's `tl.dot` does not support bf16);
`gpu` tests add bf16 and Llama-3-8B shapes.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from metrale.kernels.paged_decode_attention import (
    paged_decode_attention,
    paged_decode_attention_ref,
    plan_decode_splits,
)
from tests.kernels.paged_cache import make_paged_cache

ON_GPU = torch.cuda.is_available()
needs_gpu = pytest.mark.skipif(not ON_GPU, reason="needs a CUDA device")
FP8 = [torch.float8_e4m3fn, torch.float8_e5m2]
TOLERANCE = {torch.float32: 1e-4, torch.float16: 2e-3, torch.bfloat16: 1e-2}


def run_and_compare(
    seq_lens: list[int],
    *,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    block_size: int,
    dtype: torch.dtype,
    device: torch.device,
    sliding_window: int | None = None,
    num_splits: int | None = None,
    index_dtype: torch.dtype = torch.int64,
    cache_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    torch.manual_seed(len(seq_lens) * 1000 + sum(seq_lens))
    k_cache, v_cache, block_tables = make_paged_cache(
        seq_lens, block_size, num_kv_heads, head_dim, dtype, device, index_dtype, cache_dtype
    )
    q = torch.randn(len(seq_lens), num_heads, head_dim).to(dtype=dtype, device=device)
    lens = torch.tensor(seq_lens, dtype=index_dtype, device=device)
    scale = head_dim**-0.5
    out = torch.full_like(q, float("nan"))  # every element must be written
    paged_decode_attention(
        q, k_cache, v_cache, block_tables, lens, scale, sliding_window, out, num_splits=num_splits
    )
    ref = paged_decode_attention_ref(q, k_cache, v_cache, block_tables, lens, scale, sliding_window)
    assert not out.isnan().any()
    tol = TOLERANCE[dtype]
    torch.testing.assert_close(
        out.float(), ref.float(), atol=tol * ref.abs().max().item(), rtol=tol
    )
    return out


@pytest.mark.parametrize("cache_dtype", [None, *FP8])
@pytest.mark.parametrize("num_splits", [None, 3])
@pytest.mark.parametrize("sliding_window", [None, 6])
@pytest.mark.parametrize("num_heads,num_kv_heads", [(4, 4), (4, 2), (8, 2)])
def test_matches_reference(
    device: torch.device,
    num_heads: int,
    num_kv_heads: int,
    sliding_window: int | None,
    num_splits: int | None,
    cache_dtype: torch.dtype | None,
) -> None:
    """Also over fp8 caches, whose keys and values are widened as they are read: the result is
    the reference's over the same fp8 values (q in fp32, so nothing else rounds)."""
    run_and_compare(
        [1, 9, 16, 31, 44],
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        head_dim=32,
        block_size=8,
        dtype=torch.float32,
        device=device,
        sliding_window=sliding_window,
        num_splits=num_splits,
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
        [3, 17, 40],
        num_heads=4,
        num_kv_heads=1,
        head_dim=head_dim,
        block_size=block_size,
        dtype=torch.float32,
        device=device,
        num_splits=2,
        index_dtype=index_dtype,
    )


def test_many_splits_most_empty(device: torch.device) -> None:
    """More splits than a short sequence fills: the empty ones must not disturb the result."""
    run_and_compare(
        [2, 5, 70],
        num_heads=4,
        num_kv_heads=2,
        head_dim=16,
        block_size=4,
        dtype=torch.float32,
        device=device,
        num_splits=64,
    )


def test_padding_rows_are_finite(device: torch.device) -> None:
    """CUDA-graph padding rows carry seq_len 0 or 1: no crash, no nan; 0 gives zeros."""
    out = run_and_compare(
        [0, 1, 0, 20, 1],
        num_heads=4,
        num_kv_heads=2,
        head_dim=16,
        block_size=8,
        dtype=torch.float32,
        device=device,
        sliding_window=4,
        num_splits=2,
    )
    assert out.isfinite().all()
    assert (out[[0, 2]] == 0).all()


def test_window_of_one_returns_own_value(device: torch.device) -> None:
    torch.manual_seed(0)
    seq_lens = [1, 6, 13]
    k_cache, v_cache, block_tables = make_paged_cache(seq_lens, 4, 2, 16, torch.float32, device)
    q = torch.randn(3, 4, 16, device=device)
    lens = torch.tensor(seq_lens, device=device)
    out = paged_decode_attention(q, k_cache, v_cache, block_tables, lens, 0.25, sliding_window=1)
    for seq, n in enumerate(seq_lens):
        block, offset = block_tables[seq, (n - 1) // 4], (n - 1) % 4
        expected = v_cache[block, offset].repeat_interleave(2, dim=0)  # [num_heads, head_dim]
        torch.testing.assert_close(out[seq], expected)


def test_strided_q_and_out(device: torch.device) -> None:
    """q and out as column slices of wider rows, as a fused qkv projection produces."""
    torch.manual_seed(1)
    seq_lens = [5, 12]
    k_cache, v_cache, block_tables = make_paged_cache(seq_lens, 4, 2, 16, torch.float32, device)
    qkv = torch.randn(2, 8, 16, device=device)
    q = qkv[:, :4]  # [num_seqs, num_heads, head_dim], row stride 8 * 16
    out = torch.full((2, 6, 16), float("nan"), device=device)[:, 1:5]
    lens = torch.tensor(seq_lens, device=device)
    paged_decode_attention(q, k_cache, v_cache, block_tables, lens, 0.25, out=out)
    ref = paged_decode_attention_ref(q, k_cache, v_cache, block_tables, lens, 0.25)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("sliding_window", [None, 5])
def test_reference_matches_dense_sdpa(sliding_window: int | None) -> None:
    """The reference itself: paged gather + mask equals SDPA on the dense context."""
    torch.manual_seed(2)
    seq_lens, block_size, num_heads, num_kv_heads, head_dim = [1, 7, 19], 4, 4, 2, 16
    k_cache, v_cache, block_tables = make_paged_cache(
        seq_lens, block_size, num_kv_heads, head_dim, torch.float32, torch.device("cpu")
    )
    q = torch.randn(len(seq_lens), num_heads, head_dim)
    ref = paged_decode_attention_ref(
        q, k_cache, v_cache, block_tables, torch.tensor(seq_lens), 0.3, sliding_window
    )
    for seq, n in enumerate(seq_lens):
        flat = (
            block_tables[seq].repeat_interleave(block_size) * block_size
            + torch.arange(block_tables.shape[1] * block_size) % block_size
        )
        keys = k_cache.view(-1, num_kv_heads, head_dim)[flat[:n]]  # [n, num_kv_heads, head_dim]
        values = v_cache.view(-1, num_kv_heads, head_dim)[flat[:n]]
        visible = torch.ones(n, dtype=torch.bool)
        if sliding_window is not None:
            visible[: max(0, n - sliding_window)] = False
        dense = F.scaled_dot_product_attention(
            q[seq][:, None],  # [num_heads, 1, head_dim]
            keys.transpose(0, 1),
            values.transpose(0, 1),
            attn_mask=visible[None, None, :],
            scale=0.3,
            enable_gqa=True,
        )[:, 0]
        torch.testing.assert_close(ref[seq], dense, atol=1e-5, rtol=1e-5)


def test_plan_decode_splits() -> None:
    # A full batch already fills the GPU: one split.
    assert plan_decode_splits(256, 8, 8192, 132) == 1
    # One long sequence: many splits, none shorter than 128 tokens, at most 64.
    assert plan_decode_splits(1, 8, 2048, 132) == 16
    assert plan_decode_splits(1, 8, 4096, 132) == 32
    assert plan_decode_splits(1, 1, 1 << 20, 132) == 64
    # A short context is not split below the minimum partition.
    assert plan_decode_splits(1, 8, 100, 132) == 1
    # A few sequences in a wide table: enough splits that those over the live contexts fill the
    # GPU, though the ones past them have no keys; a power of two of them.
    assert plan_decode_splits(12, 8, 4096, 132) == 8
    assert plan_decode_splits(48, 8, 4096, 132) == 2
    assert plan_decode_splits(128, 8, 4096, 132) == 1


@pytest.mark.parametrize("sliding_window", [None, 6])
@pytest.mark.parametrize("dtype", [torch.float16, pytest.param(torch.bfloat16, marks=needs_gpu)])
def test_half_precision(
    device: torch.device, dtype: torch.dtype, sliding_window: int | None
) -> None:
    run_and_compare(
        [1, 9, 16, 31, 44],
        num_heads=8,
        num_kv_heads=2,
        head_dim=32,
        block_size=8,
        dtype=dtype,
        device=device,
        sliding_window=sliding_window,
        num_splits=3,
    )


LLAMA3_8B = dict(num_heads=32, num_kv_heads=8, head_dim=128, block_size=16)
LLAMA_SEQ_LENS = [1, 15, 16, 17, 500, 1023, 2048, 4096, 3000, 0, 777, 4095]


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("cache_dtype", [None, torch.float8_e4m3fn])
@pytest.mark.parametrize("sliding_window", [None, 1000])
@pytest.mark.parametrize("seq_lens", [LLAMA_SEQ_LENS, [4096], [37] * 64])
def test_llama3_8b_shapes_bf16(
    device: torch.device, seq_lens: list[int], sliding_window, cache_dtype
) -> None:
    run_and_compare(
        seq_lens,
        **LLAMA3_8B,
        dtype=torch.bfloat16,
        device=device,
        sliding_window=sliding_window,
        cache_dtype=cache_dtype,
    )


@pytest.mark.gpu
@needs_gpu
def test_llama3_8b_shapes_fp32_many_splits(device: torch.device) -> None:
    run_and_compare(LLAMA_SEQ_LENS, **LLAMA3_8B, dtype=torch.float32, device=device, num_splits=40)


@pytest.mark.gpu
@needs_gpu
def test_cuda_graph_replay_with_new_lengths(device: torch.device) -> None:
    """Captured once, replayed after seq_lens and block tables change in place."""
    torch.manual_seed(3)
    num_heads, num_kv_heads, head_dim, block_size = 32, 8, 128, 16
    max_blocks, num_seqs = 64, 8
    num_blocks = num_seqs * max_blocks
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    k_cache = torch.randn(shape, device=device, dtype=torch.bfloat16)
    v_cache = torch.randn(shape, device=device, dtype=torch.bfloat16)
    q = torch.randn(num_seqs, num_heads, head_dim, device=device, dtype=torch.bfloat16)
    block_tables = torch.randperm(num_blocks, device=device).view(num_seqs, max_blocks)
    seq_lens = torch.tensor([1, 2, 3, 4, 5, 6, 7, 8], device=device)
    out = torch.empty_like(q)
    scale = head_dim**-0.5

    def step() -> None:
        paged_decode_attention(q, k_cache, v_cache, block_tables, seq_lens, scale, out=out)

    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        step()  # compile and warm up outside the capture
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()

    for lens in ([0, 1, 100, 1024, 7, 512, 333, 16], [1023, 1, 1, 50, 64, 65, 900, 0]):
        seq_lens.copy_(torch.tensor(lens, device=device))
        block_tables.copy_(torch.randperm(num_blocks, device=device).view(num_seqs, max_blocks))
        out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        ref = paged_decode_attention_ref(q, k_cache, v_cache, block_tables, seq_lens, scale)
        torch.testing.assert_close(
            out.float(), ref.float(), atol=1e-2 * ref.abs().max().item(), rtol=1e-2
        )
