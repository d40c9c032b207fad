"""The `triton` attention backend: paged kernels that read the KV pool in place (GPUs).

Its metadata holds device tensors only, built without reading anything back to the host, so a
decode step can be captured in a CUDA graph and replayed with new contents in the same buffers.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from metrale.kernels.kv_store import store_kv
from metrale.kernels.paged_decode_attention import paged_decode_attention
from metrale.kernels.paged_prefill_attention import paged_prefill_attention
from metrale.layers.attention import Attention, Rotary, StepBatch
from metrale.layers.rotary import FusedRotary


@dataclass(frozen=True)
class TritonAttentionMetadata:
    slot_mapping: torch.Tensor  # [num_tokens]; < 0 skips the store (graph padding)
    block_tables: torch.Tensor  # [num_seqs, max_blocks]
    seq_lens: torch.Tensor  # [num_seqs]
    query_start_loc: torch.Tensor  # [num_seqs + 1]
    max_query_len: int
    num_decode_seqs: int  # the leading sequences of one query row each
    sliding_window: int | None

    @classmethod
    def build(cls, batch: StepBatch) -> TritonAttentionMetadata:
        return cls(
            batch.slot_mapping,
            batch.block_tables,
            batch.seq_lens,
            batch.query_start_loc,
            batch.max_query_len,
            batch.num_decode_seqs,
            batch.sliding_window,
        )

    def attend(
        self,
        layer: Attention,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        rope: Rotary,
        out: torch.Tensor | None = None,
    ) -> torch.Tensor:
        # q: [num_tokens, num_heads, head_dim]; k, v: [num_tokens, num_kv_heads, head_dim]
        # `out`: where to write the output (a CUDA graph's buffer, `piecewise_graphs.py`)
        # One launch: q rotated in place, k into the cache.
        if isinstance(rope, FusedRotary) and not rope.cpu:
            rope.rotate_and_store(q, k, v, layer.k_cache, layer.v_cache, self.slot_mapping)
        else:
            q, k = rope.rotate_qk(q, k)
            store_kv(k, v, layer.k_cache, layer.v_cache, self.slot_mapping)
        if self.max_query_len == 1:  # decode only: one row per sequence, in order
            return self._decode(layer, q, self.block_tables, self.seq_lens, out)
        # A mixed step: its leading decode rows go to the decode kernel, which splits their long
        # contexts over programs and reads a kv head once for its query heads; in the prefill
        # kernel each would take a whole tile of query rows, and a program per query head.
        if out is None:
            out = torch.empty_like(q)
        n = self.num_decode_seqs
        if n:
            self._decode(layer, q[:n], self.block_tables[:n], self.seq_lens[:n], out[:n])
        return paged_prefill_attention(
            q,
            layer.k_cache,
            layer.v_cache,
            self.block_tables[n:],
            self.query_start_loc[n:],
            self.seq_lens[n:],
            self.max_query_len,
            layer.scale,
            self.sliding_window,
            out,
        )

    def _decode(
        self,
        layer: Attention,
        q: torch.Tensor,
        block_tables: torch.Tensor,
        seq_lens: torch.Tensor,
        out: torch.Tensor | None = None,
    ) -> torch.Tensor:
        return paged_decode_attention(
            q,
            layer.k_cache,
            layer.v_cache,
            block_tables,
            seq_lens,
            layer.scale,
            self.sliding_window,
            out,
        )
