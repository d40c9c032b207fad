"""Attention over the paged KV cache, and the per-step metadata it reads.

The runner builds one `AttentionMetadata` per step from the flat batch and hands it down the
model as an argument; every layer reuses it. Each layer first writes the step's keys and values
into its cache slots, then attends over the cache, so prefix-cache hits, chunked prefill and
decode are one code path: the query tokens of each request see every cached token up to their
own position.

This is the `torch` backend: a reference that runs anywhere (CPU and tests). It gathers each
request's blocks into a padded [batch, context] view and calls `scaled_dot_product_attention`
with a mask; a paged-kernel backend for GPUs plugs in beside it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn


@dataclass(frozen=True)
class AttentionMetadata:
    slot_mapping: torch.Tensor  # [num_tokens] cache slot (block_id * block_size + offset)
    block_tables: torch.Tensor  # [num_seqs, max_blocks_per_seq], padded with block 0
    block_ids: torch.Tensor  # [num_seqs * max_blocks_per_seq] the block tables, flattened
    query_seq_idx: torch.Tensor  # [num_tokens] which request each token belongs to
    query_pos_in_seq: torch.Tensor  # [num_tokens] index of the token within its chunk
    mask: torch.Tensor  # [num_seqs, 1, max_query_len, max_blocks_per_seq * block_size] bool
    max_query_len: int

    @classmethod
    def build(
        cls,
        *,
        positions: torch.Tensor,
        slot_mapping: torch.Tensor,
        block_tables: torch.Tensor,
        query_lens: torch.Tensor,
        query_start_loc: torch.Tensor,
        max_query_len: int,
        block_size: int,
        sliding_window: int | None,
    ) -> AttentionMetadata:
        device = positions.device
        num_seqs = block_tables.shape[0]
        seq_idx = torch.repeat_interleave(torch.arange(num_seqs, device=device), query_lens)
        pos_in_seq = torch.arange(positions.shape[0], device=device) - query_start_loc[seq_idx]
        # Absolute position of each query slot; padding slots take position 0 so that every row
        # of the mask allows at least key 0 (an all-masked row would give NaN).
        query_positions = torch.zeros(num_seqs, max_query_len, dtype=torch.long, device=device)
        query_positions[seq_idx, pos_in_seq] = positions
        key_positions = torch.arange(block_tables.shape[1] * block_size, device=device)
        mask = key_positions[None, None, :] <= query_positions[:, :, None]
        if sliding_window is not None:
            mask &= key_positions[None, None, :] > query_positions[:, :, None] - sliding_window
        return cls(
            slot_mapping=slot_mapping,
            block_tables=block_tables,
            block_ids=block_tables.flatten(),
            query_seq_idx=seq_idx,
            query_pos_in_seq=pos_in_seq,
            mask=mask.unsqueeze(1),
            max_query_len=max_query_len,
        )


class Attention(nn.Module):
    """Multi-head attention with grouped KV heads, reading and writing one layer's cache."""

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int) -> None:
        super().__init__()
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.scale = head_dim**-0.5
        self.k_cache = torch.empty(0)
        self.v_cache = torch.empty(0)

    def bind_cache(self, k_cache: torch.Tensor, v_cache: torch.Tensor) -> None:
        # each: [num_blocks, block_size, num_kv_heads, head_dim]
        self.k_cache, self.v_cache = k_cache, v_cache

    def forward(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, meta: AttentionMetadata
    ) -> torch.Tensor:
        # q: [num_tokens, num_heads, head_dim]; k, v: [num_tokens, num_kv_heads, head_dim]
        slots = (-1, self.num_kv_heads, self.head_dim)
        self.k_cache.view(slots).index_copy_(0, meta.slot_mapping, k)
        self.v_cache.view(slots).index_copy_(0, meta.slot_mapping, v)
        # index_select over the flat block list: several times faster than advanced indexing.
        num_seqs = meta.block_tables.shape[0]
        context = (num_seqs, -1, self.num_kv_heads, self.head_dim)
        keys = self.k_cache.index_select(0, meta.block_ids).view(context)
        values = self.v_cache.index_select(0, meta.block_ids).view(context)
        if meta.max_query_len == 1:
            queries = q.unsqueeze(1)  # decode: one token per request, already in order
        else:
            queries = q.new_zeros(num_seqs, meta.max_query_len, self.num_heads, self.head_dim)
            queries[meta.query_seq_idx, meta.query_pos_in_seq] = q
        out = F.scaled_dot_product_attention(
            queries.transpose(1, 2),
            keys.transpose(1, 2),
            values.transpose(1, 2),
            attn_mask=meta.mask,
            scale=self.scale,
            enable_gqa=self.num_heads != self.num_kv_heads,
        ).transpose(1, 2)  # [num_seqs, max_query_len, num_heads, head_dim]
        if meta.max_query_len == 1:
            return out.squeeze(1)
        return out[meta.query_seq_idx, meta.query_pos_in_seq]
