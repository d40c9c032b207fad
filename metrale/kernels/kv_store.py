"""Write a step's keys and values into their paged-cache slots.

A slot is `block_id * block_size + offset`: the cache viewed as [num_slots, num_kv_heads,
head_dim]. A negative slot marks a padding row of a CUDA-graph batch whose key and value must
not land anywhere, so the kernel skips it on the device instead of the host filtering rows
(which would need the slots on the host: a sync).

An fp8 cache stores the values cast as they are, saturated at the format's largest finite value
(`to_cache_dtype`, the reference's rule).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from metrale.config import is_fp8
from metrale.kernels.grid import next_power_of_2
from metrale.kernels.pdl import pdl_enabled, wait_for_previous_kernel
from metrale.layers.attention import to_cache_dtype


@triton.jit
def to_cache_value(x, cache_ptr, SATURATE: tl.constexpr, FP8_MAX: tl.constexpr):
    """x as a cache of cache_ptr's dtype stores it: an fp8 cache clamps to +-FP8_MAX first."""
    if SATURATE:
        x = tl.minimum(tl.maximum(x.to(tl.float32), -FP8_MAX), FP8_MAX)
    return x.to(cache_ptr.dtype.element_ty)


@triton.jit
def _store_kv_kernel(
    k_ptr,
    v_ptr,
    k_cache_ptr,
    v_cache_ptr,
    slot_mapping_ptr,
    stride_k_token,
    stride_k_head,
    stride_v_token,
    stride_v_head,
    NUM_KV_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_H: tl.constexpr,
    SATURATE: tl.constexpr,  # an fp8 cache: clamp to +-FP8_MAX before the cast
    FP8_MAX: tl.constexpr,
    PDL: tl.constexpr,
):
    wait_for_previous_kernel(PDL)
    # One program per token: its whole [num_kv_heads, head_dim] slab of k and of v.
    token = tl.program_id(0)
    slot = tl.load(slot_mapping_ptr + token).to(tl.int64)
    if slot < 0:
        return
    offs_h = tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, HEAD_DIM)
    mask = offs_h[:, None] < NUM_KV_HEADS
    # int64 slot: num_slots * num_kv_heads * head_dim can pass 2**31 on a large cache.
    cache_off = slot * (NUM_KV_HEADS * HEAD_DIM) + offs_h[:, None] * HEAD_DIM + offs_d[None, :]
    k = tl.load(
        k_ptr + token * stride_k_token + offs_h[:, None] * stride_k_head + offs_d[None, :],
        mask=mask,
    )
    v = tl.load(
        v_ptr + token * stride_v_token + offs_h[:, None] * stride_v_head + offs_d[None, :],
        mask=mask,
    )
    tl.store(k_cache_ptr + cache_off, to_cache_value(k, k_cache_ptr, SATURATE, FP8_MAX), mask=mask)
    tl.store(v_cache_ptr + cache_off, to_cache_value(v, v_cache_ptr, SATURATE, FP8_MAX), mask=mask)


def check_store_inputs(
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> bool:
    """The shapes, dtypes and layouts `store_kv` documents; whether the cache is fp8 (stores
    saturate)."""
    num_tokens, num_kv_heads, head_dim = k.shape
    assert v.shape == k.shape, f"k {tuple(k.shape)} and v {tuple(v.shape)} differ"
    assert k_cache.shape == v_cache.shape, "k_cache and v_cache shapes differ"
    assert k_cache.dim() == 4 and k_cache.shape[2:] == (num_kv_heads, head_dim), (
        f"cache {tuple(k_cache.shape)} does not hold [*, *, {num_kv_heads}, {head_dim}] tokens"
    )
    assert k_cache.is_contiguous() and v_cache.is_contiguous(), "caches must be contiguous"
    assert k.dtype == v.dtype and k_cache.dtype == v_cache.dtype, (
        f"dtypes differ: k {k.dtype}, v {v.dtype}, caches {k_cache.dtype}/{v_cache.dtype}"
    )
    saturate = is_fp8(k_cache.dtype)
    assert saturate or k_cache.dtype == k.dtype, (
        f"a {k_cache.dtype} cache cannot store {k.dtype} keys: fp8 or the same dtype"
    )
    assert k.stride(2) == 1 and v.stride(2) == 1, "head_dim must be the contiguous dimension"
    assert slot_mapping.shape == (num_tokens,) and slot_mapping.dtype == torch.int64, (
        f"slot_mapping must be [{num_tokens}] int64, got {tuple(slot_mapping.shape)} "
        f"{slot_mapping.dtype}"
    )
    assert slot_mapping.is_contiguous(), "slot_mapping must be contiguous"
    assert head_dim >= 16 and head_dim & (head_dim - 1) == 0, (
        f"head_dim {head_dim} must be a power of two >= 16"
    )
    assert k.device == k_cache.device == slot_mapping.device, "tensors on different devices"
    return saturate


def store_kv(
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Copy token t's k and v to slot `slot_mapping[t]` of the caches; skip negative slots.

    k, v: [num_tokens, num_kv_heads, head_dim], rows may be strided (views of a fused qkv
    projection) but head_dim must be innermost and contiguous. Caches: [num_blocks, block_size,
    num_kv_heads, head_dim], contiguous, of k's dtype or an fp8 one. slot_mapping: [num_tokens]
    int64.
    """
    saturate = check_store_inputs(k, v, k_cache, v_cache, slot_mapping)
    num_tokens, num_kv_heads, head_dim = k.shape
    if num_tokens == 0:
        return
    pdl = pdl_enabled(k.device)
    _store_kv_kernel[(num_tokens,)](
        k,
        v,
        k_cache,
        v_cache,
        slot_mapping,
        k.stride(0),
        k.stride(1),
        v.stride(0),
        v.stride(1),
        NUM_KV_HEADS=num_kv_heads,
        HEAD_DIM=head_dim,
        BLOCK_H=next_power_of_2(num_kv_heads),
        SATURATE=saturate,
        FP8_MAX=torch.finfo(k_cache.dtype).max if saturate else 0.0,
        PDL=pdl,
        launch_pdl=pdl,
    )


def store_kv_ref(
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Torch reference of `store_kv` (host sync on the mask: tests only)."""
    keep = slot_mapping >= 0  # [num_tokens]
    slots = slot_mapping[keep]
    num_kv_heads, head_dim = k.shape[1:]
    k_cache.view(-1, num_kv_heads, head_dim)[slots] = to_cache_dtype(k[keep], k_cache.dtype)
    v_cache.view(-1, num_kv_heads, head_dim)[slots] = to_cache_dtype(v[keep], v_cache.dtype)
