"""The CPU kernel of prompt chunks attending over the paged cache (`kernels/cpu_extension.py`): each
chunk's rows equal causal SDPA over its own slots gathered out of the pool, whatever the chunk's
start (a fresh prompt, mid-block, after a cached prefix), length (one block's end, past a whole
task of rows) and group of query heads a KV head, with and without a sliding window, and scores
far apart; rows of q outside the chunks are left as they were in `out`; q may be a view of a
wider projection; a 16-bit pool equals float32 SDPA over the same 16-bit values to the output's
rounding; the same bits on any number of threads; inputs it cannot read are errors.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from metrale.kernels import cpu_extension
from tests.conftest import needs_cpu_kernels
from tests.kernels.paged_cache import random_pool

pytestmark = needs_cpu_kernels
BLOCK = 16


def pool(num_blocks: int, kv_heads: int, head_dim: int, seed: int = 0):
    return random_pool(num_blocks, BLOCK, kv_heads, head_dim, seed)


def reference(q, k_cache, v_cache, tables, starts, lens, positions, scale, window):
    """Each chunk's rows by SDPA over its slots, the mask by absolute position; other rows 0."""
    kv_heads, head_dim = k_cache.shape[2], k_cache.shape[3]
    group = q.shape[1] // kv_heads
    out = torch.zeros_like(q)
    for table, start, n, pos in zip(
        tables, starts.tolist(), lens.tolist(), positions.tolist(), strict=True
    ):
        slots = (table[:, None] * BLOCK + torch.arange(BLOCK)).flatten()[: pos + n]
        keys = k_cache.view(-1, kv_heads, head_dim)[slots].transpose(0, 1)
        values = v_cache.view(-1, kv_heads, head_dim)[slots].transpose(0, 1)
        key_pos, query_pos = torch.arange(pos + n), torch.arange(pos, pos + n)
        mask = key_pos[None, :] <= query_pos[:, None]
        if window:
            mask &= key_pos[None, :] > query_pos[:, None] - window
        o = F.scaled_dot_product_attention(
            q[start : start + n].transpose(0, 1),
            keys.repeat_interleave(group, 0),
            values.repeat_interleave(group, 0),
            attn_mask=mask,
            scale=scale,
        )
        out[start : start + n] = o.transpose(0, 1)
    return out


def chunks(lens, positions, num_blocks, max_blocks, gap=3, seed=0):
    """Chunks laid out in q with `gap` other rows before each (decode rows of a mixed step), and
    block tables of distinct blocks in any order."""
    g = torch.Generator().manual_seed(seed)
    starts, row = [], 0
    for n in lens:
        row += gap
        starts.append(row)
        row += n
    tables = torch.stack([torch.randperm(num_blocks, generator=g)[:max_blocks] for _ in lens])
    return row, tables, torch.tensor(starts), torch.tensor(lens), torch.tensor(positions)


def rows_of(starts, lens):
    return torch.cat(
        [torch.arange(s, s + n) for s, n in zip(starts.tolist(), lens.tolist(), strict=True)]
    )


@pytest.mark.parametrize("heads, kv_heads", [(4, 4), (8, 4), (6, 2)])
@pytest.mark.parametrize("window", [None, 5, 40])
@pytest.mark.parametrize("scale", [0.2, 8.0])
def test_chunks_equal_causal_sdpa_over_their_own_slots(heads, kv_heads, window, scale):
    assert cpu_extension.available()
    head_dim, num_blocks, max_blocks = 32, 60, 8
    k_cache, v_cache = pool(num_blocks, kv_heads, head_dim)
    # A fresh prompt past one task of rows; a chunk ending on a block's end after a cached
    # block; one starting mid-block; two tokens late in the table; a 37-token chunk at 50.
    lens, positions = [41, BLOCK, 23, 2, 37], [0, BLOCK, 7, 100, 50]
    tokens, tables, starts, lens, positions = chunks(lens, positions, num_blocks, max_blocks)
    q = torch.randn(tokens, heads, head_dim, generator=torch.Generator().manual_seed(heads))
    out = torch.full_like(q, 7.0)
    args = (q, k_cache, v_cache, tables, starts, lens, positions, scale)
    cpu_extension.paged_prefill_attention(out, *args, window)
    rows = rows_of(starts, lens)
    tolerance = 1e-5 if scale < 1 else 1e-4
    want = reference(*args, window)
    torch.testing.assert_close(out[rows], want[rows], rtol=tolerance, atol=tolerance)
    others = torch.ones(tokens, dtype=torch.bool)
    others[rows] = False
    assert torch.equal(out[others], torch.full_like(out[others], 7.0))


