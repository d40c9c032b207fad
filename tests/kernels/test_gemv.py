"""`gemv` against its fp32 reference: ragged edges, bias, strided rows, launch variants."""

from __future__ import annotations

import pytest
import torch

from metrale.kernels.gemv import gemv, gemv_ref

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


@pytest.mark.gpu
@pytest.mark.skipif(not ON_GPU, reason="needs a CUDA device")
@pytest.mark.parametrize("n,k", [(6144, 4096), (4096, 14336), (128256, 4096)])
def test_llama3_8b_shapes_bf16(device, n, k) -> None:
    torch.manual_seed(2)
    x = torch.randn(1, k, device=device, dtype=torch.bfloat16)
    w = torch.randn(n, k, device=device, dtype=torch.bfloat16) * 0.02
    torch.testing.assert_close(gemv(x, w).float(), gemv_ref(x, w).float(), atol=2e-2, rtol=2e-2)
