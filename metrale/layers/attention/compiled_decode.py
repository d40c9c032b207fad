"""Decode attention written for torch.compile on a CPU (`runner/compiled_decode.py`).

Each query row is a decode that sees its first `seq_lens[i]` cache slots. It attends through
reductions over slots that index the paged cache directly (`k_cache[slot]`, the slot from the
block table), so inductor fuses the gather into the loops that read the keys and values: each is
read once, in place. Eager, these reductions would materialize every product; they are meant to
be compiled. (At 16 rows the compiled reductions took 1.4x the eager gather and SDPA: inductor
recomputes the scores for each of the softmax's passes. Steps of several rows call the C++
`paged_decode_attention` instead, where it builds; at one row the reductions measured faster.)

The step's keys and values are written by `store_kv` (or its C++ twin where the kernels run), a
custom op that mutates the whole pool (`[num_layers, 2, num_blocks, block_size, kv_heads,
head_dim]`, an input of the graph) in place, and each layer reads its keys and values as views
of that input taken inside the graph: a mutation of a layer's own slice, a view made outside,
makes the compiled graph copy the pool.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from metrale.layers.attention import Attention, Rotary, to_cache_dtype

# An op the compiled graph calls as it is, defined straight on torch.library: a
# `torch.library.custom_op` wraps each call in more Python (~70 us a call here, ~6 us this way).
_LIB = torch.library.Library("metrale", "FRAGMENT")
_LIB.define("store_kv(Tensor(a!) kv, int layer, Tensor slot_mapping, Tensor k, Tensor v) -> ()")


def _store_kv(
    kv: torch.Tensor, layer: int, slot_mapping: torch.Tensor, k: torch.Tensor, v: torch.Tensor
) -> None:
    """Write layer `layer`'s k and v ([num_tokens, num_kv_heads, head_dim]) to their slots."""
    shape = (-1, k.shape[1], k.shape[2])
    kv[layer, 0].view(shape).index_copy_(0, slot_mapping, to_cache_dtype(k, kv.dtype))
    kv[layer, 1].view(shape).index_copy_(0, slot_mapping, to_cache_dtype(v, kv.dtype))


_LIB.impl("store_kv", _store_kv, "CPU")


@torch.library.register_fake("metrale::store_kv")
def _(kv, layer, slot_mapping, k, v) -> None:
    return None


@dataclass(frozen=True)
class CompiledDecodeMetadata:
    """A step of one-row sequences: where each row's key goes and which slots it sees."""

    kv: torch.Tensor  # the pool, every layer
    slot_mapping: torch.Tensor  # [num_rows]
    block_tables: torch.Tensor  # [num_rows, max_blocks], padded with block 0
    seq_lens: torch.Tensor  # [num_rows] slots each row sees, its own included
    block_size: int
    sliding_window: int | None
    # Whether the step runs the C++ kernels over the pool (`kernels/cpu_extension.py`): its keys
    # and values stored by `store_kv`, and rows attending through `paged_decode_attention` (the
    # kernel eager steps use) rather than through the reductions below.
    cpu_kernel: bool = False

    def attend(
        self, layer: Attention, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, rope: Rotary
    ) -> torch.Tensor:
        # q: [rows, heads, head_dim]; k, v: [rows, kv_heads, head_dim] -> [rows, heads, head_dim]
        q, k = rope.rotate_qk(q, k)
        store = torch.ops.metrale_cpu.store_kv if self.cpu_kernel else torch.ops.metrale.store_kv
        store(self.kv, layer.cache_index, self.slot_mapping, k, v)
        if self.cpu_kernel and q.shape[0] > 1:  # one row: the reductions measured faster
            return torch.ops.metrale_cpu.paged_decode_attention(
                q, self.kv[layer.cache_index, 0], self.kv[layer.cache_index, 1],
                self.block_tables, self.seq_lens, layer.scale, self.sliding_window or 0,
            )  # fmt: skip
        rows, kv_heads, head_dim = q.shape[0], layer.num_kv_heads, layer.head_dim
        group = layer.num_heads // kv_heads
        bs = self.block_size
        context = torch.arange(self.block_tables.shape[1] * bs, device=q.device)
        slots = self.block_tables[:, context // bs] * bs + context % bs  # [rows, context]
        visible = context[None, :] < self.seq_lens[:, None]
        if self.sliding_window is not None:
            visible &= context[None, :] >= self.seq_lens[:, None] - self.sliding_window
        keys = self.kv[layer.cache_index, 0].view(-1, kv_heads, head_dim)[slots].float()
        values = self.kv[layer.cache_index, 1].view(-1, kv_heads, head_dim)[slots].float()
        queries = q.float().view(rows, kv_heads, group, head_dim)
        # [rows, context, kv_heads, group] scores, each query head against its group's keys, in
        # fp32; inductor fuses the gathers into the loops that read them. (Products through
        # matmul, the keys gathered out first, measured 3x slower.)
        scores = (queries[:, None] * keys[:, :, :, None, :]).sum(-1) * layer.scale
        scores = scores.masked_fill(~visible[:, :, None, None], float("-inf"))
        weights = torch.softmax(scores, dim=1)
        out = (weights[..., None] * values[:, :, :, None, :]).sum(1)  # [rows, kv, group, dim]
        return out.reshape(rows, layer.num_heads, head_dim).to(q.dtype)
