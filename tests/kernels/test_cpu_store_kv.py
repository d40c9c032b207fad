"""The CPU kernel that writes a compiled decode step's keys and values to their slots of the
pool (`kernels/cpu_extension.py`'s `store_kv`): the pool afterwards equals the torch formula's
(`layers/attention/compiled_decode.py`), for keys whose heads are strided views of a projection,
in float32, bfloat16 and float16; nothing but the layer's slots changes; slots and shapes it
cannot take are errors.
"""

from __future__ import annotations

import pytest
import torch

from metrale.kernels import cpu_extension
from metrale.layers.attention.compiled_decode import _store_kv
from tests.conftest import needs_cpu_kernels

pytestmark = needs_cpu_kernels


@pytest.fixture(autouse=True)
def built():
    assert cpu_extension.available()


LAYERS, BLOCKS, BLOCK, KV_HEADS, HEAD_DIM = 3, 5, 4, 2, 32


def pool() -> torch.Tensor:
    return torch.randn(LAYERS, 2, BLOCKS, BLOCK, KV_HEADS, HEAD_DIM)


def step_kv(tokens: int, dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, torch.Tensor]:
    # k and v as a fused projection's slices: rows of 4 heads, every other head taken.
    qkv = torch.randn(tokens, 2, KV_HEADS * 2, HEAD_DIM).to(dtype)
    return qkv[:, 0, ::2], qkv[:, 1, 1::2]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_the_pool_equals_the_torch_formulas(dtype):
    k, v = step_kv(6, dtype)
    assert not k.is_contiguous()
    slots = torch.tensor([19, 0, 7, 12, 3, 8])
    ours = pool().to(dtype)
    theirs = ours.clone()
    before = ours.clone()
    torch.ops.metrale_cpu.store_kv(ours, 1, slots, k, v)
    _store_kv(theirs, 1, slots, k, v)
    assert torch.equal(ours, theirs)
    changed = (ours != before).flatten(4).any(-1)  # [layers, 2, blocks, block_size]
    assert changed.sum() == 2 * len(slots) and changed[1].any() and not changed[[0, 2]].any()


@pytest.mark.parametrize(
    "case",
    [
        "slot past the pool",
        "negative slot",
        "layer past the pool",
        "wrong head size",
        "bf16 pool, fp32 keys",
        "fp64 pool",
    ],
)
def test_what_it_cannot_take_is_an_error(case):
    kv = pool()
    k, v = step_kv(2)
    slots, layer = torch.tensor([1, 2]), 0
    if case == "slot past the pool":
        slots = torch.tensor([1, BLOCKS * BLOCK])
    elif case == "negative slot":
        slots = torch.tensor([-1, 2])
    elif case == "layer past the pool":
        layer = LAYERS
    elif case == "wrong head size":
        k = k[..., :16]
    elif case == "bf16 pool, fp32 keys":
        kv = kv.bfloat16()
    else:
        kv, k, v = kv.double(), k.double(), v.double()
    before = kv.clone()
    with pytest.raises(RuntimeError):
        torch.ops.metrale_cpu.store_kv(kv, layer, slots, k, v)
    assert torch.equal(kv, before)  # checked before anything is written
