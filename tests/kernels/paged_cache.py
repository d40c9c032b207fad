"""A random paged KV cache for the attention-kernel tests."""

from __future__ import annotations

import torch


def make_paged_cache(
    seq_lens: list[int],
    block_size: int,
    num_kv_heads: int,
    head_dim: int,
    dtype: torch.dtype,
    device: torch.device,
    index_dtype: torch.dtype = torch.int64,
    cache_dtype: torch.dtype | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Random caches (of `cache_dtype`, default `dtype`) and block tables: shuffled block ids,
    spare blocks full of garbage, and trailing table entries pointing at arbitrary (valid)
    blocks."""
    blocks_per_seq = [-(-n // block_size) for n in seq_lens]
    num_blocks = sum(blocks_per_seq) + 3
    max_blocks = max(blocks_per_seq) + 2
    ids = torch.randperm(num_blocks)
    block_tables = torch.randint(0, num_blocks, (len(seq_lens), max_blocks))
    start = 0
    for seq, n in enumerate(blocks_per_seq):
        block_tables[seq, :n] = ids[start : start + n]
        start += n
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    k_cache = torch.randn(shape).to(dtype=cache_dtype or dtype, device=device)
    v_cache = torch.randn(shape).to(dtype=cache_dtype or dtype, device=device)
    return k_cache, v_cache, block_tables.to(dtype=index_dtype, device=device)


def random_pool(
    num_blocks: int, block_size: int, kv_heads: int, head_dim: int, seed: int = 0
) -> tuple[torch.Tensor, torch.Tensor]:
    """Float32 key and value pools [num_blocks, block_size, kv_heads, head_dim] of random values,
    as the CPU attention kernels read them."""
    g = torch.Generator().manual_seed(seed)
    shape = (num_blocks, block_size, kv_heads, head_dim)
    return torch.randn(shape, generator=g), torch.randn(shape, generator=g)
