"""Rotary position embeddings (NeoX / Hugging Face "rotate half" layout) for q and k in one launch.

The unfused form gathers cos and sin per token, casts, splits, negates, concatenates and
multiplies, one pass each over q and k. Here one program per (token, q-or-k) looks up the
token's cos/sin row once, rotates every head of it in fp32, and rounds once to the input dtype.

q and k are usually views of the fused qkv projection (`qkv.split(...)` then `.view(...)`), so
their token stride is the width of the whole qkv row: the kernel takes token and head strides
as arguments and only needs each head's `head_dim` values to be contiguous.
"""

import torch
import triton
import triton.language as tl

from metrale.kernels.grid import next_power_of_2
from metrale.kernels.pdl import pdl_enabled, wait_for_previous_kernel


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def apply_rotary_ref(
    q: torch.Tensor,
    k: torch.Tensor,
    cos_cache: torch.Tensor,
    sin_cache: torch.Tensor,
    positions: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The torch semantics the kernel reproduces; returns new tensors, inputs untouched."""
    cos = cos_cache[positions].unsqueeze(1)  # [num_tokens, 1, head_dim] fp32
    sin = sin_cache[positions].unsqueeze(1)

    def rotate(x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        return (xf * cos + rotate_half(xf) * sin).to(x.dtype)

    return rotate(q), rotate(k)


@triton.jit
def cos_sin_halves(
    cos_ptr, sin_ptr, positions_ptr, token, cache_row_stride, half, BLOCK_HALF: tl.constexpr
):
    """The token's cos and sin rows as halves [1, BLOCK_HALF]: (cos1, cos2, sin1, sin2)."""
    dims = tl.arange(0, BLOCK_HALF)[None, :]  # [1, BLOCK_HALF]
    dim_mask = dims < half
    position = tl.load(positions_ptr + token)
    cos_row = cos_ptr + position * cache_row_stride + dims
    sin_row = sin_ptr + position * cache_row_stride + dims
    # Both halves are read rather than assuming the cache is cat(freqs, freqs): the result then
    # matches `apply_rotary_ref` for any cache, at the cost of head_dim more fp32 loads a token.
    cos1 = tl.load(cos_row, mask=dim_mask, other=0.0)
    cos2 = tl.load(cos_row + half, mask=dim_mask, other=0.0)
    sin1 = tl.load(sin_row, mask=dim_mask, other=0.0)
    sin2 = tl.load(sin_row + half, mask=dim_mask, other=0.0)
    return cos1, cos2, sin1, sin2


@triton.jit
def rotated_halves(
    x_ptr,
    x_token_stride,
    x_head_stride,
    token,
    num_heads,
    cos1,
    cos2,
    sin1,
    sin2,
    half,
    norm_ptr,
    norm_eps,
    BLOCK_HEADS: tl.constexpr,
    BLOCK_HALF: tl.constexpr,
    HEAD_NORM: tl.constexpr,
):
    """A token's heads rotated, rounded to x's dtype as `apply_rotary_ref` rounds them: the
    halves [BLOCK_HEADS, BLOCK_HALF] of each head, their head and dim offsets, and the mask.
    With HEAD_NORM, each head is first RMS-normalised with the weight at norm_ptr (Qwen3's q/k
    norm), rounded as `rms_norm_ref` rounds."""
    heads = tl.arange(0, BLOCK_HEADS)[:, None]  # [BLOCK_HEADS, 1]
    dims = tl.arange(0, BLOCK_HALF)[None, :]  # [1, BLOCK_HALF]
    mask = (heads < num_heads) & (dims < half)
    x1_ptrs = x_ptr + token * x_token_stride + heads * x_head_stride + dims
    x1 = tl.load(x1_ptrs, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(x1_ptrs + half, mask=mask, other=0.0).to(tl.float32)
    if HEAD_NORM:
        dtype = x_ptr.dtype.element_ty
        mean_square = (tl.sum(x1 * x1, axis=1) + tl.sum(x2 * x2, axis=1)) / (2 * half)
        rstd = (1.0 / tl.sqrt(mean_square + norm_eps))[:, None]  # [BLOCK_HEADS, 1]
        w1 = tl.load(norm_ptr + dims, mask=dims < half, other=0.0).to(tl.float32)
        w2 = tl.load(norm_ptr + half + dims, mask=dims < half, other=0.0).to(tl.float32)
        x1 = (w1 * (x1 * rstd).to(dtype).to(tl.float32)).to(dtype).to(tl.float32)
        x2 = (w2 * (x2 * rstd).to(dtype).to(tl.float32)).to(dtype).to(tl.float32)
    # x * cos + rotate_half(x) * sin, where rotate_half(x) = cat(-x2, x1).
    out1 = (x1 * cos1 - x2 * sin1).to(x_ptr.dtype.element_ty)
    out2 = (x2 * cos2 + x1 * sin2).to(x_ptr.dtype.element_ty)
    return out1, out2, heads, dims, mask


@triton.jit
def rotate_heads(
    x_ptr,
    out_ptr,
    x_token_stride,
    x_head_stride,
    out_token_stride,
    out_head_stride,
    token,
    num_heads,
    cos1,
    cos2,
    sin1,
    sin2,
    half,
    norm_ptr,
    norm_eps,
    BLOCK_HEADS: tl.constexpr,
    BLOCK_HALF: tl.constexpr,
    HEAD_NORM: tl.constexpr,
):
    out1, out2, heads, dims, mask = rotated_halves(
        x_ptr,
        x_token_stride,
        x_head_stride,
        token,
        num_heads,
        cos1,
        cos2,
        sin1,
        sin2,
        half,
        norm_ptr,
        norm_eps,
        BLOCK_HEADS,
        BLOCK_HALF,
        HEAD_NORM,
    )
    # Both halves of every head were loaded above, so out_ptr may alias x_ptr.
    out1_ptrs = out_ptr + token * out_token_stride + heads * out_head_stride + dims
    tl.store(out1_ptrs, out1.to(out_ptr.dtype.element_ty), mask=mask)
    tl.store(out1_ptrs + half, out2.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _rotary_kernel(
    q_ptr,
    k_ptr,
    q_out_ptr,
    k_out_ptr,
    cos_ptr,
    sin_ptr,
    positions_ptr,
    q_token_stride,
    q_head_stride,
    k_token_stride,
    k_head_stride,
    q_out_token_stride,
    q_out_head_stride,
    k_out_token_stride,
    k_out_head_stride,
    cache_row_stride,
    num_q_heads,
    num_kv_heads,
    half,
    BLOCK_Q_HEADS: tl.constexpr,
    BLOCK_KV_HEADS: tl.constexpr,
    BLOCK_HALF: tl.constexpr,
    PDL: tl.constexpr,
):
    wait_for_previous_kernel(PDL)
    # Axis 0: the token; axis 1: 0 rotates its q heads, 1 its k heads. Two programs per token
    # give a small decode batch twice the parallelism of one, at the cost of a second (cached)
    # read of the token's cos/sin row.
    token = tl.program_id(0).to(tl.int64)
    cos1, cos2, sin1, sin2 = cos_sin_halves(
        cos_ptr, sin_ptr, positions_ptr, token, cache_row_stride, half, BLOCK_HALF
    )
    if tl.program_id(1) == 0:
        rotate_heads(
            q_ptr,
            q_out_ptr,
            q_token_stride,
            q_head_stride,
            q_out_token_stride,
            q_out_head_stride,
            token,
            num_q_heads,
            cos1,
            cos2,
            sin1,
            sin2,
            half,
            q_ptr,  # no head norm
            0.0,
            BLOCK_Q_HEADS,
            BLOCK_HALF,
            False,
        )
    else:
        rotate_heads(
            k_ptr,
            k_out_ptr,
            k_token_stride,
            k_head_stride,
            k_out_token_stride,
            k_out_head_stride,
            token,
            num_kv_heads,
            cos1,
            cos2,
            sin1,
            sin2,
            half,
            k_ptr,  # no head norm
            0.0,
            BLOCK_KV_HEADS,
            BLOCK_HALF,
            False,
        )


def _check_heads(name: str, t: torch.Tensor, shape: tuple[int, ...], like: torch.Tensor) -> None:
    assert t.dim() == 3, f"{name} must be [num_tokens, num_heads, head_dim]; got {tuple(t.shape)}"
    assert t.shape == shape, f"{name} has shape {tuple(t.shape)}; expected {shape}"
    assert t.dtype == like.dtype, f"{name} is {t.dtype}; expected {like.dtype} like q"
    assert t.device == like.device, f"{name} is on {t.device}; expected {like.device} like q"
    assert t.stride(-1) == 1, f"{name} needs a contiguous head_dim; got strides {t.stride()}"


def check_rotary_inputs(
    q: torch.Tensor,
    k: torch.Tensor,
    cos_cache: torch.Tensor,
    sin_cache: torch.Tensor,
    positions: torch.Tensor,
) -> None:
    """The shapes, dtypes and layouts `apply_rotary` documents."""
    assert q.dim() == 3 and k.dim() == 3, (
        f"q and k must be [num_tokens, num_heads, head_dim]; got {tuple(q.shape)}, {tuple(k.shape)}"
    )
    num_tokens, num_q_heads, head_dim = q.shape
    num_kv_heads = k.shape[1]
    assert q.dtype in (torch.float32, torch.float16, torch.bfloat16), f"q is {q.dtype}"
    assert head_dim % 2 == 0, f"head_dim {head_dim} is odd; rotate-half needs two halves"
    _check_heads("q", q, (num_tokens, num_q_heads, head_dim), q)
    _check_heads("k", k, (num_tokens, num_kv_heads, head_dim), q)
    for name, cache in (("cos_cache", cos_cache), ("sin_cache", sin_cache)):
        assert cache.dim() == 2 and cache.shape[1] == head_dim, (
            f"{name} must be [max_positions, {head_dim}]; got {tuple(cache.shape)}"
        )
        assert cache.dtype == torch.float32, f"{name} is {cache.dtype}; keep it in fp32"
        assert cache.is_contiguous(), f"{name} must be contiguous; got strides {cache.stride()}"
        assert cache.device == q.device, f"{name} is on {cache.device}; expected {q.device}"
    assert cos_cache.shape == sin_cache.shape, "cos_cache and sin_cache differ in shape"
    assert positions.shape == (num_tokens,), (
        f"positions is {tuple(positions.shape)}; expected ({num_tokens},)"
    )
    assert positions.dtype == torch.int64, f"positions is {positions.dtype}; expected int64"
    assert positions.device == q.device, f"positions is on {positions.device}; expected {q.device}"


def apply_rotary(
    q: torch.Tensor,
    k: torch.Tensor,
    cos_cache: torch.Tensor,
    sin_cache: torch.Tensor,
    positions: torch.Tensor,
    *,
    q_out: torch.Tensor | None = None,
    k_out: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Return (q, k) rotated to their positions, like `apply_rotary_ref`.

    q: [num_tokens, num_q_heads, head_dim], k: [num_tokens, num_kv_heads, head_dim], same dtype,
    any token and head strides, contiguous last dim. cos_cache, sin_cache: [max_positions,
    head_dim] fp32, contiguous, columns cat(freqs, freqs). positions: [num_tokens] int64; each
    must be < max_positions (not checked: that would need a host sync).

    By default the results are fresh contiguous tensors and q, k are left untouched. Pass
    `q_out=q, k_out=k` to rotate in place (the usual choice inside the model: no allocation, and
    a fused qkv buffer keeps its layout); any other `q_out`/`k_out` must have q's/k's shape and
    dtype and a contiguous last dim, and must not partly overlap q or k.

    Graph-capturable: no host sync, a grid that depends only on shapes.
    """
    check_rotary_inputs(q, k, cos_cache, sin_cache, positions)
    num_tokens, num_q_heads, head_dim = q.shape
    num_kv_heads = k.shape[1]
    if q_out is None:
        q_out = torch.empty_like(q, memory_format=torch.contiguous_format)
    if k_out is None:
        k_out = torch.empty_like(k, memory_format=torch.contiguous_format)
    _check_heads("q_out", q_out, tuple(q.shape), q)
    _check_heads("k_out", k_out, tuple(k.shape), q)
    if num_tokens == 0:
        return q_out, k_out

    half = head_dim // 2
    block_half = next_power_of_2(half)
    block_q_heads = next_power_of_2(num_q_heads)
    pdl = pdl_enabled(q.device)
    _rotary_kernel[(num_tokens, 2)](
        q,
        k,
        q_out,
        k_out,
        cos_cache,
        sin_cache,
        positions,
        q.stride(0),
        q.stride(1),
        k.stride(0),
        k.stride(1),
        q_out.stride(0),
        q_out.stride(1),
        k_out.stride(0),
        k_out.stride(1),
        cos_cache.stride(0),
        num_q_heads,
        num_kv_heads,
        half,
        BLOCK_Q_HEADS=block_q_heads,
        BLOCK_KV_HEADS=next_power_of_2(num_kv_heads),
        BLOCK_HALF=block_half,
        PDL=pdl,
        num_warps=8 if block_q_heads * block_half >= 4096 else 4,
        launch_pdl=pdl,
    )
    return q_out, k_out