def test_q_a_view_of_a_wider_projection_and_a_slice_of_a_wider_table():
    # The layer's q is a column slice of the qkv product; the runner's table buffer is wider.
    k_cache, v_cache = pool(64, 2, 32)
    tokens, tables, starts, lens, positions = chunks([20, 33], [0, 9], 64, 12, seed=4)
    qkv = torch.randn(tokens, (4 + 2 * 2) * 32, generator=torch.Generator().manual_seed(4))
    q = qkv[:, : 4 * 32].view(tokens, 4, 32)
    assert not q.is_contiguous()
    out = torch.zeros(tokens, 4, 32)
    cpu_extension.paged_prefill_attention(
        out, q, k_cache, v_cache, tables[:, :4], starts, lens, positions, 0.2, None
    )
    want = reference(
        q.contiguous(), k_cache, v_cache, tables[:, :4].contiguous(), starts, lens, positions,
        0.2, None,
    )  # fmt: skip
    rows = rows_of(starts, lens)
    torch.testing.assert_close(out[rows], want[rows], rtol=1e-5, atol=1e-5)


def test_any_number_of_threads_gives_the_same_bits(torch_threads):
    k_cache, v_cache = pool(64, 2, 32)
    tokens, tables, starts, lens, positions = chunks([70, 5, 128], [0, 30, 64], 64, 14, seed=5)
    q = torch.randn(tokens, 4, 32, generator=torch.Generator().manual_seed(5))
    args = (q, k_cache, v_cache, tables, starts, lens, positions, 0.2, None)
    outs = []
    for threads in (1, 2, 3, 5):
        torch_threads(threads)
        out = torch.zeros_like(q)
        cpu_extension.paged_prefill_attention(out, *args)
        outs.append(out)
    rows = rows_of(starts, lens)
    torch.testing.assert_close(outs[0][rows], reference(*args)[rows], rtol=1e-5, atol=1e-5)
    for out in outs[1:]:
        assert torch.equal(out, outs[0])


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("window", [None, 40])
def test_a_16_bit_pool_is_read_as_it_is(dtype, window):
    """Keys, values and q in 16 bits: widened as they load, summed in float32, so the kernel
    equals float32 SDPA over the same 16-bit values, its output rounded once."""
    assert cpu_extension.available()
    k_cache, v_cache = (x.to(dtype) for x in pool(40, 2, 64))
    tokens, tables, starts, lens, positions = chunks([50, 17], [0, 40], 40, 6, seed=7)
    q = torch.randn(tokens, 8, 64, generator=torch.Generator().manual_seed(7)).to(dtype)
    out = torch.zeros_like(q)
    cpu_extension.paged_prefill_attention(
        out, q, k_cache, v_cache, tables, starts, lens, positions, 0.125, window
    )
    assert out.dtype == dtype
    wide = (x.float() for x in (q, k_cache, v_cache))
    want = reference(*wide, tables, starts, lens, positions, 0.125, window).to(dtype)
    ulp = 2**-7 if dtype == torch.bfloat16 else 2**-10
    rows = rows_of(starts, lens)
    torch.testing.assert_close(out[rows].float(), want[rows].float(), rtol=ulp, atol=1e-3)


def test_inputs_it_cannot_read_are_errors():
    assert cpu_extension.available()
    k_cache, v_cache = pool(4, 2, 32)
    q, tables = torch.randn(6, 4, 32), torch.tensor([[0, 1]])
    one = torch.tensor([0]), torch.tensor([6]), torch.tensor([0])

    def attend(q=q, tables=tables, chunk=one, k=k_cache, v=v_cache):
        cpu_extension.paged_prefill_attention(torch.empty_like(q), q, k, v, tables, *chunk, 1, 0)

    with pytest.raises(RuntimeError, match="sees 35 slots"):
        attend(chunk=(torch.tensor([0]), torch.tensor([3]), torch.tensor([32])))
    with pytest.raises(RuntimeError, match="not in q's 6"):
        attend(chunk=(torch.tensor([2]), torch.tensor([5]), torch.tensor([0])))
    with pytest.raises(RuntimeError, match="not in the pool"):
        attend(tables=torch.tensor([[9, 1]]))
    with pytest.raises(RuntimeError, match="int64"):
        attend(tables=tables.int())
    with pytest.raises(RuntimeError, match="int64"):
        attend(chunk=(torch.tensor([0]), torch.tensor([6], dtype=torch.int32), torch.tensor([0])))
    with pytest.raises(RuntimeError, match="caches' dtype"):
        attend(q=q.half())
    with pytest.raises(RuntimeError, match="float32, bfloat16 or float16"):
        attend(q=q.double(), k=k_cache.double(), v=v_cache.double())
    with pytest.raises(RuntimeError, match="query heads"):
        attend(q=torch.randn(6, 3, 32))
