"""Rotary embedding and the KV-cache store in one launch: q rotated in place, k rotated into its
cache slot, v copied into its slot.

Run apart, rotary writes the rotated k back beside q and the store kernel reads it again: a
second launch per layer, and in a batch-1 decode step (B1) two tiny kernels and the gap between
them on the critical path of every layer. The rotated k is needed only in the cache (the paged
attention kernels read keys from there), so here it never returns to the qkv buffer.

Qwen3 normalises each q and k head (RMSNorm) before rotating it: with `head_norms` that happens
here too, on the head already in registers, which saves the two norm launches of every layer.

Rounding follows the kernels it replaces: a normalised head is rounded as `rms_norm` rounds it,
k is rotated in fp32 and rounded to its dtype (`apply_rotary_ref`), then converted as the store
converts it (`store_kv_ref`, saturating for an fp8 cache). Without head norms the results are
those of rotary then store bit for bit; with them the sum of squares runs in another order than
in `rms_norm`, so a normalised element may differ by an ulp.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from metrale.kernels.grid import next_power_of_2
from metrale.kernels.kv_store import check_store_inputs, store_kv_ref, to_cache_value
from metrale.kernels.pdl import pdl_enabled, wait_for_previous_kernel
from metrale.kernels.rms_norm import rms_norm_ref
from metrale.kernels.rotary import (
    apply_rotary_ref,
    check_rotary_inputs,
    cos_sin_halves,
    rotate_heads,
    rotated_halves,
)


@triton.jit
def _rotary_kv_store_kernel(
    q_ptr,
    k_ptr,
    v_ptr,
    k_cache_ptr,
    v_cache_ptr,
    cos_ptr,
    sin_ptr,
    positions_ptr,
    slot_mapping_ptr,
    q_norm_ptr,
    k_norm_ptr,
    norm_eps,
    q_token_stride,
    q_head_stride,
    k_token_stride,
    k_head_stride,
    v_token_stride,
    v_head_stride,
    cache_row_stride,
    num_q_heads,
    NUM_KV_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HALF: tl.constexpr,
    BLOCK_Q_HEADS: tl.constexpr,
    BLOCK_KV_HEADS: tl.constexpr,
    HEAD_NORM: tl.constexpr,
    SATURATE: tl.constexpr,
    FP8_MAX: tl.constexpr,
    PDL: tl.constexpr,
):
    # Axis 0: the token; axis 1: 0 rotates its q heads, 1 stores its k and v heads.
    wait_for_previous_kernel(PDL)
    token = tl.program_id(0).to(tl.int64)
    cos1, cos2, sin1, sin2 = cos_sin_halves(
        cos_ptr, sin_ptr, positions_ptr, token, cache_row_stride, HALF, HALF
    )
    if tl.program_id(1) == 0:
        rotate_heads(
            q_ptr,
            q_ptr,
            q_token_stride,
            q_head_stride,
            q_token_stride,
            q_head_stride,
            token,
            num_q_heads,
            cos1,
            cos2,
            sin1,
            sin2,
            HALF,
            q_norm_ptr,
            norm_eps,
            BLOCK_Q_HEADS,
            HALF,
            HEAD_NORM,
        )
    else:
        slot = tl.load(slot_mapping_ptr + token)
        if slot >= 0:  # a negative slot is a padding row of a CUDA-graph batch
            k1, k2, heads, dims, mask = rotated_halves(
                k_ptr,
                k_token_stride,
                k_head_stride,
                token,
                NUM_KV_HEADS,
                cos1,
                cos2,
                sin1,
                sin2,
                HALF,
                k_norm_ptr,
                norm_eps,
                BLOCK_KV_HEADS,
                HALF,
                HEAD_NORM,
            )
            # int64 slot: num_slots * num_kv_heads * head_dim can pass 2**31 on a large cache.
            cache_row = slot * (NUM_KV_HEADS * HEAD_DIM) + heads * HEAD_DIM  # [BLOCK_KV_HEADS, 1]
            k_dst = k_cache_ptr + cache_row + dims
            tl.store(k_dst, to_cache_value(k1, k_cache_ptr, SATURATE, FP8_MAX), mask=mask)
            tl.store(k_dst + HALF, to_cache_value(k2, k_cache_ptr, SATURATE, FP8_MAX), mask=mask)
            full = tl.arange(0, HEAD_DIM)[None, :]
            head_mask = heads < NUM_KV_HEADS
            v = tl.load(
                v_ptr + token * v_token_stride + heads * v_head_stride + full, mask=head_mask
            )
            tl.store(
                v_cache_ptr + cache_row + full,
                to_cache_value(v, v_cache_ptr, SATURATE, FP8_MAX),
                mask=head_mask,
            )


def rotary_kv_store(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cos_cache: torch.Tensor,
    sin_cache: torch.Tensor,
    positions: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    head_norms: tuple[torch.Tensor, torch.Tensor, float] | None = None,
) -> None:
    """Rotate q in place; write k rotated and v to slot `slot_mapping[t]` of the caches (skip
    negative slots). k and v are left as they are.

    q, k, cos_cache, sin_cache, positions as `apply_rotary` takes them; k, v, the caches and
    slot_mapping as `store_kv` takes them (head_dim a power of two). head_norms: (q weight,
    k weight, eps), [head_dim] weights of q's dtype: each q and k head is RMS-normalised before
    its rotation (Qwen3), as `rms_norm` over the heads would. Graph-capturable.
    """
    check_rotary_inputs(q, k, cos_cache, sin_cache, positions)
    saturate = check_store_inputs(k, v, k_cache, v_cache, slot_mapping)
    q_norm, k_norm, norm_eps = head_norms if head_norms is not None else (q, k, 0.0)
    if head_norms is not None:
        for weight in (q_norm, k_norm):
            assert weight.shape == (q.shape[2],) and weight.dtype == q.dtype, (
                f"head norm weights must be [{q.shape[2]}] {q.dtype}; got "
                f"{tuple(weight.shape)} {weight.dtype}"
            )
            assert weight.is_contiguous() and weight.device == q.device
    num_tokens, num_q_heads, head_dim = q.shape
    num_kv_heads = k.shape[1]
    if num_tokens == 0:
        return
    block_q_heads = next_power_of_2(num_q_heads)
    pdl = pdl_enabled(q.device)
    _rotary_kv_store_kernel[(num_tokens, 2)](
        q,
        k,
        v,
        k_cache,
        v_cache,
        cos_cache,
        sin_cache,
        positions,
        slot_mapping,
        q_norm,
        k_norm,
        norm_eps,
        q.stride(0),
        q.stride(1),
        k.stride(0),
        k.stride(1),
        v.stride(0),
        v.stride(1),
        cos_cache.stride(0),
        num_q_heads,
        NUM_KV_HEADS=num_kv_heads,
        HEAD_DIM=head_dim,
        HALF=head_dim // 2,
        BLOCK_Q_HEADS=block_q_heads,
        BLOCK_KV_HEADS=next_power_of_2(num_kv_heads),
        HEAD_NORM=head_norms is not None,
        SATURATE=saturate,
        FP8_MAX=torch.finfo(k_cache.dtype).max if saturate else 0.0,
        PDL=pdl,
        num_warps=8 if block_q_heads * head_dim >= 8192 else 4,
        launch_pdl=pdl,
    )


def rotary_kv_store_ref(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cos_cache: torch.Tensor,
    sin_cache: torch.Tensor,
    positions: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    head_norms: tuple[torch.Tensor, torch.Tensor, float] | None = None,
) -> None:
    """Torch reference of `rotary_kv_store`: `rms_norm_ref` over each head (with head_norms),
    `apply_rotary_ref`, then `store_kv_ref`."""
    q_in, k_in = q, k
    if head_norms is not None:
        q_norm, k_norm, eps = head_norms
        q_in = rms_norm_ref(q.reshape(-1, q.shape[2]), q_norm, eps)[0].view(q.shape)
        k_in = rms_norm_ref(k.reshape(-1, k.shape[2]), k_norm, eps)[0].view(k.shape)
    q_rotated, k_rotated = apply_rotary_ref(q_in, k_in, cos_cache, sin_cache, positions)
    q.copy_(q_rotated)
    store_kv_ref(k_rotated, v, k_cache, v_cache, slot_mapping)
