"""RMSNorm with the residual add fused in: one read of each input row, one write of each output.

A decoder layer normalises `x + residual` and carries the sum on as the next residual. Unfused,
that is an add kernel, a float cast, a reduction, a scale, a cast back and a weight multiply,
each a full pass over [num_tokens, hidden]; here one program holds a whole row in registers and
does all of it, accumulating in fp32.

The rounding points follow `rms_norm_ref` (the Hugging Face order) exactly: the residual add is
rounded to x's dtype, the normalised row is rounded to x's dtype *before* the weight multiply,
and the product is rounded again. The residual sum is therefore bit-exact; only the sum of
squares is reduced in a different order from torch, so `normed` may differ by one ulp, which the
weight multiply can stretch to two ulps of `out`, in rare elements.
"""

import torch
import triton
import triton.language as tl

from metrale.kernels.grid import next_power_of_2
from metrale.kernels.pdl import pdl_enabled, wait_for_previous_kernel

# A row lives in one program's registers; past this, a two-pass (or split-row) kernel would
# be needed. The largest Llama-family hidden size (405B) is 16,384.
MAX_HIDDEN = 65536


def rms_norm_ref(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """The torch semantics the kernel reproduces: returns (out, residual_out)."""
    if residual is not None:
        x = x + residual
    residual_out = x
    xf = x.float()
    normed = (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)
    return weight * normed, residual_out


@triton.jit
def _rms_norm_kernel(
    x_ptr,
    residual_ptr,
    weight_ptr,
    out_ptr,
    residual_out_ptr,
    x_row_stride,
    residual_row_stride,
    out_row_stride,
    residual_out_row_stride,
    hidden,
    eps,
    HAS_RESIDUAL: tl.constexpr,
    BLOCK: tl.constexpr,
    PDL: tl.constexpr,
):
    wait_for_previous_kernel(PDL)
    # One program per row; int64 so that row * stride cannot overflow on huge batches.
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < hidden
    x = tl.load(x_ptr + row * x_row_stride + cols, mask=mask, other=0.0)
    if HAS_RESIDUAL:
        res = tl.load(residual_ptr + row * residual_row_stride + cols, mask=mask, other=0.0)
        # Rounded to the input dtype, as `x + residual` is in the reference.
        x = (x.to(tl.float32) + res.to(tl.float32)).to(x_ptr.dtype.element_ty)
        # May alias `residual`: this program already holds its row, and no other touches it.
        tl.store(residual_out_ptr + row * residual_out_row_stride + cols, x, mask=mask)
    xf = x.to(tl.float32)
    # Masked lanes load 0, so they add nothing to the sum; divide by the true width.
    mean_square = tl.sum(xf * xf, axis=0) / hidden
    rstd = 1.0 / tl.sqrt(mean_square + eps)
    normed = (xf * rstd).to(x_ptr.dtype.element_ty)
    w = tl.load(weight_ptr + cols, mask=mask, other=0.0)
    out = (w.to(tl.float32) * normed.to(tl.float32)).to(out_ptr.dtype.element_ty)
    tl.store(out_ptr + row * out_row_stride + cols, out, mask=mask)


def _num_warps(block: int) -> int:
    # Enough threads that each holds a few dozen fp32 values of the row at most.
    if block >= 32768:
        return 32
    if block >= 8192:
        return 16
    if block >= 2048:
        return 8
    return 4


def _check_rows(name: str, t: torch.Tensor, like: torch.Tensor) -> None:
    assert t.shape == like.shape, f"{name} has shape {tuple(t.shape)}; expected {tuple(like.shape)}"
    assert t.dtype == like.dtype, f"{name} is {t.dtype}; expected {like.dtype} like x"
    assert t.device == like.device, f"{name} is on {t.device}; expected {like.device} like x"
    assert t.stride(-1) == 1, f"{name} needs a contiguous last dim; got strides {t.stride()}"


def rms_norm(
    x: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    residual: torch.Tensor | None = None,
    *,
    out: torch.Tensor | None = None,
    residual_out: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Return (weight * norm(x + residual), x + residual), like `rms_norm_ref`.

    x, residual: [num_tokens, hidden], any row stride, contiguous last dim; weight: [hidden],
    contiguous, same dtype as x. Without `residual`, the second value is `x` itself (as in the
    reference: nothing is copied).

    `out` and `residual_out` are optional destinations ([num_tokens, hidden], contiguous last
    dim); by default fresh contiguous tensors are allocated. Pass `residual_out=residual` to
    update the residual stream in place: each row is read before it is overwritten, so the
    aliasing is safe, and the step holds one residual buffer instead of two. `x` must not alias
    `out` or `residual_out`.

    No host sync and a grid that depends only on shapes, so it can be captured in a CUDA graph.
    """
    assert x.dim() == 2, f"x must be [num_tokens, hidden]; got shape {tuple(x.shape)}"
    num_tokens, hidden = x.shape
    assert x.stride(-1) == 1, f"x needs a contiguous last dim; got strides {x.stride()}"
    assert x.dtype in (torch.float32, torch.float16, torch.bfloat16), f"x is {x.dtype}"
    assert weight.shape == (hidden,), f"weight is {tuple(weight.shape)}; expected ({hidden},)"
    assert weight.dtype == x.dtype, f"weight is {weight.dtype}; cast it to x's {x.dtype}"
    assert weight.is_contiguous() and weight.device == x.device
    assert hidden <= MAX_HIDDEN, f"hidden {hidden} > {MAX_HIDDEN}: a row must fit one program"
    if residual is None:
        assert residual_out is None, "residual_out needs residual: without it x is returned"
    else:
        _check_rows("residual", residual, x)
    if out is None:
        out = torch.empty((num_tokens, hidden), dtype=x.dtype, device=x.device)
    _check_rows("out", out, x)
    if residual is not None and residual_out is None:
        residual_out = torch.empty((num_tokens, hidden), dtype=x.dtype, device=x.device)
    if residual_out is not None:
        _check_rows("residual_out", residual_out, x)
    if num_tokens == 0:
        return out, x if residual_out is None else residual_out

    block = next_power_of_2(hidden)
    # Without a residual the pointers are never dereferenced (HAS_RESIDUAL is a constexpr).
    res_in = x if residual is None else residual
    res_out = out if residual_out is None else residual_out
    pdl = pdl_enabled(x.device)
    _rms_norm_kernel[(num_tokens,)](
        x,
        res_in,
        weight,
        out,
        res_out,
        x.stride(0),
        res_in.stride(0),
        out.stride(0),
        res_out.stride(0),
        hidden,
        eps,
        HAS_RESIDUAL=residual is not None,
        BLOCK=block,
        PDL=pdl,
        num_warps=_num_warps(block),
        launch_pdl=pdl,
    )
    return out, x if residual_out is None else residual_out
