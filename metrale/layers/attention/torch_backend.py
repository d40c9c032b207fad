"""The `torch` attention backend: a reference that runs anywhere (CPU and tests).

It gathers each request's blocks into a [batch, context] view and calls
`scaled_dot_product_attention`: all decode tokens of the step in one call, each prefill chunk in
its own (padding one-token queries to the length of a prompt chunk would multiply the work of
every decode in a mixed step). On a CPU with a float32, bfloat16 or float16 cache the decode
tokens instead attend through `paged_decode_attention` (`kernels/cpu_extension.py`), which
reads their blocks in place (16 rows of peers.md's 33.6M Llama: ~220 against ~320 us a layer
for the gather and SDPA), and the prompt chunks, all of a step in one call, through
`paged_prefill_attention`.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

from metrale.config import is_fp8
from metrale.kernels import cpu_extension
from metrale.layers.attention import Attention, Rotary, StepBatch, to_cache_dtype


@dataclass(frozen=True)
class DecodeGroup:
    """Requests that compute one token each this step, attended together in one call."""

    token_idx: torch.Tensor  # [num_seqs] their rows in the flat batch
    block_ids: torch.Tensor  # [num_seqs * max_blocks] their block tables, padded, flattened
    mask: torch.Tensor  # [num_seqs, 1, 1, max_blocks * block_size] bool: keys each may see
    num_seqs: int
    # For `paged_decode_attention` (None: the gather and SDPA): their block tables [num_seqs,
    # max_blocks], the slots each sees, the sliding window.
    block_tables: torch.Tensor | None = None
    seq_lens: torch.Tensor | None = None
    sliding_window: int | None = None


@dataclass(frozen=True)
class PrefillChunk:
    """One request computing several tokens, rows `start:end` of the flat batch."""

    start: int
    end: int
    block_ids: torch.Tensor  # [num_blocks]
    mask: torch.Tensor | None  # [1, 1, num_tokens, num_blocks * block_size]; None: causal


@dataclass(frozen=True)
class PromptChunks:
    """The step's requests computing several tokens: on a CPU with the kernels on, attended all
    in one `paged_prefill_attention` call that reads their blocks in place (peers.md's 33.6M
    Llama, two 128-token prompts: ~0.3 against ~0.8-1.0 ms a layer for the gathers and SDPA); else
    each gathered and through SDPA (`chunks`, built on first use)."""

    batch: StepBatch
    seqs: np.ndarray  # their indices in the batch

    @functools.cached_property
    def chunks(self) -> list[PrefillChunk]:
        batch, device = self.batch, self.batch.slot_mapping.device
        block_size, window = batch.block_size, batch.sliding_window
        out = []
        for seq in self.seqs:
            start, end = batch.query_start_loc_host[seq], batch.query_start_loc_host[seq + 1]
            start_pos = int(batch.start_positions_host[seq])
            seq_len = start_pos + int(end - start)
            num_blocks = -(-seq_len // block_size)
            mask = None
            if start_pos > 0 or (window is not None and seq_len > window):
                queries = torch.arange(start_pos, seq_len, device=device)
                keys = torch.arange(num_blocks * block_size, device=device)
                mask = _visible(keys[None, :], queries[:, None], window)[None, None]
            table = batch.block_tables[seq, :num_blocks]
            out.append(PrefillChunk(int(start), int(end), table, mask))
        return out

    @functools.cached_property
    def in_place(self) -> tuple[torch.Tensor, ...]:
        """`paged_prefill_attention`'s block tables, query starts, lengths and start positions."""
        batch, seqs = self.batch, self.seqs
        starts = batch.query_start_loc_host[seqs]
        lens = batch.query_start_loc_host[seqs + 1] - starts
        positions = batch.start_positions_host[seqs]
        num_blocks = int(-(-(positions + lens).max() // batch.block_size))
        tables = batch.block_tables[torch.from_numpy(seqs), :num_blocks]
        return tables, *(torch.from_numpy(a).to(torch.int64) for a in (starts, lens, positions))

    def attend(self, layer: Attention, q: torch.Tensor, out: torch.Tensor) -> None:
        """Their rows of `out`, from their rows of q [num_tokens, num_heads, head_dim]."""
        if (
            q.device.type == "cpu"
            and q.dtype == layer.k_cache.dtype
            and cpu_extension.attends_in_place(layer.k_cache.dtype, layer.head_dim)
        ):
            cpu_extension.paged_prefill_attention(
                out, q, layer.k_cache, layer.v_cache, *self.in_place, layer.scale,
                self.batch.sliding_window,
            )  # fmt: skip
            return
        for p in self.chunks:
            out[p.start : p.end] = _attend(
                layer, q[p.start : p.end].unsqueeze(0), p.block_ids, 1, p.mask
            ).squeeze(0)


@dataclass(frozen=True)
class TorchAttentionMetadata:
    """Where this step's keys go, and which cached keys each query token sees."""

    slot_mapping: torch.Tensor  # [num_tokens] cache slot (block_id * block_size + offset)
    decode: DecodeGroup | None
    prompts: PromptChunks | None

    @classmethod
    def build(cls, batch: StepBatch) -> TorchAttentionMetadata:
        slot_mapping, block_tables = batch.slot_mapping, batch.block_tables
        query_start_loc, start_positions = batch.query_start_loc_host, batch.start_positions_host
        block_size, sliding_window = batch.block_size, batch.sliding_window
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
            tables = block_tables[rows, :num_blocks]
            in_place = device.type == "cpu" and cpu_extension.enabled()
            decode = DecodeGroup(
                token_idx=torch.from_numpy(query_start_loc[decode_seqs]).to(device),
                block_ids=tables.flatten(),
                mask=mask[:, None, None, :],
                num_seqs=len(decode_seqs),
                block_tables=tables if in_place else None,
                seq_lens=batch.seq_lens[rows] if in_place else None,
                sliding_window=sliding_window,
            )
        prompt_seqs = np.flatnonzero(query_lens > 1)
        prompts = PromptChunks(batch, prompt_seqs) if len(prompt_seqs) else None
        return cls(slot_mapping, decode, prompts)

    def attend(
        self, layer: Attention, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, rope: Rotary
    ) -> torch.Tensor:
        # q: [num_tokens, num_heads, head_dim]; k, v: [num_tokens, num_kv_heads, head_dim]
        q, k = rope.rotate_qk(q, k)
        slots = (-1, layer.num_kv_heads, layer.head_dim)
        _store(layer.k_cache.view(slots), self.slot_mapping, k)
        _store(layer.v_cache.view(slots), self.slot_mapping, v)
        d = self.decode
        if d is not None and self.prompts is None:  # decode only: rows already in order
            return _attend_decodes(layer, q, d)
        out = torch.empty_like(q)
        if d is not None:
            out[d.token_idx] = _attend_decodes(layer, q[d.token_idx], d)
        if self.prompts is not None:
            self.prompts.attend(layer, q, out)
        return out


def _store(cache: torch.Tensor, slot_mapping: torch.Tensor, x: torch.Tensor) -> None:
    x = to_cache_dtype(x, cache.dtype)
    _bytes_if_fp8(cache).index_copy_(0, slot_mapping, _bytes_if_fp8(x))


def _gather(cache: torch.Tensor, block_ids: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return _bytes_if_fp8(cache).index_select(0, block_ids).view(cache.dtype).to(dtype)


def _bytes_if_fp8(t: torch.Tensor) -> torch.Tensor:
    # index_copy_ and index_select have no fp8 kernels: move an fp8 cache's bytes instead.
    return t.view(torch.uint8) if is_fp8(t.dtype) else t


def _visible(
    key_pos: torch.Tensor, query_pos: torch.Tensor, sliding_window: int | None
) -> torch.Tensor:
    """Causal (and sliding-window) visibility of keys to queries, by absolute position."""
    mask = key_pos <= query_pos
    if sliding_window is not None:
        mask &= key_pos > query_pos - sliding_window
    return mask


def _attend_decodes(layer: Attention, q: torch.Tensor, d: DecodeGroup) -> torch.Tensor:
    """The decode rows' attention, q [num_seqs, num_heads, head_dim]: read in place by the CPU
    kernel where it takes them (q and the cache of one dtype, float32, bfloat16 or float16; a
    head size of a multiple of 16), else gathered and through SDPA."""
    if (
        d.block_tables is not None
        and q.dtype == layer.k_cache.dtype
        and cpu_extension.attends_in_place(layer.k_cache.dtype, layer.head_dim)
    ):
        return cpu_extension.paged_decode_attention(
            q, layer.k_cache, layer.v_cache, d.block_tables, d.seq_lens, layer.scale,
            d.sliding_window,
        )  # fmt: skip
    return _attend(layer, q.unsqueeze(1), d.block_ids, d.num_seqs, d.mask).squeeze(1)


def _attend(
    layer: Attention,
    queries: torch.Tensor,
    block_ids: torch.Tensor,
    num_seqs: int,
    mask: torch.Tensor | None,
) -> torch.Tensor:
    # queries: [num_seqs, num_queries, num_heads, head_dim] -> the same shape
    # index_select over the flat block list: several times faster than advanced indexing.
    context = (num_seqs, -1, layer.num_kv_heads, layer.head_dim)
    keys = _gather(layer.k_cache, block_ids, queries.dtype).view(context)
    values = _gather(layer.v_cache, block_ids, queries.dtype).view(context)
    return F.scaled_dot_product_attention(
        queries.transpose(1, 2),
        keys.transpose(1, 2),
        values.transpose(1, 2),
        attn_mask=mask,
        is_causal=mask is None,
        scale=layer.scale,
        enable_gqa=layer.num_heads != layer.num_kv_heads,
    ).transpose(1, 2)
