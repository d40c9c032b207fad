"""`gemv` against its fp32 reference: ragged edges, bias, strided rows, launch variants, the
SiLU-and-mul input."""

from __future__ import annotations

import pytest
import torch

from metrale.kernels.gemv import gemv, gemv_ref
from metrale.kernels.silu_and_mul import silu_and_mul

ON_GPU = torch.cuda.is_available()


@pytest.mark.parametrize("n,k", [(16, 64), (37, 100), (5, 1000)])
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("launch", [{}, {"block_n": 4, "block_k": 32, "num_warps": 2}])
def test_matches_reference(device, n, k, bias, launch) -> None:
    torch.manual_seed(n * k)
    x = torch.randn(1, k, device=device)
    w = torch.randn(n, k, device=device)
    b = torch.randn(n, device=device) if bias else None
    torch.testing.assert_close(gemv(x, w, b, **launch), gemv_ref(x, w, b), atol=1e-4, rtol=1e-4)


def test_rows_of_a_wider_matrix(device) -> None:
    """A weight whose rows are a slice of wider rows (stride > K)."""
    torch.manual_seed(1)
    wide = torch.randn(24, 80, device=device)
    w = wide[:, 8:72]
    x = torch.randn(1, 64, device=device)
    torch.testing.assert_close(gemv(x, w), gemv_ref(x, w), atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("n,k", [(16, 64), (21, 300)])
def test_silu_and_mul_input_is_the_activation_kernel_then_the_product(device, dtype, n, k) -> None:
    """Bit for bit what `silu_and_mul` then `gemv` give: the same rounding of the activation."""
    torch.manual_seed(k)
    gate_up = (torch.randn(1, 2 * k, device=device) * 3).to(dtype)
    w = torch.randn(n, k, device=device).to(dtype)
    fused = gemv(gate_up, w, silu_and_mul=True, block_k=32)
    assert torch.equal(fused, gemv(silu_and_mul(gate_up), w, block_k=32))
    # bf16: torch's SiLU rounds a few activations one ulp apart, and outputs reach ~30 (ulp 0.125).
    tolerance = {"atol": 0.25, "rtol": 0.02} if dtype == torch.bfloat16 else {}
    torch.testing.assert_close(fused, gemv_ref(gate_up, w, silu_and_mul=True), **tolerance)
    with pytest.raises(AssertionError, match=r"x must be \[1, "):
        gemv(gate_up[:, :k], w, silu_and_mul=True)


@pytest.mark.gpu
@pytest.mark.skipif(not ON_GPU, reason="needs a CUDA device")
@pytest.mark.parametrize("n,k", [(6144, 4096), (4096, 14336), (128256, 4096)])
def test_llama3_8b_shapes_bf16(device, n, k) -> None:
    torch.manual_seed(2)
    x = torch.randn(1, k, device=device, dtype=torch.bfloat16)
    w = torch.randn(n, k, device=device, dtype=torch.bfloat16) * 0.02
    torch.testing.assert_close(gemv(x, w).float(), gemv_ref(x, w).float(), atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize("n,k", [(16, 64), (37, 300)])
def test_float32_output_is_the_accumulator_unrounded(device, n, k) -> None:
    """bf16 inputs, `out_dtype=float32` (the head's logits): the fp32 sums as they are, where
    the default output rounds them to bf16."""
    torch.manual_seed(n + k)
    x = torch.randn(1, k, device=device).to(torch.bfloat16)
    w = torch.randn(n, k, device=device).to(torch.bfloat16)
    exact = x.float() @ w.float().t()
    y = gemv(x, w, out_dtype=torch.float32, block_k=32)
    assert y.dtype == torch.float32
    torch.testing.assert_close(y, exact, atol=1e-4, rtol=1e-5)
    assert not torch.equal(y, y.to(torch.bfloat16).float())  # not a bf16 result widened
    assert gemv(x, w, block_k=32).dtype == torch.bfloat16
