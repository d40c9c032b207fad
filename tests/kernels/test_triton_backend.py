"""The triton backend's attention of a mixed step: its leading decode rows go to the decode
kernel and its longer chunks to the prefill kernel, into one output, equal to the reference of
the whole flat batch."""

from __future__ import annotations

import pytest
import torch

from metrale.kernels import paged_decode_attention as decode_kernels
from metrale.kernels import paged_prefill_attention as prefill_kernels
from metrale.kernels.paged_prefill_attention import paged_prefill_attention_ref
from metrale.layers.attention import Attention
from metrale.layers.attention.triton_backend import TritonAttentionMetadata
from tests.kernels.paged_cache import make_paged_cache

BLOCK_SIZE, NUM_HEADS, NUM_KV_HEADS, HEAD_DIM = 4, 4, 2, 16


class NoRotation:
    def rotate_qk(self, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return q, k


@pytest.mark.parametrize(
    "chunks",
    [
        [(9, 1), (30, 1), (0, 7), (5, 12)],  # decodes, then a prompt and a chunk after a prefix
        [(3, 5), (12, 1)],  # a decode after a chunk is not leading: the prefill kernel's
        [(0, 6), (20, 9)],  # no decode rows
    ],
)
def test_mixed_step_attention_matches_the_reference(device, monkeypatch, chunks) -> None:
    torch.manual_seed(0)
    seq_lens = [context + n for context, n in chunks]
    k_cache, v_cache, block_tables = make_paged_cache(
        seq_lens, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM, torch.float32, device
    )
    layer = Attention(NUM_HEADS, NUM_KV_HEADS, HEAD_DIM)
    layer.bind_cache(k_cache, v_cache)
    num_tokens = sum(n for _, n in chunks)
    q = torch.randn(num_tokens, NUM_HEADS, HEAD_DIM, device=device)
    # This step's own keys and values: stored (through slot_mapping) into the cache before
    # attention, so the reference reads them from there too.
    k = torch.randn(num_tokens, NUM_KV_HEADS, HEAD_DIM, device=device)
    v = torch.randn(num_tokens, NUM_KV_HEADS, HEAD_DIM, device=device)
    slots, starts = [], [0]
    for seq, (context, n) in enumerate(chunks):
        pos = torch.arange(context, context + n)
        slots.append(block_tables[seq, pos // BLOCK_SIZE].cpu() * BLOCK_SIZE + pos % BLOCK_SIZE)
        starts.append(starts[-1] + n)
    num_decode_seqs = next((i for i, (_, n) in enumerate(chunks) if n > 1), len(chunks))
    meta = TritonAttentionMetadata(
        slot_mapping=torch.cat(slots).to(device),
        block_tables=block_tables,
        seq_lens=torch.tensor(seq_lens, device=device),
        query_start_loc=torch.tensor(starts, device=device),
        max_query_len=max(n for _, n in chunks),
        num_decode_seqs=num_decode_seqs,
        sliding_window=None,
    )
    launches = {"decode": 0, "prefill": 0}

    def counting(name, kernel):
        def launch(*args, **kwargs):
            launches[name] += 1
            return kernel(*args, **kwargs)

        return launch

    monkeypatch.setattr(
        "metrale.layers.attention.triton_backend.paged_decode_attention",
        counting("decode", decode_kernels.paged_decode_attention),
    )
    monkeypatch.setattr(
        "metrale.layers.attention.triton_backend.paged_prefill_attention",
        counting("prefill", prefill_kernels.paged_prefill_attention),
    )

    out = meta.attend(layer, q.clone(), k, v, NoRotation())

    assert launches == {"decode": int(num_decode_seqs > 0), "prefill": 1}
    expected = paged_prefill_attention_ref(
        q, k_cache, v_cache, block_tables, meta.query_start_loc, meta.seq_lens, layer.scale
    )
    torch.testing.assert_close(out, expected, atol=1e-4, rtol=1e-4)
