"""`rotary_kv_store` writes what `apply_rotary` then `store_kv` write, bit for bit, and matches
their torch references."""

from __future__ import annotations

import pytest
import torch

from metrale.kernels.kv_store import store_kv
from metrale.kernels.rms_norm import rms_norm
from metrale.kernels.rotary import apply_rotary
from metrale.kernels.rotary_kv_store import rotary_kv_store, rotary_kv_store_ref
from tests.kernels.test_kv_store import random_caches, random_slots
from tests.kernels.test_rotary import (
    MAX_POSITIONS,
    assert_matches,
    fused_qkv,
    random_positions,
    rotary_caches,
)

ON_GPU = torch.cuda.is_available()
# (dtype, cache dtype). fp8 only on the GPU: Triton's interpreter rounds fp32 -> fp8 wrongly
# when a carry reaches the exponent (tests/kernels/test_kv_store.py), and rotated keys are not
# fp8-exact values.
CASES = [(torch.float32, torch.float32)]
if ON_GPU:
    CASES += [
        (torch.bfloat16, torch.bfloat16),
        (torch.float16, torch.float16),
        (torch.bfloat16, torch.float8_e4m3fn),
        (torch.bfloat16, torch.float8_e5m2),
    ]
HEAD_CONFIGS = [(4, 2, 32), (6, 3, 16)] + ([(32, 8, 128), (16, 8, 128)] if ON_GPU else [])


def views(qkv: torch.Tensor, num_q_heads: int, num_kv_heads: int, head_dim: int):
    """q, k, v: views of a fused qkv buffer [num_tokens, (q + 2 kv heads) * head_dim]."""
    sizes = [num_q_heads * head_dim, num_kv_heads * head_dim, num_kv_heads * head_dim]
    return [x.view(qkv.shape[0], -1, head_dim) for x in qkv.split(sizes, dim=-1)]


def close(actual: torch.Tensor, expected: torch.Tensor) -> None:
    """Equal up to an ulp of a normalised element, carried through the rotation (and through
    an fp8 cast, where an ulp of bf16 can move the value to the next fp8 step)."""
    if actual.dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
        torch.testing.assert_close(actual.float(), expected.float(), atol=0.02, rtol=0.15)
    else:
        assert_matches(actual, expected)


@pytest.mark.parametrize("dtype,cache_dtype", CASES, ids=lambda d: str(d).split(".")[-1])
@pytest.mark.parametrize("heads", HEAD_CONFIGS)
@pytest.mark.parametrize("num_tokens", [1, 9])
@pytest.mark.parametrize("head_norm", [False, True], ids=["", "head-norm"])
def test_matches_rotary_then_store(
    device, dtype, cache_dtype, heads, num_tokens, head_norm
) -> None:
    num_q_heads, num_kv_heads, head_dim = heads
    torch.manual_seed(num_tokens * 100 + num_q_heads)
    qkv = fused_qkv(num_tokens, num_q_heads, num_kv_heads, head_dim, dtype, device)[0]
    cos, sin = rotary_caches(head_dim, MAX_POSITIONS, device)
    positions = random_positions(num_tokens, MAX_POSITIONS, device)
    slots = random_slots(num_tokens, 4 * 16, num_skipped=num_tokens // 3).to(device)
    caches = random_caches(4, 16, num_kv_heads, head_dim, cache_dtype, device)
    norms = None
    if head_norm:  # Qwen3's per-head RMSNorm of q and k before the rotation
        weights = (torch.rand(2, head_dim, device=device) + 0.5).to(dtype)
        norms = (weights[0], weights[1], 1e-6)
    runs = {}
    for name in ("fused", "separate kernels", "reference"):
        buffer, run_caches = qkv.clone(), tuple(c.clone() for c in caches)
        q, k, v = views(buffer, num_q_heads, num_kv_heads, head_dim)
        if name == "fused":
            rotary_kv_store(q, k, v, cos, sin, positions, *run_caches, slots, norms)
        elif name == "separate kernels":
            if norms is not None:
                for x, weight in zip((q, k), norms, strict=False):
                    x.copy_(rms_norm(x.reshape(-1, head_dim), weight, norms[2])[0].view(x.shape))
            apply_rotary(q, k, cos, sin, positions, q_out=q, k_out=k)
            store_kv(k, v, *run_caches, slots)
        else:
            rotary_kv_store_ref(q, k, v, cos, sin, positions, *run_caches, slots, norms)
        runs[name] = (q, k, v, *run_caches)

    q, k, v, k_cache, v_cache = runs["fused"]
    sep_q, _, _, sep_k_cache, sep_v_cache = runs["separate kernels"]
    ref_q, _, _, ref_k_cache, ref_v_cache = runs["reference"]
    if head_norm:
        close(q, sep_q)
        close(k_cache, sep_k_cache)
    else:  # the same operations in the same order as rotary then store: bit for bit
        assert torch.equal(q, sep_q) and torch.equal(k_cache, sep_k_cache)
    assert torch.equal(v_cache, sep_v_cache) and torch.equal(v_cache, ref_v_cache)
    _, k_before, v_before = views(qkv, num_q_heads, num_kv_heads, head_dim)
    assert torch.equal(k, k_before) and torch.equal(v, v_before), "k and v stay as they were"
    close(q, ref_q)
    close(k_cache, ref_k_cache)


def test_rejects_bad_inputs(device) -> None:
    _, q, k = fused_qkv(3, 4, 2, 32, torch.float32, device)
    v = torch.randn_like(k)
    cos, sin = rotary_caches(32, MAX_POSITIONS, device)
    positions = random_positions(3, MAX_POSITIONS, device)
    k_cache, v_cache = random_caches(2, 16, 2, 32, torch.float32, device)
    slots = torch.arange(3, device=device)
    with pytest.raises(AssertionError, match="slot_mapping must be"):
        rotary_kv_store(q, k, v, cos, sin, positions, k_cache, v_cache, slots[:2])
    with pytest.raises(AssertionError, match="positions is"):
        rotary_kv_store(q, k, v, cos, sin, positions.int(), k_cache, v_cache, slots)
