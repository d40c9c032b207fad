"""SiLU-and-mul, the gated MLP activation: out = silu(gate) * up, read once, written once.

The fused gate/up projection yields [num_tokens, 2 * intermediate]; unfused, the chunk, the
SiLU and the multiply each make a pass over it. Here each program reads one block of a row's gate
half and the matching block of its up half and writes one block of the output, computing in fp32
and rounding once to the input dtype.
"""

import torch
import triton
import triton.language as tl

from metrale.kernels.grid import cdiv
from metrale.kernels.pdl import pdl_enabled, wait_for_previous_kernel

# Columns per program: large enough to amortise the program, small enough that a decode step
# with a single token still spreads an intermediate size of ~14k over a dozen or more programs.
BLOCK = 1024


def silu_and_mul_ref(gate_up: torch.Tensor) -> torch.Tensor:
    """[num_tokens, 2 * intermediate] -> [num_tokens, intermediate], fp32 math, input dtype."""
    gate, up = gate_up.float().chunk(2, dim=-1)
    return (torch.nn.functional.silu(gate) * up).to(gate_up.dtype)


@triton.jit
def _silu_and_mul_kernel(
    gate_up_ptr,
    out_ptr,
    gate_up_row_stride,
    out_row_stride,
    intermediate,
    BLOCK: tl.constexpr,
    PDL: tl.constexpr,
):
    wait_for_previous_kernel(PDL)
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < intermediate
    gate_ptrs = gate_up_ptr + row * gate_up_row_stride + cols
    gate = tl.load(gate_ptrs, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(gate_ptrs + intermediate, mask=mask, other=0.0).to(tl.float32)
    # silu(g) = g * sigmoid(g) = g / (1 + exp(-g)), the form torch uses; exp(-g) overflowing to
    # inf for very negative g gives -0, the right limit.
    out = gate / (1.0 + tl.exp(-gate)) * up
    tl.store(out_ptr + row * out_row_stride + cols, out.to(out_ptr.dtype.element_ty), mask=mask)


def silu_and_mul(gate_up: torch.Tensor, *, out: torch.Tensor | None = None) -> torch.Tensor:
    """[num_tokens, 2 * intermediate] -> [num_tokens, intermediate] = silu(gate) * up.

    `gate_up` may have any row stride but needs a contiguous last dim. `out` is an optional
    destination ([num_tokens, intermediate], same dtype, contiguous last dim); by default a fresh
    contiguous tensor. Graph-capturable: no host sync, a grid that depends only on shapes.
    """
    assert gate_up.dim() == 2, f"gate_up must be [num_tokens, 2 * I]; got {tuple(gate_up.shape)}"
    num_tokens, width = gate_up.shape
    assert width % 2 == 0, f"gate_up's last dim {width} is odd; it must hold gate and up halves"
    assert gate_up.stride(-1) == 1, f"gate_up needs a contiguous last dim; got {gate_up.stride()}"
    assert gate_up.dtype in (torch.float32, torch.float16, torch.bfloat16), f"{gate_up.dtype}"
    intermediate = width // 2
    if out is None:
        out = torch.empty((num_tokens, intermediate), dtype=gate_up.dtype, device=gate_up.device)
    assert out.shape == (num_tokens, intermediate), (
        f"out is {tuple(out.shape)}; expected {(num_tokens, intermediate)}"
    )
    assert out.dtype == gate_up.dtype, f"out is {out.dtype}; expected {gate_up.dtype}"
    assert out.device == gate_up.device, f"out is on {out.device}; expected {gate_up.device}"
    assert out.stride(-1) == 1, f"out needs a contiguous last dim; got strides {out.stride()}"
    if num_tokens == 0 or intermediate == 0:
        return out
    grid = (num_tokens, cdiv(intermediate, BLOCK))
    pdl = pdl_enabled(gate_up.device)
    _silu_and_mul_kernel[grid](
        gate_up,
        out,
        gate_up.stride(0),
        out.stride(0),
        intermediate,
        BLOCK=BLOCK,
        PDL=pdl,
        num_warps=4,
        launch_pdl=pdl,
    )
    return out
