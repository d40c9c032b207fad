"""Attention over the paged KV cache, and the per-step metadata it reads.

The runner builds one `AttentionMetadata` per step from the flat batch and hands it down the
model as an argument; every layer reuses it. Each layer first writes the step's keys and values
into its cache slots, then attends over the cache, so prefix-cache hits, chunked prefill and
decode are one code path: the query tokens of each request see every cached token up to their
own position.

This is the `torch` backend: a reference that runs anywhere (CPU and tests). It gathers each
request's blocks into a [batch, context] view and calls `scaled_dot_product_attention`: all
decode tokens of the step in one call, each prefill chunk in its own; a paged-kernel backend
for GPUs plugs in beside it.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn


@dataclass(frozen=True)
class DecodeGroup:
    """Requests that compute one token each this step, attended together in one call."""

    token_idx: torch.Tensor  # [num_seqs] their rows in the flat batch
    block_ids: torch.Tensor  # [num_seqs * max_blocks] their block tables, padded, flattened
    mask: torch.Tensor  # [num_seqs, 1, 1, max_blocks * block_size] bool: keys each may see
    num_seqs: int


@dataclass(frozen=True)
class PrefillChunk:
    """One request computing several tokens, rows `start:end` of the flat batch."""

    start: int
    end: int
    block_ids: torch.Tensor  # [num_blocks]
    mask: torch.Tensor | None  # [1, 1, num_tokens, num_blocks * block_size]; None: causal


@dataclass(frozen=True)
class AttentionMetadata:
    """Where this step's keys go, and which cached keys each query token sees.

    Decode tokens and prefill chunks are attended apart: padding one-token queries to the
    length of a prompt chunk would multiply the work of every decode in a mixed step.
    """

    slot_mapping: torch.Tensor  # [num_tokens] cache slot (block_id * block_size + offset)
    decode: DecodeGroup | None
    prefills: list[PrefillChunk]

    @classmethod
    def build(
        cls,
        *,
        slot_mapping: torch.Tensor,
        block_tables: torch.Tensor,
        query_start_loc: np.ndarray,
        start_positions: np.ndarray,
        block_size: int,
        sliding_window: int | None,
    ) -> AttentionMetadata:
        """From the flat batch: `block_tables` [num_seqs, max_blocks] on the device;
        `query_start_loc` [num_seqs + 1] and `start_positions` [num_seqs] on the host."""
        device = slot_mapping.device
        query_lens = np.diff(query_start_loc)
        seq_lens = start_positions + query_lens
        decode_seqs = np.flatnonzero(query_lens == 1)
        decode = None
        if len(decode_seqs):
            num_blocks = int(-(-seq_lens[decode_seqs].max() // block_size))
            rows = torch.from_numpy(decode_seqs).to(device)
            positions = torch.from_numpy(start_positions[decode_seqs]).to(device)
            keys = torch.arange(num_blocks * block_size, device=device)
            mask = _visible(keys[None, :], positions[:, None], sliding_window)
            decode = DecodeGroup(
                token_idx=torch.from_numpy(query_start_loc[decode_seqs]).to(device),
                block_ids=block_tables[rows, :num_blocks].flatten(),
                mask=mask[:, None, None, :],
                num_seqs=len(decode_seqs),
            )
        prefills = []
        for seq in np.flatnonzero(query_lens > 1):
            start_pos, seq_len = int(start_positions[seq]), int(seq_lens[seq])
            num_blocks = -(-seq_len // block_size)
            mask = None
            if start_pos > 0 or (sliding_window is not None and seq_len > sliding_window):
                queries = torch.arange(start_pos, seq_len, device=device)
                keys = torch.arange(num_blocks * block_size, device=device)
                mask = _visible(keys[None, :], queries[:, None], sliding_window)[None, None]
            prefills.append(
                PrefillChunk(
                    int(query_start_loc[seq]),
                    int(query_start_loc[seq + 1]),
                    block_tables[seq, :num_blocks],
                    mask,
                )
            )
        return cls(slot_mapping, decode, prefills)


def _visible(
    key_pos: torch.Tensor, query_pos: torch.Tensor, sliding_window: int | None
) -> torch.Tensor:
    """Causal (and sliding-window) visibility of keys to queries, by absolute position."""
    mask = key_pos <= query_pos
    if sliding_window is not None:
        mask &= key_pos > query_pos - sliding_window
    return mask


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
        d = meta.decode
        if d is not None and not meta.prefills:  # decode only: rows already in order
            return self._attend(q.unsqueeze(1), d.block_ids, d.num_seqs, d.mask).squeeze(1)
        out = torch.empty_like(q)
        if d is not None:
            out[d.token_idx] = self._attend(
                q[d.token_idx].unsqueeze(1), d.block_ids, d.num_seqs, d.mask
            ).squeeze(1)
        for p in meta.prefills:
            out[p.start : p.end] = self._attend(
                q[p.start : p.end].unsqueeze(0), p.block_ids, 1, p.mask
            ).squeeze(0)
        return out

    def _attend(
        self,
        queries: torch.Tensor,
        block_ids: torch.Tensor,
        num_seqs: int,
        mask: torch.Tensor | None,
    ) -> torch.Tensor:
        # queries: [num_seqs, num_queries, num_heads, head_dim] -> the same shape
        # index_select over the flat block list: several times faster than advanced indexing.
        context = (num_seqs, -1, self.num_kv_heads, self.head_dim)
        keys = self.k_cache.index_select(0, block_ids).view(context)
        values = self.v_cache.index_select(0, block_ids).view(context)
        return F.scaled_dot_product_attention(
            queries.transpose(1, 2),
            keys.transpose(1, 2),
            values.transpose(1, 2),
            attn_mask=mask,
            is_causal=mask is None,
            scale=self.scale,
            enable_gqa=self.num_heads != self.num_kv_heads,
        ).transpose(1, 2)
