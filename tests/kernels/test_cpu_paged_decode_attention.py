"""The CPU kernel of decode attention over the paged cache (`kernels/cpu_extension.py`): each row
equals SDPA over its own slots gathered out of the pool, for groups of 1, 2 and 3 query heads a KV
head, contexts of one slot, a block's end and a whole table, blocks in any order, and a sliding
window, and scores far apart, block tables sliced out of a wider one, the same bits on any number of
threads (which claim runs of rows as they come free); over a bfloat16 or float16 pool it equals
float32 SDPA over the same 16-bit values to the output's rounding; inputs it cannot read are errors,
not wrong numbers.
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


def reference(q, k_cache, v_cache, block_tables, seq_lens, scale, window):
    kv_heads, head_dim = k_cache.shape[2], k_cache.shape[3]
    group = q.shape[1] // kv_heads
    out = []
    for row, (table, length) in enumerate(zip(block_tables, seq_lens.tolist(), strict=True)):
        slots = (table[:, None] * BLOCK + torch.arange(BLOCK)).flatten()[:length]
        if window:
            slots = slots[-window:]
        keys = k_cache.view(-1, kv_heads, head_dim)[slots].transpose(0, 1)
        values = v_cache.view(-1, kv_heads, head_dim)[slots].transpose(0, 1)
        o = F.scaled_dot_product_attention(
            q[row][:, None],
            keys.repeat_interleave(group, 0),
            values.repeat_interleave(group, 0),
            scale=scale,
        )
        out.append(o[:, 0])
    return torch.stack(out)


@pytest.mark.parametrize("heads, kv_heads", [(4, 4), (8, 4), (6, 2)])
@pytest.mark.parametrize("window", [None, 5, 40])
# A scale of 8: most of a row's weights fall past exp's floor (scores 100s apart), one dominates;
# float32 scores of that size are ~1e-5 apart, so the weights agree to ~1e-5 of themselves.
@pytest.mark.parametrize("scale", [0.2, 8.0])
def test_rows_equal_sdpa_over_their_own_slots(heads, kv_heads, window, scale):
    assert cpu_extension.available()
    head_dim, num_blocks, max_blocks = 32, 40, 6
    k_cache, v_cache = pool(num_blocks, kv_heads, head_dim)
    g = torch.Generator().manual_seed(heads + kv_heads)
    # One slot; a block's last; into a second block; a whole table; others at random.
    lengths = [1, BLOCK, BLOCK + 1, max_blocks * BLOCK, 50, 77, 3]
    block_tables = torch.stack(
        [torch.randperm(num_blocks, generator=g)[:max_blocks] for _ in lengths]
    )
    seq_lens = torch.tensor(lengths)
    q = torch.randn(len(lengths), heads, head_dim, generator=g)
    args = (q, k_cache, v_cache, block_tables, seq_lens, scale)
    got = cpu_extension.paged_decode_attention(*args, window)
    tolerance = 1e-5 if scale < 1 else 1e-4
    torch.testing.assert_close(got, reference(*args, window), rtol=tolerance, atol=tolerance)


def test_a_slice_of_a_wider_table_reads_its_rows_where_they_lie():
    # The runner's block-table buffer is wider than a step needs: the step passes a slice.
    k_cache, v_cache = pool(64, 2, 32)
    g = torch.Generator().manual_seed(9)
    wide = torch.stack([torch.randperm(64, generator=g)[:12] for _ in range(5)])
    lengths = torch.tensor([1, 17, 40, 64, 80])
    q = torch.randn(5, 4, 32, generator=g)
    got = cpu_extension.paged_decode_attention(q, k_cache, v_cache, wide[:, :5], lengths, 0.2, None)
    want = reference(q, k_cache, v_cache, wide[:, :5].contiguous(), lengths, 0.2, None)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_any_number_of_threads_gives_the_same_bits(torch_threads):
    k_cache, v_cache = pool(64, 2, 32)
    g = torch.Generator().manual_seed(5)
    lengths = torch.randint(1, 8 * BLOCK, (23,), generator=g)
    block_tables = torch.stack([torch.randperm(64, generator=g)[:8] for _ in range(23)])
    q = torch.randn(23, 4, 32, generator=g)
    args = (q, k_cache, v_cache, block_tables, lengths, 0.2)
    outs = []
    for threads in (1, 2, 3, 5):
        torch_threads(threads)
        outs.append(cpu_extension.paged_decode_attention(*args, None))
    torch.testing.assert_close(outs[0], reference(*args, None), rtol=1e-5, atol=1e-5)
    for out in outs[1:]:
        assert torch.equal(out, outs[0])


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("window", [None, 40])
def test_a_16_bit_pool_is_read_as_it_is(dtype, window):
    """Keys, values and q held in 16 bits (a bfloat16 checkpoint's cache): the kernel widens
    them as it loads and sums in float32, so it equals float32 SDPA over the same 16-bit values,
    its output rounded once to the pool's dtype."""
    assert cpu_extension.available()
    head_dim, num_blocks, max_blocks = 64, 40, 6
    k_cache, v_cache = (x.to(dtype) for x in pool(num_blocks, 2, head_dim))
    g = torch.Generator().manual_seed(7)
    lengths = [1, BLOCK + 1, max_blocks * BLOCK, 50]
    block_tables = torch.stack(
        [torch.randperm(num_blocks, generator=g)[:max_blocks] for _ in lengths]
    )
    q = torch.randn(len(lengths), 8, head_dim, generator=g).to(dtype)
    seq_lens = torch.tensor(lengths)
    got = cpu_extension.paged_decode_attention(
        q, k_cache, v_cache, block_tables, seq_lens, 0.125, window
    )
    assert got.dtype == dtype
    wide = (x.float() for x in (q, k_cache, v_cache))
    want = reference(*wide, block_tables, seq_lens, 0.125, window).to(dtype)
    # One rounding of the output apart at most: a unit in its last place.
    ulp = 2**-7 if dtype == torch.bfloat16 else 2**-10
    torch.testing.assert_close(got.float(), want.float(), rtol=ulp, atol=1e-3)


def test_inputs_it_cannot_read_are_errors():
    assert cpu_extension.available()
    k_cache, v_cache = pool(4, 2, 32)
    q = torch.randn(1, 4, 32)
    tables = torch.tensor([[0, 1]])
    attend = cpu_extension.paged_decode_attention
    with pytest.raises(RuntimeError, match="sees 33 slots"):
        attend(q, k_cache, v_cache, tables, torch.tensor([33]), 1.0, None)
    with pytest.raises(RuntimeError, match="not in the pool"):
        attend(q, k_cache, v_cache, torch.tensor([[0, 9]]), torch.tensor([20]), 1.0, None)
    with pytest.raises(RuntimeError, match="int64"):
        attend(q, k_cache, v_cache, tables.int(), torch.tensor([3]), 1.0, None)
    with pytest.raises(RuntimeError, match="caches' dtype"):
        attend(q.half(), k_cache, v_cache, tables, torch.tensor([3]), 1.0, None)
    with pytest.raises(RuntimeError, match="float32, bfloat16 or float16"):
        attend(q.double(), k_cache.double(), v_cache.double(), tables, torch.tensor([3]), 1.0, 0)
    with pytest.raises(RuntimeError, match="query heads"):
        attend(torch.randn(1, 3, 32), k_cache, v_cache, tables, torch.tensor([3]), 1.0, None)
